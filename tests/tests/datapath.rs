//! lbproxy datapath scenarios: real `lbproxy run`, real TCP and UDP, both pod-network shapes.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::inspect::rows::FlowRow;
use lbproxy_tests::lab::{
    Conditions, Endpoint, EndpointSlice, Family, Inspect as _, Lab, Manifest, Pod, Proto, Protocol,
    Service, Shape, run_in_ns, udp_request_here, vip,
};

both_shapes!(spread, live_update, not_ready, named_port);
both_shapes_and_families!(invalid_drop);

/// 1. Three ready backends: new TCP connections and new UDP flows spread over all of them,
///    and replies come from the VIP:port, never from a pod IP.
fn spread(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    for proto in [Proto::Tcp, Proto::Udp] {
        let port = if proto == Proto::Tcp {
            WEB_TCP
        } else {
            WEB_UDP
        };
        let t = s.client.tally(proto, WEB_VIP, port, 60, T);
        assert!(t.all_ok(), "[{shape}] spread: {t}");
        for b in ["b1", "b2", "b3"] {
            // With even spreading each gets ~20 of 60; fewer than 5 means starved.
            assert!(
                t.count(b) >= 5,
                "[{shape}] spread: backend {b} starved: {t}"
            );
        }
        eprintln!("[{shape}] spread {t}");
    }
    // `inspect --json` agrees: both frontends with all three backends, and the flows.
    let svcs = s.lab.inspect_services();
    for (frontend, port) in [
        (format!("{WEB_VIP}:{WEB_TCP}/TCP"), BACKEND_TCP),
        (format!("{WEB_VIP}:{WEB_UDP}/UDP"), BACKEND_UDP),
    ] {
        let svc = svcs
            .iter()
            .find(|x| x.frontend == frontend)
            .unwrap_or_else(|| panic!("[{shape}] inspect services: no {frontend}: {svcs:#?}"));
        let got = row_backends(svc);
        let mut want: Vec<String> = s
            .backends
            .iter()
            .map(|p| format!("{}:{port}", p.ip))
            .collect();
        want.sort();
        assert_eq!(got, want, "[{shape}] inspect services {frontend}: {svc:#?}");
        assert_eq!(svc.service, "default/web", "[{shape}] {svc:#?}");
        assert_eq!(svc.vip, WEB_VIP.to_string(), "[{shape}] {svc:#?}");
    }
    // The JSON's keys themselves (the contract scripts rely on), then its rows typed.
    let json = s.lab.inspect_json("flows");
    let raw = json
        .as_array()
        .unwrap_or_else(|| panic!("[{shape}] inspect flows: not an array: {json}"));
    for f in raw {
        for k in [
            "client",
            "frontend",
            "backend",
            "protocol",
            "service",
            "age_seconds",
            "idle_seconds",
        ] {
            assert!(
                f.get(k).is_some(),
                "[{shape}] inspect flows: entry without {k}: {f}"
            );
        }
    }
    let udp_frontend = format!("{WEB_VIP}:{WEB_UDP}/UDP");
    let client_prefix = format!("{}:", s.client.ip);
    let flows: Vec<FlowRow> = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("[{shape}] inspect flows: not flow rows ({e}): {json:#}"));
    let n = flows
        .iter()
        .filter(|f| f.frontend == udp_frontend && f.client.starts_with(&client_prefix))
        .count();
    assert!(
        n > 0,
        "[{shape}] inspect flows: no UDP flow from {} to {udp_frontend}: {flows:#?}",
        s.client.ip
    );

    // Source IP of the client is preserved for pod -> ClusterIP traffic (informational).
    let (r, _) = s.client.tcp_request(WEB_VIP, WEB_TCP, T).unwrap();
    eprintln!(
        "[{shape}] backend saw client as {} (client pod ip {})",
        r.client_seen, s.client.ip
    );
}

