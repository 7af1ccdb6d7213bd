//! lbproxy's Kubernetes API source against a real list+watch API server (see
//! kube_source.rs for the protocol itself): what the source's state does. kube-proxy's
//! skips, real traffic through services that exist only in the API server (both shapes),
//! internalTrafficPolicy, zone hints following the Node's label, /healthz before the first sync and while changes cannot be
//! programmed, the Node Events of programming and health-check failures, and a restart
//! picking up changes.
//!
//! Timing contract (see `kube_common`): a watch event is applied within 2 s ([`APPLY`]).

mod common;
mod kube_common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::lab::{Endpoint, Proto, Shape, vip};
use serde_json::json;

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

/// Topology from the API: the watched Node's `topology.kubernetes.io/zone` label picks the
/// zone hints' endpoints, and a change of the label (zone-a, then zone-b, then none) is
/// applied live, within the watch deadline.
#[test]
fn zone_hints_follow_the_node_label() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1", "b2"]);
    let (b1, b2) = (k.pod("b1").clone(), k.pod("b2").clone());
    let client = k.pod("client").clone();
    let node = |zone: Option<&str>| {
        let mut n = lbproxy_tests::apiserver::ApiServer::node(NODE);
        if let Some(z) = zone {
            n["metadata"]["labels"]["topology.kubernetes.io/zone"] = json!(z);
        }
        n
    };
    let ep = |p: &lbproxy_tests::lab::Pod, zone: &str| {
        Endpoint::ready(p.ip).pod(&p.name).hints(&[zone], &[])
    };
    let (svc, slice) = web_json("web", WEB_VIP, vec![ep(&b1, "zone-a"), ep(&b2, "zone-b")]);
    k.api.apply_all([node(Some("zone-a")), svc, slice]);
    k.start_healthy();
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "zone-a", &client, WEB_VIP, 30);
    assert_eq!(tcp.keys().collect::<Vec<_>>(), ["b1"], "TCP {tcp:?}");
    assert_eq!(udp.keys().collect::<Vec<_>>(), ["b1"], "UDP {udp:?}");
    k.wait_watching(Duration::from_secs(5));

    k.api.apply(node(Some("zone-b")));
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        t.keys().eq(["b2"].iter()) && u.keys().eq(["b2"].iter())
    });
    eprintln!("zone-b applied in {d:?}");
    let (tcp, udp) = web_traffic_ok_in(Some(&k.lab), "zone-b", &client, WEB_VIP, 30);
    assert_eq!(tcp.keys().collect::<Vec<_>>(), ["b2"], "TCP {tcp:?}");
    assert_eq!(udp.keys().collect::<Vec<_>>(), ["b2"], "UDP {udp:?}");

    k.api.apply(node(None));
    let d = wait_traffic(&k, &client, WEB_VIP, |t, u| {
        ["b1", "b2"]
            .iter()
            .all(|b| t.contains_key(*b) && u.contains_key(*b))
    });
    eprintln!("no zone label applied in {d:?}");
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
