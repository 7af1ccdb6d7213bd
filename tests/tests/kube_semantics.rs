//! kube-proxy semantics the skeleton already honours beyond its issue's list
//! (shared/notes/field.md), and plain operability of the manifest watcher.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{Conditions, Endpoint, Inspect as _, Lab, Shape, ns, wait_for};

both_shapes!(terminating_keeps_established);

/// field.md: "A terminating endpoint keeps its existing connections." An established TCP
/// connection to a backend that turns terminating (ready: false, serving: true,
/// terminating: true) keeps working, while new connections avoid that backend.
fn terminating_keeps_established(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let mut conn = (0..50)
        .find_map(|_| {
            let mut c = s.client.connect(WEB_VIP, WEB_TCP, T).ok()?;
            (c.request().ok()?.backend == "b2").then_some(c)
        })
        .expect("no connection landed on b2 in 50 tries");

    s.lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        vec![
            Endpoint::ready(b1.ip).pod("b1"),
            Endpoint::new(b2.ip, Conditions::TERMINATING_SERVING).pod("b2"),
        ],
    ));
    std::thread::sleep(APPLY_WITHIN);
    let (t, u) = web_traffic_ok(&format!("[{shape}] b2 terminating"), &s.client, WEB_VIP, 30);
    assert!(
        !t.contains_key("b2") && !u.contains_key("b2"),
        "[{shape}] terminating b2 got new connections: TCP {t:?} UDP {u:?}"
    );
    let r: Vec<_> = (0..3).map(|_| conn.request().map(|r| r.backend)).collect();
    assert!(
        r.iter().all(|x| matches!(x, Ok(b) if b == "b2")),
        "[{shape}] established TCP connection to b2 after b2 turned terminating (still serving): {r:?}"
    );
}

/// An unchanged (bad) manifest is not re-read and re-logged over and over. One write may
/// cause a few file events, so up to 3 rejections in the window are accepted.
#[test]
fn bad_manifest_not_relogged_while_unchanged() {
    let s = Setup::new(Shape::Routed, &["b1"]);
    s.lab.write_manifest_text("spec: [unclosed\n");
    std::thread::sleep(Duration::from_millis(500));
    let off = s.lb.stderr_len();
    std::thread::sleep(Duration::from_secs(3));
    let log = s.lb.stderr_since(off);
    let path = s.lab.manifest_path().display().to_string();
    let n = log.lines().filter(|l| l.contains(&path)).count();
    assert!(
        n <= 3,
        "the unchanged bad manifest was rejected (and logged) {n} times in 3 s with no file \
         change; first lines:\n{}",
        log.lines().take(3).collect::<Vec<_>>().join("\n")
    );
}

/// A manifest that is invalid from the very start is rejected once, not re-read and
/// re-logged while it stays the same; lbproxy stays unhealthy (nothing is programmed), and
/// serves as soon as the file is fixed.
#[test]
fn bad_manifest_from_the_start_logged_once_then_fixed() {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let (backends, _servers) = serving_pods(&lab, &["b1"]);
    lab.write_manifest_text("spec: [unclosed\n");
    let mut lb = lab.start_lbproxy();
    let path = lab.manifest_path().display().to_string();
    let rejected = |lb: &lbproxy_tests::lab::Lbproxy| {
        lb.stderr_since(0)
            .lines()
            .filter(|l| l.contains("manifests rejected") && l.contains(&path))
            .count()
    };
    // The first read comes after the programs are loaded, which takes seconds on a busy
    // machine: wait for the rejection, then watch 3 s for another.
    let first = wait_for(HEALTHY_WITHIN, Duration::from_millis(50), || {
        (rejected(&lb) > 0).then_some(())
    });
    std::thread::sleep(Duration::from_secs(3));
    let n = rejected(&lb);
    assert!(
        first.is_ok() && n == 1,
        "an unchanged bad manifest from the start was rejected {n} times (first: {first:?}), \
         counted 3 s after the first; log:\n{}",
        lb.stderr_since(0)
            .lines()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_ne!(
        lb.healthz(),
        Ok(200),
        "healthy with nothing programmed from a bad manifest"
    );
    let b: Vec<&lbproxy_tests::lab::Pod> = backends.iter().collect();
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&b)));
    lb.expect_healthy(HEALTHY_WITHIN);
    web_traffic_ok("fixed manifest", &client, WEB_VIP, 5);
}

/// Every frontend a Service asks for is served and listed by `inspect services` with its
/// kind (a NodePort as `*:port`, any node address), its SCTP port's too (issue 28; this
/// slice has no SCTP port, so those frontends have no backend and reject), and
/// `lbproxy_frontends_not_served` counts none of any kind.
#[test]
fn every_frontend_is_shown_served_sctp_included() {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let (backends, _servers) = serving_pods(&lab, &["b1"]);
    let b1 = backends[0].ip;
    lab.write_manifest_text(&format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: NodePort
  clusterIP: {WEB_VIP}
  externalIPs: [203.0.113.7]
  ports:
  - {{name: http, port: 80, targetPort: {BACKEND_TCP}, nodePort: 30080}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: {BACKEND_UDP}, nodePort: 30053}}
  - {{name: sig, port: 99, protocol: SCTP, nodePort: 30099}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: {BACKEND_TCP}}}, {{name: dns, port: {BACKEND_UDP}, protocol: UDP}}]
endpoints: [{{addresses: ['{b1}']}}]
"
    ));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    web_traffic_ok("the ClusterIP of a NodePort service", &client, WEB_VIP, 5);

    let mut got: Vec<(String, String, bool, String)> = lab
        .inspect_services()
        .into_iter()
        .map(|r| (r.kind, r.frontend, r.served, r.not_served))
        .collect();
    got.sort();
    let vip = WEB_VIP;
    let row = |kind: &str, fe: String, served: bool, why: &str| {
        (kind.to_owned(), fe, served, why.to_owned())
    };
    let mut want = vec![
        row("ClusterIP", format!("{vip}:53/UDP"), true, ""),
        row("ClusterIP", format!("{vip}:80/TCP"), true, ""),
        row("ClusterIP", format!("{vip}:99/SCTP"), true, ""),
        row("ExternalIP", "203.0.113.7:53/UDP".into(), true, ""),
        row("ExternalIP", "203.0.113.7:80/TCP".into(), true, ""),
        row("ExternalIP", "203.0.113.7:99/SCTP".into(), true, ""),
        row("NodePort", "*:30053/UDP".into(), true, ""),
        row("NodePort", "*:30080/TCP".into(), true, ""),
        row("NodePort", "*:30099/SCTP".into(), true, ""),
    ];
    want.sort();
    assert_eq!(got, want, "inspect services --json");

    let addr: SocketAddr = lbproxy_tests::lab::METRICS_ADDR.parse().unwrap();
    let text = ns::http_get_full(lab.node_ns(), addr, "/metrics", Duration::from_secs(2))
        .map(|r| r.body)
        .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
    for (kind, n) in [
        ("cluster_ip", 0),
        ("node_port", 0),
        ("external_ip", 0),
        ("load_balancer_ip", 0),
    ] {
        let line = format!("lbproxy_frontends_not_served{{kind=\"{kind}\"}} {n}");
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in /metrics:\n{}",
            text.lines()
                .filter(|l| l.contains("not_served"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
