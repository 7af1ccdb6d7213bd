//! North-south traffic on two nodes (issue 11, see north_south.rs): the flows of a backend
//! that leaves (moved or reset), and ICMP errors about NodePort flows, both ways.

mod north_south_common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::multinode::{
    NodeId, WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
    cluster_ip_manifest, dual_stack_web_manifest,
};
use lbproxy_tests::lab::{Family, Pod, udp_request, wait_for};

use north_south_common::*;

/// The flow lifecycle holds for north-south flows as for ClusterIP ones: a UDP flow from a
/// fixed source port through nodeA's NodePort moves to a live backend on its next datagram
/// once its backend leaves the slice, and an open TCP connection to the backend that left
/// is reset on its next segment instead of hanging.
#[test]
fn a_removed_backends_north_south_flows_move_or_reset() {
    removed_backends_flows_move_or_reset(false);
}

/// [`a_removed_backends_north_south_flows_move_or_reset`] with the backend that leaves `web`
/// still an endpoint, same address and ports, of another Service (`metrics`): its flows
/// through `web` must move or reset all the same. (Until the flow checked its backend's
/// membership of the flow's own Service, they stayed on the old backend: 203 UDP answers
/// after the change, none from the new one, and the TCP connection stayed open.)
#[test]
fn a_backend_leaving_one_of_two_services_loses_that_services_north_south_flows() {
    removed_backends_flows_move_or_reset(true);
}

/// The body of the two tests above; `shared`: the backend that leaves `web` stays in
/// `metrics`.
fn removed_backends_flows_move_or_reset(shared: bool) {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    // A UDP flow from one source port, and a TCP connection, both on one backend.
    let (first, _) = udp_request(&client.netns, a, NODE_PORT_UDP, TIMEOUT, Some(40_053))
        .unwrap_or_else(|e| panic!("UDP: {e}\n{}", s.logs()));
    let mut conn = loop {
        let mut c = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
        if c.request().unwrap().backend == first.backend {
            break c;
        }
    };
    let (keep, gone) = if first.backend == "a1" {
        (&s.b1, &s.a1)
    } else {
        (&s.a1, &s.b1)
    };
    let mut after = manifest(&s.lab, &[keep], "Cluster");
    if shared {
        let gone_ep = (gone.ip, Some(s.lab.node_of(&gone.name).name()));
        after.push_str(&cluster_ip_manifest("metrics", METRICS_IP, &[gone_ep]));
    }
    s.lab.write_manifest_text(&after);
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let r = udp_request(
            &client.netns,
            a,
            NODE_PORT_UDP,
            Duration::from_millis(500),
            Some(40_053),
        );
        match r {
            Ok((reply, _)) if reply.backend == keep.name => break,
            other => assert!(
                Instant::now() < until,
                "the UDP flow stays on {}: {other:?}\n{}",
                first.backend,
                s.logs()
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = conn.request();
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the open TCP connection to {} is reset: {r:?}",
        first.backend
    );
    if shared {
        // The other Service still reaches the backend, through its own flows.
        let pod = s.lab.add_pod(NodeId::A, "mclient");
        s.lab.wait_programs_on(&pod, HEALTHY_WITHIN);
        let seen = requests(&pod.netns, true, METRICS_IP, 53, 5);
        assert!(
            seen.errors.is_empty() && seen.by_backend.keys().eq([&gone.name]),
            "metrics (only {}) through node A after it left web: {seen:?}\n{}",
            gone.name,
            s.logs()
        );
    }
}

lbproxy_tests::both_families!(icmp_errors_about_node_port_flows_reach_the_client);

/// ICMP errors about north-south flows reach the outside client translated, so its socket
/// sees them (issue 10's ICMP handling, for NodePorts), in each family (over IPv6 the
/// Service is dual-stack, the errors are ICMPv6):
/// - the port unreachable of a backend on nodeB, about a datagram source-NATed by nodeA: the
///   client's connected UDP socket to nodeA's NodePort gets "connection refused" at once
///   (addressed to nodeA's SNAT address, it is translated and sent on to the client);
/// - the same from a backend on nodeA itself (no SNAT; translated as it leaves the node);
/// - PMTU: nodeB's link to b1 is 1280 bytes, narrower than the path before it, so nodeB
///   answers the client's full-size segments, source-NATed by nodeA, with "fragmentation
///   needed" (Packet Too Big) to nodeA's address; translated and sent on, the client lowers
///   its path MTU and a 256 KiB request through the NodePort is answered.
fn icmp_errors_about_node_port_flows_reach_the_client(family: Family) {
    let s = Setup::for_family(family, "Cluster");
    let client = s.lab.add_client("ext");
    let (a, v6): (IpAddr, bool) = match family {
        Family::V4 => (s.lab.node(NodeId::A).ip.into(), false),
        Family::V6 => (s.lab.node(NodeId::A).ip6.into(), true),
    };
    let addr_of = |p: &Pod| -> IpAddr {
        match family {
            Family::V4 => p.ip.into(),
            Family::V6 => p.ip6.expect("dual-stack pod").into(),
        }
    };
    for (backend, what) in [(&s.b1, "on nodeB, source-NATed"), (&s.a1, "on nodeA")] {
        let web = match family {
            Family::V4 => manifest(&s.lab, &[&s.a1, &s.b1], "Cluster"),
            Family::V6 => dual_stack_web_manifest(&s.lab, &[&s.a1, &s.b1], "Cluster", ""),
        };
        s.lab
            .write_manifest_text(&format!("{web}{}", s.lab.closed_service(backend, v6)));
        // Programmed on nodeA first: until then nodeA's own stack would refuse the datagram.
        let programmed = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
            s.lab
                .serves_only(NodeId::A, "default/closed", addr_of(backend))
                .then_some(())
        });
        assert!(
            programmed.is_ok(),
            "nodeA serves closed's {family} NodePort with {} only\n{}",
            backend.name,
            s.logs()
        );
        let refused = wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
            let u = client
                .run(|| match family {
                    Family::V4 => lbproxy_tests::lab::socket2_udp(0),
                    Family::V6 => lbproxy_tests::lab::net::socket2_udp6(0),
                })
                .expect("UDP socket");
            u.connect((a, 30055)).unwrap();
            u.set_read_timeout(Some(Duration::from_millis(900)))
                .unwrap();
            let started = Instant::now();
            u.send(b"hello\n").unwrap();
            let r = u.recv(&mut [0u8; 64]);
            (matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
                && started.elapsed() < Duration::from_secs(1))
            .then_some(())
        });
        assert!(
            refused.is_ok(),
            "UDP through nodeA's {family} NodePort to {} ({what}), where nothing listens: want \
             connection refused within 1 s\n{}",
            backend.name,
            s.logs()
        );
    }
    // PMTU, source-NATed to b1 on nodeB.
    match family {
        Family::V4 => only_b1(&s, &client.netns),
        Family::V6 => {
            s.lab
                .write_manifest_text(&dual_stack_web_manifest(&s.lab, &[&s.b1], "Cluster", ""));
            // Both nodes' maps first: requests alone can all land on b1 by chance while a1
            // is still in, and a connection opened to a1 then is reset when a1 leaves.
            let b1_6 = addr_of(&s.b1);
            let only_b1 = wait_for(Duration::from_secs(10), Duration::from_millis(100), || {
                let programmed = NodeId::ALL
                    .iter()
                    .all(|&node| s.lab.serves_only(node, "default/web", b1_6));
                let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 6);
                (programmed
                    && seen.errors.is_empty()
                    && seen.wrong_source.is_empty()
                    && seen.by_backend.len() == 1
                    && seen.by_backend.contains_key(&s.b1.name))
                .then_some(())
            });
            assert!(
                only_b1.is_ok(),
                "only b1 serves {}\n{}",
                SocketAddr::from((a, NODE_PORT_TCP)),
                s.logs()
            );
        }
    }
    s.lab
        .node_run(
            NodeId::B,
            &["ip", "link", "set", "dev", &s.b1.host_if, "mtu", "1280"],
        )
        .unwrap();
    let answer = big_request(&client, a, NODE_PORT_TCP);
    assert!(
        answer.as_ref().is_ok_and(|a| a.starts_with("b1 ")),
        "a 256 KiB request through nodeA's {family} NodePort to b1 over a 1280-byte hop: \
         {answer:?}\n{}",
        s.logs()
    );
}

