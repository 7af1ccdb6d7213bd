//! Spoofed sources (issue 10 §3): a pod that sends to a service with a source address that
//! is not its own gets no translation. The packet is dropped and counted as
//! `spoofed_source`, takes no flow entry, and reaches no backend; the pod's own address
//! keeps working. Real `lbproxy run`, real sockets, both pod-network shapes.
//!
//! The client pod gets a second address, [`SPOOFED`], outside the pods' subnet, and sends
//! from sockets bound to it: the node routes that address out of its uplink, not out of the
//! client's interface (routed) or the pods' bridge (bridge). Without the source check the
//! datapath translates these packets like any other: it creates their flows and counts
//! nothing, so the test fails.
//!
//! [`spoofed_frame_verdicts`] pins the verdicts down with `BPF_PROG_TEST_RUN` (the rows of
//! `docs/datapath-verdicts.md`), including that an interface lbproxy wrote no check for is
//! not checked.
//!
//! In the routed shape a pod also cannot use a neighbour pod's address. In the bridge shape
//! it can: the node routes every address of the bridge's subnet to the bridge, so the check
//! does not tell the bridge's pods apart (README, "Spoofed sources").

mod common;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::inspect::rows::FlowRow;
use lbproxy_tests::lab::{Family, Lab, Pod, Shape, bpf, ns_run, wait_for};

both_shapes!(pod_addresses_follow_the_routes);
both_shapes_and_families!(spoofed_source_is_dropped);

#[test]
fn spoofed_frame_verdicts() {
    frame_verdicts(Shape::Routed);
}

/// The client's second address: outside the pods' 198.18.0.0/24 and the uplink's /30, so
/// the node routes it out of the uplink.
const SPOOFED: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 200);
/// The client's second IPv6 address: outside the pods' `fd00:c612::/64`, which the node
/// does not route to any pod.
const SPOOFED6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x9, 0, 0, 0, 0, 0, 0xc8);
/// Fixed source ports of the spoofed sockets.
const SRC_UDP: u16 = 21001;
const SRC_TCP: u16 = 21002;
/// UDP requests sent from each spoofed address.
const UDP_SENDS: u64 = 3;
/// How long to wait for an answer that must not come.
const SILENCE: Duration = Duration::from_secs(1);

/// The flow entries (`inspect flows --json`) whose client is `addr`, any port.
fn flows_from(lab: &Lab, addr: impl Into<IpAddr>) -> Vec<FlowRow> {
    let prefix = match addr.into() {
        IpAddr::V4(a) => format!("{a}:"),
        IpAddr::V6(a) => format!("[{a}]:"),
    };
    lab.inspect_flows()
        .into_iter()
        .filter(|f| f.client.starts_with(&prefix))
        .collect()
}

/// Packets the counting rule for `src` in `pod`'s INPUT chain (iptables or ip6tables, by
/// `src`'s family) has seen.
fn input_packets_from(pod: &Pod, src: IpAddr) -> u64 {
    let tool = iptables(family_of(src));
    let out = ns_run(&pod.netns, &[tool, "-L", "INPUT", "-v", "-n", "-x"])
        .unwrap_or_else(|e| panic!("{tool} -L in {}: {e}", pod.name));
    let (host, host128) = (src.to_string(), format!("{src}/128"));
    out.lines()
        .find(|l| l.split_whitespace().any(|w| w == host || w == host128))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no counting rule for {src} in {}:\n{out}", pod.name))
}

/// The family of `addr`.
fn family_of(addr: IpAddr) -> Family {
    if addr.is_ipv6() {
        Family::V6
    } else {
        Family::V4
    }
}

/// A non-blocking TCP connect from `src` to `dst` (one family), in the calling thread's
/// namespace.
fn connect_from(src: SocketAddr, dst: SocketAddr) -> io::Result<OwnedFd> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(src),
        socket2::Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    sock.set_reuse_address(true)?;
    sock.bind(&src.into())?;
    match sock.connect(&dst.into()) {
        Err(e) if e.raw_os_error() != Some(libc::EINPROGRESS) => return Err(e),
        _ => {}
    }
    Ok(sock.into())
}

/// Whether the connect on `fd` completed within `wait`.
fn connected_within(fd: &OwnedFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, wait.as_millis() as i32) };
    if n <= 0 {
        return false;
    }
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: valid fd, and an int-sized option buffer.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut err as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    err == 0
}

/// The flows from `addr` as (client, frontend, backend), sorted.
fn flow_tuples(lab: &Lab, addr: IpAddr) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = flows_from(lab, addr)
        .into_iter()
        .map(|f| (f.client, f.frontend, f.backend))
        .collect();
    v.sort();
    v
}

