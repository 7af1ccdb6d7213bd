//! Hairpin (issue 12 §2): a pod that reaches itself through a frontend of its own service,
//! with real `lbproxy run` and real sockets, on both pod-network shapes.
//!
//! Without hairpin handling, every connection the load balancer sends back to its own
//! client times out: the pod's kernel drops a packet from outside that carries its own
//! address as the source. With it, the pod sees the flow come from `HAIRPIN`
//! (169.254.42.1, `lbproxy_common::HAIRPIN_ADDR`), never from its own address, and its
//! answers come back from the frontend it called. Each test fails on the datapath from
//! before hairpin: the requests that land on the client itself time out. The every-frontend
//! test runs over IPv6 too, where the pod sees `HAIRPIN6` (`fd00:a9fe:2a01::1`).

mod common;

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::Instant;

use common::*;
use lbproxy_tests::lab::{
    Family, Inspect as _, Lab, Pod, Proto, Reply, Shape, UPLINK_NODE_ADDR, socket2_udp,
};

both_shapes!(
    hairpin_flows_follow_their_backend_leaving,
    hairpin_keeps_session_affinity,
);
both_shapes_and_families!(a_pod_reaches_itself_through_every_frontend);

/// The source address a pod sees on its own hairpin flows.
const HAIRPIN: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// The source address a pod sees on its own IPv6 hairpin flows
/// (`lbproxy_common::HAIRPIN_ADDR6`).
const HAIRPIN6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa9fe, 0x2a01, 0, 0, 0, 0, 1);
/// An externalIP of the web service, in the lab's service range.
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 7);
/// The web service's NodePorts, served on the node's uplink address.
const NODE_PORT_TCP: u16 = 30080;
const NODE_PORT_UDP: u16 = 30053;

/// The web service's YAML over `members`, with `extra` spec lines (two-space indented)
/// added.
fn web_yaml(members: &[&Pod], extra: &str) -> String {
    web_objects("web", WEB_VIP, ready(members))
        .to_yaml()
        .replace("  sessionAffinity: None\n", extra)
}

const NO_AFFINITY: &str = "  sessionAffinity: None\n";

fn with_affinity() -> String {
    "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      \
     timeoutSeconds: 600\n"
        .to_owned()
}

/// `n` requests (a new connection, or a new UDP socket and port, each) from `pod` to
/// `addr:port`, each answered from `addr:port` within [`T`]; panics otherwise. Returns
/// the answering backend and the client address it saw, per request.
fn requests(
    lab: &Lab,
    pod: &Pod,
    proto: Proto,
    addr: impl Into<IpAddr>,
    port: u16,
    n: usize,
) -> Vec<(String, SocketAddr)> {
    let addr = addr.into();
    let to = SocketAddr::new(addr, port);
    (0..n)
        .map(|i| {
            let r = match proto {
                Proto::Tcp => pod.tcp_request(addr, port, T),
                Proto::Udp => pod.udp_request(addr, port, T, None),
            };
            let (reply, from): (Reply, SocketAddr) = r.unwrap_or_else(|e| {
                panic!(
                    "{proto} request {i} from {} to {to}: {e}\n{}",
                    pod.name,
                    lab.diagnostics()
                )
            });
            assert_eq!(
                from, to,
                "{proto} request {i} from {} to {to}: answered by {reply} from {from}",
                pod.name
            );
            let seen: SocketAddr = reply.client_seen.parse().unwrap_or_else(|e| {
                panic!(
                    "backend {} sent client {:?}: {e}",
                    reply.backend, reply.client_seen
                )
            });
            (reply.backend, seen)
        })
        .collect()
}

/// Asserts that every answer `pod` got from itself over `family` saw the client as
/// `HAIRPIN` (`HAIRPIN6`), and every answer from another backend saw the pod's own address.
fn assert_sources(ctx: &str, pod: &Pod, family: Family, answers: &[(String, SocketAddr)]) {
    for (backend, seen) in answers {
        let want: IpAddr = match (*backend == pod.name, family) {
            (true, Family::V4) => HAIRPIN.into(),
            (true, Family::V6) => HAIRPIN6.into(),
            (false, _) => pod_addr(pod, family),
        };
        assert_eq!(
            seen.ip(),
            want,
            "{ctx}: {backend} saw {} as {seen} (want {want}); all answers: {answers:?}",
            pod.name
        );
    }
}

/// How many answers came from `backend`.
fn from(answers: &[(String, SocketAddr)], backend: &str) -> usize {
    answers.iter().filter(|(b, _)| b == backend).count()
}