/// An outside client's own ICMP error about a reply it got through a NodePort reaches the
/// backend translated: b1 (on nodeB, source-NATed by nodeA) answers after the client has
/// closed its socket, the client's kernel sends port unreachable to nodeA's NodePort
/// address (which is also nodeA's SNAT address) quoting nodeA:30056 -> client, and nodeA
/// readdresses it to b1 with the quote as b1 sent its reply, so b1's connected socket gets
/// "connection refused".
#[test]
fn a_clients_icmp_error_about_a_node_port_reply_reaches_the_backend() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    let server =
        s.b1.run(|| std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 5656)))
            .expect("bind 5656 in b1");
    let text = closed_manifest(&s.lab, &[&s.a1, &s.b1], &s.b1)
        .replace(
            "targetPort: 5555, nodePort: 30055",
            "targetPort: 5656, nodePort: 30056",
        )
        .replace("port: 5555, protocol: UDP}", "port: 5656, protocol: UDP}");
    assert!(
        text.contains("nodePort: 30056") && text.contains("port: 5656,"),
        "{text}"
    );
    s.lab.write_manifest_text(&text);
    server
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 64];
    // Until nodeA serves 30056 (its own stack would refuse the first datagrams).
    let mut ports = Vec::new();
    let from = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        let u = client
            .run(|| lbproxy_tests::lab::socket2_udp(0))
            .expect("UDP socket");
        u.connect((a, 30056)).unwrap();
        ports.push(u.local_addr().unwrap().port());
        u.send(b"hello\n").unwrap();
        server.recv_from(&mut buf).ok().map(|(_, from)| from)
    });
    let (from, _) =
        from.unwrap_or_else(|t| panic!("b1 got no datagram through 30056 in {t:?}\n{}", s.logs()));
    assert_eq!(
        from.ip(),
        std::net::IpAddr::V4(a),
        "b1 sees nodeA's address (SNAT)"
    );
    // The client's sockets are closed by now, and no copy of one lives on in a child process
    // that another test thread is starting (see `wait_udp_port_released`).
    for port in ports {
        client
            .run(|| lbproxy_tests::lab::wait_udp_port_released(port, TIMEOUT))
            .unwrap_or_else(|e| panic!("the client's socket: {e}"));
    }
    let (r, took) = lbproxy_tests::lab::answer_after_close(&server, from);
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "b1's connected socket after the client's port unreachable: {r:?} after {took:?} \
         (want connection refused)\n{}",
        s.logs()
    );
}
