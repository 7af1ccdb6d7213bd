//! lbproxy's `/metrics` (OpenMetrics text) and `/proxyMode` with the Kubernetes API source:
//! names users alert on, values after known changes, map fill against `inspect`, network
//! programming latency from `endpoints.kubernetes.io/last-change-trigger-time`.

mod common;
mod kube_common;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use kube_common::*;
use lbproxy_tests::apiserver::rfc3339;
use lbproxy_tests::lab::{
    DATAPATH_EVENTS, Endpoint, Inspect as _, METRICS_ADDR, Shape, run_in_ns, vip, wait_for,
};
use serde_json::json;

fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn scrape(k: &Kube) -> Scrape {
    let r = http_get(k.lab.node_ns(), METRICS_ADDR, "/metrics")
        .unwrap_or_else(|e| panic!("scrape: {e}\n{}", k.diag()));
    assert_eq!(r.status, 200, "/metrics: {}", r.body);
    let sc = Scrape::parse(&r.body)
        .unwrap_or_else(|e| panic!("/metrics does not parse: {e}\n{}", r.body));
    assert!(
        sc.eof,
        "/metrics does not end with `# EOF` (OpenMetrics):\n{}",
        r.body
    );
    let ct = r.header("content-type").unwrap_or("");
    assert!(
        ct.starts_with("application/openmetrics-text"),
        "/metrics Content-Type {ct:?} is not OpenMetrics"
    );
    sc
}

/// The values of label `label` among the samples named `name`.
fn label_values<'a>(sc: &'a Scrape, name: &str, label: &str) -> BTreeSet<&'a str> {
    sc.samples
        .iter()
        .filter(|s| s.name == name)
        .filter_map(|s| s.labels.get(label).map(String::as_str))
        .collect()
}

/// Buckets of histogram `name` as (le, cumulative count), sorted by le.
fn buckets(sc: &Scrape, name: &str) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = sc
        .samples
        .iter()
        .filter(|s| {
            s.name == format!("{name}_bucket")
                && s.labels.get("ip_family").map(String::as_str) == Some("IPv4")
        })
        .map(|s| {
            let le = s.labels.get("le").expect("bucket without le");
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            (le, s.value)
        })
        .collect();
    v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    v
}

/// The `ip_family` label of kube-proxy's sync series: lbproxy has one series per family.
const V4: &[(&str, &str)] = &[("ip_family", "IPv4")];
const V6: &[(&str, &str)] = &[("ip_family", "IPv6")];

fn check_histogram(sc: &Scrape, name: &str) {
    assert_eq!(
        sc.types.get(name).map(String::as_str),
        Some("histogram"),
        "# TYPE of {name}"
    );
    let b = buckets(sc, name);
    assert!(!b.is_empty(), "{name}: no buckets");
    assert!(
        b.windows(2).all(|w| w[0].1 <= w[1].1),
        "{name}: buckets not cumulative: {b:?}"
    );
    let last = b.last().unwrap();
    assert!(last.0.is_infinite(), "{name}: no +Inf bucket");
    assert_eq!(
        last.1,
        sc.value(&format!("{name}_count"), V4),
        "{name}: +Inf bucket != _count"
    );
    assert!(
        sc.get(&format!("{name}_sum"), V4).is_some(),
        "{name}: no _sum"
    );
    // One sync programs both families: the IPv6 series has seen the same.
    assert_eq!(
        sc.value(&format!("{name}_count"), V6),
        sc.value(&format!("{name}_count"), V4),
        "{name}: the IPv6 and IPv4 series differ"
    );
}