/// `lbproxy inspect delivery --json`'s hairpin counter.
fn hairpin_packets(lab: &Lab) -> u64 {
    let v = lab.inspect_delivery();
    v.packets
        .get("redirect_hairpin")
        .copied()
        .unwrap_or_else(|| panic!("inspect delivery: no packets.redirect_hairpin: {v:#?}"))
}

/// A pod reaches itself through every frontend kind of its own service: over IPv4 its
/// ClusterIP, an externalIP and the NodePorts on the node's address; over IPv6 (the
/// dual-stack `web`) its IPv6 ClusterIP, the one IPv6 frontend a pod of the single-node lab
/// can call (its node has no IPv6 address of its own for NodePorts).
fn a_pod_reaches_itself_through_every_frontend(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let b1 = s.backend("b1");
    let members: Vec<&Pod> = s.backends.iter().collect();
    let frontends: Vec<(IpAddr, u16, u16)> = match family {
        Family::V4 => {
            // The web service as type NodePort, with an externalIP: every frontend kind a pod
            // can call (its ClusterIP, the externalIP, and the NodePorts on the node's
            // address).
            let yaml = web_yaml(
                &members,
                &format!("  externalIPs: [{EXTERNAL_IP}]\n{NO_AFFINITY}"),
            )
            .replace("  type: ClusterIP\n", "  type: NodePort\n")
            .replace(
                &format!("    port: {WEB_TCP}\n"),
                &format!("    port: {WEB_TCP}\n    nodePort: {NODE_PORT_TCP}\n"),
            )
            .replace(
                &format!("    port: {WEB_UDP}\n"),
                &format!("    port: {WEB_UDP}\n    nodePort: {NODE_PORT_UDP}\n"),
            );
            s.lab.write_manifest_text(&yaml);
            std::thread::sleep(APPLY_WITHIN);
            vec![
                (WEB_VIP.into(), WEB_TCP, WEB_UDP),
                (EXTERNAL_IP.into(), WEB_TCP, WEB_UDP),
                (UPLINK_NODE_ADDR.into(), NODE_PORT_TCP, NODE_PORT_UDP),
            ]
        }
        Family::V6 => {
            serve_family(&s, family, &members);
            vec![(VIP6.into(), WEB_TCP, WEB_UDP)]
        }
    };
    let before = hairpin_packets(&s.lab);
    for (addr, tcp, udp) in frontends {
        for (proto, port) in [(Proto::Tcp, tcp), (Proto::Udp, udp)] {
            let ctx = format!(
                "[{shape}, {family}] {proto} from b1 to {}",
                SocketAddr::new(addr, port)
            );
            let answers = requests(&s.lab, b1, proto, addr, port, 16);
            assert_sources(&ctx, b1, family, &answers);
            // Both backends answer, so b1 reached itself and the other pod alike.
            assert!(
                from(&answers, "b1") > 0 && from(&answers, "b2") > 0,
                "{ctx}: answers {answers:?}"
            );
        }
    }
    // Another pod's requests to b1 keep their own address: hairpin is only the client's
    // flows to itself.
    let answers = requests(&s.lab, &s.client, Proto::Tcp, web_vip(family), WEB_TCP, 8);
    assert_sources(
        &format!("[{shape}, {family}] TCP from client"),
        &s.client,
        family,
        &answers,
    );
    let after = hairpin_packets(&s.lab);
    assert!(
        after > before,
        "[{shape}, {family}] inspect delivery counted no hairpin packets ({before} -> {after})"
    );
}

/// A UDP socket in `pod` connected to `dst`, with a read timeout of [`T`].
fn connected_udp(pod: &Pod, dst: SocketAddrV4) -> UdpSocket {
    let u = pod
        .run(|| socket2_udp(0))
        .unwrap_or_else(|e| panic!("UDP socket in {}: {e}", pod.name));
    u.connect(dst).unwrap();
    u.set_read_timeout(Some(T)).unwrap();
    u
}

/// One request on a connected UDP socket: the answering backend and the client it saw.
fn udp_ask(u: &UdpSocket) -> std::io::Result<(String, SocketAddr)> {
    u.send(b"hello\n")?;
    let mut buf = [0u8; 256];
    let n = u.recv(&mut buf)?;
    let text = String::from_utf8_lossy(&buf[..n]);
    let (backend, seen) = text
        .trim_end()
        .split_once(' ')
        .ok_or_else(|| std::io::Error::other(format!("malformed answer {text:?}")))?;
    let seen = seen.parse().map_err(std::io::Error::other)?;
    Ok((backend.to_owned(), seen))
}

