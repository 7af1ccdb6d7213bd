//! lbproxy lifecycle scenarios: SIGTERM and restart, cleanup, interfaces that appear later,
//! bad manifests, two instances side by side. Both pod-network shapes; SIGTERM and restart
//! over both IP families too.

mod common;

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::connect::PendingConnect;
use lbproxy_tests::lab::{
    Endpoint, Family, Inspect as _, Lab, Pod, Proto, Shape, bpf, run_in_ns, tcp_request_here,
    udp_request_here, vip, wait_for,
};

both_shapes!(cleanup, iface_later, bad_input, two_instances);
both_shapes_and_families!(sigterm);

/// How soon `run` must notice that `lbproxy cleanup` removed its pins.
const NOTICE_CLEANUP_WITHIN: Duration = Duration::from_secs(5);

/// lbproxy programs (`lb_from_pod`/`lb_to_pod`) visible in the lab's node namespace: tcx
/// attachments (kernel query) and any line of `bpftool net show` naming them (which would
/// catch a legacy tc attachment; this bpftool does not list tcx).
fn lb_programs(lab: &Lab) -> (Vec<bpf::TcxAttachment>, Vec<String>) {
    let net_show = lab
        .node_run(&["bpftool", "net", "show"])
        .unwrap_or_else(|e| e);
    let lines = net_show
        .lines()
        .filter(|l| l.contains("lb_from_pod") || l.contains("lb_to_pod"))
        .map(str::to_owned)
        .collect();
    (lb_attachments(lab), lines)
}

/// Asserts every pod's host-side interface has lb_from_pod on tcx ingress and lb_to_pod on
/// tcx egress, and no other interface has lbproxy programs.
fn assert_attached(ctx: &str, lab: &Lab, pods: &[&Pod]) {
    let (att, _) = lb_programs(lab);
    for p in pods {
        for (dir, name) in [("ingress", "lb_from_pod"), ("egress", "lb_to_pod")] {
            assert!(
                att.iter()
                    .any(|a| a.ifname == p.host_if && a.direction == dir && a.prog_name == name),
                "{ctx}: {} (pod {}) has no {name} on tcx {dir}; lbproxy attachments: {att:#?}",
                p.host_if,
                p.name
            );
        }
    }
    let stray: Vec<_> = att
        .iter()
        .filter(|a| !a.ifname.starts_with(lab.if_prefix()))
        .collect();
    assert!(
        stray.is_empty(),
        "{ctx}: lbproxy programs on non-pod interfaces: {stray:#?}"
    );
}