/// From inside `client`'s namespace: [`UDP_SENDS`] UDP requests to the web service on
/// `src`'s family and one TCP connect to it, all from `src`. Returns the UDP answers and
/// whether the connect completed, within [`SILENCE`].
fn send_from(client: &Pod, src: IpAddr) -> (Vec<String>, bool) {
    let vip = web_vip(family_of(src));
    client.run(|| {
        let udp = UdpSocket::bind((src, SRC_UDP)).expect("bind UDP to the spoofed address");
        for _ in 0..UDP_SENDS {
            udp.send_to(b"hello\n", (vip, WEB_UDP))
                .expect("UDP send from the spoofed address");
        }
        let syn = connect_from(SocketAddr::new(src, SRC_TCP), SocketAddr::new(vip, WEB_TCP))
            .expect("TCP connect from the spoofed address");
        let end = Instant::now() + SILENCE;
        let mut answers = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            udp.set_read_timeout(Some(left)).unwrap();
            match udp.recv_from(&mut buf) {
                Ok((n, from)) => answers.push(format!(
                    "{} from {from}",
                    String::from_utf8_lossy(&buf[..n]).trim()
                )),
                Err(e) if lbproxy_tests::lab::net::recv_again(&e) => {}
                Err(e) => panic!(
                    "UDP recv: {e} ({:?}, os error {:?})",
                    e.kind(),
                    e.raw_os_error()
                ),
            }
        }
        (answers, connected_within(&syn, Duration::ZERO))
    })
}

/// `ip addr add` (`add`) or `ip addr del` of `addr` as a host address on `pod`'s eth0; an
/// IPv6 one without duplicate address detection, so it can be bound at once.
fn pod_extra_addr(pod: &Pod, op: &str, addr: IpAddr) {
    let (fam, plen) = match addr {
        IpAddr::V4(_) => ("-4", 32),
        IpAddr::V6(_) => ("-6", 128),
    };
    let prefix = format!("{addr}/{plen}");
    let mut argv = vec!["ip", fam, "addr", op, &prefix, "dev", "eth0"];
    if op == "add" && addr.is_ipv6() {
        argv.push("nodad");
    }
    ns_run(&pod.netns, &argv)
        .unwrap_or_else(|e| panic!("ip addr {op} {addr} in {}: {e}", pod.name));
}

