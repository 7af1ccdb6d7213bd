//! IPv6 north-south traffic on two nodes (issue 14): a dual-stack LoadBalancer Service's
//! IPv6 NodePorts, externalIP and load-balancer IP, reached from a client outside the
//! cluster over IPv6, through either node, while its IPv4 frontends keep serving.
//!
//! Each node runs its own lbproxy, started exactly as other harnesses start it (`run
//! --manifests FILE --pod-interfaces 'lxc*' --hostname-override nodeX --nodeport-addresses
//! 198.18.80.0/24 ...`): the IPv4 CIDR says nothing about IPv6, so, as kube-proxy, every
//! IPv6 node address serves NodePorts.
//!
//! - `externalTrafficPolicy: Cluster`: both backends answer, always from the address and
//!   port the client used; the backend on the node reached sees the client's own IPv6
//!   address, the one on the other node sees that node's IPv6 address (SNAT, with its own
//!   IPv6 port space).
//! - `externalTrafficPolicy: Local`: only the node's own endpoint answers, seeing the client;
//!   a node without one drops; the `healthCheckNodePort` answers over IPv6 with kube-proxy's
//!   statuses (200 with a local endpoint, 503 without).
//! - Processes of the node itself (in the lab's cgroup, so `connect6`/`sendmsg6`/
//!   `recvmsg6`/`getpeername6` see them) reach every IPv6 frontend kind, see the frontend as
//!   their peer, and lose a connected socket whose backend leaves (`LB_SOCKREV6_V1`, the
//!   reaper's IPv6 `sock_diag` dump).
//!
//! Three tests are the `ipv6` cases of north_south.rs's: `--nodeport-addresses primary`
//! (`node_port_addresses_primary_follows_the_default_route`), `externalTrafficPolicy:
//! Cluster` through either node (`node_port_external_ip_and_lb_ip_through_either_node`) and
//! `externalTrafficPolicy: Local` with the healthCheckNodePort
//! (`external_traffic_policy_local_and_health_check_node_port`); a fourth is the `ipv6` case
//! of north_south_flows.rs's `icmp_errors_about_node_port_flows_reach_the_client`.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::cgroup::{HostClient, Mode, Outcome, Requests};
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP,
    WEB_CLUSTER_IP6 as CLUSTER_IP6, WEB_EXTERNAL_IP6 as EXTERNAL_IP6, WEB_LB_IP,
    WEB_LB_IP6 as LB_IP6, WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
    dual_stack_web_manifest,
};
use lbproxy_tests::lab::{Backend, Lbproxy, Pod};

const TIMEOUT: Duration = Duration::from_secs(2);
const HEALTHY_WITHIN: Duration = Duration::from_secs(20);

struct Setup {
    // Dropped last: servers and lbproxys go first.
    lab: MultiNodeLab,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
    a1: Pod,
    b1: Pod,
}

/// The dual-stack `web` Service over `pods` (see [`dual_stack_web_manifest`]).
fn manifest(lab: &MultiNodeLab, pods: &[&Pod], policy: &str, extra: &str) -> String {
    dual_stack_web_manifest(lab, pods, policy, extra)
}

impl Setup {
    /// a1 on nodeA and b1 on nodeB serve; `b1_listed`: whether b1 is an endpoint.
    fn new(policy: &str, b1_listed: bool, extra: &str) -> Setup {
        Setup::with_args(policy, b1_listed, extra, &[])
    }

    /// [`Setup::new`] with extra `lbproxy run` arguments on both nodes.
    fn with_args(policy: &str, b1_listed: bool, extra: &str, args: &[&str]) -> Setup {
        let lab = MultiNodeLab::new();
        let a1 = lab.add_pod(NodeId::A, "a1");
        let b1 = lab.add_pod(NodeId::B, "b1");
        let servers = vec![
            a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
            b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        ];
        let pods: Vec<&Pod> = if b1_listed { vec![&a1, &b1] } else { vec![&a1] };
        lab.write_manifest_text(&manifest(&lab, &pods, policy, extra));
        let lbs = lab.start_lbproxy_on_both(args, HEALTHY_WITHIN);
        Setup {
            lab,
            _servers: servers,
            lbs,
            a1,
            b1,
        }
    }

    fn logs(&self) -> String {
        let mut out = self.lab.diagnostics();
        for lb in &self.lbs {
            out.push_str(&format!("\n--- lbproxy {:?}\n{}", lb.argv(), lb.log()));
        }
        out
    }
}