/// 6. SIGTERM: exit 0; programs stay attached and maps pinned, so the VIP keeps working with
///    no lbproxy running (including an established connection); a new `run` on the same
///    bpffs dir becomes healthy, adopts the pinned frontends and serves. Over IPv4 and over
///    IPv6 (the dual-stack `web`'s IPv6 clusterIP).
fn sigterm(shape: Shape, family: Family) {
    let mut s = Setup::new(shape, &["b1", "b2", "b3"]);
    let backends = s.backends.clone();
    serve_family(&s, family, &backends.iter().collect::<Vec<_>>());
    let vip = web_vip(family);
    let ctx = |what: &str| format!("[{shape}, {family}] {what}");
    traffic_ok(&s, family, &ctx("before SIGTERM"), 20);
    let mut conn = s
        .client
        .connect(vip, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}, {family}] long-lived connection: {e}"));
    let first = conn
        .request()
        .unwrap_or_else(|e| {
            panic!("[{shape}, {family}] first request on the long-lived connection: {e}")
        })
        .backend;

    let (st, took) = s.lb.terminate(EXIT_WITHIN);
    eprintln!("[{shape}, {family}] lbproxy exited with {st} {took:?} after SIGTERM");
    assert_eq!(
        st.code(),
        Some(0),
        "[{shape}, {family}] exit status after SIGTERM: {st}\n{}",
        s.lb.log()
    );
    assert!(
        s.lab.bpffs_dir().exists(),
        "[{shape}, {family}] bpffs dir {} gone after SIGTERM",
        s.lab.bpffs_dir().display()
    );
    let pods: Vec<&Pod> = std::iter::once(&s.client).chain(&s.backends).collect();
    assert_attached(&ctx("after SIGTERM"), &s.lab, &pods);

    let (t, u) = traffic_ok(&s, family, &ctx("with lbproxy stopped"), 30);
    eprintln!("[{shape}, {family}] lbproxy stopped: TCP {t:?} UDP {u:?}");
    for (p, m) in [("TCP", &t), ("UDP", &u)] {
        assert_eq!(
            m.len(),
            3,
            "[{shape}, {family}] {p} with lbproxy stopped: not all 3 backends answer: {m:?}"
        );
    }
    let r = conn.request();
    assert!(
        matches!(&r, Ok(r) if r.backend == first),
        "[{shape}, {family}] established connection (to {first}) after lbproxy exited: {r:?}"
    );

    let mut lb2 = s.lab.start_lbproxy();
    let took = lb2.expect_healthy(HEALTHY_WITHIN);
    eprintln!("[{shape}, {family}] second lbproxy healthy after {took:?}");
    let (t, u) = traffic_ok(&s, family, &ctx("after restart"), 30);
    for (p, m) in [("TCP", &t), ("UDP", &u)] {
        assert_eq!(
            m.len(),
            3,
            "[{shape}, {family}] {p} after restart: not all 3 backends answer: {m:?}"
        );
    }
    let r = conn.request();
    assert!(
        matches!(&r, Ok(r) if r.backend == first),
        "[{shape}, {family}] established connection (to {first}) after lbproxy restarted: \
         {r:?}\n{}",
        lb2.log()
    );
    assert_attached(&ctx("after restart"), &s.lab, &pods);
    let rows = s.lab.inspect_services();
    assert_eq!(
        rows.iter().filter(|r| r.vip == vip.to_string()).count(),
        2,
        "[{shape}, {family}] the TCP and UDP frontends on {vip} adopted: {rows:#?}"
    );
}

/// Fixed source port of the connection whose flow entries outlive lbproxy in `cleanup`.
const SRC_STALE: u16 = 20041;