/// A client sends UDP and a TCP SYN to the web VIP from an address that is not its own,
/// over IPv4 and over IPv6 (the dual-stack `web`'s IPv6 clusterIP, the address
/// [`SPOOFED6`]). Nothing is translated: no answer, no connection, no backend sees a packet
/// from that address, no flow entry names it, and `spoofed_source` counts every packet.
/// Traffic from the client's own address works before and after, and is never counted as
/// spoofed. In the routed shape, the same holds for a neighbour pod's address.
fn spoofed_source_is_dropped(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let lab = &s.lab;
    serve_family(&s, family, &s.backends.iter().collect::<Vec<_>>());
    let vip = web_vip(family);
    traffic_ok(
        &s,
        family,
        &format!("[{shape}, {family}] own address, before"),
        4,
    );
    assert_eq!(
        lab.drop_count("spoofed_source"),
        0,
        "[{shape}, {family}] the client's own address was counted as spoofed\n{}",
        lab.diagnostics()
    );

    let mut spoofed = vec![match family {
        Family::V4 => IpAddr::from(SPOOFED),
        Family::V6 => IpAddr::from(SPOOFED6),
    }];
    let neighbour = pod_addr(s.backend("b2"), family);
    if shape == Shape::Routed {
        // A neighbour's address: routed out of the neighbour's interface, not the client's.
        spoofed.push(neighbour);
    }
    for &addr in &spoofed {
        for b in &s.backends {
            ns_run(
                &b.netns,
                &[
                    iptables(family),
                    "-I",
                    "INPUT",
                    "-s",
                    &addr.to_string(),
                    "-j",
                    "ACCEPT",
                ],
            )
            .unwrap_or_else(|e| panic!("counting rule in {}: {e}", b.name));
        }
        pod_extra_addr(&s.client, "add", addr);

        // The neighbour's own flow on the very tuple the client will forge: its entry
        // exists, so the forged packets hit it and must still be checked (they arrive on
        // another interface than the flow's).
        if addr == neighbour {
            s.backend("b2").run(|| {
                let u = UdpSocket::bind((addr, SRC_UDP)).expect("bind UDP in b2");
                u.send_to(b"hello\n", (vip, WEB_UDP))
                    .expect("UDP send from b2");
            });
            std::thread::sleep(Duration::from_millis(100));
        }
        let flows_before = flow_tuples(lab, addr);
        if addr != neighbour {
            assert!(
                flows_before.is_empty(),
                "[{shape}, {family}] flows from {addr} before it sent anything: {flows_before:?}"
            );
        }
        // The neighbour's own packet may have reached a backend: count from here on.
        let received_before: Vec<u64> = s
            .backends
            .iter()
            .map(|b| input_packets_from(b, addr))
            .collect();
        let before = lab.drop_count("spoofed_source");
        let (answers, connected) = send_from(&s.client, addr);
        let dropped = lab.drop_count("spoofed_source") - before;
        let ctx = format!(
            "[{shape}, {family}] client {} sending from {addr}",
            pod_addr(&s.client, family)
        );
        assert!(
            answers.is_empty(),
            "{ctx}: UDP answered: {answers:?}\n{}",
            lab.diagnostics()
        );
        assert!(!connected, "{ctx}: TCP connected\n{}", lab.diagnostics());
        // Each UDP request and at least the first SYN (the kernel retransmits it after 1 s).
        assert!(
            dropped > UDP_SENDS,
            "{ctx}: spoofed_source counted {dropped} packets, want at least {}\n{}",
            UDP_SENDS + 1,
            lab.diagnostics()
        );
        let flows = flow_tuples(lab, addr);
        assert_eq!(
            flows, flows_before,
            "{ctx}: flow entries for the spoofed address changed"
        );
        for (b, before) in s.backends.iter().zip(received_before) {
            let n = input_packets_from(b, addr) - before;
            assert_eq!(
                n, 0,
                "{ctx}: backend {} received {n} packets from {addr}",
                b.name
            );
        }
        // Gone again, so that source address selection cannot pick it for the client's
        // own requests.
        pod_extra_addr(&s.client, "del", addr);
    }

    let before = lab.drop_count("spoofed_source");
    traffic_ok(
        &s,
        family,
        &format!("[{shape}, {family}] own address, after"),
        4,
    );
    assert_eq!(
        lab.drop_count("spoofed_source"),
        before,
        "[{shape}, {family}] the client's own address was counted as spoofed"
    );
    let own = flows_from(lab, pod_addr(&s.client, family));
    assert!(
        !own.is_empty(),
        "[{shape}, {family}] no flow entry for the client's own address ({}): inspect flows \
         shows nothing?",
        pod_addr(&s.client, family)
    );
}

/// A UDP datagram from `src:sport` to the web service's UDP frontend, as the client pod
/// sends it: Ethernet, IPv4 (checksum exact), UDP (checksum 0, "none").
fn udp_frame(src: Ipv4Addr, sport: u16) -> Vec<u8> {
    let payload = b"hello\n";
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let tot = (20 + 8 + payload.len()) as u16;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&tot.to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&WEB_VIP.octets());
    let sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    let folded = (sum & 0xffff) + (sum >> 16);
    let csum = !(((folded & 0xffff) + (folded >> 16)) as u16);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&WEB_UDP.to_be_bytes());
    f.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

/// The destination address of an IPv4 frame.
fn frame_dst(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(f[30], f[31], f[32], f[33])
}

const TC_ACT_UNSPEC: i32 = -1;
const TC_ACT_SHOT: i32 = 2;