/// 2. Removing a backend from the slice stops new connections to it within ~1 s; adding one
///    makes it answer within ~1 s; lbproxy is not restarted.
fn live_update(shape: Shape) {
    let mut s = Setup::with_members(shape, &["b1", "b2", "b3", "b4"], &["b1", "b2", "b3"]);
    let pid = s.lb.pid();
    let (t, u) = web_traffic_ok(&format!("[{shape}] before update"), &s.client, WEB_VIP, 30);
    assert!(
        !t.contains_key("b4") && !u.contains_key("b4"),
        "[{shape}] b4 answered before being added: {t:?} {u:?}"
    );
    assert!(
        t.contains_key("b3") && u.contains_key("b3"),
        "[{shape}] b3 never answered before removal: {t:?} {u:?}"
    );

    let pods =
        |names: &[&str]| -> Vec<Pod> { names.iter().map(|n| s.backend(n).clone()).collect() };

    // Remove b3.
    let keep = pods(&["b1", "b2"]);
    s.lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        ready(&keep.iter().collect::<Vec<_>>()),
    ));
    let obs = probe_for(
        &s.client,
        WEB_VIP,
        Duration::from_millis(2000),
        Duration::from_millis(500),
    );
    let late_b3: Vec<&Obs> = obs
        .iter()
        .filter(|o| matches!(&o.result, Ok((b, _)) if b == "b3") && o.at > APPLY_WITHIN)
        .collect();
    // The one TCP connection that may be open to b3 at the instant it leaves the maps is
    // reset (README: a flow whose backend left gets a RST). The probe makes one request at
    // a time, so at most one, and it started before the change was applied.
    let straddling = |o: &&Obs| {
        o.proto == Proto::Tcp
            && o.at <= APPLY_WITHIN
            && matches!(&o.result, Err(e) if e.contains("reset"))
    };
    let resets = obs.iter().filter(straddling).count();
    let errors = obs
        .iter()
        .filter(|o| o.result.is_err() && !straddling(o))
        .count()
        + resets.saturating_sub(1);
    let wrong_src = obs
        .iter()
        .filter(|o| matches!(&o.result, Ok((_, src)) if src.ip() != WEB_VIP))
        .count();
    let last_b3 = obs
        .iter()
        .filter(|o| matches!(&o.result, Ok((b, _)) if b == "b3"))
        .map(|o| o.at)
        .max();
    eprintln!(
        "[{shape}] after removing b3: last b3 reply at {last_b3:?}\n  {}",
        summarize(&obs)
    );
    assert!(
        late_b3.is_empty() && errors == 0 && wrong_src == 0,
        "[{shape}] after removing b3 from the slice: {} replies from b3 later than {APPLY_WITHIN:?} \
         (last at {last_b3:?}), {errors} failed requests, {wrong_src} replies not from the VIP:\n  {}",
        late_b3.len(),
        summarize(&obs)
    );
    let (t, u) = web_traffic_ok(
        &format!("[{shape}] after removing b3"),
        &s.client,
        WEB_VIP,
        40,
    );
    assert!(
        !t.contains_key("b3") && !u.contains_key("b3"),
        "[{shape}] b3 still gets new connections: TCP {t:?} UDP {u:?}"
    );

    // Add b4.
    let add = pods(&["b1", "b2", "b4"]);
    s.lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        ready(&add.iter().collect::<Vec<_>>()),
    ));
    let obs = probe_for(
        &s.client,
        WEB_VIP,
        Duration::from_millis(2000),
        Duration::from_millis(500),
    );
    let first_b4 = |p: Proto| {
        obs.iter()
            .filter(|o| o.proto == p && matches!(&o.result, Ok((b, _)) if b == "b4"))
            .map(|o| o.at)
            .min()
    };
    let (ft, fu) = (first_b4(Proto::Tcp), first_b4(Proto::Udp));
    let errors = obs.iter().filter(|o| o.result.is_err()).count();
    let b3 = obs
        .iter()
        .filter(|o| matches!(&o.result, Ok((b, _)) if b == "b3"))
        .count();
    eprintln!(
        "[{shape}] after adding b4: first b4 reply TCP {ft:?} UDP {fu:?}\n  {}",
        summarize(&obs)
    );
    assert!(
        ft.is_some_and(|t| t <= APPLY_WITHIN)
            && fu.is_some_and(|t| t <= APPLY_WITHIN)
            && errors == 0
            && b3 == 0,
        "[{shape}] after adding b4: first b4 reply TCP {ft:?} UDP {fu:?} (want <= {APPLY_WITHIN:?}), \
         {errors} failed requests, {b3} replies from removed b3:\n  {}",
        summarize(&obs)
    );
    assert!(
        s.lb.is_running() && s.lb.pid() == pid,
        "[{shape}] lbproxy restarted or exited\n{}",
        s.lb.log()
    );
}

