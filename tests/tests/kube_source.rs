//! lbproxy's Kubernetes API source against a real list+watch API server
//! (`lbproxy_tests::apiserver`) inside the lab's node namespace: initial list, add / modify /
//! delete events, broken watches, 410 Gone, a slow or absent API server, kube-proxy's skips,
//! internalTrafficPolicy, the Node Event on programming failure, and real traffic through
//! services that exist only in the API server.
//!
//! Timing contract (see `kube_common`): a watch event is applied within 2 s ([`APPLY`]);
//! recoveries that go through kube-rs's watcher backoff are bounded by [`RECOVER`] and the
//! time they took is printed.

mod common;
mod kube_common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::apiserver::{GoneMode, Request, TOKEN};
use lbproxy_tests::lab::{Endpoint, EndpointSlice, Proto, Protocol, Service, Shape, vip};
use serde_json::{Value, json};

fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n)
}

fn ready_ips(ips: &[Ipv4Addr]) -> Vec<Endpoint> {
    ips.iter().map(|i| Endpoint::ready(*i)).collect()
}

/// `endpoints` JSON for `ips` (ready, on lab-node).
fn eps_json(ips: &[Ipv4Addr]) -> Value {
    let s = EndpointSlice {
        endpoints: ready_ips(ips),
        ..EndpointSlice::new("x", "x")
    }
    .to_json();
    s["endpoints"].clone()
}

fn watches_since(reqs: &[Request], plural: &str) -> Vec<Request> {
    reqs.iter()
        .filter(|r| r.is_watch() && r.resource() == Some(plural))
        .cloned()
        .collect()
}

fn lists_since(reqs: &[Request], plural: &str) -> Vec<Request> {
    reqs.iter()
        .filter(|r| r.is_list() && r.resource() == Some(plural))
        .cloned()
        .collect()
}

/// Objects that exist before lbproxy starts are programmed by the first sync: two slices of
/// one service are merged and de-duplicated, a named targetPort resolves per slice, other
/// namespaces count. lbproxy lists all three resources with the right selectors and token,
/// then watches from the list's resourceVersion.
#[test]
fn initial_list() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3), ip(4)]));
    let mut s2 = s1.clone();
    s2["metadata"]["name"] = json!("web-2");
    s2["endpoints"] = eps_json(&[ip(4), ip(5)]);
    k.api.apply_all([svc, s1, s2]);
    k.api.apply(
        Service::cluster_ip("api", vip(20))
            .namespace("shop")
            .port("https", 443, Protocol::Tcp, "https-port")
            .to_json(),
    );
    k.api.apply(
        EndpointSlice::new("api-x1", "api")
            .namespace("shop")
            .port("https", 8443, Protocol::Tcp)
            .endpoint(Endpoint::ready(ip(9)))
            .to_json(),
    );
    let rv = k.api.resource_version();
    k.start_healthy();
    let want = union([
        web_fes("web", WEB_VIP, &[ip(3), ip(4), ip(5)]),
        fes(&[("198.19.0.20:443/TCP", "shop/api", &["198.18.0.9:8443"])]),
    ]);
    // Healthy means the first full sync is in the maps: no waiting here.
    assert_eq!(
        k.frontends(),
        want,
        "state at the moment /healthz turned 200\n{}",
        k.diag()
    );

    k.wait_watching(Duration::from_secs(5));
    let reqs = k.api.requests();
    for r in &reqs {
        assert_eq!(
            r.authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str()),
            "request without the kubeconfig's token: {}",
            r.line()
        );
    }
    let svc_lists = lists_since(&reqs, "services");
    assert!(!svc_lists.is_empty(), "no list of services\n{}", k.diag());
    assert_eq!(svc_lists[0].path, "/api/v1/services", "cluster-wide list");
    let slice_lists = lists_since(&reqs, "endpointslices");
    assert!(
        !slice_lists.is_empty(),
        "no list of endpointslices\n{}",
        k.diag()
    );
    assert_eq!(
        slice_lists[0].path,
        "/apis/discovery.k8s.io/v1/endpointslices"
    );
    assert_eq!(
        slice_lists[0].param("labelSelector"),
        Some("kubernetes.io/service-name"),
        "slices are selected by the existence of kubernetes.io/service-name"
    );
    let node_lists = lists_since(&reqs, "nodes");
    assert!(!node_lists.is_empty(), "no list of nodes\n{}", k.diag());
    assert_eq!(
        node_lists[0].param("fieldSelector"),
        Some("metadata.name=lab-node")
    );
    for plural in ["services", "endpointslices", "nodes"] {
        let w = watches_since(&reqs, plural);
        assert!(!w.is_empty(), "no watch on {plural}");
        assert_eq!(
            w[0].param("resourceVersion"),
            Some(rv.to_string().as_str()),
            "the first watch on {plural} starts at the list's resourceVersion: {}",
            w[0].line()
        );
    }
    assert_eq!(k.api.unknown_requests(), Vec::<String>::new());
}

