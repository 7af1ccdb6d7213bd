//! ICMP errors about translated flows (issue 10 §2), with real `lbproxy run` and real
//! sockets. Each test fails when the ICMP error is left untranslated:
//! 1. [`pmtu_through_vip`], over IPv4 and IPv6: the node's route to the backend has a
//!    smaller MTU than both pods. The node answers the client's full-size segments with
//!    "fragmentation needed" (ICMPv6: Packet Too Big) quoting client -> backend; untranslated, the client's kernel finds no socket for it, never
//!    lowers its path MTU, and the request hangs.
//! 2. [`udp_port_unreachable`]: a UDP service whose backend has nothing on the target port,
//!    over IPv4 and over IPv6 (ICMPv6). The backend's port unreachable, translated, gives the
//!    client "connection refused" at once; untranslated, the client waits for its timeout.
//! 3. [`client_port_unreachable`]: the client closed its UDP socket before the answer came;
//!    its kernel's port unreachable is addressed to the VIP and quotes VIP -> client.
//!    Translated, it reaches the backend's connected socket as "connection refused".

mod common;

use std::io::{BufRead as _, BufReader, ErrorKind, Write as _};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::connect::PendingConnect;
use lbproxy_tests::lab::{
    EndpointSlice, Family, Manifest, Protocol, Service, Shape, answer_after_close, socket2_udp,
    vip, wait_udp_port_released,
};

mod pmtu_through_vip {
    use lbproxy_tests::lab::{Family, Shape};
    #[test]
    fn routed_ipv4() {
        super::pmtu_through_vip(Shape::Routed, Family::V4)
    }
    #[test]
    fn routed_ipv6() {
        super::pmtu_through_vip(Shape::Routed, Family::V6)
    }
}

both_shapes!(client_port_unreachable);
both_shapes_and_families!(udp_port_unreachable);

/// A request this long needs many full-size segments.
const BIG: usize = 256 * 1024;

fn pmtu_through_vip(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    if family == Family::V6 {
        s.lab
            .write_manifest_text(&dual_stack_manifest(&[&b1], &[&b1]));
        wait_ipv6_served(&s);
    }
    // Only the node's side of b1's link is narrow (1280, the IPv6 minimum MTU): b1 still
    // announces a 1460-byte (IPv6: 1440-byte) MSS, so the client's segments do not fit and
    // the node must say so ("fragmentation needed", or Packet Too Big).
    s.lab
        .node_run(&["ip", "link", "set", "dev", &b1.host_if, "mtu", "1280"])
        .unwrap_or_else(|e| panic!("[{shape}] narrowing {}: {e}", b1.host_if));
    let stream = match family {
        Family::V4 => {
            let dst = SocketAddrV4::new(WEB_VIP, WEB_TCP);
            let c = s
                .client
                .run(|| PendingConnect::start(21121, dst))
                .unwrap_or_else(|e| panic!("[{shape}] connect: {e}"));
            c.wait_until(c.started + T)
                .unwrap_or_else(|e| panic!("[{shape}] connect: {e}"));
            c.into_stream(T)
        }
        Family::V6 => s
            .client
            .run(|| TcpStream::connect_timeout(&SocketAddr::from((VIP6, WEB_TCP)), T))
            .unwrap_or_else(|e| panic!("[{shape}] connect over IPv6: {e}")),
    };
    let started = Instant::now();
    let r = (|| {
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        // Untranslated, the client never learns the path MTU and the write stalls.
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let mut line = vec![b'x'; BIG];
        line.push(b'\n');
        (&stream).write_all(&line)?;
        let mut answer = String::new();
        BufReader::new(&stream).read_line(&mut answer)?;
        Ok::<_, std::io::Error>(answer)
    })();
    assert!(
        matches!(&r, Ok(a) if a.starts_with("b1 ")),
        "[{shape}] a {BIG}-byte request over {family} through the VIP over a 1280-byte hop: \
         {r:?} after {:?}\n{}\n{}",
        started.elapsed(),
        s.lab.diagnostics(),
        s.lb.log()
    );
}