/// One answered request: (backend, the client address it saw, where the answer came from).
type Answer = (String, IpAddr, SocketAddr);

/// One request to `to` from the calling thread's namespace: a new TCP connection, or a UDP
/// datagram from a new socket.
fn request(udp: bool, to: SocketAddr) -> Result<Answer, String> {
    let (line, from) = if udp {
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
        u.set_read_timeout(Some(TIMEOUT))
            .map_err(|e| e.to_string())?;
        u.send_to(b"hello\n", to)
            .map_err(|e| format!("send to {to}: {e}"))?;
        let mut buf = [0u8; 512];
        let (n, from) = u
            .recv_from(&mut buf)
            .map_err(|e| format!("no UDP answer from {to}: {e}"))?;
        (String::from_utf8_lossy(&buf[..n]).to_string(), from)
    } else {
        let mut c =
            TcpStream::connect_timeout(&to, TIMEOUT).map_err(|e| format!("connect {to}: {e}"))?;
        c.set_read_timeout(Some(TIMEOUT))
            .map_err(|e| e.to_string())?;
        c.write_all(b"hello\n").map_err(|e| format!("write: {e}"))?;
        let mut line = String::new();
        BufReader::new(&c)
            .read_line(&mut line)
            .map_err(|e| format!("read from {to}: {e}"))?;
        (line, c.peer_addr().map_err(|e| e.to_string())?)
    };
    let (backend, seen) = line
        .trim_end()
        .split_once(' ')
        .ok_or_else(|| format!("malformed reply {line:?}"))?;
    let seen: SocketAddr = seen
        .parse()
        .map_err(|e| format!("reply {line:?}: client address: {e}"))?;
    Ok((backend.to_string(), seen.ip(), from))
}

/// `n` requests to `to` from `ns`: the client addresses each backend saw, and the failures
/// (an error, or an answer from anywhere but `to`).
fn requests(
    ns: &str,
    udp: bool,
    to: SocketAddr,
    n: usize,
) -> (BTreeMap<String, Vec<IpAddr>>, Vec<String>) {
    lbproxy_tests::lab::run_in_ns(ns, || {
        let mut seen: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let mut failed = Vec::new();
        for i in 0..n {
            match request(udp, to) {
                Ok((backend, ip, from)) if from == to => {
                    let e = seen.entry(backend).or_default();
                    if !e.contains(&ip) {
                        e.push(ip);
                    }
                }
                Ok(a) => failed.push(format!("#{i}: answered from {}: {a:?}", a.2)),
                Err(e) => failed.push(format!("#{i}: {e}")),
            }
        }
        (seen, failed)
    })
}

/// Waits until `to` answers a TCP request from `ns` (both lbproxys programmed it).
fn wait_served(ns: &str, to: SocketAddr) {
    let deadline = Instant::now() + HEALTHY_WITHIN;
    while lbproxy_tests::lab::run_in_ns(ns, || request(false, to)).is_err()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn proto(udp: bool) -> &'static str {
    if udp { "UDP" } else { "TCP" }
}

/// The node processes' requests: each answered, from `to` as the peer; the backends that
/// answered and the addresses they saw.
fn node_tally(out: &[Outcome], to: SocketAddr, ctx: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for o in out {
        assert!(o.ok, "{ctx}: request failed: {o:?}");
        assert_eq!(
            o.peer,
            to.to_string(),
            "{ctx}: the client must see the frontend as its peer: {o:?}"
        );
        let seen: SocketAddr = o.client_seen.parse().unwrap_or_else(|e| {
            panic!("{ctx}: client_seen {:?}: {e}", o.client_seen);
        });
        let e = m.entry(o.backend.clone()).or_default();
        if !e.contains(&seen.ip().to_string()) {
            e.push(seen.ip().to_string());
        }
    }
    m
}

