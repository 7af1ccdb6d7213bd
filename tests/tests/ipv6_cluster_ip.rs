//! IPv6 ClusterIPs served to pods (issue 14), in both lab shapes.
//!
//! A dual-stack Service (`ipFamilies: [IPv4, IPv6]`, `RequireDualStack`, one clusterIP per
//! family) with one EndpointSlice per family: each family's frontend is served from its own
//! family's endpoints, at the same time. Over IPv6, new TCP connections and UDP requests
//! from a pod reach both backends, the backend sees the client's own IPv6 address, and the
//! answer comes back from the IPv6 ClusterIP and port the client used (the reverse
//! translation). A backend removed from the IPv6 slice gets no new IPv6 flows within the
//! apply deadline, while IPv4 keeps both. `inspect services` lists both families'
//! frontends.
//!
//! `inspect flows` lists IPv6 flows beside IPv4 ones, and `flows flush --client` removes a
//! client's IPv6 flows (both halves) and leaves its IPv4 ones.
//!
//! `sessionAffinity: ClientIP` holds over IPv6 (`LB_AFFINITY6_V1`). When a backend leaves
//! the IPv6 slice, an open IPv6 TCP connection to it is reset on its next packet and a UDP
//! flow moves to a live backend, as over IPv4.
//!
//! UDP datagrams larger than the MTU, fragmented at their source, are translated in every
//! fragment both ways (`LB_FRAGS6_V1`): a 3000-byte request reaches the backend whole, and
//! its 4000-byte answer reaches the client whole, from the ClusterIP.
//!
//! ICMPv6 errors about translated flows are translated (quote and outer header): their
//! tests are the IPv6 cases of icmp_errors.rs (`pmtu_through_vip`: a node's Packet Too Big
//! lowers the client's path MTU; `udp_port_unreachable`: a backend's port unreachable
//! reaches a connected UDP client as "connection refused").
//!
//! A restart (SIGTERM, then a new `lbproxy run`) keeps IPv6 serving throughout: an open
//! IPv6 connection stays on its backend while lbproxy is stopped and after the new one
//! adopts the pinned IPv6 maps.
//!
//! An IPv6 frontend without endpoints answers at once, as the IPv4 one does: a TCP RST
//! (connection refused) and an ICMPv6 port unreachable for UDP (a connected socket's
//! `recv` fails with "connection refused"), each counted under its reject reason and shown
//! by `lbproxy monitor` with its IPv6 addresses and service.

mod common;
mod ipv6_common;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use ipv6_common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::{Pod, Shape};

/// The clusterIP of `metrics`, an IPv6 Service over a backend of `web`.
const METRICS_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x14);

both_shapes!(
    dual_stack_service_serves_both_families,
    ipv6_frontend_without_endpoints_rejects,
    ipv6_flows_are_listed_and_flushed,
    ipv6_session_affinity,
    ipv6_flows_of_a_backend_that_left,
    ipv6_flows_of_a_backend_that_left_one_of_two_services,
    ipv6_fragmented_datagrams_both_ways,
    ipv6_survives_a_restart,
);