/// Add, modify and delete events are each applied within 2 s: endpoints added and removed,
/// a second slice (merged, de-duplicated), an endpoint turning not ready, a service port
/// change, a slice port (targetPort) change, a new service, slices deleted, services deleted.
#[test]
fn watch_events() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    k.api.apply_all([svc.clone(), s1.clone()]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    assert_eq!(k.frontends(), web_fes("web", WEB_VIP, &[ip(3)]));

    // Endpoint added.
    let mut s1b = s1.clone();
    s1b["endpoints"] = eps_json(&[ip(3), ip(4)]);
    k.api.apply(s1b);
    k.wait_fes(
        "endpoint added",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(3), ip(4)]),
    );

    // A second slice of the same service, overlapping.
    let mut s2 = s1.clone();
    s2["metadata"]["name"] = json!("web-2");
    s2["endpoints"] = eps_json(&[ip(4), ip(5)]);
    k.api.apply(s2.clone());
    k.wait_fes(
        "second slice added (merged, de-duplicated)",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(3), ip(4), ip(5)]),
    );

    // Endpoint removed from the first slice (still in the second: stays).
    let mut s1c = s1.clone();
    s1c["endpoints"] = eps_json(&[ip(4)]);
    k.api.apply(s1c.clone());
    k.wait_fes(
        "endpoint removed",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(4), ip(5)]),
    );

    // Endpoint turns not ready.
    let mut s2b = s2.clone();
    s2b["endpoints"][1]["conditions"] =
        json!({"ready": false, "serving": false, "terminating": false});
    k.api.apply(s2b.clone());
    k.wait_fes(
        "endpoint not ready",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(4)]),
    );

    // Service port change: TCP 80 -> 81.
    let mut svc2 = svc.clone();
    svc2["spec"]["ports"][0]["port"] = json!(81);
    k.api.apply(svc2.clone());
    k.wait_fes(
        "service port 80 -> 81",
        APPLY,
        &fes(&[
            ("198.19.0.10:81/TCP", "default/web", &["198.18.0.4:8080"]),
            ("198.19.0.10:53/UDP", "default/web", &["198.18.0.4:5353"]),
        ]),
    );

    // Slice port (the resolved targetPort) change on both slices: 8080 -> 9090.
    let mut s1d = s1c.clone();
    s1d["ports"][0]["port"] = json!(9090);
    let mut s2c = s2b.clone();
    s2c["ports"][0]["port"] = json!(9090);
    k.api.apply(s1d);
    k.api.apply(s2c);
    k.wait_fes(
        "slice port 8080 -> 9090",
        APPLY,
        &fes(&[
            ("198.19.0.10:81/TCP", "default/web", &["198.18.0.4:9090"]),
            ("198.19.0.10:53/UDP", "default/web", &["198.18.0.4:5353"]),
        ]),
    );

    // A new service with its slice.
    let (db, dbs) = web_json("db", vip(30), ready_ips(&[ip(7)]));
    k.api.apply(db);
    k.api.apply(dbs);
    let db_fes = web_fes("db", vip(30), &[ip(7)]);
    let web_now = fes(&[
        ("198.19.0.10:81/TCP", "default/web", &["198.18.0.4:9090"]),
        ("198.19.0.10:53/UDP", "default/web", &["198.18.0.4:5353"]),
    ]);
    k.wait_fes(
        "service added",
        APPLY,
        &union([web_now.clone(), db_fes.clone()]),
    );

    // A slice losing its kubernetes.io/service-name label leaves the watch's selection (the
    // API server sends DELETED): db has no backends; the label back brings them back.
    let (_, dbs) = web_json("db", vip(30), ready_ips(&[ip(7)]));
    let mut unlabelled = dbs.clone();
    unlabelled["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("kubernetes.io/service-name");
    k.api.apply(unlabelled);
    k.wait_fes_with_backends("slice label removed", APPLY, &web_now);
    k.api.apply(dbs.clone());
    k.wait_fes(
        "slice label back",
        APPLY,
        &union([web_now.clone(), db_fes.clone()]),
    );
    // The slice moves to another service (label value changed: MODIFIED).
    let mut moved = dbs.clone();
    moved["metadata"]["labels"]["kubernetes.io/service-name"] = json!("web");
    k.api.apply(moved);
    k.wait_fes_with_backends(
        "slice moved from db to web",
        APPLY,
        &fes(&[
            (
                "198.19.0.10:81/TCP",
                "default/web",
                &["198.18.0.4:9090", "198.18.0.7:8080"],
            ),
            (
                "198.19.0.10:53/UDP",
                "default/web",
                &["198.18.0.4:5353", "198.18.0.7:5353"],
            ),
        ]),
    );
    k.api.apply(dbs);
    k.wait_fes(
        "slice moved back",
        APPLY,
        &union([web_now.clone(), db_fes.clone()]),
    );

    // Both slices of web deleted: web has no backends left.
    assert!(k.api.delete("EndpointSlice", "default", "web-1"));
    assert!(k.api.delete("EndpointSlice", "default", "web-2"));
    k.wait_fes_with_backends("slices deleted", APPLY, &db_fes);

    // Service web deleted: its frontends go away entirely.
    assert!(k.api.delete("Service", "default", "web"));
    k.wait_fes("service deleted", APPLY, &db_fes);

    // Service db deleted while its slice remains: gone too.
    assert!(k.api.delete("Service", "default", "db"));
    k.wait_fes("service deleted, slice kept", APPLY, &Fes::new());
}

/// A watch cut mid-stream is resumed from the last resourceVersion: a change made right
/// after the break arrives within 2 s, and the request log shows new watches.
#[test]
fn broken_watch_resumes() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    k.api.apply_all([svc.clone(), s1.clone()]);
    // Frequent bookmarks, so resumes also start from bookmarked resourceVersions.
    k.api
        .set_bookmark_interval(Some(Duration::from_millis(300)));
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    for round in 0..3u8 {
        std::thread::sleep(Duration::from_millis(700));
        let mark = k.api.request_count();
        let rv_before = k.api.resource_version();
        let broken = k.api.break_watches();
        assert!(
            broken >= 3,
            "round {round}: only {broken} open watches to break"
        );
        let mut s = s1.clone();
        s["endpoints"] = eps_json(&[ip(3), ip(10 + round)]);
        k.api.apply(s);
        k.wait_fes(
            &format!("round {round}: change right after a broken watch"),
            APPLY,
            &web_fes("web", WEB_VIP, &[ip(3), ip(10 + round)]),
        );
        // The services and nodes watches come back too.
        for plural in ["services", "endpointslices", "nodes"] {
            let r = k
                .api
                .wait_for_request(mark, Duration::from_secs(10), |r| {
                    r.is_watch() && r.resource() == Some(plural)
                })
                .unwrap_or_else(|| panic!("round {round}: no new watch on {plural}\n{}", k.diag()));
            let rv: u64 = r
                .param("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!(
                rv >= 1 && rv <= rv_before + 1,
                "round {round}: the new watch on {plural} does not resume from a known \
                 resourceVersion (<= {rv_before}): {}",
                r.line()
            );
        }
        let relists: Vec<String> = k
            .api
            .requests_since(mark)
            .iter()
            .filter(|r| r.is_list())
            .map(Request::line)
            .collect();
        eprintln!("round {round}: re-lists after the break (not required): {relists:?}");
        k.wait_watching(Duration::from_secs(10));
    }
}

