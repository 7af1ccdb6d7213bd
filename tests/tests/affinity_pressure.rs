//! Session affinity across several client pods (over both IP families), and a deliberately
//! tiny flow table.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::inspect::rows::AffinityRow;
use lbproxy_tests::lab::{Family, Lab, Pod, Proto, Shape, ns};

both_shapes!(tiny_flow_table);
both_shapes_and_families!(affinity_across_clients);

/// The web service YAML with `sessionAffinity: ClientIP` and `timeoutSeconds`.
fn with_affinity(lab_yaml: &str, timeout_s: u32) -> String {
    lab_yaml.replace(
        "  sessionAffinity: None\n",
        &format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {timeout_s}\n"
        ),
    )
}

/// Backends that answered `n` new TCP connections (new source port each) from `client`.
fn tcp_backends(client: &Pod, n: usize) -> BTreeMap<String, usize> {
    backends(client, Proto::Tcp, Family::V4, n)
}

/// Backends that answered `n` new flows of `proto` (TCP connections, or UDP datagrams from
/// a new source port each) from `client` to `web` over `family`. Each answer must come from
/// the VIP:port, and its backend must have seen the client's own address.
fn backends(client: &Pod, proto: Proto, family: Family, n: usize) -> BTreeMap<String, usize> {
    let (vip, me) = (web_vip(family), pod_addr(client, family));
    let port = match proto {
        Proto::Tcp => WEB_TCP,
        Proto::Udp => WEB_UDP,
    };
    let mut out = BTreeMap::new();
    for i in 0..n {
        let r = match proto {
            Proto::Tcp => client.tcp_request(vip, port, T),
            Proto::Udp => client.udp_request(vip, port, T, None),
        };
        let (r, from) = r.unwrap_or_else(|e| {
            panic!(
                "[{family}] {}: {proto} flow {i} to the VIP failed: {e}",
                client.name
            )
        });
        assert_eq!(
            from,
            SocketAddr::new(vip, port),
            "[{family}] {}: {proto} flow {i}: the answer must come from the VIP:port: {r}",
            client.name
        );
        let seen: SocketAddr = r.client_seen.parse().unwrap();
        assert_eq!(
            seen.ip(),
            me,
            "[{family}] {}: {proto} flow {i}: the backend must see the client's own address: \
             {r}",
            client.name
        );
        *out.entry(r.backend).or_insert(0) += 1;
    }
    out
}

/// `sessionAffinity: ClientIP` with a 60 s timeout, as lines of a Service's spec.
const AFFINITY_60: &str =
    "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";