fn dual_stack_service_serves_both_families(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1, &b2]));

    // The IPv6 frontend is programmed within the apply deadline.
    let deadline = Instant::now() + APPLY_WITHIN;
    while s.client.run(tcp6).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (tcp, udp) = ipv6_traffic_ok("both backends", &s, 24);
    for (proto, t) in [("TCP", &tcp), ("UDP", &udp)] {
        assert!(
            t.get("b1").is_some_and(|n| *n > 0) && t.get("b2").is_some_and(|n| *n > 0),
            "{proto} over IPv6 must reach both backends: {t:?}"
        );
    }
    // The IPv4 frontend of the same Service, at the same time.
    let (t4, _) = web_traffic_ok_in(Some(&s.lab), "IPv4 beside IPv6", &s.client, WEB_VIP, 12);
    assert_eq!(t4.keys().count(), 2, "IPv4 reaches both backends: {t4:?}");

    // `inspect services` lists the IPv6 frontends with their IPv6 backends.
    let rows = s.lab.inspect_json("services");
    let v6_rows: Vec<&serde_json::Value> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["vip"] == VIP6.to_string())
        .collect();
    assert_eq!(
        v6_rows.len(),
        2,
        "TCP and UDP frontends on {VIP6}: {rows:#}"
    );
    let mut want = vec![b1.ip6.unwrap().to_string(), b2.ip6.unwrap().to_string()];
    want.sort();
    for r in &v6_rows {
        let mut addrs: Vec<String> = r["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["addr"].as_str().unwrap_or("?").to_string())
            .collect();
        addrs.sort();
        assert_eq!(addrs, want, "IPv6 backends of {r:#}");
    }
    // The table shows an IPv6 backend as [address]:port.
    let dir = s.lab.bpffs_dir().display().to_string();
    let out = s
        .lab
        .lbproxy_cmd(&["inspect", "services", "--bpffs-dir", &dir]);
    let table = String::from_utf8_lossy(&out.stdout);
    let shown = format!("[{}]:{BACKEND_TCP}", b1.ip6.unwrap());
    assert!(table.contains(&shown), "want {shown} in:\n{table}");

    // Each family's map fill is its own series: 2 frontends (TCP, UDP) and 4 backends (2
    // pods x 2 ports) per family.
    let metrics = lbproxy_tests::lab::ns::http_get_full(
        s.lab.node_ns(),
        lbproxy_tests::lab::METRICS_ADDR.parse().unwrap(),
        "/metrics",
        Duration::from_secs(2),
    )
    .unwrap()
    .body;
    for (map, n) in [
        ("services", 2),
        ("services6", 2),
        ("backends", 4),
        ("backends6", 4),
    ] {
        let line = format!("lbproxy_map_entries{{map=\"{map}\"}} {n}");
        assert!(
            metrics.lines().any(|l| l == line),
            "want `{line}` in /metrics:\n{}",
            metrics
                .lines()
                .filter(|l| l.starts_with("lbproxy_map_entries"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    // b1 leaves the IPv6 slice only: new IPv6 flows go to b2 within the deadline; IPv4
    // keeps both.
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b2]));
    let started = Instant::now();
    let mut settled = false;
    while started.elapsed() < APPLY_WITHIN + Duration::from_millis(500) {
        let a = s.client.run(udp6);
        if matches!(&a, Ok(a) if a.backend == "b2") {
            // Several in a row, to tell a settled choice from the hash's luck.
            let after = s.client.run(|| (0..8).map(|_| udp6()).collect::<Vec<_>>());
            if after
                .iter()
                .all(|a| matches!(a, Ok(a) if a.backend == "b2"))
            {
                settled = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        settled,
        "new IPv6 flows still reach b1 {:?} after it left the IPv6 slice\n{}",
        started.elapsed(),
        s.lab.diagnostics()
    );
    let (tcp, udp) = ipv6_traffic_ok("b1 gone from IPv6", &s, 12);
    assert_eq!(
        tcp.keys().collect::<Vec<_>>(),
        vec!["b2"],
        "TCP over IPv6: {tcp:?}"
    );
    assert_eq!(
        udp.keys().collect::<Vec<_>>(),
        vec!["b2"],
        "UDP over IPv6: {udp:?}"
    );
    let (t4, u4) = web_traffic_ok_in(Some(&s.lab), "IPv4 unchanged", &s.client, WEB_VIP, 12);
    assert_eq!(
        (t4.keys().count(), u4.keys().count()),
        (2, 2),
        "IPv4 keeps both backends: {t4:?} {u4:?}"
    );
}

fn ipv6_frontend_without_endpoints_rejects(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    let empty = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: empty, namespace: default}}\nspec:\n  clusterIP: 198.19.0.20\n  clusterIPs: [\"198.19.0.20\", \"{EMPTY6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: http, port: {WEB_TCP}, protocol: TCP}}\n  - {{name: dns, port: {WEB_UDP}, protocol: UDP}}\n"
    );
    s.lab
        .write_manifest_text(&format!("{}{empty}", dual_stack_manifest(&[&b1], &[&b1])));
    // Served once the other Service's IPv6 frontend is.
    let deadline = Instant::now() + APPLY_WITHIN;
    while s.client.run(tcp6).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = s.lab.inspect_json("drops");
    let count = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or(0);
    // `lbproxy monitor` shows the IPv6 rejects with their addresses and service.
    let mon = Monitor::start(&s.lab, &["--duration", "30"]);

    refused_at_once(&s, 40_006, false, "");
    let after = s.lab.inspect_json("drops");
    for reason in ["no_backend_tcp_reset", "no_backend_icmp_unreachable"] {
        assert!(
            count(&after, reason) > count(&before, reason),
            "{reason} counted: before {before:#}, after {after:#}"
        );
    }
    let events = mon.events(2, Duration::from_secs(3));
    let client6 = s.client.ip6.unwrap();
    let by_reason = |r: &str| {
        events
            .iter()
            .find(|e| e["reason"] == r)
            .unwrap_or_else(|| panic!("no {r} event from lbproxy monitor among {events:#?}"))
    };
    let tcp_ev = by_reason("no_backend_tcp_reset");
    assert_eq!(tcp_ev["verdict"], "reject", "{tcp_ev}");
    assert_eq!(tcp_ev["protocol"], "TCP", "{tcp_ev}");
    assert_eq!(tcp_ev["dst"], format!("[{EMPTY6}]:{WEB_TCP}"), "{tcp_ev}");
    assert!(
        tcp_ev["src"]
            .as_str()
            .is_some_and(|a| a.starts_with(&format!("[{client6}]:"))),
        "{tcp_ev}"
    );
    assert_eq!(tcp_ev["service"], "default/empty:http", "{tcp_ev}");
    assert_eq!(tcp_ev["hook"], "from_pod", "{tcp_ev}");
    let udp_ev = by_reason("no_backend_icmp_unreachable");
    assert_eq!(udp_ev["src"], format!("[{client6}]:40006"), "{udp_ev}");
    assert_eq!(udp_ev["dst"], format!("[{EMPTY6}]:{WEB_UDP}"), "{udp_ev}");
    assert_eq!(udp_ev["service"], "default/empty:dns", "{udp_ev}");
    drop(mon);
    // The same with a destination-options header on every packet (a sticky
    // `IPV6_DSTOPTS` on the sockets): the answers still come at once, the extension header
    // removed from what is sent back.
    let before = s.lab.inspect_json("drops");
    refused_at_once(&s, 0, true, "with a destination-options header");
    let after = s.lab.inspect_json("drops");
    assert_eq!(
        count(&after, "reject_failed"),
        count(&before, "reject_failed"),
        "no reject failed: {after:#}"
    );
    for reason in ["no_backend_tcp_reset", "no_backend_icmp_unreachable"] {
        assert!(
            count(&after, reason) > count(&before, reason),
            "{reason} counted with extension headers: before {before:#}, after {after:#}"
        );
    }
    // The frontend with an endpoint still serves over IPv6.
    let (tcp, udp) = ipv6_traffic_ok("beside the empty frontend", &s, 4);
    assert_eq!((tcp.len(), udp.len()), (1, 1), "{tcp:?} {udp:?}");
}

fn ipv6_flows_are_listed_and_flushed(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1], &[&b1]));
    let deadline = Instant::now() + APPLY_WITHIN;
    while s.client.run(tcp6).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    ipv6_traffic_ok("flows to list", &s, 3);
    web_traffic_ok_in(Some(&s.lab), "IPv4 flows beside", &s.client, WEB_VIP, 3);
    let c6 = s.client.ip6.unwrap();
    let b6 = b1.ip6.unwrap();
    let flows = s.lab.inspect_json("flows");
    let v6: Vec<&serde_json::Value> = flows
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(&format!("[{c6}]:")))
        })
        .collect();
    // 3 TCP and 3 UDP flows (plus the probes that waited for the frontend).
    assert!(v6.len() >= 6, "IPv6 flows listed: {flows:#}");
    for f in &v6 {
        let fe = f["frontend"].as_str().unwrap();
        assert!(
            fe == format!("[{VIP6}]:{WEB_TCP}/TCP") || fe == format!("[{VIP6}]:{WEB_UDP}/UDP"),
            "{f:#}"
        );
        assert!(
            f["backend"]
                .as_str()
                .unwrap()
                .starts_with(&format!("[{b6}]:")),
            "{f:#}"
        );
        assert_eq!(f["reply_half"], true, "{f:#}");
    }
    let v4_before = flows.as_array().unwrap().len() - v6.len();
    assert!(v4_before >= 6, "IPv4 flows listed too: {flows:#}");

    let report = tool_json(
        &s,
        &["flows", "flush", "--json", "--client", &c6.to_string()],
    );
    assert_eq!(report["flushed"], v6.len(), "{report:#}");
    assert_eq!(
        report["entries"],
        2 * v6.len(),
        "both halves of each: {report:#}"
    );
    let after = s.lab.inspect_json("flows");
    let rows = after.as_array().unwrap();
    assert!(
        rows.iter()
            .all(|f| !f["client"].as_str().unwrap_or("").starts_with('[')),
        "no IPv6 flow left: {after:#}"
    );
    assert_eq!(rows.len(), v4_before, "the IPv4 flows stay: {after:#}");
    // The client's next IPv6 requests are new flows, served as before.
    ipv6_traffic_ok("after the flush", &s, 2);
}

