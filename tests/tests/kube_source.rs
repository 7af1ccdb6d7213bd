//! lbproxy's Kubernetes API source against a real list+watch API server
//! (`lbproxy_tests::apiserver`) inside the lab's node namespace: initial list, add / modify /
//! delete events, broken watches, 410 Gone, a slow or absent API server, kube-proxy's skips,
//! internalTrafficPolicy, the Node Event on programming failure, and real traffic through
//! services that exist only in the API server.
//!
//! Timing contract (see `kube_common`): a watch event is applied within 2 s ([`APPLY`]);
//! recoveries that go through kube-rs's watcher backoff are bounded by [`RECOVER`] and the
//! time they took is printed.
//!
//! This suite: the list and watch protocol (pagination, events, broken watches, 410 Gone,
//! timeouts, a slow or absent API server). kube_source_serving.rs: what the source's state
//! does (skips, traffic, internalTrafficPolicy, health, Node Events, restarts).

mod common;
mod kube_common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::apiserver::{GoneMode, Request, TOKEN};
use lbproxy_tests::lab::{Endpoint, EndpointSlice, Protocol, Service, Shape, vip};
use serde_json::json;

/// Objects that exist before lbproxy starts are programmed by the first sync: two slices of
/// one service are merged and de-duplicated, a named targetPort resolves per slice, other
/// namespaces count. lbproxy lists all three resources with the right selectors and token,
/// each with one watch-list (`sendInitialEvents=true`) that then goes on as its watch.
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
    // Start-up lists are streamed (watch-lists): each resource's first request.
    let first = |plural: &str| -> Request {
        reqs.iter()
            .find(|r| (r.is_list() || r.is_watch()) && r.resource() == Some(plural))
            .cloned()
            .unwrap_or_else(|| panic!("no list or watch of {plural}\n{}", k.diag()))
    };
    for plural in ["services", "endpointslices", "nodes"] {
        let r = first(plural);
        assert!(
            r.is_watch()
                && r.param("sendInitialEvents") == Some("true")
                && r.param("resourceVersionMatch") == Some("NotOlderThan")
                && r.param("allowWatchBookmarks") == Some("true")
                && r.param("resourceVersion") == Some("0"),
            "{plural}: the start-up list is a watch-list: {}",
            r.line()
        );
    }
    assert_eq!(
        first("services").path,
        "/api/v1/services",
        "cluster-wide list"
    );
    let slices = first("endpointslices");
    assert_eq!(slices.path, "/apis/discovery.k8s.io/v1/endpointslices");
    assert_eq!(
        slices.param("labelSelector"),
        Some("kubernetes.io/service-name"),
        "slices are selected by the existence of kubernetes.io/service-name"
    );
    assert_eq!(
        first("nodes").param("fieldSelector"),
        Some("metadata.name=lab-node")
    );
    // The watch-list goes on as the watch: no list, no second watch.
    for plural in ["services", "endpointslices", "nodes"] {
        let (l, w) = (lists_since(&reqs, plural), watches_since(&reqs, plural));
        assert_eq!(
            (l.len(), w.len()),
            (0, 1),
            "{plural}: one watch-list, then nothing: {:?}",
            l.iter().chain(&w).map(Request::line).collect::<Vec<_>>()
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

/// Start-up makes a handful of requests whatever the size, as kube-proxy's informers: at
/// 5,000 Services and 5,000 EndpointSlices (ten of kube-rs's 500-object pages each) lbproxy
/// streams each resource once (a watch-list, `sendInitialEvents=true`), and every service is
/// programmed at `/healthz` 200. Before issue 31 it listed consistently in pages: 10 list
/// requests per resource (this test then fails). A re-list after `410 Gone` reads
/// consistently (no `resourceVersion`), in pages, and converges.
#[test]
fn start_up_lists_each_resource_once() {
    start_up_requests(false);
}

/// The same against an API server that refuses watch-lists (the `WatchList` gate off, as
/// Kubernetes 1.33 by default): each refused once, then listed once from the watch cache
/// (`resourceVersion=0`, one response).
#[test]
fn start_up_lists_each_resource_once_without_watch_lists() {
    start_up_requests(true);
}

fn start_up_requests(refuse_watch_lists: bool) {
    let mut k = Kube::new(Shape::Routed, &[]);
    if refuse_watch_lists {
        k.api.refuse_watch_lists();
    }
    let n = 5000u32;
    let vip_of = |i: u32| Ipv4Addr::new(198, 19, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
    let be_of = |i: u32| Ipv4Addr::new(198, 18, 1 + (i / 250) as u8, 1 + (i % 250) as u8);
    let slice_of = |i: u32, be: Ipv4Addr| {
        EndpointSlice::new(&format!("s{i}-1"), &format!("s{i}"))
            .port("http", 8080, Protocol::Tcp)
            .endpoint(Endpoint::ready(be))
            .to_json()
    };
    for i in 0..n {
        k.api.apply(
            Service::cluster_ip(&format!("s{i}"), vip_of(i))
                .port("http", 80, Protocol::Tcp, 8080)
                .to_json(),
        );
        k.api.apply(slice_of(i, be_of(i)));
    }
    k.start_with(&[]);
    let d = k.expect_healthy(Duration::from_secs(60));
    eprintln!("{n} services: healthy {d:?} after start");
    let f = k.frontends();
    assert_eq!(f.len(), n as usize, "frontends programmed at healthy");
    for i in [0, 1, 499, 500, 4999] {
        let fe = &f[&format!("{}:80/TCP", vip_of(i))];
        assert_eq!(fe.service, format!("default/s{i}"));
        assert_eq!(fe.backends, vec![format!("{}:8080", be_of(i))]);
    }
    k.wait_watching(Duration::from_secs(10));
    let reqs = k.api.requests();
    let mut counts = Vec::new();
    for plural in ["services", "endpointslices", "servicecidrs", "nodes"] {
        let lists = lists_since(&reqs, plural);
        let watch_lists: Vec<Request> = watches_since(&reqs, plural)
            .into_iter()
            .filter(|r| r.param("sendInitialEvents") == Some("true"))
            .collect();
        let lines = || {
            lists
                .iter()
                .chain(&watch_lists)
                .map(Request::line)
                .collect::<Vec<_>>()
                .join("\n")
        };
        counts.push(format!(
            "{plural}: {} lists, {} watch-lists",
            lists.len(),
            watch_lists.len()
        ));
        let served = |r: &&Request| r.status == Some(200);
        assert_eq!(
            lists.iter().filter(served).count() + watch_lists.iter().filter(served).count(),
            1,
            "{plural}: start-up should list once, whatever the size:\n{}",
            lines()
        );
        let (want_lists, want_watch_lists) = if refuse_watch_lists { (1, 1) } else { (0, 1) };
        assert_eq!(
            (lists.len(), watch_lists.len()),
            (want_lists, want_watch_lists),
            "{plural}: lists and watch-lists at start-up:\n{}",
            lines()
        );
        for r in &lists {
            assert_eq!(
                (r.param("resourceVersion"), r.param("limit")),
                (Some("0"), None),
                "{plural}: a start-up list from the watch cache: {}",
                r.line()
            );
        }
    }
    eprintln!("start-up requests: {counts:?}");

    // 410 Gone: the re-list is consistent (no resourceVersion) and paginated.
    k.api.go_down();
    let mark = k.api.request_count();
    k.api.apply(slice_of(7, Ipv4Addr::new(198, 18, 99, 7)));
    k.api.expire_history();
    k.api.come_back();
    let want = format!("{}:8080", Ipv4Addr::new(198, 18, 99, 7));
    let key = format!("{}:80/TCP", vip_of(7));
    k.wait_until("the change only a re-list shows", RECOVER, |f| {
        f.get(&key)
            .is_some_and(|fe| fe.backends == vec![want.clone()])
            && f.len() == n as usize
    });
    let relists = lists_since(&k.api.requests_since(mark), "endpointslices");
    assert!(
        relists
            .first()
            .is_some_and(|r| r.param("resourceVersion").is_none()),
        "the re-list after 410 reads consistently: {:?}",
        relists.iter().map(Request::line).collect::<Vec<_>>()
    );
    assert!(
        relists
            .iter()
            .any(|r| r.param("continue").is_some_and(|c| !c.is_empty())),
        "the consistent re-list is paginated: {:?}",
        relists.iter().map(Request::line).collect::<Vec<_>>()
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