/// Three clients, ClientIP affinity over three backends, over IPv4 and over IPv6 (the
/// dual-stack `web`'s IPv6 clusterIP): each client's new TCP connections and UDP flows stick
/// to one backend, one affinity entry per client and frontend; when a client's backend
/// leaves, it moves at once and sticks to a new one, and the other clients keep theirs.
fn affinity_across_clients(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    let all: Vec<&Pod> = s.backends.iter().collect();
    serve_family(&s, family, &all);
    let vip = web_vip(family);
    let clients: Vec<Pod> = (1..=3).map(|i| s.lab.add_pod(&format!("c{i}"))).collect();
    // Interfaces of pods added after start are attached within a couple of seconds.
    std::thread::sleep(Duration::from_secs(3));

    // Control: without affinity one client's new connections spread over backends, so the
    // assertions below can fail.
    let spread = backends(&clients[0], Proto::Tcp, family, 30);
    assert!(
        spread.len() > 1,
        "[{shape}, {family}] without affinity 30 connections from c1 all went to {spread:?}"
    );

    let manifest = |pods: &[&Pod]| match family {
        Family::V4 => with_affinity(&web_objects("web", WEB_VIP, ready(pods)).to_yaml(), 60),
        Family::V6 => dual_stack_manifest_with(pods, pods, AFFINITY_60),
    };
    s.lab.write_manifest_text(&manifest(&all));
    std::thread::sleep(APPLY_WITHIN);
    let svc = s.lab.inspect_services();
    let tcp = svc
        .iter()
        .find(|r| r.frontend == format!("{}/TCP", SocketAddr::new(vip, WEB_TCP)))
        .unwrap_or_else(|| panic!("[{shape}, {family}] no TCP frontend in {svc:?}"));
    assert_eq!(tcp.affinity_timeout_s, 60, "[{shape}, {family}] {tcp:?}");

    let mut chosen = BTreeMap::new();
    for c in &clients {
        let got = backends(c, Proto::Tcp, family, 20);
        assert_eq!(
            got.len(),
            1,
            "[{shape}, {family}] with ClientIP affinity {}'s 20 connections went to {got:?}",
            c.name
        );
        let udp = backends(c, Proto::Udp, family, 20);
        assert_eq!(
            udp.len(),
            1,
            "[{shape}, {family}] with ClientIP affinity {}'s 20 UDP flows went to {udp:?}",
            c.name
        );
        chosen.insert(c.name.clone(), got.into_keys().next().unwrap());
        let rows = s.lab.inspect_affinity();
        let me = pod_addr(c, family).to_string();
        let mine: Vec<&AffinityRow> = rows.iter().filter(|r| r.client == me).collect();
        assert_eq!(
            mine.len(),
            2,
            "[{shape}, {family}] one affinity entry per frontend for {} ({me}): {rows:#?}",
            c.name
        );
    }

    // The backend of c1 leaves: c1's affinity is dropped at once and it sticks to a new one.
    let gone = chosen["c1"].clone();
    let keep: Vec<&Pod> = s.backends.iter().filter(|p| p.name != gone).collect();
    let written = Instant::now();
    s.lab.write_manifest_text(&manifest(&keep));
    let deadline = written + APPLY_WITHIN;
    let moved_after = loop {
        // A connection made to `gone` just before it left is reset on its request (a flow
        // whose backend left gets a RST): that is still "on the removed backend".
        let moved = match clients[0].tcp_request(vip, WEB_TCP, T) {
            Ok((r, _)) => r.backend != gone,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => false,
            Err(e) => panic!("[{shape}, {family}] c1: connection to the VIP failed: {e}"),
        };
        if moved {
            break written.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "[{shape}, {family}] c1 still sent to removed {gone} {:?} after the manifest write",
            written.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let after = backends(&clients[0], Proto::Tcp, family, 20);
    assert!(
        after.len() == 1 && !after.contains_key(&gone),
        "[{shape}, {family}] after {gone} left (moved in {moved_after:?}), c1 went to {after:?}"
    );
    // The other clients, whose backends stayed, keep theirs.
    for c in &clients[1..] {
        if chosen[&c.name] != gone {
            let got = backends(c, Proto::Tcp, family, 10);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                vec![&chosen[&c.name]],
                "[{shape}, {family}] {} lost its affinity to {} though it stayed",
                c.name,
                chosen[&c.name]
            );
        }
    }
}

fn metrics(lab: &Lab) -> String {
    let addr: SocketAddr = "127.0.0.1:10249".parse().unwrap();
    ns::http_get_full(lab.node_ns(), addr, "/metrics", Duration::from_secs(2))
        .map(|r| r.body)
        .unwrap_or_default()
}

fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A flow table of 1024 entries (512 flows) flooded with 1500 UDP flows: lbproxy keeps
/// running and serving; an active TCP connection survives (LRU keeps what is used); the
/// collector works under pressure; an idle TCP connection evicted by the flood is counted,
/// and with consistent hashing its next segment still reaches its backend.
fn tiny_flow_table(shape: Shape) {
    let s = Setup::with_args(shape, &["b1", "b2"], &["--flow-map-size", "1024"]);
    let (lab, client, lb) = (&s.lab, &s.client, &s.lb);

    let mut active = client
        .connect(WEB_VIP, WEB_TCP, T)
        .expect("active connection");
    let mut idle = client
        .connect(WEB_VIP, WEB_TCP, T)
        .expect("idle connection");
    let idle_backend = idle
        .request()
        .expect("idle connection's first request")
        .backend;
    active.request().expect("active connection's first request");
    let before = lab.drop_count("tcp_midstream_without_flow");

    // 1500 UDP flows, one source port each, keeping the active connection busy meanwhile.
    let mut udp_ok = 0;
    for i in 0..1500u16 {
        if client
            .udp_request(
                WEB_VIP,
                WEB_UDP,
                Duration::from_millis(500),
                Some(20_000 + i),
            )
            .is_ok()
        {
            udp_ok += 1;
        }
        if i % 100 == 0 {
            active.request().unwrap_or_else(|e| {
                panic!("[{shape}] active TCP connection failed during the flood at {i}: {e}")
            });
        }
    }
    assert!(
        udp_ok >= 1450,
        "[{shape}] only {udp_ok} of 1500 UDP requests answered with a full table"
    );
    let n = lab.inspect_flows().len();
    assert!(
        n <= 512,
        "[{shape}] {n} forward flows in a 1024-entry table"
    );

    // The kernel's LRU picks what it evicts; keep flooding (bounded) until the idle
    // connection's flow is gone, so the eviction below is certain.
    let idle_client = idle.local.to_string();
    let listed = |lab: &Lab| lab.inspect_flows().iter().any(|f| f.client == idle_client);
    let mut extra = 0u16;
    while listed(lab) {
        assert!(
            extra < 6000,
            "[{shape}] the idle flow {idle_client} survived 7500 new flows in a 1024-entry table"
        );
        for _ in 0..500 {
            let _ = client.udp_request(
                WEB_VIP,
                WEB_UDP,
                Duration::from_millis(500),
                Some(30_000 + extra),
            );
            extra += 1;
        }
        active
            .request()
            .expect("active connection during the extra flood");
    }

    // The idle connection's entries were evicted; its next segment is counted, and goes to
    // the same backend by consistent hashing, so the connection still works.
    let r = idle
        .request()
        .unwrap_or_else(|e| panic!("[{shape}] the evicted idle connection failed: {e}"));
    assert_eq!(
        r.backend, idle_backend,
        "[{shape}] evicted flow re-hashed elsewhere"
    );
    let after = lab.drop_count("tcp_midstream_without_flow");
    assert!(
        after > before,
        "[{shape}] eviction of a live flow not counted ({before} -> {after})"
    );
    active.request().expect("active connection after the flood");

    // Fill and capacity are exported; the collector runs under pressure within ~10 s.
    let deadline = Instant::now() + Duration::from_secs(25);
    let mut seen_pressure = false;
    while Instant::now() < deadline && !seen_pressure {
        seen_pressure = lb.stderr().contains("under_pressure=true");
        std::thread::sleep(Duration::from_millis(500));
    }
    let text = metrics(lab);
    let cap = metric(&text, "lbproxy_map_capacity{map=\"flows\"}");
    let entries = metric(&text, "lbproxy_map_entries{map=\"flows\"}");
    assert_eq!(cap, Some(1024.0), "[{shape}] capacity metric: {cap:?}");
    assert!(
        entries.is_some_and(|e| e <= 1024.0),
        "[{shape}] entries metric: {entries:?}"
    );
    assert!(
        seen_pressure,
        "[{shape}] the flow collector never ran under pressure; log:\n{}",
        lb.stderr()
    );
    // Healthy and still serving new connections.
    assert_eq!(
        lb.healthz(),
        Ok(200),
        "[{shape}] not healthy after the flood"
    );
    let fresh: BTreeSet<String> = (0..10)
        .filter_map(|_| {
            client
                .tcp_request(WEB_VIP, WEB_TCP, T)
                .ok()
                .map(|(r, _)| r.backend)
        })
        .collect();
    assert!(
        !fresh.is_empty(),
        "[{shape}] no new connection works after the flood"
    );
}

both_shapes!(idle_flows_expire);

/// Idle expiry by the userspace collector: with `--conntrack-udp-timeout 1s`, an idle UDP
/// flow is gone after the next collection (every 10 s), while an established TCP connection
/// idle for the same time stays (its timeout is 24 h) and keeps working.
fn idle_flows_expire(shape: Shape) {
    let s = Setup::with_args(shape, &["b1", "b2"], &["--conntrack-udp-timeout", "1s"]);
    let (lab, client, lb) = (&s.lab, &s.client, &s.lb);
    let mut tcp = client.connect(WEB_VIP, WEB_TCP, T).expect("tcp connection");
    tcp.request().expect("first request");
    client
        .udp_request(WEB_VIP, WEB_UDP, T, Some(31_000))
        .expect("udp request");
    let protos = |lab: &Lab| -> Vec<String> {
        lab.inspect_flows()
            .into_iter()
            .map(|f| f.protocol)
            .collect()
    };
    let before = protos(lab);
    assert!(
        before.contains(&"UDP".to_string()) && before.contains(&"TCP".to_string()),
        "[{shape}] flows before: {before:?}"
    );
    let started = Instant::now();
    let mut after = before.clone();
    while started.elapsed() < Duration::from_secs(25) && after.contains(&"UDP".to_string()) {
        std::thread::sleep(Duration::from_millis(500));
        after = protos(lab);
    }
    assert!(
        !after.contains(&"UDP".to_string()),
        "[{shape}] idle UDP flow still there {:?} after a 1 s timeout; log:\n{}",
        started.elapsed(),
        lb.stderr()
    );
    assert!(
        after.contains(&"TCP".to_string()),
        "[{shape}] the idle established TCP flow was collected too: {after:?}"
    );
    tcp.request().unwrap_or_else(|e| {
        panic!("[{shape}] the TCP connection failed after the collection: {e}")
    });
    assert!(
        lb.stderr().contains("flow gc"),
        "[{shape}] no collection logged"
    );
}

both_shapes!(affinity_expires);

/// `timeoutSeconds` bounds affinity: with a 1 s timeout and a pause of 1.3 s between single
/// connections, each connection is a fresh selection, so 8 of them do not all land on one of
/// three backends (probability 3^-7 if they were independent and uniform), while 8
/// back-to-back connections do (the control).
fn affinity_expires(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    let base = web_objects(
        "web",
        WEB_VIP,
        ready(&s.backends.iter().collect::<Vec<_>>()),
    );
    s.lab
        .write_manifest_text(&with_affinity(&base.to_yaml(), 1));
    std::thread::sleep(APPLY_WITHIN);
    let back_to_back = tcp_backends(&s.client, 8);
    assert_eq!(
        back_to_back.len(),
        1,
        "[{shape}] fresh affinity did not hold: {back_to_back:?}"
    );
    let mut spaced = BTreeMap::new();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(1300));
        for (b, n) in tcp_backends(&s.client, 1) {
            *spaced.entry(b).or_insert(0) += n;
        }
    }
    assert!(
        spaced.len() > 1,
        "[{shape}] 8 connections 1.3 s apart with a 1 s affinity timeout all went to {spaced:?}"
    );
}