fn ipv6_session_affinity(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    let pods: Vec<Pod> = ["b1", "b2", "b3"]
        .iter()
        .map(|n| s.backend(n).clone())
        .collect();
    let refs: Vec<&Pod> = pods.iter().collect();
    let affinity =
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";
    s.lab
        .write_manifest_text(&dual_stack_manifest_with(&refs, &refs, affinity));
    wait_ipv6_served(&s);
    // Every new flow of the client (new source ports, both protocols' frontends each keep
    // their own choice) goes to one backend.
    let (tcp, udp) = ipv6_traffic_ok("with affinity", &s, 16);
    assert_eq!(
        tcp.len(),
        1,
        "TCP over IPv6 with ClientIP affinity: {tcp:?}"
    );
    assert_eq!(
        udp.len(),
        1,
        "UDP over IPv6 with ClientIP affinity: {udp:?}"
    );
    let rows = tool_json(&s, &["inspect", "affinity", "--json"]);
    let mine: Vec<&serde_json::Value> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["client"] == s.client.ip6.unwrap().to_string())
        .collect();
    assert_eq!(
        mine.len(),
        2,
        "one IPv6 affinity entry per frontend: {rows:#}"
    );
}

fn ipv6_flows_of_a_backend_that_left(shape: Shape) {
    flows_of_a_backend_that_left6(shape, false);
}

