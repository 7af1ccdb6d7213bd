//! Per-Service traffic metrics (issue 31 §2), on one node, lbproxy started as the lab
//! starts it: `web` and `metrics` are two Services over the same two pods (a pod behind its
//! app's and its metrics' Services), `empty` has no endpoint.
//!
//! - [`new_flows_rejects_and_active_flows_by_service`]: 30 TCP connections and 10 UDP
//!   datagrams from 10 source ports to `web` raise
//!   `lbproxy_service_new_flows_total{namespace="default",service="web"}` by exactly 40, and
//!   `metrics`'s by 0 though it shares the pods; 3 refused connections to `empty` are
//!   `lbproxy_service_rejects_total{service="empty",reason="no_backend_tcp_reset"}` 3;
//!   `lbproxy_service_active_flows` of `web` reaches the 40 flows open within 15 s;
//!   `inspect services` has the same counts per frontend.
//! - [`per_service_metrics_off`]: with `--per-service-metrics=false` the same traffic makes
//!   no `lbproxy_service_*` series, and the datapath counts nothing by service.
//!
//! Watched failing: without the datapath's count on a new flow, the first test reads 0.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::{Lab, METRICS_ADDR, Shape, http_get_full};

const METRICS_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
const EMPTY_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 12);

/// The value of sample `name{labels}` (labels in the order the encoder writes them), 0 when
/// absent.
fn sample(lab: &Lab, name: &str, labels: &str) -> u64 {
    let body = scrape(lab);
    let want = format!("{name}{{{labels}}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&want))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap_or(0.0) as u64)
}

fn scrape(lab: &Lab) -> String {
    let addr = METRICS_ADDR.parse().unwrap();
    let r = http_get_full(lab.node_ns(), addr, "/metrics", Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("scrape: {e}"));
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

fn svc(name: &str) -> String {
    format!("namespace=\"default\",service=\"{name}\"")
}

struct Setup {
    lab: Lab,
    client: lbproxy_tests::lab::Pod,
    _servers: Vec<lbproxy_tests::lab::Backend>,
    _lb: lbproxy_tests::lab::Lbproxy,
}

fn setup(args: &[&str]) -> Setup {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let (pods, servers) = serving_pods(&lab, &["b1", "b2"]);
    let refs: Vec<&lbproxy_tests::lab::Pod> = pods.iter().collect();
    lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&refs)),
        web_objects("metrics", METRICS_VIP, ready(&refs)),
        web_objects("empty", EMPTY_VIP, vec![]),
    ]));
    let mut lb = lab.start_lbproxy_with(args);
    lb.expect_healthy(HEALTHY_WITHIN);
    Setup {
        lab,
        client,
        _servers: servers,
        _lb: lb,
    }
}

/// 30 TCP connections (held open, returned) and 10 UDP datagrams from 10 source ports to
/// `web`, and 3 connections refused by `empty`.
fn traffic(s: &Setup) -> Vec<lbproxy_tests::lab::TcpConn> {
    let mut open = Vec::new();
    for i in 0..30 {
        let mut c = s
            .client
            .connect(WEB_VIP, WEB_TCP, T)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}"));
        c.request().unwrap();
        open.push(c);
    }
    for p in 0..10 {
        s.client
            .udp_request(WEB_VIP, WEB_UDP, T, Some(22_001 + p))
            .unwrap_or_else(|e| panic!("UDP from port {}: {e}", 22_001 + p));
    }
    for i in 0..3 {
        let err = s
            .client
            .connect(EMPTY_VIP, WEB_TCP, T)
            .err()
            .unwrap_or_else(|| panic!("connection #{i} to empty was accepted"));
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    }
    open
}

/// Waits up to `within` for `get` to return `want`; panics with the last value otherwise.
fn wait_value(what: &str, within: Duration, want: u64, get: impl Fn() -> u64) {
    let start = Instant::now();
    loop {
        let v = get();
        if v == want {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{what}: {v}, not {want}, after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn new_flows_rejects_and_active_flows_by_service() {
    let s = setup(&[]);
    let new_flows = |name: &str| sample(&s.lab, "lbproxy_service_new_flows_total", &svc(name));
    let (web0, metrics0) = (new_flows("web"), new_flows("metrics"));
    let _open = traffic(&s);
    // The counters are copied every 2 s.
    wait_value("web's new flows", Duration::from_secs(5), web0 + 40, || {
        new_flows("web")
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(new_flows("web"), web0 + 40, "web's count moved on");
    assert_eq!(
        new_flows("metrics"),
        metrics0,
        "metrics shares web's pods but had no traffic"
    );
    let rejects = sample(
        &s.lab,
        "lbproxy_service_rejects_total",
        &format!("{},reason=\"no_backend_tcp_reset\"", svc("empty")),
    );
    assert_eq!(rejects, 3, "empty's rejects\n{}", scrape(&s.lab));
    assert_eq!(
        sample(
            &s.lab,
            "lbproxy_service_rejects_total",
            &format!("{},reason=\"no_backend_tcp_reset\"", svc("web"))
        ),
        0
    );
    wait_value("web's active flows", Duration::from_secs(15), 40, || {
        sample(&s.lab, "lbproxy_service_active_flows", &svc("web"))
    });

    // inspect services: per frontend, the same counts.
    let rows = s.lab.inspect_json("services");
    let of = |vip: Ipv4Addr, field: &str| -> u64 {
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| {
                r["vip"].as_str().and_then(|v| v.parse::<IpAddr>().ok()) == Some(vip.into())
            })
            .map(|r| r[field].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(of(WEB_VIP, "new_flows"), web0 + 40, "{rows:#}");
    assert_eq!(of(WEB_VIP, "active_flows"), 40, "{rows:#}");
    assert_eq!(of(METRICS_VIP, "new_flows"), 0, "{rows:#}");
    assert_eq!(of(EMPTY_VIP, "rejects"), 3, "{rows:#}");
}

#[test]
fn per_service_metrics_off() {
    let s = setup(&["--per-service-metrics=false"]);
    let _open = traffic(&s);
    std::thread::sleep(Duration::from_secs(12));
    let body = scrape(&s.lab);
    assert!(
        !body.lines().any(|l| l.starts_with("lbproxy_service_")
            && !l.starts_with("lbproxy_service_changes")),
        "per-Service series with the counters off:\n{body}"
    );
    let rows = s.lab.inspect_json("services");
    for r in rows.as_array().unwrap() {
        assert_eq!(r["new_flows"], 0, "{r:#}");
        assert_eq!(r["rejects"], 0, "{r:#}");
    }
}
