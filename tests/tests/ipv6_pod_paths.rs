//! IPv6 pod paths (issue 14), in both lab shapes: what a pod sends that is not an ordinary
//! request (see ipv6_cluster_ip.rs for the dual-stack Service these use).
//!
//! A pod that sends to an IPv6 frontend from an address the node does not route back to it
//! gets no translation: dropped, counted as `spoofed_source`, no flow entry. A pod that
//! reaches itself through the IPv6 frontend (hairpin) is answered by itself, seeing the
//! flow come from `HAIRPIN6`, from the frontend it called. With `--stack-bypass`, IPv6
//! flows between routed pods are redirected past the node's stack, both ways: they are
//! served while the node's ip6tables FORWARD chain drops the backends' traffic.
//!
//! With kube-proxy's `ip6tables -A FORWARD -m conntrack --ctstate INVALID -j DROP` in the
//! node namespace, IPv6 service traffic is not dropped: the node's netfilter sees only
//! consistent pod-to-pod tuples.

mod common;
mod ipv6_common;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use ipv6_common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::{Pod, Shape};

both_shapes!(
    ipv6_spoofed_source_is_dropped,
    ipv6_pod_reaches_itself,
    ipv6_with_the_invalid_drop_rule,
);

#[test]
fn ipv6_routed_pods_bypass_the_node_stack() {
    ipv6_stack_bypass(Shape::Routed);
}

/// The source address a pod sees on its own IPv6 hairpin flows
/// (`lbproxy_common::HAIRPIN_ADDR6`).
const HAIRPIN6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa9fe, 0x2a01, 0, 0, 0, 0, 1);
/// An address outside the pods' `fd00:c612::/64`, which the node does not route to any pod.
const SPOOFED6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x9, 0, 0, 0, 0, 0, 0xc8);

/// From the client, with `src` added to its interface: three UDP requests and one TCP
/// connect to the IPv6 frontend, all from `src`, each given 300 ms (the connect a second) to
/// be answered. Returns the answers and the connect's outcome.
fn send_from6(s: &Setup, src: Ipv6Addr) -> (Vec<String>, Result<(), String>) {
    lbproxy_tests::lab::ns_run(
        &s.client.netns,
        &[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{src}/128"),
            "dev",
            "eth0",
            "nodad",
        ],
    )
    .unwrap_or_else(|e| panic!("adding {src} to the client: {e}"));
    s.client.run(|| {
        let u = UdpSocket::bind((src, 21001)).expect("bind UDP to the spoofed address");
        u.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut answers = Vec::new();
        for _ in 0..3 {
            u.send_to(b"hello\n", (VIP6, WEB_UDP)).expect("UDP send");
            let mut buf = [0u8; 256];
            if let Ok((n, from)) = u.recv_from(&mut buf) {
                answers.push(format!(
                    "{} from {from}",
                    String::from_utf8_lossy(&buf[..n])
                ));
            }
        }
        let tcp = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)
            .and_then(|t| {
                t.bind(&SocketAddr::from((src, 21002)).into())?;
                t.connect_timeout(
                    &SocketAddr::from((VIP6, WEB_TCP)).into(),
                    Duration::from_secs(1),
                )
            })
            .map_err(|e| e.to_string());
        (answers, tcp)
    })
}

/// A client sends UDP and a TCP SYN to the IPv6 frontend from an address that is not its
/// own: nothing is translated (no answer, no connection, no flow names the address) and
/// `spoofed_source` counts the packets. In the routed shape, the same for a neighbour pod's
/// IPv6 address. The client's own address is never counted and keeps working.
fn ipv6_spoofed_source_is_dropped(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1]));
    wait_ipv6_served(&s);
    ipv6_traffic_ok("own address, before", &s, 4);
    assert_eq!(
        s.lab.drop_count("spoofed_source"),
        0,
        "the client's own IPv6 address was counted as spoofed\n{}",
        s.lab.diagnostics()
    );
    let mut spoofed = vec![SPOOFED6];
    if shape == Shape::Routed {
        spoofed.push(b2.ip6.unwrap());
    }
    for src in spoofed {
        let before = s.lab.drop_count("spoofed_source");
        let (answers, tcp) = send_from6(&s, src);
        assert!(
            answers.is_empty(),
            "answers to IPv6 requests from {src}, which is not the client's: {answers:?}"
        );
        assert!(
            tcp.is_err(),
            "a TCP connection from {src}, which is not the client's, was established"
        );
        let counted = s.lab.drop_count("spoofed_source") - before;
        assert!(
            counted >= 4,
            "spoofed_source counted {counted} packets from {src}, want the 3 UDP requests and \
             at least one SYN\n{}",
            s.lab.diagnostics()
        );
        let flows = tool_json(&s, &["inspect", "flows", "--json"]);
        let named: Vec<_> = flows
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f.to_string().contains(&src.to_string()))
            .collect();
        assert!(named.is_empty(), "flows name {src}: {named:#?}");
        // Gone again, so that source address selection cannot pick it for the client's
        // own requests.
        lbproxy_tests::lab::ns_run(
            &s.client.netns,
            &[
                "ip",
                "-6",
                "addr",
                "del",
                &format!("{src}/128"),
                "dev",
                "eth0",
            ],
        )
        .unwrap_or_else(|e| panic!("removing {src} from the client: {e}"));
    }
    ipv6_traffic_ok("own address, after", &s, 4);
}