/// Every metric name of the contract is exported with the right type; the values follow an
/// endpoint change and a service change; `lbproxy_map_entries` matches what `inspect` shows;
/// `/proxyMode` is `ebpf`.
#[test]
fn metrics_follow_changes() {
    let mut k = Kube::new(Shape::Routed, &["client"]);
    let t0 = now();
    let (web, webs) = web_json("web", WEB_VIP, vec![Endpoint::ready(ip(3))]);
    let (db, dbs) = web_json(
        "db",
        vip(30),
        vec![Endpoint::ready(ip(3)), Endpoint::ready(ip(4))],
    );
    k.api.apply_all([web.clone(), webs.clone(), db, dbs]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));

    let pm = http_get(k.lab.node_ns(), METRICS_ADDR, "/proxyMode").unwrap();
    assert_eq!((pm.status, pm.body.trim()), (200, "ebpf"), "/proxyMode");

    let s1 = scrape(&k);
    for (name, ty) in [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        (
            "kubeproxy_network_programming_duration_seconds",
            "histogram",
        ),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        (
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "gauge",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "gauge",
        ),
        ("kubeproxy_sync_proxy_rules_service_changes", "counter"),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "gauge",
        ),
        ("kubeproxy_sync_proxy_rules_endpoint_changes", "counter"),
        ("lbproxy_map_entries", "gauge"),
        ("lbproxy_map_capacity", "gauge"),
        ("lbproxy_sync_failures", "counter"),
        ("lbproxy_datapath_drops", "counter"),
        ("lbproxy_datapath_events", "counter"),
    ] {
        assert_eq!(
            s1.types.get(name).map(String::as_str),
            Some(ty),
            "# TYPE {name} {ty} missing; types: {:?}",
            s1.types
        );
    }
    for name in [
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_service_changes_pending",
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "lbproxy_sync_failures_total",
    ] {
        let labels = if name.contains("timestamp") { V4 } else { &[] };
        s1.value(name, labels);
        if name.contains("timestamp") {
            assert_eq!(s1.value(name, V6), s1.value(name, V4), "{name} per family");
        }
    }
    check_histogram(&s1, "kubeproxy_sync_proxy_rules_duration_seconds");
    check_histogram(&s1, "kubeproxy_network_programming_duration_seconds");
    assert!(s1.value("kubeproxy_sync_proxy_rules_duration_seconds_count", V4) >= 1.0);
    let last = s1.value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", V4);
    assert!(
        last >= t0 - 1.0 && last <= now() + 1.0,
        "last sync timestamp {last} not in [{t0}, now]"
    );
    assert_eq!(s1.value("lbproxy_sync_failures_total", &[]), 0.0);
    assert_eq!(
        s1.value("kubeproxy_sync_proxy_rules_endpoint_changes_pending", &[]),
        0.0
    );
    assert_eq!(
        s1.value("kubeproxy_sync_proxy_rules_service_changes_pending", &[]),
        0.0
    );
    check_maps(&k, "initial");
    assert_eq!(
        s1.value("lbproxy_map_capacity", &[("map", "services")]),
        65536.0
    );
    assert_eq!(
        s1.value("lbproxy_map_capacity", &[("map", "flows")]),
        262144.0
    );
    let drop_reasons = label_values(&s1, "lbproxy_datapath_drops_total", "reason");
    assert!(
        drop_reasons.contains("no_backend"),
        "drop reasons exported: {drop_reasons:?}"
    );
    // The datapath's events that are not drops have their own metric, under the names they
    // had as drop reasons; for one release those reasons keep their drop series too.
    let events = label_values(&s1, "lbproxy_datapath_events_total", "event");
    let want_events = BTreeSet::from(DATAPATH_EVENTS);
    assert_eq!(events, want_events, "events exported");
    assert!(
        drop_reasons.is_superset(&want_events),
        "the deprecated drop reasons left lbproxy_datapath_drops_total: {drop_reasons:?}"
    );

    // Endpoint change.
    let t1 = now();
    let mut s = webs.clone();
    s["endpoints"] = json!([
        {"addresses": [ip(3).to_string()], "conditions": {"ready": true}, "nodeName": NODE},
        {"addresses": [ip(5).to_string()], "conditions": {"ready": true}, "nodeName": NODE},
    ]);
    k.api.apply(s);
    k.wait_until("endpoint added", APPLY, |f| {
        f.get(&format!("{WEB_VIP}:{WEB_TCP}/TCP"))
            .is_some_and(|fe| fe.backends.len() == 2)
    });
    let s2 = scrape(&k);
    let d = |n: &str| {
        let l = if n.contains("duration") { V4 } else { &[] };
        s2.value(n, l) - s1.value(n, l)
    };
    assert!(
        d("kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 1.0,
        "endpoint_changes_total did not increase after an endpoint change ({} -> {})",
        s1.value("kubeproxy_sync_proxy_rules_endpoint_changes_total", &[]),
        s2.value("kubeproxy_sync_proxy_rules_endpoint_changes_total", &[])
    );
    assert!(
        d("kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1.0,
        "no sync counted"
    );
    assert_eq!(
        s2.value("kubeproxy_sync_proxy_rules_endpoint_changes_pending", &[]),
        0.0,
        "pending after the sync"
    );
    let last = s2.value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", V4);
    assert!(
        last >= t1 - 0.5,
        "last sync timestamp {last} is before the change ({t1})"
    );
    let queued = s2.value(
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        V4,
    );
    assert!(
        queued >= t1 - 0.5 && queued <= last + 0.5,
        "last queued {queued}: change at {t1}, synced at {last}"
    );
    check_maps(&k, "after an endpoint change");

    // Service change: a new port (one more frontend).
    let mut w = web.clone();
    w["spec"]["ports"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "alt", "port": 8081, "protocol": "TCP", "targetPort": 8080}));
    k.api.apply(w);
    k.wait_until("service port added", APPLY, |f| {
        f.contains_key(&format!("{WEB_VIP}:8081/TCP"))
    });
    let s3 = scrape(&k);
    assert!(
        s3.value("kubeproxy_sync_proxy_rules_service_changes_total", &[])
            >= s2.value("kubeproxy_sync_proxy_rules_service_changes_total", &[]) + 1.0,
        "service_changes_total did not increase after a service change"
    );
    assert_eq!(
        s3.value("kubeproxy_sync_proxy_rules_service_changes_pending", &[]),
        0.0
    );
    check_maps(&k, "after a service change");
}