/// 7. `lbproxy cleanup` removes the pins and detaches every program; the VIP stops answering
///    while the pod network itself keeps working. The detach is done when `cleanup` returns:
///    a connection straight to a backend from the source port of an old VIP flow (whose
///    reply entry would reverse-NAT the backend's SYN-ACK) connects at once.
fn cleanup(shape: Shape) {
    let mut s = Setup::new(shape, &["b1", "b2"]);
    web_traffic_ok(&format!("[{shape}] before cleanup"), &s.client, WEB_VIP, 10);
    let vip_flow = s
        .client
        .run(|| PendingConnect::start(SRC_STALE, SocketAddrV4::new(WEB_VIP, WEB_TCP)))
        .unwrap_or_else(|e| panic!("[{shape}] connect from :{SRC_STALE}: {e}"));
    vip_flow
        .wait_until(vip_flow.started + T)
        .unwrap_or_else(|e| panic!("[{shape}] connect from :{SRC_STALE} to the VIP: {e}"));
    vip_flow.abort();
    let me = format!("{}:{SRC_STALE}", s.client.ip);
    let flows = s.lab.inspect_flows();
    let stale_backend: SocketAddrV4 = flows
        .iter()
        .find(|f| f.client == me)
        .and_then(|f| f.backend.parse().ok())
        .unwrap_or_else(|| panic!("[{shape}] no flow from {me} in inspect flows: {flows:#?}"));
    let pods: Vec<&Pod> = std::iter::once(&s.client).chain(&s.backends).collect();
    assert_attached(&format!("[{shape}] before cleanup"), &s.lab, &pods);
    let (before, _) = lb_programs(&s.lab);

    let (st, _) = s.lb.terminate(EXIT_WITHIN);
    assert_eq!(
        st.code(),
        Some(0),
        "[{shape}] exit status after SIGTERM: {st}\n{}",
        s.lb.log()
    );
    let out = s.lab.lbproxy_cleanup();
    let cleanup_log = format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "[{shape}] lbproxy cleanup failed: {cleanup_log}"
    );
    let direct = s
        .client
        .run(|| PendingConnect::start(SRC_STALE, stale_backend))
        .unwrap_or_else(|e| panic!("[{shape}] connect from :{SRC_STALE}: {e}"));
    let r = direct.wait_until(direct.started + Duration::from_millis(500));
    assert!(
        r.is_ok(),
        "[{shape}] right after cleanup, {me} -> {stale_backend} (the tuple of an old VIP flow) \
         did not connect within 500 ms: {r:?}"
    );
    direct.abort();

    let dir = s.lab.bpffs_dir();
    let left: Vec<_> = std::fs::read_dir(dir)
        .map(|r| r.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        !dir.exists(),
        "[{shape}] bpffs dir {} still exists after cleanup, holding {left:?}",
        dir.display()
    );
    let (after, net_show) = lb_programs(&s.lab);
    assert!(
        after.is_empty() && net_show.is_empty(),
        "[{shape}] lbproxy programs still attached after cleanup: tcx {after:#?}; bpftool net show: {net_show:?}\ncleanup: {cleanup_log}"
    );
    // The links and programs themselves are gone (not merely detached but still pinned).
    let gone = wait_for(Duration::from_secs(2), Duration::from_millis(100), || {
        let links = bpf::all_link_ids();
        let progs = bpf::all_prog_ids();
        let l: Vec<u32> = before
            .iter()
            .map(|a| a.link_id)
            .filter(|id| *id != 0 && links.contains(id))
            .collect();
        let p: Vec<u32> = before
            .iter()
            .map(|a| a.prog_id)
            .filter(|id| progs.contains(id))
            .collect();
        (l.is_empty() && p.is_empty())
            .then_some(())
            .ok_or((l, p))
            .ok()
    });
    if gone.is_err() {
        let links = bpf::all_link_ids();
        let progs = bpf::all_prog_ids();
        panic!(
            "[{shape}] after cleanup, bpftool still lists lbproxy's links {:?} / programs {:?}\n{}",
            before
                .iter()
                .map(|a| a.link_id)
                .filter(|id| links.contains(id))
                .collect::<Vec<_>>(),
            before
                .iter()
                .map(|a| a.prog_id)
                .filter(|id| progs.contains(id))
                .collect::<Vec<_>>(),
            std::process::Command::new("bpftool")
                .args(["link", "show"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        );
    }

    let short = Duration::from_millis(500);
    let t = s.client.tcp_request(WEB_VIP, WEB_TCP, short);
    assert!(
        t.is_err(),
        "[{shape}] TCP to the VIP still answered after cleanup: {t:?}"
    );
    let u = s.client.udp_request(WEB_VIP, WEB_UDP, short, None);
    assert!(
        u.is_err(),
        "[{shape}] UDP to the VIP still answered after cleanup: {u:?}"
    );
    let b1 = s.backend("b1");
    let d = s.client.tcp_request(b1.ip, BACKEND_TCP, T);
    assert!(
        matches!(&d, Ok((r, _)) if r.backend == "b1"),
        "[{shape}] pod network broken after cleanup: {d:?}"
    );
}

/// 8. A pod created after lbproxy is healthy is attached automatically and works as a client
///    and as a backend within 2 s; removing it does not disturb lbproxy.
fn iface_later(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    let late_vip = vip(13);
    let within = Duration::from_secs(2);

    let t0 = Instant::now();
    let late = s.lab.add_pod("late");
    let _srv = late.serve(&[BACKEND_TCP, BACKEND_UDP]);
    s.lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&[&b1])),
        web_objects("late-svc", late_vip, ready(&[&late])),
    ]));

    // One TCP and one UDP request; Ok if both answered by `backend` from `vip`.
    let both = |from: &Pod, vip: std::net::Ipv4Addr, backend: &str| -> Result<(), String> {
        let short = Duration::from_millis(200);
        run_in_ns(&from.netns, || {
            let (r, peer) =
                tcp_request_here(vip, WEB_TCP, short).map_err(|e| format!("TCP: {e}"))?;
            if r.backend != backend || peer.ip() != vip {
                return Err(format!("TCP answered by {} from {peer}", r.backend));
            }
            let (r, src) =
                udp_request_here(vip, WEB_UDP, short, None).map_err(|e| format!("UDP: {e}"))?;
            if r.backend != backend || src.ip() != vip {
                return Err(format!("UDP answered by {} from {src}", r.backend));
            }
            Ok(())
        })
    };
    let mut last = String::new();
    let as_client = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        both(&late, WEB_VIP, "b1").map_err(|e| last = e).ok()
    });
    let client_at = t0.elapsed();
    let mut last2 = String::new();
    let as_backend = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        both(&s.client, late_vip, "late")
            .map_err(|e| last2 = e)
            .ok()
    });
    let backend_at = t0.elapsed();
    eprintln!("[{shape}] late pod: client OK at {client_at:?}, backend OK at {backend_at:?}");
    assert!(
        as_client.is_ok() && client_at <= within,
        "[{shape}] pod added later, as a client of {WEB_VIP}: {} after {client_at:?} (want <= {within:?}); last error: {last}\n{}",
        if as_client.is_ok() {
            "worked"
        } else {
            "never worked"
        },
        s.lb.log()
    );
    assert!(
        as_backend.is_ok() && backend_at <= within,
        "[{shape}] pod added later, as the backend of {late_vip}: {} after {backend_at:?} (want <= {within:?}); last error: {last2}\n{}",
        if as_backend.is_ok() {
            "worked"
        } else {
            "never worked"
        },
        s.lb.log()
    );
    assert_attached(
        &format!("[{shape}] late pod"),
        &s.lab,
        &[&s.client, &b1, &late],
    );

    // Removing it and adding another keeps lbproxy working.
    drop(_srv);
    s.lab
        .write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    s.lab.remove_pod("late");
    let late2 = s.lab.add_pod("late2");
    let t1 = Instant::now();
    let mut last3 = String::new();
    let r = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        both(&late2, WEB_VIP, "b1").map_err(|e| last3 = e).ok()
    });
    assert!(
        r.is_ok() && t1.elapsed() <= within,
        "[{shape}] second late pod as a client: {r:?} after {:?}; last error: {last3}\n{}",
        t1.elapsed(),
        s.lb.log()
    );
    assert_eq!(
        s.lb.healthz(),
        Ok(200),
        "[{shape}] healthz after pod removal\n{}",
        s.lb.log()
    );
    web_traffic_ok_in(
        Some(&s.lab),
        &format!("[{shape}] after pod removal"),
        &s.client,
        WEB_VIP,
        10,
    );
}