/// A UDP socket on `port` in the client's namespace, connected to `dst`.
fn connected_udp(s: &Setup, port: u16, dst: SocketAddrV4) -> UdpSocket {
    let u = s
        .client
        .run(|| socket2_udp(port))
        .unwrap_or_else(|e| panic!("UDP socket: {e}"));
    u.connect(dst).unwrap();
    u
}

fn udp_port_unreachable(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1");
    // A second service on b1's port 5555, where nothing listens: a connected UDP socket
    // of the client to it.
    let u = match family {
        Family::V4 => {
            let mut slice =
                EndpointSlice::new("closed-1", "closed").port("dns", 5555, Protocol::Udp);
            slice.endpoints = ready(&[b1]);
            s.lab.write_manifest(&merge([
                web_objects("web", WEB_VIP, ready(&[b1])),
                Manifest::new()
                    .with(Service::cluster_ip("closed", vip(13)).port(
                        "dns",
                        55,
                        Protocol::Udp,
                        5555,
                    ))
                    .with(slice),
            ]));
            std::thread::sleep(APPLY_WITHIN);
            connected_udp(&s, 21101, SocketAddrV4::new(vip(13), 55))
        }
        Family::V6 => {
            const CLOSED6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x13);
            let closed = format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: closed, namespace: default}}\nspec:\n  clusterIP: \"{CLOSED6}\"\n  clusterIPs: [\"{CLOSED6}\"]\n  ipFamilies: [IPv6]\n  ports:\n  - {{name: dns, port: 55, protocol: UDP, targetPort: 5555}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: closed-1, namespace: default, labels: {{kubernetes.io/service-name: closed}}}}\naddressType: IPv6\nports: [{{name: dns, port: 5555, protocol: UDP}}]\nendpoints: [{{addresses: [\"{}\"], conditions: {{ready: true}}}}]\n",
                b1.ip6.unwrap()
            );
            s.lab
                .write_manifest_text(&format!("{}{closed}", dual_stack_manifest(&[b1], &[b1])));
            wait_ipv6_served(&s);
            std::thread::sleep(Duration::from_millis(300));
            s.client.run(|| {
                let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap();
                u.connect((CLOSED6, 55)).unwrap();
                u
            })
        }
    };
    u.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let started = Instant::now();
    u.send(b"hello\n").unwrap();
    let mut buf = [0u8; 64];
    let r = u.recv(&mut buf);
    let took = started.elapsed();
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::ConnectionRefused) && took < T,
        "[{shape}] UDP over {family} to a backend port nobody listens on: {r:?} after {took:?} \
         (want connection refused within {T:?})\n{}\n{}",
        s.lab.diagnostics(),
        s.lb.log()
    );
}

fn client_port_unreachable(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    // b1's own server on 5656: takes one datagram, connects to its sender, answers after
    // the client has gone, then waits for the client's kernel's port unreachable.
    let server = b1
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 5656)))
        .expect("bind 5656 in b1");
    let mut slice = EndpointSlice::new("late-1", "late").port("dns", 5656, Protocol::Udp);
    slice.endpoints = ready(&[&b1]);
    s.lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&[&b1])),
        Manifest::new()
            .with(Service::cluster_ip("late", vip(14)).port("dns", 56, Protocol::Udp, 5656))
            .with(slice),
    ]));
    std::thread::sleep(APPLY_WITHIN);
    let u = connected_udp(&s, 21111, SocketAddrV4::new(vip(14), 56));
    u.send(b"hello\n").unwrap();
    server.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 64];
    let (_, from) = server.recv_from(&mut buf).expect("b1 gets the request");
    drop(u);
    // Closed for good first: a child process another test thread is starting may still hold
    // a copy of the socket, which would take the late answer without a port unreachable.
    let held = s
        .client
        .run(|| wait_udp_port_released(21111, T))
        .unwrap_or_else(|e| panic!("[{shape}] the client's socket: {e}"));
    eprintln!("[{shape}] client port 21111 released {held:?} after the close");
    let (r, took) = answer_after_close(&server, from);
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
        "[{shape}] b1's connected socket after the client's port unreachable: {r:?} after \
         {took:?} (want connection refused)\n{}",
        s.lb.log()
    );
}
