//! The lab's pods are dual-stack (an IPv4 and an IPv6 address each, DAD off). lbproxy serves
//! IPv6 Services (issue 14; `ipv6_cluster_ip.rs`), and must not get in the way of the IPv6
//! traffic that is not addressed to one: with lbproxy running and its programs on every pod
//! interface, pods ping each other and their gateway over IPv6 (neighbour discovery
//! included), and TCP and UDP between pods over IPv6 arrive from the sender's own address,
//! while the IPv4 service is served as usual.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{
    BRIDGE_GATEWAY6, Inspect as _, Pod, ROUTED_GATEWAY6, Shape, ns_run, run_in_ns,
};

both_shapes!(ipv6_between_pods_passes_untouched);

fn ping6(from: &Pod, to: &str) -> Result<(), String> {
    ns_run(
        &from.netns,
        &["ping", "-6", "-c", "2", "-i", "0.2", "-W", "1", to],
    )
    .map(|_| ())
    .map_err(|e| format!("ping -6 {to} from {}: {e}", from.name))
}

fn ipv6_between_pods_passes_untouched(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    web_traffic_ok_in(Some(&s.lab), "IPv4 service", &s.client, WEB_VIP, 4);
    let b1 = s.backend("b1").clone();
    let (c6, b6) = (s.client.ip6.unwrap(), b1.ip6.unwrap());

    let gateway = match shape {
        Shape::Routed => format!("{ROUTED_GATEWAY6}%eth0"),
        Shape::Bridge => BRIDGE_GATEWAY6.to_string(),
    };
    for (from, to) in [
        (&s.client, b6.to_string()),
        (&b1, c6.to_string()),
        (&s.client, gateway),
    ] {
        ping6(from, &to).unwrap_or_else(|e| panic!("{e}\n{}", s.lab.diagnostics()));
    }

    // TCP: b1 listens on [b6]:9000 and says who connected; the client connects.
    let listener = run_in_ns(&b1.netns, || TcpListener::bind((b6, 9000)).unwrap());
    let server = std::thread::spawn(move || {
        let (mut conn, peer) = listener.accept().unwrap();
        conn.write_all(peer.to_string().as_bytes()).unwrap();
        peer
    });
    let seen = run_in_ns(&s.client.netns, || {
        let mut c = TcpStream::connect_timeout(&SocketAddr::from((b6, 9000)), T).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    });
    let peer = server.join().unwrap();
    assert_eq!(
        peer.ip(),
        std::net::IpAddr::V6(c6),
        "TCP over IPv6 from the client's own address"
    );
    assert_eq!(seen, peer.to_string());

    // UDP: the client sends to [b6]:9001, b1 answers, the answer comes from b6.
    let sock = run_in_ns(&b1.netns, || UdpSocket::bind((b6, 9001)).unwrap());
    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let (n, from) = sock.recv_from(&mut buf).unwrap();
        sock.send_to(&buf[..n], from).unwrap();
        from
    });
    let (reply, from) = run_in_ns(&s.client.netns, || {
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        u.send_to(b"hello6", (b6, 9001)).unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = u.recv_from(&mut buf).unwrap();
        (buf[..n].to_vec(), from)
    });
    let sender = echo.join().unwrap();
    assert_eq!(
        sender.ip(),
        std::net::IpAddr::V6(c6),
        "UDP over IPv6 from the client's own address"
    );
    assert_eq!(
        (reply.as_slice(), from.ip()),
        (&b"hello6"[..], std::net::IpAddr::V6(b6))
    );

    // Still served over IPv4, and nothing was dropped on the way.
    web_traffic_ok_in(
        Some(&s.lab),
        "IPv4 service after IPv6 traffic",
        &s.client,
        WEB_VIP,
        4,
    );
    let drops = s.lab.drop_counts();
    let total: u64 = drops.values().sum();
    assert_eq!(total, 0, "datapath drops during IPv6 traffic: {drops:#?}");
}