/// [`ipv6_flows_of_a_backend_that_left`] with the backend that leaves `web`'s IPv6 slice
/// still an endpoint (same address and ports) of another Service, `metrics`: its `web`
/// flows must still reset or move, and `metrics` must still reach it.
fn ipv6_flows_of_a_backend_that_left_one_of_two_services(shape: Shape) {
    flows_of_a_backend_that_left6(shape, true);
}

/// `metrics`, an IPv6 ClusterIP Service on [`METRICS_VIP6`] with `web`'s ports over `pod`.
fn metrics_manifest6(pod: &Pod) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: metrics, namespace: default}}\nspec:\n  clusterIP: \"{METRICS_VIP6}\"\n  ipFamilies: [IPv6]\n  ports:\n  - {{name: http, port: {WEB_TCP}, protocol: TCP, targetPort: {BACKEND_TCP}}}\n  - {{name: dns, port: {WEB_UDP}, protocol: UDP, targetPort: {BACKEND_UDP}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: metrics-v6\n  namespace: default\n  labels: {{kubernetes.io/service-name: metrics}}\naddressType: IPv6\nports: [{{name: http, port: {BACKEND_TCP}, protocol: TCP}}, {{name: dns, port: {BACKEND_UDP}, protocol: UDP}}]\nendpoints: [{{addresses: [\"{}\"], conditions: {{ready: true}}}}]\n",
        pod.ip6.unwrap()
    )
}