/// 410 Gone as the real API server sends it (HTTP 200, an ERROR event with a 410 Status):
/// lbproxy re-lists, and the state afterwards is right, including a change that only the
/// re-list can show.
#[test]
fn gone_relists() {
    gone(GoneMode::ErrorEvent);
}

/// 410 Gone as the HTTP status of the watch request itself (client-go's reflector treats
/// both the same way: re-list).
#[test]
fn gone_http_status_relists() {
    gone(GoneMode::HttpStatus);
}

fn gone(mode: GoneMode) {
    let mut k = Kube::new(Shape::Routed, &[]);
    k.api.set_gone_mode(mode);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    let (old, olds) = web_json("old", vip(11), ready_ips(&[ip(5)]));
    k.api.apply_all([svc, s1.clone(), old, olds]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    // While nobody watches: changes, then history expires (compaction).
    k.api.go_down();
    let mark = k.api.request_count();
    let mut s = s1.clone();
    s["endpoints"] = eps_json(&[ip(4)]);
    k.api.apply(s);
    k.api.delete("Service", "default", "old");
    k.api.delete("EndpointSlice", "default", "old-1");
    k.api.expire_history();
    let floor = k.api.resource_version();
    k.api.come_back();
    let t = Instant::now();
    k.wait_fes(
        &format!("after 410 ({mode:?}), re-list"),
        RECOVER,
        &web_fes("web", WEB_VIP, &[ip(4)]),
    );
    eprintln!(
        "{mode:?}: converged {:?} after the API server came back",
        t.elapsed()
    );
    let since = k.api.requests_since(mark);
    let expired = since.iter().find(|r| {
        r.is_watch()
            && r.status.is_some()
            && r.param("resourceVersion")
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v > 0 && v < floor)
    });
    assert!(
        expired.is_some(),
        "no watch from an expired resourceVersion was answered\n{}",
        k.diag()
    );
    for plural in ["services", "endpointslices"] {
        assert!(
            !lists_since(&since, plural).is_empty(),
            "no re-list of {plural} after 410\n{}",
            k.diag()
        );
    }
    // And it keeps following events afterwards.
    k.wait_watching(RECOVER);
    let mut s = s1.clone();
    s["endpoints"] = eps_json(&[ip(4), ip(6)]);
    k.api.apply(s);
    k.wait_fes(
        "event after the re-list",
        APPLY,
        &web_fes("web", WEB_VIP, &[ip(4), ip(6)]),
    );
}

/// The API server goes away: the last state keeps serving (traffic and /healthz); changes
/// made meanwhile (and compacted away) are picked up once it is back.
#[test]
fn apiserver_away_keeps_serving() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1", "b2", "b3"]);
    let (b1, b2, b3) = (
        k.pod("b1").clone(),
        k.pod("b2").clone(),
        k.pod("b3").clone(),
    );
    let (svc, s1) = web_json("web", WEB_VIP, eps(&[&b1, &b2]));
    k.api.apply_all([svc, s1.clone()]);
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    let client = k.pod("client").clone();
    web_traffic_ok_in(Some(&k.lab), "before the outage", &client, WEB_VIP, 20);

    k.api.go_down();
    k.api.apply(web_json("web", WEB_VIP, eps(&[&b2, &b3])).1);
    k.api.expire_history();
    let before = web_fes("web", WEB_VIP, &[b1.ip, b2.ip]);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(4) {
        let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "API server away", &client, WEB_VIP, 10);
        assert!(
            !tcp.contains_key("b3") && !udp.contains_key("b3"),
            "b3 got traffic while the API server was away: {tcp:?} {udp:?}"
        );
        let h = k.lb().healthz();
        assert_eq!(
            h,
            Ok(200),
            "/healthz while the API server is away (nothing queued)\n{}",
            k.diag()
        );
        assert_eq!(
            k.frontends(),
            before,
            "state changed while the API server was away"
        );
    }
    assert!(
        k.lb().is_running(),
        "lbproxy exited while the API server was away\n{}",
        k.diag()
    );
    k.api.come_back();
    let t = Instant::now();
    k.wait_fes(
        "after the API server came back",
        RECOVER,
        &web_fes("web", WEB_VIP, &[b2.ip, b3.ip]),
    );
    eprintln!("converged {:?} after the API server came back", t.elapsed());
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "after the outage", &client, WEB_VIP, 30);
    assert!(
        !tcp.contains_key("b1") && !udp.contains_key("b1"),
        "b1 still gets traffic: {tcp:?} {udp:?}"
    );
    assert!(
        tcp.contains_key("b3") && udp.contains_key("b3"),
        "b3 gets no traffic: {tcp:?} {udp:?}"
    );
}