/// Processes in node A's own namespace reach the IPv6 ClusterIP, externalIP, LB IP and
/// NodePorts (on either node's IPv6 address) over TCP, unconnected and connected UDP: both
/// backends answer, always showing the frontend as the peer, and the backends see node A's
/// IPv6 address (the socket was connected from the node itself).
#[test]
fn node_processes_reach_every_ipv6_frontend_kind() {
    let s = Setup::new("Cluster", true, "");
    let node_a = s.lab.node(NodeId::A).ip6;
    let mut frontends = vec![
        (CLUSTER_IP6, 80, 53),
        (EXTERNAL_IP6, 80, 53),
        (LB_IP6, 80, 53),
    ];
    for node in NodeId::ALL {
        frontends.push((s.lab.node(node).ip6, NODE_PORT_TCP, NODE_PORT_UDP));
    }
    for (ip, tcp, udp) in frontends {
        for (mode, port) in [
            (Mode::Tcp, tcp),
            (Mode::Udp, udp),
            (Mode::UdpConnected, udp),
        ] {
            let to = SocketAddr::from((ip, port));
            let out = s
                .lab
                .host_client(NodeId::A, &Requests::new(mode, to, 16).timeout(TIMEOUT))
                .all();
            let ctx = format!("{mode:?} from nodeA to {to}\n{}", s.logs());
            let m = node_tally(&out, to, &ctx);
            let want = if matches!(mode, Mode::UdpConnected) {
                1
            } else {
                2
            };
            assert!(m.len() >= want, "{ctx}: want {want} backend(s), got {m:?}");
            if ip == CLUSTER_IP6 {
                for seen in m.values() {
                    assert_eq!(seen, &vec![node_a.to_string()], "{ctx}: {m:?}");
                }
            }
        }
    }
}

/// Churn over IPv6: a node process's open TCP connection to the IPv6 ClusterIP whose
/// backend leaves the IPv6 slice is destroyed by lbproxy (the old backend still serves, so
/// without that the connection would go on talking to it), and the process's next
/// connection is answered by the live backend within 2 s.
#[test]
fn a_node_processs_ipv6_connection_moves_when_its_backend_leaves() {
    let s = Setup::new("Cluster", true, "");
    let to = SocketAddr::from((CLUSTER_IP6, 80));
    let mut c = s.lab.host_client(
        NodeId::A,
        &Requests::new(Mode::TcpConnected, to, 100)
            .interval(Duration::from_millis(50))
            .timeout(Duration::from_millis(500)),
    );
    let mut first = None;
    for _ in 0..5 {
        let o = c.next_outcome().expect("client running");
        assert!(o.ok, "before the change: {o:?}\n{}", s.logs());
        assert_eq!(o.peer, to.to_string());
        if let Some(f) = &first {
            assert_eq!(&o.backend, f, "a connected socket must keep its backend");
        }
        first = Some(o.backend.clone());
    }
    let gone = first.unwrap();
    let stays = if gone == s.a1.name { &s.b1 } else { &s.a1 };
    s.lab
        .write_manifest_text(&manifest(&s.lab, &[stays], "Cluster", ""));
    let changed = Instant::now();
    let mut errors = Vec::new();
    let moved = loop {
        let Some(o) = c.next_outcome() else {
            panic!(
                "client ended before its socket moved; errors {errors:?}\n{}",
                s.logs()
            );
        };
        if !o.ok {
            errors.push((changed.elapsed(), o.error.clone(), o.errno));
            continue;
        }
        if o.backend == stays.name {
            break changed.elapsed();
        }
        assert!(
            changed.elapsed() < Duration::from_secs(3),
            "still answered by {gone} 3 s after it left\n{}",
            s.logs()
        );
    };
    eprintln!("IPv6 TCP: socket moved {moved:?} after the change; errors seen: {errors:?}");
    assert!(
        !errors.is_empty(),
        "the socket moved without being destroyed?\n{}",
        s.logs()
    );
    assert!(moved < Duration::from_secs(2), "moved only after {moved:?}");
}