/// The body of the two tests above; `shared`: the backend that leaves stays in `metrics`.
fn flows_of_a_backend_that_left6(shape: Shape, shared: bool) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1, &b2]));
    wait_ipv6_served(&s);
    // An open IPv6 TCP connection, and a UDP socket with a fixed source port.
    let (mut conn, first) = s.client.run(|| {
        let c = TcpStream::connect_timeout(&SocketAddr::from((VIP6, WEB_TCP)), T).unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let mut w = c.try_clone().unwrap();
        w.write_all(b"hello\n").unwrap();
        let mut line = String::new();
        BufReader::new(&c).read_line(&mut line).unwrap();
        (c, line.split_whitespace().next().unwrap().to_string())
    });
    let udp = s
        .client
        .run(|| UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap());
    udp.set_read_timeout(Some(T)).unwrap();
    let ask = |u: &UdpSocket| -> String {
        s.client.run(|| {
            u.send_to(b"hello\n", (VIP6, WEB_UDP)).unwrap();
            let mut buf = [0u8; 256];
            let (n, from) = u.recv_from(&mut buf).unwrap();
            assert_eq!(from, SocketAddr::from((VIP6, WEB_UDP)));
            String::from_utf8_lossy(&buf[..n])
                .split_whitespace()
                .next()
                .unwrap()
                .to_string()
        })
    };
    let udp_first = ask(&udp);
    // Take the TCP connection's backend out of the IPv6 slice (IPv4 keeps both).
    let (stay, gone) = if first == "b1" {
        (&b2, &b1)
    } else {
        (&b1, &b2)
    };
    let resets = |lab: &lbproxy_tests::lab::Lab| lab.drop_count("backend_gone_tcp_reset");
    let before = resets(&s.lab);
    let mut after = dual_stack_manifest(&[&b1, &b2], &[stay]);
    if shared {
        after.push_str(&metrics_manifest6(gone));
    }
    s.lab.write_manifest_text(&after);
    // Once applied, the open connection's next request is reset.
    let started = Instant::now();
    let mut reset = false;
    while started.elapsed() < APPLY_WITHIN + Duration::from_secs(1) {
        let r = s.client.run(|| {
            conn.write_all(b"hello\n")?;
            let mut line = String::new();
            BufReader::new(&conn).read_line(&mut line)?;
            Ok::<_, std::io::Error>(line)
        });
        match r {
            Ok(line) => assert!(line.starts_with(gone.name.as_str()), "{line}"),
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ),
                    "the open IPv6 connection to {} must be reset, got {e}",
                    gone.name
                );
                reset = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        reset,
        "the open IPv6 connection to {} was never reset",
        gone.name
    );
    assert!(resets(&s.lab) > before, "backend_gone_tcp_reset counted");
    // The UDP flow (same source port) now gets the backend that stayed.
    let udp_after = ask(&udp);
    assert_eq!(
        udp_after, stay.name,
        "the IPv6 UDP flow moves off {} (it was on {udp_first})",
        gone.name
    );
    let _ = conn.shutdown(std::net::Shutdown::Both);
    if shared {
        let via_metrics = s.client.run(|| {
            let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap();
            u.set_read_timeout(Some(T)).unwrap();
            (0..5)
                .map(|_| {
                    u.send_to(b"hello\n", (METRICS_VIP6, WEB_UDP)).unwrap();
                    let mut buf = [0u8; 256];
                    let (n, _) = u.recv_from(&mut buf).unwrap();
                    String::from_utf8_lossy(&buf[..n])
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .to_string()
                })
                .collect::<Vec<_>>()
        });
        assert!(
            via_metrics.iter().all(|b| *b == gone.name),
            "metrics (only {}) after it left web: {via_metrics:?}",
            gone.name
        );
    }
}