/// A slow API server (every response's first byte 1.5 s late): lbproxy still becomes
/// healthy with the right state, follows events on its open watches within 2 s, and after
/// a broken watch the last state keeps serving while it reconnects.
#[test]
fn slow_apiserver() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1", "b2"]);
    let (b1, b2) = (k.pod("b1").clone(), k.pod("b2").clone());
    let client = k.pod("client").clone();
    let (svc, s1) = web_json("web", WEB_VIP, eps(&[&b1]));
    k.api.apply_all([svc, s1.clone()]);
    let delay = Duration::from_millis(1500);
    k.api.set_delay(delay);
    k.start_with(&[]);
    let d = k.expect_healthy(Duration::from_secs(30));
    eprintln!("healthy {d:?} after start with a {delay:?} API server");
    assert_eq!(
        k.frontends(),
        web_fes("web", WEB_VIP, &[b1.ip]),
        "{}",
        k.diag()
    );
    k.wait_watching(Duration::from_secs(30));

    k.api.apply(web_json("web", WEB_VIP, eps(&[&b1, &b2])).1);
    k.wait_fes(
        "event on an open watch (slow server)",
        APPLY,
        &web_fes("web", WEB_VIP, &[b1.ip, b2.ip]),
    );

    k.api.break_watches();
    k.api.apply(web_json("web", WEB_VIP, eps(&[&b2])).1);
    // Meanwhile the last state serves.
    web_traffic_ok_in(
        Some(&k.lab),
        "slow server, reconnecting",
        &client,
        WEB_VIP,
        10,
    );
    assert_eq!(k.lb().healthz(), Ok(200));
    let t = Instant::now();
    k.wait_fes(
        "change after a broken watch (slow server)",
        RECOVER,
        &web_fes("web", WEB_VIP, &[b2.ip]),
    );
    eprintln!(
        "slow server: change after a broken watch applied in {:?}",
        t.elapsed()
    );
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "slow server, after", &client, WEB_VIP, 20);
    assert!(
        !tcp.contains_key("b1") && !udp.contains_key("b1"),
        "{tcp:?} {udp:?}"
    );
}

/// kube-proxy's skips: a service labelled `service.kubernetes.io/service-proxy-name` (any
/// value, also empty), a headless service (`clusterIP: None`, or labelled
/// `service.kubernetes.io/headless` whatever its clusterIP, as the e2e test "should
/// implement service.kubernetes.io/headless" checks) and an ExternalName service are not
/// programmed, whether listed at start or added by a watch event; labelling a programmed
/// service later removes it, and removing the label brings it back.
#[test]
fn skipped_services() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (web, webs) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    let (other, others) = web_json("other", vip(11), ready_ips(&[ip(4)]));
    let mut other = other;
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    let (hl, hls) = web_json("hl", vip(12), ready_ips(&[ip(5)]));
    let mut hl = hl;
    hl["spec"]["clusterIP"] = json!("None");
    hl["spec"]["clusterIPs"] = json!(["None"]);
    let ext = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "ext", "namespace": "default"},
        "spec": {"type": "ExternalName", "externalName": "example.com", "sessionAffinity": "None",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}]},
        "status": {"loadBalancer": {}},
    });
    let (hll, hlls) = web_json("hl-label", vip(13), ready_ips(&[ip(5)]));
    let mut hll = hll;
    hll["metadata"]["labels"] = json!({"service.kubernetes.io/headless": ""});
    k.api
        .apply_all([web.clone(), webs, other, others, hl, hls, ext, hll, hlls]);
    k.start_healthy();
    let web_only = web_fes("web", WEB_VIP, &[ip(3)]);
    assert_eq!(
        k.frontends(),
        web_only,
        "skips at the initial list\n{}",
        k.diag()
    );
    k.wait_watching(Duration::from_secs(5));

    // The same kinds arriving by watch events.
    let (o2, o2s) = web_json("other2", vip(21), ready_ips(&[ip(6)]));
    let mut o2 = o2;
    o2["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": ""});
    let (h2, h2s) = web_json("hl2", vip(22), ready_ips(&[ip(7)]));
    let mut h2 = h2;
    h2["spec"]["clusterIP"] = json!("None");
    h2["spec"]["clusterIPs"] = json!(["None"]);
    let mut e2 = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "ext2", "namespace": "default"},
        "spec": {"type": "ExternalName", "externalName": "example.org", "sessionAffinity": "None"},
        "status": {"loadBalancer": {}},
    });
    e2["spec"]["ports"] =
        json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}]);
    let (marker, markers) = web_json("marker", vip(40), ready_ips(&[ip(8)]));
    k.api.apply_all([o2, o2s, h2, h2s, e2]);
    // A marker service applied after them: once it shows, the others have been seen.
    k.api.apply_all([marker, markers]);
    let with_marker = union([web_only.clone(), web_fes("marker", vip(40), &[ip(8)])]);
    k.wait_fes(
        "skipped kinds added by watch (marker applied last)",
        APPLY,
        &with_marker,
    );

    // Labelling web for another proxy removes it; unlabelling brings it back.
    let mut wl = web.clone();
    wl["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    k.api.apply(wl);
    k.wait_fes(
        "web labelled for another proxy",
        APPLY,
        &web_fes("marker", vip(40), &[ip(8)]),
    );
    k.api.apply(web.clone());
    k.wait_fes("label removed again", APPLY, &with_marker);

    // The same with the headless label, on a service that keeps its clusterIP.
    let mut wh = web.clone();
    wh["metadata"]["labels"] = json!({"service.kubernetes.io/headless": ""});
    k.api.apply(wh);
    k.wait_fes(
        "web labelled service.kubernetes.io/headless",
        APPLY,
        &web_fes("marker", vip(40), &[ip(8)]),
    );
    k.api.apply(web.clone());
    k.wait_fes("headless label removed again", APPLY, &with_marker);

    // web turns ExternalName (MODIFIED): removed; back to ClusterIP: programmed again.
    let mut wx = web.clone();
    wx["spec"] = json!({
        "type": "ExternalName", "externalName": "example.net", "sessionAffinity": "None",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
    });
    k.api.apply(wx);
    k.wait_fes(
        "web turned ExternalName",
        APPLY,
        &web_fes("marker", vip(40), &[ip(8)]),
    );
    k.api.apply(web);
    k.wait_fes("web back to ClusterIP", APPLY, &with_marker);
}