/// One TCP request (a new connection) and one UDP request (a new socket) from `pod` to the
/// IPv6 frontend: (backend, client seen, answered from) of each.
fn requests6(pod: &Pod) -> (Answer, Answer) {
    pod.run(|| (tcp6(), udp6()))
        .into_tcp_udp()
        .unwrap_or_else(|e| panic!("from {}: {e}", pod.name))
}

trait Both {
    fn into_tcp_udp(self) -> Result<(Answer, Answer), String>;
}

impl Both for (Result<Answer, String>, Result<Answer, String>) {
    fn into_tcp_udp(self) -> Result<(Answer, Answer), String> {
        Ok((self.0?, self.1?))
    }
}

/// A pod that is a backend of the IPv6 frontend reaches itself through it: answered by
/// itself, seeing `HAIRPIN6` as the client, from the frontend's address and port; other
/// pods still see their own address. A flow to another backend keeps the pod's address.
fn ipv6_pod_reaches_itself(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    // Only b1 serves IPv6, so every IPv6 request from b1 is a hairpin flow.
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1]));
    wait_ipv6_served(&s);
    for i in 0..4 {
        let (tcp, udp) = requests6(&b1);
        for (proto, a, port) in [("TCP", &tcp, WEB_TCP), ("UDP", &udp, WEB_UDP)] {
            assert_eq!(a.backend, "b1", "{proto} #{i} from b1 to itself: {a:?}");
            let seen: SocketAddr = a.client_seen.parse().unwrap();
            assert_eq!(
                seen.ip(),
                IpAddr::V6(HAIRPIN6),
                "{proto} #{i}: b1 must see its own flow come from the hairpin address: {a:?}"
            );
            assert_eq!(
                a.from,
                SocketAddr::from((VIP6, port)),
                "{proto} #{i}: the answer must come from the IPv6 frontend: {a:?}"
            );
        }
    }
    // b2 to b1: an ordinary flow, with b2's own address.
    let (tcp, _) = requests6(&b2);
    let seen: SocketAddr = tcp.client_seen.parse().unwrap();
    assert_eq!(seen.ip(), IpAddr::V6(b2.ip6.unwrap()), "b2 to b1: {tcp:?}");
    let v = s.lab.inspect_json("delivery");
    assert!(
        v["packets"]["redirect_hairpin"].as_u64().unwrap_or(0) > 0,
        "hairpin packets are sent back into the pod, and counted: {v:#}"
    );
}

/// `--stack-bypass` on routed pods: with the node's ip6tables FORWARD chain dropping the
/// backends' traffic (so pod-to-pod IPv6 through the node's stack is lost), every IPv6
/// request through the frontend is answered, by both backends, from the frontend, and the
/// datapath counts redirects both ways.
fn ipv6_stack_bypass(shape: Shape) {
    let s = Setup::with_args(shape, &["b1", "b2"], &["--stack-bypass"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1, &b2]));
    wait_ipv6_served(&s);
    // Warm the neighbours (the first packets to a backend take the stack, which resolves
    // them), then drop what the stack forwards.
    ipv6_traffic_ok("bypass, open node", &s, 8);
    for (proto, port) in [("tcp", BACKEND_TCP), ("udp", BACKEND_UDP)] {
        for dir in ["--dport", "--sport"] {
            s.lab
                .node_run(&[
                    "ip6tables",
                    "-A",
                    "FORWARD",
                    "-p",
                    proto,
                    dir,
                    &port.to_string(),
                    "-j",
                    "DROP",
                ])
                .unwrap_or_else(|e| panic!("installing an ip6tables FORWARD drop rule: {e}"));
        }
    }
    let direct = s.client.run(|| {
        TcpStream::connect_timeout(
            &SocketAddr::from((b1.ip6.unwrap(), BACKEND_TCP)),
            Duration::from_millis(500),
        )
    });
    assert!(
        direct.is_err(),
        "the FORWARD drop rule must stop direct IPv6 pod-to-pod traffic, but b1 answered"
    );
    let delivered = |path: &str| {
        s.lab.inspect_json("delivery")["packets"][path]
            .as_u64()
            .unwrap_or(0)
    };
    let (fwd0, rev0) = (
        delivered("redirect_to_backend"),
        delivered("redirect_to_client"),
    );
    let n = 20;
    let (tcp, udp) = ipv6_traffic_ok("bypass, FORWARD dropping", &s, n);
    assert!(
        tcp.len() == 2 && udp.len() == 2,
        "both backends answer over IPv6: TCP {tcp:?} UDP {udp:?}"
    );
    let (fwd, rev) = (
        delivered("redirect_to_backend") - fwd0,
        delivered("redirect_to_client") - rev0,
    );
    assert!(
        fwd >= 5 * n as u64 && rev >= 4 * n as u64,
        "redirects during {n} TCP and {n} UDP requests over IPv6: {fwd} to backends, {rev} to the client"
    );
}