/// 3. `ready: false` endpoints get no new connections; an endpoint without `ready` is ready.
fn not_ready(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let (pods, _srv) = serving_pods(&lab, &["b1", "b2", "b3"]);
    lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        vec![
            Endpoint::ready(pods[0].ip).pod("b1"),
            Endpoint::not_ready(pods[1].ip).pod("b2"),
            // `conditions: {}`: ready absent, so ready.
            Endpoint::new(pods[2].ip, Conditions::ABSENT).pod("b3"),
        ],
    ));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    let (t, u) = web_traffic_ok(&format!("[{shape}] not-ready"), &client, WEB_VIP, 60);
    eprintln!("[{shape}] not-ready: TCP {t:?} UDP {u:?}");
    for (p, m) in [("TCP", &t), ("UDP", &u)] {
        assert!(
            !m.contains_key("b2"),
            "[{shape}] {p}: not-ready b2 got new connections: {m:?}"
        );
        assert!(
            m.contains_key("b1"),
            "[{shape}] {p}: ready b1 got nothing: {m:?}"
        );
        assert!(
            m.contains_key("b3"),
            "[{shape}] {p}: b3 (ready absent = ready) got nothing: {m:?}"
        );
    }
}

/// 4. `targetPort` by name: two slices of one service resolve the port to different numbers;
///    traffic reaches the backends of both slices on their own slice's number.
fn named_port(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let b2 = lab.add_pod("b2");
    // Each backend listens only on its own slice's numbers: a wrong mapping gets no answer.
    let _s1 = b1.serve(&[8080, 5353]);
    let _s2 = b2.serve(&[9090, 6363]);
    let v = vip(11);
    let m = Manifest::new()
        .with(
            Service::cluster_ip("named", v)
                .port("http", WEB_TCP, Protocol::Tcp, "web")
                .port("dns", WEB_UDP, Protocol::Udp, "dns-udp"),
        )
        .with(
            EndpointSlice::new("named-a", "named")
                .port("http", 8080, Protocol::Tcp)
                .port("dns", 5353, Protocol::Udp)
                .endpoint(Endpoint::ready(b1.ip).pod("b1")),
        )
        .with(
            EndpointSlice::new("named-b", "named")
                .port("http", 9090, Protocol::Tcp)
                .port("dns", 6363, Protocol::Udp)
                .endpoint(Endpoint::ready(b2.ip).pod("b2")),
        );
    lab.write_manifest(&m);
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    let (t, u) = web_traffic_ok(&format!("[{shape}] named port"), &client, v, 40);
    eprintln!("[{shape}] named port: TCP {t:?} UDP {u:?}");
    for (p, m) in [("TCP", &t), ("UDP", &u)] {
        assert!(
            m.contains_key("b1") && m.contains_key("b2"),
            "[{shape}] {p}: named targetPort did not reach both slices' backends: {m:?}"
        );
    }

    // `inspect services --json` shows each backend with its own slice's port.
    let svcs = lab.inspect_services();
    let want = [
        (
            format!("{v}:{WEB_TCP}/TCP"),
            [(b1.ip, 8080u16), (b2.ip, 9090)],
        ),
        (format!("{v}:{WEB_UDP}/UDP"), [(b1.ip, 5353), (b2.ip, 6363)]),
    ];
    for (frontend, backends) in want {
        let svc = svcs
            .iter()
            .find(|s| s.frontend == frontend)
            .unwrap_or_else(|| {
                panic!("[{shape}] inspect services: no frontend {frontend}: {svcs:#?}")
            });
        let mut got: Vec<(String, u16)> = svc
            .backends
            .iter()
            .map(|b| (b.addr.clone(), b.port))
            .collect();
        got.sort();
        let mut want: Vec<(String, u16)> =
            backends.iter().map(|(a, p)| (a.to_string(), *p)).collect();
        want.sort();
        assert_eq!(
            got, want,
            "[{shape}] inspect services: backends of {frontend}: {svc:#?}"
        );
        assert_eq!(svc.service, "default/named", "[{shape}] {svc:#?}");
    }
}