/// Flow lifecycle on hairpin flows: when the pod leaves its own service, its open TCP
/// connection to itself is reset, its connected UDP socket's next datagram goes to the live
/// backend (which sees the pod's own address and port), and new connections go there too.
fn hairpin_flows_follow_their_backend_leaving(shape: Shape) {
    let s = Setup::with_members(shape, &["b1", "b2"], &["b1"]);
    let (b1, b2) = (s.backend("b1"), s.backend("b2"));
    let mut conn = b1
        .connect(WEB_VIP, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}] b1 connects to its own service: {e}"));
    let r = conn
        .request()
        .unwrap_or_else(|e| panic!("[{shape}] request on b1's hairpin connection: {e}"));
    assert_eq!(
        (r.backend.as_str(), r.client_seen.split(':').next()),
        ("b1", Some("169.254.42.1")),
        "[{shape}] b1's connection to itself: {r}"
    );
    let u = connected_udp(b1, SocketAddrV4::new(WEB_VIP, WEB_UDP));
    let first = udp_ask(&u).unwrap_or_else(|e| panic!("[{shape}] b1's UDP to itself: {e}"));
    assert_eq!(
        (first.0.as_str(), first.1.ip()),
        ("b1", std::net::IpAddr::V4(HAIRPIN)),
        "[{shape}] b1's UDP to itself"
    );

    s.lab
        .write_manifest(&web_objects("web", WEB_VIP, ready(&[b2])));
    std::thread::sleep(APPLY_WITHIN);

    let started = Instant::now();
    let moved = udp_ask(&u);
    let local = u.local_addr().unwrap();
    assert!(
        matches!(&moved, Ok((b, seen)) if b == "b2" && *seen == SocketAddr::from((b1.ip, local.port()))),
        "[{shape}] b1's connected UDP socket after b1 left the service: {moved:?} after {:?} \
         (want b2, seeing {}:{})\n{}",
        started.elapsed(),
        b1.ip,
        local.port(),
        s.lb.log()
    );

    let started = Instant::now();
    let reset = conn.request();
    let took = started.elapsed();
    assert!(
        matches!(&reset, Err(e) if e.kind() == ErrorKind::ConnectionReset) && took < T,
        "[{shape}] b1's open hairpin connection after b1 left the service: {reset:?} after \
         {took:?} (want a reset within {T:?})\n{}",
        s.lb.log()
    );

    let answers = requests(&s.lab, b1, Proto::Tcp, WEB_VIP, WEB_TCP, 4);
    assert_eq!(
        from(&answers, "b2"),
        4,
        "[{shape}] b1's new connections: {answers:?}"
    );
    assert_sources(
        &format!("[{shape}] after b1 left"),
        b1,
        Family::V4,
        &answers,
    );
}

/// `sessionAffinity: ClientIP` holds on hairpin flows: once the pod's affinity names
/// itself, every new connection and datagram it sends goes to itself, from `HAIRPIN`, even
/// after another backend joins.
fn hairpin_keeps_session_affinity(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let b1 = s.backend("b1");
    let both: Vec<&Pod> = s.backends.iter().collect();
    // Control: without affinity b1's new connections spread over both backends, so the
    // assertions below can fail.
    let spread = requests(&s.lab, b1, Proto::Tcp, WEB_VIP, WEB_TCP, 16);
    assert!(
        from(&spread, "b1") > 0 && from(&spread, "b2") > 0,
        "[{shape}] without affinity: {spread:?}"
    );

    s.lab
        .write_manifest_text(&web_yaml(&[b1], &with_affinity()));
    std::thread::sleep(APPLY_WITHIN);
    for (proto, port) in [(Proto::Tcp, WEB_TCP), (Proto::Udp, WEB_UDP)] {
        let answers = requests(&s.lab, b1, proto, WEB_VIP, port, 2);
        assert_sources(
            &format!("[{shape}] {proto} affinity to b1 alone"),
            b1,
            Family::V4,
            &answers,
        );
    }

    s.lab
        .write_manifest_text(&web_yaml(&both, &with_affinity()));
    std::thread::sleep(APPLY_WITHIN);
    for (proto, port) in [(Proto::Tcp, WEB_TCP), (Proto::Udp, WEB_UDP)] {
        let ctx = format!("[{shape}] {proto} from b1 with affinity, b2 added");
        let answers = requests(&s.lab, b1, proto, WEB_VIP, port, 12);
        assert_eq!(from(&answers, "b1"), 12, "{ctx}: {answers:?}");
        assert_sources(&ctx, b1, Family::V4, &answers);
    }
}