fn ipv6_fragmented_datagrams_both_ways(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    // A backend of its own for IPv6: answers each datagram with 4000 bytes that start
    // with the size it got and who sent it.
    let big = s.lab.add_pod("big");
    let sock = big.run(|| UdpSocket::bind((Ipv6Addr::UNSPECIFIED, BACKEND_UDP)).unwrap());
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    let mut answer = format!("big {n} {from}\n").into_bytes();
                    answer.resize(4000, b'x');
                    let _ = sock.send_to(&answer, from);
                }
            }
        })
    };
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1], &[&big]));
    // Programmed before the first datagram: one sent while the frontend appears could
    // have its first fragment pass untranslated and the later ones not.
    let want = big.ip6.unwrap().to_string();
    let programmed = lbproxy_tests::lab::wait_for(APPLY_WITHIN, Duration::from_millis(20), || {
        let rows = s.lab.inspect_json("services");
        rows.as_array()?
            .iter()
            .any(|r| {
                r["vip"] == VIP6.to_string()
                    && r["backends"]
                        .as_array()
                        .is_some_and(|b| b.iter().any(|b| b["addr"] == want.as_str()))
            })
            .then_some(())
    });
    assert!(
        programmed.is_ok(),
        "the IPv6 frontend over {want} was not programmed in time"
    );
    let c6 = s.client.ip6.unwrap();
    let before = s.lab.inspect_json("drops");
    let results = s.client.run(|| {
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let request = vec![b'q'; 3000];
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut got = Vec::new();
        while got.len() < 3 && Instant::now() < deadline {
            u.send_to(&request, (VIP6, WEB_UDP)).unwrap();
            let mut buf = vec![0u8; 65536];
            if let Ok((n, from)) = u.recv_from(&mut buf) {
                let head = String::from_utf8_lossy(&buf[..n.min(200)])
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string();
                got.push((n, from, head));
            }
        }
        got
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    server.join().unwrap();
    assert_eq!(
        results.len(),
        3,
        "3000-byte requests over IPv6 answered with 4000 bytes: {results:?}\n{}",
        s.lab.diagnostics()
    );
    for (n, from, head) in &results {
        assert_eq!(*n, 4000, "the whole answer, reassembled: {results:?}");
        assert_eq!(*from, SocketAddr::from((VIP6, WEB_UDP)), "{results:?}");
        let mut words = head.split_whitespace();
        assert_eq!(words.next(), Some("big"), "{head}");
        assert_eq!(
            words.next(),
            Some("3000"),
            "the whole request reached the backend: {head}"
        );
        let seen: SocketAddr = words.next().unwrap().parse().unwrap();
        assert_eq!(seen.ip(), IpAddr::V6(c6), "{head}");
    }
    let after = s.lab.inspect_json("drops");
    let n = |v: &serde_json::Value| v["fragment_without_first"].as_u64().unwrap_or(0);
    assert_eq!(n(&after), n(&before), "no fragment went untranslated");
}

fn ipv6_survives_a_restart(shape: Shape) {
    let mut s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    s.lab
        .write_manifest_text(&dual_stack_manifest(&[&b1, &b2], &[&b1, &b2]));
    wait_ipv6_served(&s);
    let conn = s
        .client
        .run(|| TcpStream::connect_timeout(&SocketAddr::from((VIP6, WEB_TCP)), T).unwrap());
    conn.set_read_timeout(Some(T)).unwrap();
    let request = |c: &TcpStream| -> std::io::Result<String> {
        (&*c).write_all(b"hello\n")?;
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line)?;
        Ok(line.split_whitespace().next().unwrap_or("").to_string())
    };
    let first = request(&conn).unwrap();
    let (status, _) = s.lb.terminate(EXIT_WITHIN);
    assert_eq!(
        status.code(),
        Some(0),
        "exit status after SIGTERM: {status}"
    );
    // Stopped: the datapath keeps serving IPv6 from the pinned maps.
    ipv6_traffic_ok("lbproxy stopped", &s, 8);
    let r = request(&conn);
    assert!(
        matches!(&r, Ok(b) if *b == first),
        "the open IPv6 connection (to {first}) with lbproxy stopped: {r:?}"
    );
    let mut lb2 = s.lab.start_lbproxy();
    lb2.expect_healthy(HEALTHY_WITHIN);
    let (tcp, udp) = ipv6_traffic_ok("after the restart", &s, 16);
    assert_eq!(
        (tcp.len(), udp.len()),
        (2, 2),
        "both backends: {tcp:?} {udp:?}"
    );
    let r = request(&conn);
    assert!(
        matches!(&r, Ok(b) if *b == first),
        "the open IPv6 connection (to {first}) after the restart: {r:?}\n{}",
        lb2.log()
    );
    let rows = s.lab.inspect_json("services");
    assert_eq!(
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["vip"] == VIP6.to_string())
            .count(),
        2,
        "the IPv6 frontends adopted: {rows:#}"
    );
}