/// 9. Invalid YAML, then an invalid IP: lbproxy keeps running and serving the last good
///    state, and its stderr names the file and the reason; a good file is applied again.
fn bad_input(shape: Shape) {
    let mut s = Setup::new(shape, &["b1", "b2"]);
    let path = s.lab.manifest_path().display().to_string();
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let settle = APPLY_WITHIN + Duration::from_millis(500);

    let serving_b1_b2 = |s: &mut Setup, ctx: &str| {
        assert!(s.lb.is_running(), "{ctx}: lbproxy exited\n{}", s.lb.log());
        let (t, u) = web_traffic_ok(ctx, &s.client, WEB_VIP, 24);
        assert!(
            t.len() == 2 && u.len() == 2,
            "{ctx}: previous good state (b1, b2) not served: TCP {t:?} UDP {u:?}"
        );
    };
    serving_b1_b2(&mut s, &format!("[{shape}] initial"));

    // (a) Invalid YAML.
    let off = s.lb.stderr_len();
    s.lab.write_manifest_text(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec: [unclosed\n  ports: {\n",
    );
    std::thread::sleep(settle);
    serving_b1_b2(&mut s, &format!("[{shape}] after invalid YAML"));
    let log = s.lb.stderr_since(off);
    eprintln!("[{shape}] invalid YAML, new stderr: {log}");
    let lower = log.to_lowercase();
    assert!(
        log.contains(&path)
            && (lower.contains("line") || lower.contains("yaml") || lower.contains("column")),
        "[{shape}] invalid YAML: stderr does not name the file {path} and a parse reason; new stderr:\n{log}"
    );

    // (b) A slice with an invalid IP (b2 dropped, bogus address added): the whole update is
    //     rejected, so b2 must keep getting traffic.
    let off = s.lb.stderr_len();
    s.lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        vec![
            Endpoint::ready(b1.ip).pod("b1"),
            Endpoint::ready("198.18.0.999").pod("bogus"),
        ],
    ));
    std::thread::sleep(settle);
    serving_b1_b2(&mut s, &format!("[{shape}] after invalid IP"));
    let log = s.lb.stderr_since(off);
    eprintln!("[{shape}] invalid IP, new stderr: {log}");
    assert!(
        log.contains(&path) && log.contains("web-1") && log.contains("198.18.0.999"),
        "[{shape}] invalid IP: stderr does not name the file {path}, the object web-1 and the bad value 198.18.0.999; new stderr:\n{log}"
    );

    // (c) A good file again is applied.
    s.lab
        .write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    std::thread::sleep(APPLY_WITHIN);
    let (t, u) = web_traffic_ok(
        &format!("[{shape}] good file after bad ones"),
        &s.client,
        WEB_VIP,
        20,
    );
    assert!(
        t.keys().eq(["b1"]) && u.keys().eq(["b1"]),
        "[{shape}] good manifest (only b1) not applied {APPLY_WITHIN:?} after bad ones: TCP {t:?} UDP {u:?}"
    );
    let _ = b2;
}