both_shapes!(end_to_end);

/// Real TCP and UDP through a service that exists only in the API server; backends added and
/// removed by watch events, a second service added and deleted; traffic follows each
/// change within 2 s.
fn end_to_end(shape: Shape) {
    let mut k = Kube::new(shape, &["client", "b1", "b2", "b3"]);
    let (b1, b2, b3) = (
        k.pod("b1").clone(),
        k.pod("b2").clone(),
        k.pod("b3").clone(),
    );
    let client = k.pod("client").clone();
    let (svc, s1) = web_json("web", WEB_VIP, eps(&[&b1, &b2]));
    k.api.apply_all([svc, s1.clone()]);
    k.start_healthy();
    let (tcp, udp) = web_traffic_ok_in(
        Some(&k.lab),
        &format!("[{shape}] initial"),
        &client,
        WEB_VIP,
        30,
    );
    for m in [&tcp, &udp] {
        assert!(
            m.contains_key("b1") && m.contains_key("b2") && !m.contains_key("b3"),
            "[{shape}] {tcp:?} {udp:?}"
        );
    }
    k.wait_watching(Duration::from_secs(5));

    // Add b3.
    let slice = |pods: &[&lbproxy_tests::lab::Pod]| {
        let (_, s) = web_json("web", WEB_VIP, eps(pods));
        s
    };
    k.api.apply(slice(&[&b1, &b2, &b3]));
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        t.contains_key("b3") && u.contains_key("b3")
    });
    eprintln!("[{shape}] b3 answered TCP and UDP {d:?} after the event");
    let (tcp, udp) = web_traffic_ok_in(
        Some(&k.lab),
        &format!("[{shape}] b3 added"),
        &client,
        WEB_VIP,
        45,
    );
    for b in ["b1", "b2", "b3"] {
        assert!(
            tcp.contains_key(b) && udp.contains_key(b),
            "[{shape}] {b} starved: {tcp:?} {udp:?}"
        );
    }

    // Remove b1.
    k.api.apply(slice(&[&b2, &b3]));
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        !t.contains_key("b1") && !u.contains_key("b1")
    });
    eprintln!("[{shape}] b1 out of new TCP and UDP flows {d:?} after the event");
    let (tcp, udp) = web_traffic_ok_in(
        Some(&k.lab),
        &format!("[{shape}] b1 removed"),
        &client,
        WEB_VIP,
        30,
    );
    assert!(
        !tcp.contains_key("b1") && !udp.contains_key("b1"),
        "[{shape}] b1 still chosen: {tcp:?} {udp:?}"
    );

    // A second service, only in the API server, then deleted.
    let (s2, s2s) = web_json("second", vip(11), eps(&[&b1]));
    k.api.apply_all([s2, s2s]);
    let d = wait_traffic(&k, &client, vip(11), |t, u| {
        t.contains_key("b1") && u.contains_key("b1")
    });
    eprintln!("[{shape}] new service answered {d:?} after the event");
    k.api.delete("Service", "default", "second");
    let t = Instant::now();
    loop {
        let r = client.tcp_request(vip(11), WEB_TCP, Duration::from_millis(300));
        if r.is_err() {
            break;
        }
        assert!(
            t.elapsed() < APPLY,
            "[{shape}] deleted service still answers after {:?}: {r:?}\n{}",
            t.elapsed(),
            k.diag()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "[{shape}] deleted service stopped answering {:?} after the event",
        t.elapsed()
    );
}

/// Tallies 8 TCP and 8 UDP requests until `ok(tcp, udp)` (every request must be answered);
/// returns the time since the call, or panics after [`APPLY`].
fn wait_traffic(
    k: &Kube,
    client: &lbproxy_tests::lab::Pod,
    vip: Ipv4Addr,
    ok: impl Fn(
        &std::collections::BTreeMap<String, usize>,
        &std::collections::BTreeMap<String, usize>,
    ) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let t = client.tally(Proto::Tcp, vip, WEB_TCP, 8, Duration::from_millis(500));
        let u = client.tally(Proto::Udp, vip, WEB_UDP, 8, Duration::from_millis(500));
        if ok(&t.by_backend, &u.by_backend) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < APPLY,
            "[{}] traffic did not follow within {APPLY:?}: TCP {t} / UDP {u}\n{}",
            k.lab.shape(),
            k.diag()
        );
    }
}

