//! Checks of the namespace lab itself; these need no lbproxy.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::{Duration, Instant};

use lbproxy_tests::lab::{self, Lab, Proto, Shape, ns};

const T: Duration = Duration::from_secs(1);

fn links(ns_name: &str) -> Vec<String> {
    let out = ns::ns_run(ns_name, &["ip", "-o", "link", "show"]).unwrap();
    out.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_owned())
        .collect()
}

fn direct_traffic(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let b2 = lab.add_pod("b2");
    let _s1 = b1.serve(&[8080, 8081]);
    let _s2 = b2.serve(&[8080]);

    // Only host sides (plus lo, the uplink and the bridge) live in the node namespace.
    let mut node_links = links(lab.node_ns());
    node_links.sort();
    let mut want = vec![
        "lo".to_owned(),
        lab::UPLINK_IF.to_owned(),
        client.host_if.clone(),
        b1.host_if.clone(),
        b2.host_if.clone(),
    ];
    if shape == Shape::Bridge {
        want.push(lab::BRIDGE_IF.to_owned());
    }
    want.sort();
    assert_eq!(node_links, want, "[{shape}] links in the node namespace");
    for p in [&client, &b1, &b2] {
        assert!(
            p.host_if.starts_with(lab.if_prefix()) && p.host_if.len() <= 15,
            "{p:?}"
        );
        assert_eq!(
            links(&p.netns),
            ["lo", "eth0"],
            "[{shape}] links in {}",
            p.netns
        );
    }
    assert_eq!(
        ns::sysctl_read(lab.node_ns(), "net/ipv4/ip_forward").unwrap(),
        "1"
    );
    if shape == Shape::Bridge && Path::new("/proc/sys/net/bridge/bridge-nf-call-iptables").exists()
    {
        assert_eq!(
            ns::sysctl_read(lab.node_ns(), "net/bridge/bridge-nf-call-iptables").unwrap(),
            "1"
        );
    }

    for (pod, port) in [(&b1, 8080), (&b1, 8081), (&b2, 8080)] {
        let (r, peer) = client
            .tcp_request(pod.ip, port, T)
            .unwrap_or_else(|e| panic!("[{shape}] TCP client -> {}:{port}: {e}", pod.ip));
        assert_eq!(r.backend, pod.name, "[{shape}] TCP reply identity");
        assert_eq!(peer, SocketAddr::from((pod.ip, port)));
        assert!(r.client_seen.starts_with(&format!("{}:", client.ip)), "{r}");

        let (r, from) = client
            .udp_request(pod.ip, port, T, Some(40000))
            .unwrap_or_else(|e| panic!("[{shape}] UDP client -> {}:{port}: {e}", pod.ip));
        assert_eq!(r.backend, pod.name, "[{shape}] UDP reply identity");
        assert_eq!(from, SocketAddr::from((pod.ip, port)));
        assert_eq!(r.client_seen, format!("{}:40000", client.ip));
    }

    // Long-lived connection.
    let mut c = client.connect(b2.ip, 8080, T).unwrap();
    for _ in 0..5 {
        assert_eq!(c.request().unwrap().backend, "b2");
    }

    // Tally.
    for proto in [Proto::Tcp, Proto::Udp] {
        let t = client.tally(proto, b1.ip, 8080, 20, T);
        assert!(t.all_ok() && t.count("b1") == 20, "[{shape}] {t}");
    }

    // The tcx query works and finds nothing on a fresh lab.
    let att = lab.tcx_attachments();
    assert!(
        att.is_empty(),
        "[{shape}] tcx attachments on a fresh lab: {att:?}"
    );

    // Nothing answers a VIP without lbproxy.
    let e = client.udp_request(lab::vip(10), 80, Duration::from_millis(300), None);
    assert!(e.is_err(), "[{shape}] VIP answered without lbproxy: {e:?}");
    let e = client.tcp_request(lab::vip(10), 80, Duration::from_millis(300));
    assert!(e.is_err(), "[{shape}] VIP answered without lbproxy: {e:?}");

    // A pod added later works at once; a removed pod is gone.
    let t0 = Instant::now();
    let late = lab.add_pod("late");
    let _sl = late.serve(&[8080]);
    let (r, _) = late
        .tcp_request(b1.ip, 8080, T)
        .expect("late pod as client");
    assert_eq!(r.backend, "b1");
    let (r, _) = client
        .udp_request(late.ip, 8080, T, None)
        .expect("late pod as server");
    assert_eq!(r.backend, "late");
    eprintln!("[{shape}] late pod usable after {:?}", t0.elapsed());
    lab.remove_pod("b2");
    if shape == Shape::Bridge {
        let l = ns::ns_run(lab.node_ns(), &["ip", "-o", "link", "show", lab::BRIDGE_IF]).unwrap();
        assert!(l.contains(lab::BRIDGE_MAC), "bridge MAC changed: {l}");
    }
    assert!(!links(lab.node_ns()).contains(&b2.host_if));
    assert!(
        client
            .tcp_request(b2.ip, 8080, Duration::from_millis(300))
            .is_err()
    );

    // HTTP helper against a tiny server in the node namespace.
    let l = ns::run_in_ns(lab.node_ns(), || {
        TcpListener::bind("127.0.0.1:10256").unwrap()
    });
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut req = Vec::new();
        let mut buf = [0u8; 1024];
        while !req.ends_with(b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "EOF before end of request");
            req.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\nno")
            .unwrap();
    });
    let code = ns::http_get(
        lab.node_ns(),
        "127.0.0.1:10256".parse().unwrap(),
        "/healthz",
    );
    srv.join().unwrap();
    assert_eq!(code.unwrap(), 503);

    let names = [lab.node_ns().to_owned(), client.netns.clone()];
    drop(_s1);
    drop(_s2);
    drop(_sl);
    drop(lab);
    for n in names {
        assert!(!ns::netns_path(&n).exists(), "{n} left behind");
    }
}

#[test]
fn lab_direct_traffic_routed() {
    direct_traffic(Shape::Routed);
}

#[test]
fn lab_direct_traffic_bridge() {
    direct_traffic(Shape::Bridge);
}