/// 10. Two labs, each with its own lbproxy and bpffs dir (same addresses in both), work at
///     once; cleaning up one leaves the other working.
fn two_instances(shape: Shape) {
    let mk = |tag: &str| {
        let lab = Lab::new(shape);
        let client = lab.add_pod("client");
        let (bs, srv) = serving_pods(&lab, &[&format!("{tag}-b1"), &format!("{tag}-b2")]);
        lab.write_manifest(&web_objects(
            "web",
            WEB_VIP,
            ready(&bs.iter().collect::<Vec<_>>()),
        ));
        let mut lb = lab.start_lbproxy();
        lb.expect_healthy(HEALTHY_WITHIN);
        (lab, client, bs, srv, lb)
    };
    let (lab1, c1, _bs1, _srv1, mut lb1) = mk("one");
    let (lab2, c2, bs2, _srv2, lb2) = mk("two");
    assert_ne!(lab1.bpffs_dir(), lab2.bpffs_dir());

    // Both at once, from two threads.
    let check = |ctx: &str, c: &Pod, tag: &str| {
        for proto in [Proto::Tcp, Proto::Udp] {
            let port = if proto == Proto::Tcp {
                WEB_TCP
            } else {
                WEB_UDP
            };
            let t = c.tally(proto, WEB_VIP, port, 30, T);
            let want: Vec<String> = ["b1", "b2"].iter().map(|b| format!("{tag}-{b}")).collect();
            assert!(
                t.all_ok() && t.by_backend.keys().eq(want.iter()),
                "{ctx}: lab {tag}: want replies from exactly {want:?}: {t}"
            );
        }
    };
    std::thread::scope(|sc| {
        let a = sc.spawn(|| check(&format!("[{shape}] concurrently"), &c1, "one"));
        let b = sc.spawn(|| check(&format!("[{shape}] concurrently"), &c2, "two"));
        let (ra, rb) = (a.join(), b.join());
        if let Err(p) = ra.and(rb) {
            std::panic::resume_unwind(p);
        }
    });

    // Stop and clean up lab 1.
    let (st, _) = lb1.terminate(EXIT_WITHIN);
    assert_eq!(
        st.code(),
        Some(0),
        "[{shape}] lab 1 exit status: {st}\n{}",
        lb1.log()
    );
    let out = lab1.lbproxy_cleanup();
    assert!(
        out.status.success(),
        "[{shape}] lab 1 cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !lab1.bpffs_dir().exists(),
        "[{shape}] lab 1 bpffs dir survived cleanup"
    );
    assert!(
        lb_attachments(&lab1).is_empty(),
        "[{shape}] lab 1 programs survived cleanup"
    );

    // Lab 2 is untouched and its controller still applies changes.
    let mut lb2 = lb2;
    assert!(
        lb2.is_running(),
        "[{shape}] lab 2 lbproxy died when lab 1 was cleaned up\n{}",
        lb2.log()
    );
    assert!(
        lab2.bpffs_dir().exists(),
        "[{shape}] lab 2 bpffs dir vanished when lab 1 was cleaned up"
    );
    assert_eq!(lb2.healthz(), Ok(200), "[{shape}] lab 2 healthz");
    let pods2: Vec<&Pod> = std::iter::once(&c2).chain(&bs2).collect();
    assert_attached(
        &format!("[{shape}] lab 2 after lab 1 cleanup"),
        &lab2,
        &pods2,
    );
    check(&format!("[{shape}] lab 2 after lab 1 cleanup"), &c2, "two");
    lab2.write_manifest(&web_objects("web", WEB_VIP, ready(&[&bs2[0]])));
    std::thread::sleep(APPLY_WITHIN);
    let t = c2.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 20, T);
    assert!(
        t.all_ok() && t.by_backend.keys().eq(["two-b1"]),
        "[{shape}] lab 2 update after lab 1 cleanup not applied: {t}"
    );
    // Lab 1's VIP is dead.
    let r = c1.udp_request(WEB_VIP, WEB_UDP, Duration::from_millis(300), None);
    assert!(
        r.is_err(),
        "[{shape}] lab 1 VIP still answers after cleanup: {r:?}"
    );
}

/// `lbproxy cleanup` while `run` is active: `run` notices that its pins are gone and exits
/// non-zero (so a DaemonSet restarts it), instead of writing to orphaned maps while the node
/// serves nothing and `/healthz` says 200. A new `run` then serves again.
#[test]
fn cleanup_while_running_makes_run_exit() {
    let mut s = Setup::new(Shape::Routed, &["b1"]);
    web_traffic_ok("before cleanup", &s.client, WEB_VIP, 5);
    let out = s.lab.lbproxy_cleanup();
    assert!(
        out.status.success(),
        "cleanup failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t = Instant::now();
    let st = s.lb.wait_exit(NOTICE_CLEANUP_WITHIN);
    let log = s.lb.log();
    let Some(st) = st else {
        panic!(
            "run still running {:?} after cleanup removed its pins\n{log}",
            t.elapsed()
        );
    };
    assert_ne!(st.code(), Some(0), "run exited 0 after cleanup\n{log}");
    assert!(
        log.contains("pinned maps are gone"),
        "no log line saying why run exited\n{log}"
    );
    eprintln!("run exited ({st}) {:?} after cleanup", t.elapsed());
    let mut lb = s.lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    web_traffic_ok("after the restart", &s.client, WEB_VIP, 5);
}
