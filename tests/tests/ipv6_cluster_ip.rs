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
//! `sessionAffinity: ClientIP` holds over IPv6 (`LB_AFFINITY6_V1`): that test is the IPv6
//! case of affinity_pressure.rs' `affinity_across_clients`. When a backend leaves, an open
//! IPv6 TCP connection to it is reset on its next packet and a UDP flow moves to a live
//! backend, also when it stays in another Service: those are the IPv6 cases of
//! flow_lifecycle.rs' `terminating_then_removed`, `udp_flow_moves` and
//! `shared_backend_leaves_one_service`.
//!
//! UDP datagrams larger than the MTU, fragmented at their source, are translated in every
//! fragment both ways (`LB_FRAGS6_V1`): that test is the IPv6 case of fragments.rs.
//!
//! ICMPv6 errors about translated flows are translated (quote and outer header): their
//! tests are the IPv6 cases of icmp_errors.rs (`pmtu_through_vip`: a node's Packet Too Big
//! lowers the client's path MTU; `udp_port_unreachable`: a backend's port unreachable
//! reaches a connected UDP client as "connection refused").
//!
//! A restart (SIGTERM, then a new `lbproxy run`) keeps IPv6 serving throughout: that test
//! is the IPv6 case of lifecycle.rs' `sigterm`.
//!
//! An IPv6 frontend without endpoints answers at once, as the IPv4 one does, also with a
//! destination-options header on every packet: that test is the IPv6 case of
//! flow_lifecycle.rs' `reject_timings`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::Shape;
use lbproxy_tests::lab::inspect::rows::{FlowRow, ServiceRow};

both_shapes!(
    dual_stack_service_serves_both_families,
    ipv6_flows_are_listed_and_flushed,
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
    let rows = s.lab.inspect_services();
    let v6_rows: Vec<&ServiceRow> = rows.iter().filter(|r| r.vip == VIP6.to_string()).collect();
    assert_eq!(
        v6_rows.len(),
        2,
        "TCP and UDP frontends on {VIP6}: {rows:#?}"
    );
    let mut want = vec![b1.ip6.unwrap().to_string(), b2.ip6.unwrap().to_string()];
    want.sort();
    for r in &v6_rows {
        let mut addrs: Vec<String> = r.backends.iter().map(|b| b.addr.clone()).collect();
        addrs.sort();
        assert_eq!(addrs, want, "IPv6 backends of {r:#?}");
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
    let flows = s.lab.inspect_flows();
    let v6: Vec<&FlowRow> = flows
        .iter()
        .filter(|f| f.client.starts_with(&format!("[{c6}]:")))
        .collect();
    // 3 TCP and 3 UDP flows (plus the probes that waited for the frontend).
    assert!(v6.len() >= 6, "IPv6 flows listed: {flows:#?}");
    for f in &v6 {
        let fe = &f.frontend;
        assert!(
            *fe == format!("[{VIP6}]:{WEB_TCP}/TCP") || *fe == format!("[{VIP6}]:{WEB_UDP}/UDP"),
            "{f:#?}"
        );
        assert!(f.backend.starts_with(&format!("[{b6}]:")), "{f:#?}");
        assert!(f.reply_half, "{f:#?}");
    }
    let v4_before = flows.len() - v6.len();
    assert!(v4_before >= 6, "IPv4 flows listed too: {flows:#?}");

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
    let after = s.lab.inspect_flows();
    assert!(
        after.iter().all(|f| !f.client.starts_with('[')),
        "no IPv6 flow left: {after:#?}"
    );
    assert_eq!(after.len(), v4_before, "the IPv4 flows stay: {after:#?}");
    // The client's next IPv6 requests are new flows, served as before.
    ipv6_traffic_ok("after the flush", &s, 2);
}

/// `lbproxy ARGS --bpffs-dir DIR` in the lab's node namespace, which must succeed: its
/// stdout parsed as JSON.
pub fn tool_json(s: &Setup, args: &[&str]) -> serde_json::Value {
    let dir = s.lab.bpffs_dir().display().to_string();
    let argv: Vec<&str> = args.iter().copied().chain(["--bpffs-dir", &dir]).collect();
    let out = s.lab.lbproxy_cmd(&argv);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lbproxy {argv:?}: {}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("lbproxy {argv:?}: bad JSON ({e}): {text}"))
}