/// `loadBalancerSourceRanges` over IPv6, per family as kube-proxy: with an IPv4 range and
/// an IPv6 `/128` holding the first client, that client reaches the IPv6 LB IP (TCP and
/// UDP) and the second does not (dropped, counted as `source_range_denied`); the IPv6
/// NodePort and externalIP stay open to both (the ranges are for LB IPs only); over IPv4 the
/// first client is outside the IPv4 range, so the IPv4 LB IP refuses it: each family's LB
/// IP is filtered by that family's ranges.
#[test]
fn ipv6_load_balancer_source_ranges_filter_the_ipv6_lb_ip() {
    let inside = Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, 100);
    let s = Setup::new(
        "Cluster",
        true,
        &format!("  loadBalancerSourceRanges: ['203.0.113.0/24', '{inside}/128']\n"),
    );
    let ok = s.lab.add_client("ok");
    let other = s.lab.add_client("other");
    assert_eq!(ok.ip6, inside, "the first client is the one in the range");
    let node = s.lab.node(NodeId::A).clone();
    for c in [&ok, &other] {
        c.route_via6("fd00:c612:ffff::/64", &node);
        c.route_via("198.19.0.0/16", &node);
    }
    wait_served(&ok.netns, SocketAddr::from((LB_IP6, 80)));
    for (udp, port) in [(false, 80), (true, 53)] {
        let to = SocketAddr::from((LB_IP6, port));
        let (seen, failed) = requests(&ok.netns, udp, to, 8);
        assert!(
            failed.is_empty() && seen.values().map(Vec::len).sum::<usize>() > 0,
            "{} {to} from inside the range: {seen:?} {failed:?}\n{}",
            proto(udp),
            s.logs()
        );
    }
    let before = s.lab.node(NodeId::A).drop_count("source_range_denied");
    for (udp, port) in [(false, 80), (true, 53)] {
        let to = SocketAddr::from((LB_IP6, port));
        let (seen, _) = requests(&other.netns, udp, to, 2);
        assert!(
            seen.is_empty(),
            "{} {to}: outside the range the IPv6 LB IP must not answer: {seen:?}",
            proto(udp)
        );
    }
    let after = s.lab.node(NodeId::A).drop_count("source_range_denied");
    assert!(
        after >= before + 4,
        "source_range_denied counted on nodeA ({before} -> {after})\n{}",
        s.logs()
    );
    for to in [
        SocketAddr::from((node.ip6, NODE_PORT_TCP)),
        SocketAddr::from((EXTERNAL_IP6, 80)),
    ] {
        let (seen, failed) = requests(&other.netns, false, to, 4);
        assert!(
            failed.is_empty() && !seen.is_empty(),
            "the ranges do not apply to {to}: {seen:?} {failed:?}"
        );
    }
    // IPv4: the first client's IPv4 address is outside 203.0.113.0/24.
    let to = SocketAddr::from((WEB_LB_IP, 80));
    let (seen, _) = requests(&ok.netns, false, to, 2);
    assert!(
        seen.is_empty(),
        "{to}: the IPv4 LB IP is filtered by the IPv4 range, which does not hold {}: {seen:?}",
        ok.ip
    );
}
/// `--socket-lb pods` over IPv6: a pod's process (in the group) reaching the IPv6 ClusterIP
/// is translated at the socket, `connect6` and `sendmsg6`: every request is answered, showing the
/// ClusterIP as the peer, the backends see the pod's IPv6 address, the socket events count
/// the translations (none as another namespace's), and the per-packet path keeps no flow of
/// the pod.
#[test]
fn socket_lb_pods_translates_ipv6_at_the_socket() {
    let s = Setup::with_args("Cluster", true, "", &["--socket-lb", "pods"]);
    let client = s.lab.add_pod(NodeId::A, "client");
    s.lab.wait_programs_on(&client, Duration::from_secs(10));
    let client6 = client.ip6.unwrap().to_string();
    let before = s.lab.node(NodeId::A).inspect_json("sockets")["events"].clone();
    for (mode, port) in [(Mode::Tcp, 80), (Mode::Udp, 53)] {
        let to = SocketAddr::from((CLUSTER_IP6, port));
        let out = HostClient::spawn(
            &client.netns,
            Some(s.lab.cgroup()),
            &Requests::new(mode, to, 8).timeout(TIMEOUT),
        )
        .all();
        let ctx = format!("pod {mode:?} to {to}\n{}", s.logs());
        let m = node_tally(&out, to, &ctx);
        for seen in m.values() {
            assert_eq!(seen, &vec![client6.clone()], "{ctx}: {m:?}");
        }
    }
    let after = s.lab.node(NodeId::A).inspect_json("sockets")["events"].clone();
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    for (event, least) in [("connect_translated", 8), ("sendmsg_translated", 8)] {
        assert!(
            n(&after, event) >= n(&before, event) + least,
            "{event}: {} -> {}, want at least {least} more\n{after}",
            n(&before, event),
            n(&after, event)
        );
    }
    assert_eq!(
        n(&after, "other_netns"),
        n(&before, "other_netns"),
        "a pod's socket was left to the per-packet path: {after}"
    );
    let flows = s.lab.node(NodeId::A).inspect_json("flows").to_string();
    assert!(
        !flows.contains(&client6),
        "a per-packet flow of the pod {client6}: {flows}"
    );
}