/// Packet count of the first rule in the node namespace's FORWARD chain of `family`.
fn forward_drop_count(lab: &Lab, family: Family) -> String {
    lab.node_run(&[iptables(family), "-L", "FORWARD", "-v", "-x", "-n"])
        .map(|o| {
            o.lines()
                .nth(2)
                .map(|l| l.split_whitespace().next().unwrap_or("?").to_owned())
                .unwrap_or_default()
        })
        .unwrap_or_else(|e| e)
}

/// 5. With `iptables -A FORWARD -m conntrack --ctstate INVALID -j DROP` in the node namespace
///    (over IPv6, the same rule in ip6tables, kube-proxy's rule in its IPv6 table), TCP and
///    UDP through VIPs still work, in both directions between two pods: each request is
///    answered within 800 ms (a dropped SYN-ACK or reply, recovered by a retransmission after
///    1 s, fails), on new connections, on one long-lived connection and from one fixed UDP
///    source port, always from the VIP and port it was sent to.
fn invalid_drop(shape: Shape, family: Family) {
    let lab = Lab::new(shape);
    lab.node_run(&[
        iptables(family),
        "-A",
        "FORWARD",
        "-m",
        "conntrack",
        "--ctstate",
        "INVALID",
        "-j",
        "DROP",
    ])
    .unwrap_or_else(|e| panic!("[{shape}, {family}] installing the INVALID drop rule: {e}"));
    let a = lab.add_pod("a");
    let b = lab.add_pod("b");
    let c = lab.add_pod("c");
    let _sa = a.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let _sb = b.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let (to_b, to_a) = (vip_in(family, 10), vip_in(family, 12));
    lab.write_manifest(&merge([
        web_objects("to-b", to_b, ready_in(family, &[&b])),
        web_objects("to-a", to_a, ready_in(family, &[&a])),
    ]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);

    // Tight timeout: a dropped SYN-ACK or reply recovered by retransmission (>= 1 s) fails.
    let tt = Duration::from_millis(800);
    let mut failures = Vec::new();
    for (client, target, backend) in [(&a, to_b, "b"), (&b, to_a, "a"), (&c, to_b, "b")] {
        for (proto, port) in [(Proto::Tcp, WEB_TCP), (Proto::Udp, WEB_UDP)] {
            let t = client.tally(proto, target, port, 20, tt);
            if !t.all_ok() || t.count(backend) != 20 {
                failures.push(format!("{} -> {t}", client.name));
            }
        }
        // One long-lived TCP connection and one UDP flow (fixed source port), 20 exchanges each.
        let r: Result<(), String> = run_in_ns(&client.netns, || {
            let mut conn = lbproxy_tests::lab::TcpConn::connect_here(target, WEB_TCP, tt)
                .map_err(|e| format!("connect: {e}"))?;
            for i in 0..20 {
                let r = conn
                    .request()
                    .map_err(|e| format!("TCP request #{i} on one connection: {e}"))?;
                if r.backend != backend {
                    return Err(format!("TCP request #{i}: answered by {}", r.backend));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            for i in 0..20 {
                let (r, src) = udp_request_here(target, WEB_UDP, tt, Some(41000))
                    .map_err(|e| format!("UDP request #{i} from fixed port 41000: {e}"))?;
                if r.backend != backend || src != SocketAddr::new(target, WEB_UDP) {
                    return Err(format!(
                        "UDP request #{i}: answered by {} from {src}",
                        r.backend
                    ));
                }
            }
            Ok(())
        });
        if let Err(e) = r {
            failures.push(format!("{} -> {target}: {e}", client.name));
        }
    }
    let drops = forward_drop_count(&lab, family);
    eprintln!("[{shape}, {family}] INVALID-drop rule packet count: {drops}");
    assert!(
        failures.is_empty(),
        "[{shape}, {family}] with the INVALID drop rule (it dropped {drops} packets):\n  {}\nrules:\n{}",
        failures.join("\n  "),
        lab.node_run(&[iptables(family), "-L", "FORWARD", "-v", "-x", "-n"])
            .unwrap_or_else(|e| e)
    );
}