/// internalTrafficPolicy: Local: only endpoints whose nodeName is ours (`--hostname-override
/// lab-node`) get traffic; with none local, traffic is dropped; back to Cluster, all get it.
#[test]
fn internal_traffic_policy_local() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1", "b2"]);
    let (b1, b2) = (k.pod("b1").clone(), k.pod("b2").clone());
    let client = k.pod("client").clone();
    let ep = |p: &lbproxy_tests::lab::Pod, node: &str| {
        Endpoint::ready(p.ip).pod(&p.name).node(Some(node))
    };
    let (mut svc, _) = web_json("web", WEB_VIP, vec![]);
    svc["spec"]["internalTrafficPolicy"] = json!("Local");
    let (_, s_b1_local) = web_json("web", WEB_VIP, vec![ep(&b1, NODE), ep(&b2, "other-node")]);
    k.api.apply_all([svc.clone(), s_b1_local]);
    k.start_healthy();
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "Local, b1 local", &client, WEB_VIP, 30);
    assert_eq!(tcp.keys().collect::<Vec<_>>(), ["b1"], "TCP {tcp:?}");
    assert_eq!(udp.keys().collect::<Vec<_>>(), ["b1"], "UDP {udp:?}");
    k.wait_watching(Duration::from_secs(5));

    // No local endpoint: dropped.
    let (_, none_local) = web_json(
        "web",
        WEB_VIP,
        vec![ep(&b1, "other-node"), ep(&b2, "other-node")],
    );
    k.api.apply(none_local);
    std::thread::sleep(APPLY);
    let t = client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 5, Duration::from_millis(500));
    let u = client.tally(Proto::Udp, WEB_VIP, WEB_UDP, 5, Duration::from_millis(500));
    assert!(
        t.replies() == 0 && u.replies() == 0,
        "Local with no local endpoint must not reach any backend: TCP {t} / UDP {u}\n{}",
        k.diag()
    );

    // Policy Cluster: both.
    svc["spec"]["internalTrafficPolicy"] = json!("Cluster");
    k.api.apply(svc.clone());
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        ["b1", "b2"]
            .iter()
            .all(|b| t.contains_key(*b) && u.contains_key(*b))
    });
    eprintln!("policy Cluster applied in {d:?}");

    // Local again, now b2 is the local one.
    svc["spec"]["internalTrafficPolicy"] = json!("Local");
    k.api.apply(svc);
    let (_, b2_local) = web_json("web", WEB_VIP, vec![ep(&b1, "other-node"), ep(&b2, NODE)]);
    k.api.apply(b2_local);
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        t.keys().eq(["b2"].iter()) && u.keys().eq(["b2"].iter())
    });
    eprintln!("Local with b2 local applied in {d:?}");
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "Local, b2 local", &client, WEB_VIP, 30);
    assert_eq!(tcp.keys().collect::<Vec<_>>(), ["b2"], "TCP {tcp:?}");
    assert_eq!(udp.keys().collect::<Vec<_>>(), ["b2"], "UDP {udp:?}");
}

/// /healthz and /livez are not 200 before the first sync (the API server is not there yet),
/// and turn 200 once it is there and the state is programmed.
#[test]
fn healthz_waits_for_first_sync() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    k.api.apply_all([svc, s1]);
    k.api.go_down();
    k.start_with(&[]);
    let t = Instant::now();
    let mut seen = Vec::new();
    while t.elapsed() < Duration::from_secs(4) {
        let h = k.lb().healthz();
        let l =
            http_get(k.lab.node_ns(), lbproxy_tests::lab::HEALTHZ_ADDR, "/livez").map(|r| r.status);
        assert_ne!(h, Ok(200), "/healthz 200 before any sync\n{}", k.diag());
        assert_ne!(l, Ok(200), "/livez 200 before any sync\n{}", k.diag());
        seen.push(h);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        seen.contains(&Ok(503)),
        "/healthz never answered 503 before the first sync: {seen:?}"
    );
    assert!(
        k.lb().is_running(),
        "lbproxy exited while the API server was absent\n{}",
        k.diag()
    );
    k.api.come_back();
    let d = k.expect_healthy(RECOVER);
    eprintln!("healthy {d:?} after start (API server came back after 4 s)");
    assert_eq!(k.frontends(), web_fes("web", WEB_VIP, &[ip(3)]));
    let l = http_get(k.lab.node_ns(), lbproxy_tests::lab::HEALTHZ_ADDR, "/livez").map(|r| r.status);
    assert_eq!(l, Ok(200));
}

/// When the dataplane cannot be programmed (here: LB_SERVICES_V2 pinned beforehand with
/// room for 2 frontends, and the API server asks for 4), lbproxy posts a Warning Event about
/// its Node, saying which map refused which entry and why (the errno and its meaning), logs
/// each failed write with the same, and counts the failure.
#[test]
fn node_event_on_programming_failure() {
    let mut k = Kube::new(Shape::Routed, &[]);
    small_services_map(&k, 2);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    let (svc2, s2) = web_json("second", vip(11), ready_ips(&[ip(4)]));
    k.api.apply_all([svc, s1, svc2, s2]);
    k.start_with(&[]);
    let start = Instant::now();
    // Both Events: one about the Node (which map refused which write, and why) and one about
    // each Service whose frontend could not be programmed. Their order is not fixed.
    let (ev, svc_ev) = loop {
        let posted = k.api.events_posted();
        let node = posted
            .iter()
            .find(|e| e.regarding()["kind"] == "Node")
            .cloned();
        let service = posted
            .iter()
            .find(|e| e.regarding()["kind"] == "Service")
            .cloned();
        if let (Some(n), Some(s)) = (node, service) {
            break (n, s);
        }
        assert!(k.lb().is_running(), "lbproxy exited\n{}", k.diag());
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no Node and Service Events within 30 s although LB_SERVICES_V2 holds 2 of 4 \
             frontends: {posted:?}\n{}",
            k.diag()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "Event posted {:?} after start: {} {}",
        start.elapsed(),
        ev.path,
        ev.body
    );
    // The Service's Event names the frontend, the node and "map full".
    let svc_note = svc_ev.note().unwrap_or_default();
    assert_eq!(svc_ev.body["type"], "Warning", "{}", svc_ev.body);
    assert_eq!(
        svc_ev.body["reason"], "FrontendNotProgrammed",
        "{}",
        svc_ev.body
    );
    assert!(
        svc_note.contains("map full") && svc_note.contains(NODE),
        "the Service's Event does not say the map is full on this node: {svc_note:?}"
    );
    assert_eq!(ev.method, "POST");
    assert_eq!(ev.regarding()["kind"], "Node", "{}", ev.body);
    assert_eq!(ev.regarding()["name"], NODE, "{}", ev.body);
    assert_eq!(ev.body["type"], "Warning", "{}", ev.body);
    let note = ev.note().unwrap_or_default();
    assert!(
        note.contains("LB_SERVICES_V2: update ") && note.contains("map full (errno 7, E2BIG)"),
        "the Event does not say which map refused the write and why: {note:?}"
    );
    let log = k.lb().log();
    assert!(
        log.lines().any(|l| l.contains("map write failed")
            && l.contains("map=\"LB_SERVICES_V2\"")
            && l.contains("errno=7")
            && l.contains("map full")),
        "no log line with the failed write's map and errno\n{log}"
    );
    let m = http_get(
        k.lab.node_ns(),
        lbproxy_tests::lab::METRICS_ADDR,
        "/metrics",
    )
    .unwrap();
    let sc = Scrape::parse(&m.body).unwrap();
    assert_eq!(
        sc.value("lbproxy_map_capacity", &[("map", "services")]),
        2.0
    );
    assert!(
        sc.value("lbproxy_sync_failures_total", &[]) >= 1.0,
        "{}",
        m.body
    );
    // One Event per failure streak, not one per retry.
    std::thread::sleep(Duration::from_secs(3));
    let n = k
        .api
        .events_posted()
        .iter()
        .filter(|e| e.method == "POST")
        .count();
    assert!(n <= 2, "{n} Events posted for one failure streak");
}