/// lbproxy refreshes its map gauges on a 2 s tick (not at each sync), so `lbproxy_map_entries`
/// may lag a change by up to that long.
const MAP_GAUGE_LAG: Duration = Duration::from_millis(2500);

/// `lbproxy_map_entries` for the services, backends and slots maps equals what `inspect`
/// shows, within [`MAP_GAUGE_LAG`]. Returns how long it took to agree.
fn check_maps(k: &Kube, ctx: &str) -> Duration {
    let f = k.frontends();
    let inspect_backends = k.lab.inspect_backends();
    let want = [
        ("services", f.len() as f64),
        ("backends", inspect_backends.len() as f64),
        (
            "slots",
            f.values().map(|fe| fe.backends.len()).sum::<usize>() as f64,
        ),
    ];
    let start = Instant::now();
    loop {
        let sc = scrape(k);
        let got: Vec<(&str, f64)> = want
            .iter()
            .map(|(m, _)| (*m, sc.value("lbproxy_map_entries", &[("map", m)])))
            .collect();
        if got.iter().zip(&want).all(|(g, w)| g.1 == w.1) {
            let d = start.elapsed();
            eprintln!("{ctx}: lbproxy_map_entries agreed with inspect after {d:?}");
            return d;
        }
        assert!(
            start.elapsed() < MAP_GAUGE_LAG,
            "{ctx}: lbproxy_map_entries {got:?} != {want:?} (from inspect) after {MAP_GAUGE_LAG:?}\n\
             frontends {f:#?}\nbackends {inspect_backends:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `kubeproxy_network_programming_duration_seconds` observes, for a slice carrying
/// `endpoints.kubernetes.io/last-change-trigger-time`, the time from that trigger to the
/// change being programmed; a slice change without the annotation is not observed.
#[test]
fn network_programming_duration() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (web, webs) = web_json("web", WEB_VIP, vec![Endpoint::ready(ip(3))]);
    k.api.apply_all([web, webs.clone()]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    let name = "kubeproxy_network_programming_duration_seconds";
    let s1 = scrape(&k);

    // Trigger 5 s in the past (second precision, as RFC 3339 without fraction).
    let trigger = SystemTime::now() - Duration::from_secs(5);
    let mut s = webs.clone();
    s["metadata"]["annotations"] =
        json!({"endpoints.kubernetes.io/last-change-trigger-time": rfc3339(trigger)});
    s["endpoints"] = json!([
        {"addresses": [ip(3).to_string()], "conditions": {"ready": true}, "nodeName": NODE},
        {"addresses": [ip(4).to_string()], "conditions": {"ready": true}, "nodeName": NODE},
    ]);
    k.api.apply(s.clone());
    k.wait_fes(
        "annotated change",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(3), ip(4)]),
    );
    let s2 = scrape(&k);
    check_histogram(&s2, name);
    let dc = s2.value(&format!("{name}_count"), V4) - s1.value(&format!("{name}_count"), V4);
    let ds = s2.value(&format!("{name}_sum"), V4) - s1.value(&format!("{name}_sum"), V4);
    assert_eq!(
        dc, 1.0,
        "{name}_count should grow by 1 for one annotated slice change"
    );
    // 5 s before the change, up to 1 s more from the truncation to whole seconds, plus the
    // programming time (under 2 s by contract).
    assert!(
        (5.0..8.5).contains(&ds),
        "{name}: observed {ds} s for a trigger 5 s before the change"
    );
    let b1 = buckets(&s1, name);
    let b2 = buckets(&s2, name);
    for ((le, c1), (_, c2)) in b1.iter().zip(&b2) {
        let want = if *le < 5.0 {
            0.0
        } else if *le >= 8.5 {
            1.0
        } else {
            c2 - c1
        };
        assert_eq!(
            c2 - c1,
            want,
            "{name} bucket le={le}: grew by {} for one ~5-6 s observation",
            c2 - c1
        );
    }

    // No annotation: nothing observed.
    let mut s = s.clone();
    s["metadata"]["annotations"] = json!({});
    s["endpoints"] = json!([{"addresses": [ip(4).to_string()], "conditions": {"ready": true}, "nodeName": NODE}]);
    k.api.apply(s);
    k.wait_fes(
        "change without annotation",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(4)]),
    );
    let s3 = scrape(&k);
    assert_eq!(
        s3.value(&format!("{name}_count"), V4),
        s2.value(&format!("{name}_count"), V4),
        "{name} observed a change without last-change-trigger-time"
    );
}