/// With `ip6tables -A FORWARD -m conntrack --ctstate INVALID -j DROP` in the node namespace
/// (kube-proxy's rule, in its IPv6 table), TCP and UDP through the IPv6 ClusterIP keep
/// working: each request is answered within 800 ms (a dropped SYN-ACK or reply, recovered
/// by a retransmission after 1 s, fails), on new connections, on one long-lived connection
/// and from one fixed UDP source port, always from the ClusterIP.
fn ipv6_with_the_invalid_drop_rule(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let rule = [
        "FORWARD",
        "-m",
        "conntrack",
        "--ctstate",
        "INVALID",
        "-j",
        "DROP",
    ];
    let mut argv = vec!["ip6tables", "-A"];
    argv.extend(rule);
    s.lab
        .node_run(&argv)
        .unwrap_or_else(|e| panic!("[{shape}] installing the ip6tables INVALID drop rule: {e}"));
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1, &b2]));
    let deadline = Instant::now() + APPLY_WITHIN;
    while s.client.run(tcp6).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let tt = Duration::from_millis(800);
    let (tcp_to, udp_to) = (
        SocketAddr::from((VIP6, WEB_TCP)),
        SocketAddr::from((VIP6, WEB_UDP)),
    );
    let failures: Vec<String> = s.client.run(|| {
        let mut failures = Vec::new();
        let request = |c: &TcpStream, r: &mut BufReader<&TcpStream>| -> Result<String, String> {
            (&mut &*c)
                .write_all(b"hello\n")
                .map_err(|e| format!("write: {e}"))?;
            let mut line = String::new();
            r.read_line(&mut line).map_err(|e| format!("read: {e}"))?;
            Ok(line)
        };
        for i in 0..20 {
            let r = TcpStream::connect_timeout(&tcp_to, tt)
                .map_err(|e| format!("connect: {e}"))
                .and_then(|c| {
                    c.set_read_timeout(Some(tt)).map_err(|e| e.to_string())?;
                    request(&c, &mut BufReader::new(&c))
                });
            if let Err(e) = r {
                failures.push(format!("new TCP connection #{i}: {e}"));
            }
        }
        match TcpStream::connect_timeout(&tcp_to, tt) {
            Ok(c) => {
                c.set_read_timeout(Some(tt)).unwrap();
                let mut r = BufReader::new(&c);
                for i in 0..20 {
                    if let Err(e) = request(&c, &mut r) {
                        failures.push(format!("request #{i} on one TCP connection: {e}"));
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) => failures.push(format!("the long-lived connection: {e}")),
        }
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 41_000)).unwrap();
        u.set_read_timeout(Some(tt)).unwrap();
        for i in 0..20 {
            let mut buf = [0u8; 256];
            let r = u
                .send_to(b"hello\n", udp_to)
                .and_then(|_| u.recv_from(&mut buf));
            match r {
                Ok((_, from)) if from == udp_to => {}
                Ok((_, from)) => {
                    failures.push(format!("UDP #{i} from port 41000: answered from {from}"))
                }
                Err(e) => failures.push(format!("UDP #{i} from port 41000: {e}")),
            }
        }
        failures
    });
    let counters = s
        .lab
        .node_run(&["ip6tables", "-L", "FORWARD", "-v", "-x", "-n"])
        .unwrap_or_else(|e| e);
    assert!(
        failures.is_empty(),
        "[{shape}] with the ip6tables INVALID drop rule:\n  {}\nrules:\n{counters}",
        failures.join("\n  ")
    );
}