/// After a restart (SIGTERM, exit 0, programs and maps stay), changes made while lbproxy
/// was down are applied by the first sync: a service deleted meanwhile is not left over from
/// the adopted pinned state, and an established connection keeps working.
#[test]
fn restart_picks_up_changes() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1", "b2"]);
    let (b1, b2) = (k.pod("b1").clone(), k.pod("b2").clone());
    let client = k.pod("client").clone();
    let (svc, s1) = web_json("web", WEB_VIP, eps(&[&b1]));
    let (old, olds) = web_json("old", vip(11), eps(&[&b1]));
    k.api.apply_all([svc, s1, old, olds]);
    k.start_healthy();
    let mut conn = client.connect(WEB_VIP, WEB_TCP, T).unwrap();
    assert_eq!(conn.request().unwrap().backend, "b1");
    let (st, _) = k.lb().terminate(EXIT_WITHIN);
    assert!(st.success(), "lbproxy exit status {st}");

    k.api.apply(web_json("web", WEB_VIP, eps(&[&b1, &b2])).1);
    k.api.delete("Service", "default", "old");
    k.api.delete("EndpointSlice", "default", "old-1");
    k.start_healthy();
    assert_eq!(
        k.frontends(),
        web_fes("web", WEB_VIP, &[b1.ip, b2.ip]),
        "state at the moment /healthz turned 200 after the restart\n{}",
        k.diag()
    );
    let r = conn.request();
    assert!(
        matches!(&r, Ok(rep) if rep.backend == "b1"),
        "established connection across the restart: {r:?}"
    );
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "after restart", &client, WEB_VIP, 30);
    assert!(
        tcp.contains_key("b2") && udp.contains_key("b2"),
        "{tcp:?} {udp:?}"
    );
}