/// Sum of `lbproxy_datapath_drops_total` over the reasons starting with `no_backend` (the
/// contract leaves the reason names open; lbproxy has `no_backend`, and
/// `no_backend_tcp_reset` / `no_backend_icmp_unreachable` for rejected packets).
fn no_backend_drops(sc: &Scrape) -> f64 {
    sc.samples
        .iter()
        .filter(|s| {
            s.name == "lbproxy_datapath_drops_total"
                && s.labels
                    .get("reason")
                    .is_some_and(|r| r.starts_with("no_backend"))
        })
        .map(|s| s.value)
        .sum()
}

/// Traffic to a service without any endpoint is rejected at once (kube-proxy: TCP RST, ICMP
/// port unreachable), and counted in `lbproxy_datapath_drops_total{reason=~"no_backend.*"}`.
#[test]
fn no_backend_rejected_and_counted() {
    let mut k = Kube::new(Shape::Routed, &["client"]);
    let (web, webs) = web_json("web", WEB_VIP, vec![Endpoint::ready(ip(3))]);
    k.api.apply_all([web, webs]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    let (empty, _) = web_json("empty", vip(50), vec![]);
    k.api.apply(empty);
    k.wait_until(
        "endpoint-less service programmed (as a rejecting frontend)",
        APPLY,
        |f| f.contains_key(&format!("{}:{WEB_UDP}/UDP", vip(50))),
    );
    let before = no_backend_drops(&scrape(&k));
    let client = k.pod("client").clone();
    let results = run_in_ns(&client.netns, || {
        let mut v = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let r = TcpStream::connect_timeout(
                &SocketAddr::from((vip(50), WEB_TCP)),
                Duration::from_secs(1),
            );
            v.push(("TCP", r.map(|_| ()).map_err(|e| e.kind()), t.elapsed()));
            let t = Instant::now();
            let r = (|| -> std::io::Result<()> {
                let u = UdpSocket::bind("0.0.0.0:0")?;
                u.connect(SocketAddr::from((vip(50), WEB_UDP)))?;
                u.set_read_timeout(Some(Duration::from_secs(1)))?;
                u.send(b"hello\n")?;
                let mut buf = [0u8; 64];
                u.recv(&mut buf).map(|_| ())
            })();
            v.push(("UDP", r.map_err(|e| e.kind()), t.elapsed()));
        }
        v
    });
    for (proto, r, took) in &results {
        assert!(
            *r == Err(std::io::ErrorKind::ConnectionRefused) && *took < Duration::from_millis(300),
            "{proto} to a service without endpoints: {r:?} after {took:?} (want refused at once); all: {results:?}"
        );
    }
    let (after, _) = wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
        let v = no_backend_drops(&scrape(&k));
        (v >= before + 6.0).then_some(v)
    })
    .unwrap_or_else(|_| {
        panic!(
            "lbproxy_datapath_drops_total{{reason=~\"no_backend.*\"}} did not grow by 6 (from {before})\n{}",
            k.diag()
        )
    });
    eprintln!("no_backend* drops {before} -> {after}");
}