/// `lb_from_pod` run with `BPF_PROG_TEST_RUN` on the client's interface: a datagram to the
/// VIP from an address not the client's is `TC_ACT_SHOT`, untouched, `spoofed_source` +1,
/// and no flow; the same datagram from the client's address is translated (`TC_ACT_UNSPEC`,
/// destination a backend). On an interface without a check (`lo`: lbproxy manages it not)
/// the spoofed datagram is translated: no entry, no check.
fn frame_verdicts(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let lab = &s.lab;
    let ((ifindex, prog), _) = wait_for(Duration::from_secs(5), Duration::from_millis(20), || {
        lab.tcx_attachments()
            .into_iter()
            .find(|a| {
                a.ifname == s.client.host_if
                    && a.direction == "ingress"
                    && a.prog_name == "lb_from_pod"
            })
            .map(|a| (a.ifindex, a.prog_id))
    })
    .unwrap_or_else(|w| {
        panic!(
            "lb_from_pod not attached to {} within {w:?}",
            s.client.host_if
        )
    });
    let b1 = s.backend("b1").ip;
    let run = |what: &str, ifindex: u32, frame: &[u8]| {
        bpf::prog_test_run(lab.node_ns(), prog, ifindex, frame)
            .unwrap_or_else(|e| panic!("{what}: BPF_PROG_TEST_RUN: {e}"))
    };

    let spoofed = udp_frame(SPOOFED, SRC_UDP);
    let before = lab.drop_count("spoofed_source");
    let r = run("spoofed", ifindex, &spoofed);
    assert_eq!(r.retval, TC_ACT_SHOT, "spoofed source: want TC_ACT_SHOT");
    assert_eq!(r.data, spoofed, "spoofed source: the frame was changed");
    assert_eq!(lab.drop_count("spoofed_source"), before + 1);
    assert!(
        flows_from(lab, SPOOFED).is_empty(),
        "a flow for the spoofed source"
    );

    let own = udp_frame(s.client.ip, SRC_UDP);
    let r = run("own address", ifindex, &own);
    assert_eq!(r.retval, TC_ACT_UNSPEC, "own address: want TC_ACT_UNSPEC");
    assert_eq!(frame_dst(&r.data), b1, "own address: not translated to b1");
    assert_eq!(lab.drop_count("spoofed_source"), before + 1);

    let unchecked = Ipv4Addr::new(198, 18, 9, 201);
    let r = run("unchecked interface", 1, &udp_frame(unchecked, SRC_UDP));
    assert_eq!(
        r.retval, TC_ACT_UNSPEC,
        "unchecked interface: want TC_ACT_UNSPEC"
    );
    assert_eq!(
        frame_dst(&r.data),
        b1,
        "unchecked interface: not translated"
    );
    assert_eq!(lab.drop_count("spoofed_source"), before + 1);
    assert_eq!(
        flows_from(lab, unchecked).len(),
        1,
        "unchecked interface: no flow"
    );
}

/// `LB_PODADDRS_V1` (the source check's fast path), read with bpftool: address -> ifindex.
fn pod_addrs(lab: &Lab) -> std::collections::BTreeMap<Ipv4Addr, u64> {
    lab.map_dump("LB_PODADDRS_V1")
        .iter()
        .map(|e| {
            let addr = bpf::ipv4_of_json(&e["key"])
                .unwrap_or_else(|| panic!("LB_PODADDRS_V1: not an address key: {e}"));
            let ifindex = e["value"]["ifindex"]
                .as_u64()
                .unwrap_or_else(|| panic!("LB_PODADDRS_V1: no ifindex: {e}"));
            (addr, ifindex)
        })
        .collect()
}

/// The source check's fast path follows the node's routes: on a routed pod network
/// `LB_PODADDRS_V1` lists each pod's address with its host-side interface; a pod's route
/// deleted takes its entry away within a second (a route event, well before the 2 s
/// re-list), and the route put back brings it back, so traffic from that pod still works
/// through the FIB check meanwhile. On a bridged network the map stays empty: those checks
/// are the FIB's.
fn pod_addresses_follow_the_routes(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let lab = &s.lab;
    let pods: Vec<&Pod> = std::iter::once(&s.client).chain(&s.backends).collect();
    let att = lab.tcx_attachments();
    let ifindex = |p: &Pod| {
        att.iter()
            .find(|a| a.ifname == p.host_if)
            .map(|a| u64::from(a.ifindex))
            .unwrap_or_else(|| panic!("[{shape}] {} has no programs", p.host_if))
    };
    let all: std::collections::BTreeMap<Ipv4Addr, u64> = match shape {
        Shape::Routed => pods.iter().map(|p| (p.ip, ifindex(p))).collect(),
        Shape::Bridge => Default::default(),
    };
    let within = Duration::from_secs(1);
    let expect = |want: &std::collections::BTreeMap<Ipv4Addr, u64>, ctx: &str| {
        if let Err(t) = wait_for(within, Duration::from_millis(20), || {
            (pod_addrs(lab) == *want).then_some(())
        }) {
            panic!(
                "[{shape}] {ctx}: LB_PODADDRS_V1 after {t:?}: {:?}, want {want:?}",
                pod_addrs(lab)
            );
        }
    };
    expect(&all, "at start");
    if shape == Shape::Bridge {
        // Traffic works without the fast path.
        web_traffic_ok(&format!("[{shape}] no fast path"), &s.client, WEB_VIP, 4);
        return;
    }
    let route = format!("{}/32", s.client.ip);
    lab.node_run(&["ip", "route", "del", &route, "dev", &s.client.host_if])
        .unwrap_or_else(|e| panic!("ip route del {route}: {e}"));
    let mut without = all.clone();
    without.remove(&s.client.ip);
    expect(&without, "the client's route deleted");
    lab.node_run(&["ip", "route", "add", &route, "dev", &s.client.host_if])
        .unwrap_or_else(|e| panic!("ip route add {route}: {e}"));
    expect(&all, "the client's route back");
    web_traffic_ok(&format!("[{shape}] route back"), &s.client, WEB_VIP, 4);
}