/// More objects than kube-rs's list page (500): the initial list is paginated with
/// `limit`/`continue`, and every service is programmed.
#[test]
fn initial_list_paginated() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let n = 600u32;
    let vip_of = |i: u32| Ipv4Addr::new(198, 19, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
    let be_of = |i: u32| Ipv4Addr::new(198, 18, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
    for i in 0..n {
        let name = format!("s{i}");
        k.api.apply(
            Service::cluster_ip(&name, vip_of(i))
                .port("http", 80, Protocol::Tcp, 8080)
                .to_json(),
        );
        k.api.apply(
            EndpointSlice::new(&format!("{name}-1"), &name)
                .port("http", 8080, Protocol::Tcp)
                .endpoint(Endpoint::ready(be_of(i)))
                .to_json(),
        );
    }
    k.start_with(&[]);
    let d = k.expect_healthy(Duration::from_secs(60));
    eprintln!("{n} services: healthy {d:?} after start");
    let f = k.frontends();
    assert_eq!(f.len(), n as usize, "frontends programmed at healthy");
    for i in [0, 1, 499, 500, 599] {
        let fe = &f[&format!("{}:80/TCP", vip_of(i))];
        assert_eq!(fe.service, format!("default/s{i}"));
        assert_eq!(fe.backends, vec![format!("{}:8080", be_of(i))]);
    }
    let reqs = k.api.requests();
    for plural in ["services", "endpointslices"] {
        assert!(
            lists_since(&reqs, plural)
                .iter()
                .any(|r| r.param("continue").is_some_and(|c| !c.is_empty())),
            "no paginated (continue) list of {plural}:\n{}",
            k.api.request_log()
        );
    }
}

/// kube-proxy's /healthz rule: a change that stays queued (here it cannot be written:
/// LB_SERVICES_V2 pinned beforehand with room for 2 frontends) for more than 2 x syncPeriod
/// turns /healthz 503; once the change can be synced again it is 200. The failure is
/// reported by a Node Event, and the programmed part keeps serving.
#[test]
fn healthz_503_while_changes_cannot_be_programmed() {
    let mut k = Kube::new(Shape::Routed, &[]);
    small_services_map(&k, 2);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    k.api.apply_all([svc, s1]);
    k.start_with(&["--sync-period", "1s"]);
    k.expect_healthy(HEALTHY_WITHIN);
    k.wait_watching(Duration::from_secs(5));
    let web_only = web_fes("web", WEB_VIP, &[ip(3)]);
    assert_eq!(k.frontends(), web_only);

    let (svc2, s2) = web_json("second", vip(11), ready_ips(&[ip(4)]));
    k.api.apply_all([svc2, s2]);
    let t = Instant::now();
    let mut last = Ok(200);
    while t.elapsed() < Duration::from_secs(6) {
        last = k.lb().healthz();
        if last == Ok(503) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        last,
        Ok(503),
        "/healthz with a change queued and unsyncable for {:?} (syncPeriod 1s)\n{}",
        t.elapsed(),
        k.diag()
    );
    eprintln!(
        "/healthz 503 {:?} after the unprogrammable change",
        t.elapsed()
    );
    // Liveness is not readiness: a change that cannot be written must not get lbproxy
    // restarted.
    let l = http_get(k.lab.node_ns(), lbproxy_tests::lab::HEALTHZ_ADDR, "/livez").map(|r| r.status);
    assert_eq!(
        l,
        Ok(200),
        "/livez while a change cannot be programmed\n{}",
        k.diag()
    );
    assert!(
        k.api
            .events_posted()
            .iter()
            .any(|e| e.regarding()["kind"] == "Node"),
        "no Node Event for the failure\n{}",
        k.diag()
    );
    let now = k.frontends();
    for (fe, want) in &web_only {
        assert_eq!(
            now.get(fe),
            Some(want),
            "web while the change is stuck: {now:#?}"
        );
    }

    k.api.delete("Service", "default", "second");
    let t = Instant::now();
    let h = loop {
        let h = k.lb().healthz();
        if h == Ok(200) || t.elapsed() > APPLY {
            break h;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        h,
        Ok(200),
        "/healthz once the queue can be synced again\n{}",
        k.diag()
    );
    eprintln!(
        "/healthz 200 again {:?} after the change was withdrawn",
        t.elapsed()
    );
    k.wait_fes("second withdrawn", APPLY, &web_only);
}

/// A `healthCheckNodePort` that cannot be bound (another process holds it) gets a Warning
/// Event on this Node with kube-proxy's reason, `FailedToStartServiceHealthcheck`, naming
/// the port, once; lbproxy keeps serving the service.
#[test]
fn health_check_bind_failure_posts_a_node_event() {
    const HC_PORT: u16 = 32011;
    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    let b1 = k.ip("b1");
    let (mut svc, slice) = web_json("web", WEB_VIP, ready_ips(&[b1]));
    svc["spec"]["type"] = "LoadBalancer".into();
    svc["spec"]["externalTrafficPolicy"] = "Local".into();
    svc["spec"]["healthCheckNodePort"] = HC_PORT.into();
    for (i, p) in svc["spec"]["ports"]
        .as_array_mut()
        .expect("ports")
        .iter_mut()
        .enumerate()
    {
        p["nodePort"] = (30_090 + i as u16).into();
    }
    let squatter = lbproxy_tests::lab::run_in_ns(k.lab.node_ns(), || {
        std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, HC_PORT))
    })
    .expect("bind the health-check port first");
    k.api.apply_all([svc, slice]);
    k.start_with(&["--sync-period", "1s"]);
    let start = Instant::now();
    let failed = |posted: &[lbproxy_tests::apiserver::PostedEvent]| {
        posted
            .iter()
            .filter(|e| {
                e.regarding()["kind"] == "Node"
                    && e.body["reason"] == "FailedToStartServiceHealthcheck"
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    let ev = loop {
        if let Some(e) = failed(&k.api.events_posted()).into_iter().next() {
            break e;
        }
        assert!(k.lb().is_running(), "lbproxy exited\n{}", k.diag());
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no FailedToStartServiceHealthcheck Event within 20 s: {:?}\n{}",
            k.api.events_posted(),
            k.diag()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(ev.regarding()["name"], NODE, "{}", ev.body);
    assert_eq!(ev.body["type"], "Warning", "{}", ev.body);
    let note = ev.note().unwrap_or_default();
    assert!(
        note.contains(&HC_PORT.to_string()),
        "the Event names the port: {note:?}"
    );
    // About 3 more syncs retry the port: still one Event, and the service is served.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        failed(&k.api.events_posted()).len(),
        1,
        "one Event per failure streak, not per retry"
    );
    let r = k
        .pod("client")
        .tcp_request(WEB_VIP, WEB_TCP, Duration::from_secs(2));
    assert!(
        matches!(&r, Ok((reply, _)) if reply.backend == "b1"),
        "the service is still served: {r:?}\n{}",
        k.diag()
    );
    drop(squatter);
}

/// Pins an `LB_SERVICES_V2` with room for `n` entries in the lab's bpffs dir before lbproxy
/// creates its own (lbproxy reuses a pinned map whose type, key and value sizes match).
fn small_services_map(k: &Kube, n: u32) {
    let dir = k.lab.bpffs_dir().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(dir.join("LB_SERVICES_V2"))
        .args(["type", "hash", "key", "8", "value", "16", "entries"])
        .arg(n.to_string())
        .args(["name", "LB_SERVICES_V2"])
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool map create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Watches that the API server ends on its own (cleanly, as it does after its
/// min-request-timeout) are re-opened from the last resourceVersion, without a re-list, and
/// no event is lost: changes made every 250 ms across many watch restarts are each applied
/// within 2 s.
#[test]
fn watch_timeouts_resume_without_relist() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, ready_ips(&[ip(3)]));
    k.api.apply_all([svc, s1.clone()]);
    k.api
        .set_watch_timeout_cap(Some(Duration::from_millis(800)));
    k.start_healthy();
    k.wait_watching(Duration::from_secs(5));
    let mark = k.api.request_count();
    for i in 0..16u8 {
        let mut s = s1.clone();
        s["endpoints"] = eps_json(&[ip(3), ip(20 + i)]);
        k.api.apply(s);
        k.wait_until(&format!("change {i}"), APPLY, |f| {
            *f == web_fes("web", WEB_VIP, &[ip(3), ip(20 + i)])
        });
        std::thread::sleep(Duration::from_millis(250));
    }
    let since = k.api.requests_since(mark);
    let watches = watches_since(&since, "endpointslices").len();
    assert!(
        watches >= 4,
        "only {watches} endpointslices watches in ~5 s with 0.8 s watches"
    );
    let relists: Vec<String> = since
        .iter()
        .filter(|r| r.is_list())
        .map(Request::line)
        .collect();
    assert!(
        relists.is_empty(),
        "re-lists after watches that ended cleanly (a resume from the last \
         resourceVersion needs none): {relists:#?}"
    );
    eprintln!("{watches} endpointslices watches, no re-list");
}
