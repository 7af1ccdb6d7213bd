//! Flow lifecycle under endpoint churn (issue 4 §1–§3, §6 restarts): what lbproxy's own flow
//! table does when a flow's backend leaves, turns terminating, or never answers, and what a
//! client of a service without usable endpoints sees. Real `lbproxy run`, real sockets, both
//! pod-network shapes. Every assertion is timed and panics with what was observed.
//!
//! Each test fails under conntrack-style behaviour (a flow pinned to its first backend until
//! it times out; a black hole for a service without endpoints):
//! 1. [`udp_flow_moves`] (over IPv4 and IPv6): the removed backend keeps serving, so a
//!    pinned flow keeps getting its answers.
//! 2. [`syn_retry_reaches_replacement`]: a SYN_SENT flow pinned to the frozen backend never
//!    connects.
//! 3. [`terminating_then_removed`] (over IPv4 and IPv6): a pinned connection keeps being
//!    answered by the removed (still serving) backend instead of reset.
//! 4. [`kep1669_fallback`]: without the fallback the service has no usable endpoint.
//! 5. [`reject_timings`] (over IPv4 and IPv6): a black hole makes connect and recv time out
//!    instead of failing at once.
//! 6. [`restart_keeps_flows`]: a flow table rebuilt on start shows a young entry (or none).
//! 7. [`source_port_reuse`]: one connection after another from one source port each gets a
//!    working flow, and the table keeps exactly one flow (two entries) for the tuple, also
//!    when the backend changes between them.
//! 8. [`shared_backend_leaves_one_service`] (over IPv4 and IPv6): a backend that leaves
//!    `web` but stays in `metrics` keeps its `web` flows (its backend id lives on through
//!    `metrics`).

mod common;

use std::io::{self, BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::connect::{PendingConnect, reset_on_close};
use lbproxy_tests::lab::inspect::rows::FlowRow;
use lbproxy_tests::lab::{
    Conditions, Endpoint, Family, Lab, Pod, Proto, Shape, TcpConn, ns_run, wait_for,
};
use serde_json::Value;

both_shapes!(
    syn_retry_reaches_replacement,
    kep1669_fallback,
    restart_keeps_flows,
    source_port_reuse,
);
both_shapes_and_families!(
    reject_timings,
    udp_flow_moves,
    terminating_then_removed,
    shared_backend_leaves_one_service
);

/// Fixed client source ports (below the ephemeral range, so nothing else takes them).
const SRC_UDP: u16 = 20001;
const SRC_SYN_RETRANSMIT: u16 = 20011;
const SRC_SYN_FRESH: u16 = 20012;
const SRC_RESTART_UDP: u16 = 20021;
const SRC_REUSE: u16 = 20031;
const SRC_SHARED: u16 = 20041;

/// The contract for a removed backend's UDP flow: answers from a live backend within 1 s.
const MOVE_WITHIN: Duration = Duration::from_secs(1);
/// A rejected connect or UDP exchange must fail this fast (not by a timeout).
const REJECT_WITHIN: Duration = Duration::from_millis(100);
/// lbproxy collects expired flows every 10 s, the first time 10 s after it starts; this is
/// past that first collection.
const GC_FIRST_RUN: Duration = Duration::from_millis(11_500);

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// The backend identity in a reply line (`"<identity> <client>\n"`).
fn reply_backend(buf: &[u8]) -> String {
    let text = String::from_utf8_lossy(buf);
    text.split_whitespace().next().unwrap_or("?").to_owned()
}

/// One request/reply on a TCP stream.
fn stream_request(s: &TcpStream) -> io::Result<String> {
    (&*s).write_all(b"hello\n")?;
    let mut line = String::new();
    if BufReader::new(s).read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    Ok(reply_backend(line.as_bytes()))
}

/// The forward flow entries (`inspect flows --json`) from `client` to `frontend`.
fn flows_from(lab: &Lab, client: impl Into<SocketAddr>, frontend: &str) -> Vec<FlowRow> {
    let client = client.into();
    let c = client.to_string();
    lab.inspect_flows()
        .into_iter()
        .filter(|f| f.client == c && f.frontend == frontend)
        .collect()
}

/// The distinct backend addresses (`ip:port`) `inspect services --json` lists for `frontend`.
fn service_backends(lab: &Lab, frontend: &str) -> Option<Vec<String>> {
    let svc = lab
        .inspect_services()
        .into_iter()
        .find(|s| s.frontend == frontend)?;
    let mut v = row_backends(&svc);
    v.dedup();
    Some(v)
}

/// Polls `inspect services` until `frontend` lists exactly `want` (`ip:port`); returns how
/// long that took. Panics after 3 s.
fn wait_service_backends(lab: &Lab, frontend: &str, want: &[String], ctx: &str) -> Duration {
    let mut want = want.to_vec();
    want.sort();
    let mut last = None;
    wait_for(Duration::from_secs(3), Duration::from_millis(20), || {
        let got = service_backends(lab, frontend);
        let ok = got.as_deref() == Some(&want[..]);
        last = got;
        ok.then_some(())
    })
    .map(|((), t)| t)
    .unwrap_or_else(|t| {
        panic!(
            "{ctx}: after {t:?} inspect services shows {frontend} with {last:?}, want {want:?}\n{}",
            lab.diagnostics()
        )
    })
}

fn tcp_frontend() -> String {
    tcp_frontend_in(Family::V4)
}

fn udp_frontend() -> String {
    udp_frontend_in(Family::V4)
}

/// `web`'s TCP frontend in `family`, as `inspect` writes it.
fn tcp_frontend_in(family: Family) -> String {
    format!("{}/TCP", SocketAddr::new(web_vip(family), WEB_TCP))
}

/// `web`'s UDP frontend in `family`, as `inspect` writes it.
fn udp_frontend_in(family: Family) -> String {
    format!("{}/UDP", SocketAddr::new(web_vip(family), WEB_UDP))
}

/// The unspecified address of `family`.
fn any(family: Family) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::UNSPECIFIED.into(),
        Family::V6 => Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// `pod`'s `port` in `family`, as `inspect` writes a backend (`ip:port`, `[ip]:port`).
fn backend_addr(pod: &Pod, family: Family, port: u16) -> String {
    SocketAddr::new(pod_addr(pod, family), port).to_string()
}

/// For IPv6, makes `web` a single-stack IPv6 Service over `pods` and waits until `inspect
/// services` shows it (for IPv4, [`Setup`] wrote `web`).
fn web_in(s: &Setup, family: Family, pods: &[&Pod]) {
    if family == Family::V6 {
        s.lab
            .write_manifest(&web_objects("web", VIP6, ready_in(family, pods)));
        let want: Vec<String> = pods
            .iter()
            .map(|p| backend_addr(p, family, BACKEND_TCP))
            .collect();
        wait_service_backends(&s.lab, &tcp_frontend_in(family), &want, "[IPv6] web");
    }
}

/// One UDP exchange slot on an unconnected socket: send a request to `dst`, then collect
/// every reply arriving within `slot`. Returns (arrival time since `t0`, backend, source).
fn udp_slot(
    sock: &UdpSocket,
    dst: SocketAddr,
    slot: Duration,
    t0: Instant,
) -> Vec<(Duration, String, SocketAddr)> {
    let mut out = Vec::new();
    sock.send_to(b"hello\n", dst).expect("UDP send");
    let end = Instant::now() + slot;
    let mut buf = [0u8; 512];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return out;
        }
        sock.set_read_timeout(Some(left)).unwrap();
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => out.push((t0.elapsed(), reply_backend(&buf[..n]), from)),
            Err(e) if lbproxy_tests::lab::net::recv_again(&e) => {}
            Err(e) => panic!(
                "UDP recv: {e} ({:?}, os error {:?})",
                e.kind(),
                e.raw_os_error()
            ),
        }
    }
}

fn fmt_events(ev: &[(Duration, String, SocketAddr)]) -> String {
    let mut runs: Vec<(String, usize, Duration, Duration)> = Vec::new();
    for (t, b, src) in ev {
        let k = format!("{b} via {src}");
        match runs.last_mut() {
            Some(r) if r.0 == k => {
                r.1 += 1;
                r.3 = *t;
            }
            _ => runs.push((k, 1, *t, *t)),
        }
    }
    runs.iter()
        .map(|(k, n, a, b)| format!("{k}: {n}x {a:?}..{b:?}"))
        .collect::<Vec<_>>()
        .join("; ")
}

// ---------------------------------------------------------------------------------------
// 1. UDP from a fixed source port, its backend removed mid-stream
// ---------------------------------------------------------------------------------------

/// A client keeps one UDP flow (fixed source port) and sends every 50 ms. Its backend X is
/// removed from the slice while X keeps serving. Answers must come from a live backend
/// within 1 s of the manifest write, and never again from X; the moved flow then stays on
/// its new backend. Over IPv4 and over IPv6.
fn udp_flow_moves(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    web_in(&s, family, &s.backends.iter().collect::<Vec<_>>());
    let vip = web_vip(family);
    let shape = format!("{shape}, {family}");
    let dst = SocketAddr::new(vip, WEB_UDP);
    let sock = s
        .client
        .run(|| UdpSocket::bind((any(family), SRC_UDP)))
        .expect("bind the client's fixed UDP port");
    let slot = Duration::from_millis(50);

    // Before: the flow is pinned to one backend.
    let t0 = Instant::now();
    let mut before = Vec::new();
    for _ in 0..10 {
        before.extend(udp_slot(&sock, dst, slot, t0));
    }
    let x = before.first().map(|e| e.1.clone()).unwrap_or_else(|| {
        panic!(
            "[{shape}] no UDP answer before the change\n{}",
            s.lab.diagnostics()
        )
    });
    assert!(
        before.len() == 10 && before.iter().all(|e| e.1 == x && e.2 == dst),
        "[{shape}] before the change, 10 requests from port {SRC_UDP} should all be answered \
         by one backend from {dst}: {}",
        fmt_events(&before)
    );

    // Remove X (it keeps running and answering whatever reaches it).
    let keep: Vec<&Pod> = s.backends.iter().filter(|p| p.name != x).collect();
    let t_write = Instant::now();
    s.lab
        .write_manifest(&web_objects("web", vip, ready_in(family, &keep)));
    let mut after = Vec::new();
    let mut sent = 0;
    while t_write.elapsed() < Duration::from_secs(3) {
        after.extend(udp_slot(&sock, dst, slot, t_write));
        sent += 1;
    }
    let first_live = after.iter().find(|e| e.1 != x).cloned();
    let last_x = after.iter().filter(|e| e.1 == x).map(|e| e.0).max();
    eprintln!(
        "[{shape}] udp_flow_moves: flow on {x}; removed it; first live answer at {:?} after the \
         write, last answer from {x} at {last_x:?}; {} answers to {sent} requests: {}",
        first_live.as_ref().map(|e| e.0),
        after.len(),
        fmt_events(&after)
    );
    let Some((moved_at, y, _)) = first_live else {
        panic!(
            "[{shape}] removed backend {x}: no answer from a live backend in 3 s of the write \
             (the flow stayed pinned): {}\n{}",
            fmt_events(&after),
            s.lab.diagnostics()
        );
    };
    assert!(
        moved_at <= MOVE_WITHIN,
        "[{shape}] removed backend {x}: first answer from a live backend {moved_at:?} after the \
         write (want <= {MOVE_WITHIN:?}): {}",
        fmt_events(&after)
    );
    let stray: Vec<_> = after
        .iter()
        .filter(|e| e.0 > moved_at && (e.1 != y || e.2 != dst))
        .collect();
    assert!(
        stray.is_empty(),
        "[{shape}] after the flow moved to {y} at {moved_at:?}, answers came from elsewhere \
         (removed {x}, or another backend, or not from {dst}): {stray:?}\nall: {}",
        fmt_events(&after)
    );
    let me = SocketAddr::new(pod_addr(&s.client, family), SRC_UDP);
    let flows = flows_from(&s.lab, me, &udp_frontend_in(family));
    let y_addr = backend_addr(s.backend(&y), family, BACKEND_UDP);
    assert!(
        flows.len() == 1 && flows[0].backend == y_addr,
        "[{shape}] inspect flows for {me}: want one flow to {y} ({y_addr}): {flows:#?}"
    );
}

// ---------------------------------------------------------------------------------------
// 2. SYN to a frozen backend, backend replaced, retry from the same source port
// ---------------------------------------------------------------------------------------

/// The service has one backend A, frozen (its pod drops inbound TCP). Two clients with fixed
/// source ports send SYNs that A never answers (`inspect flows`: syn_sent to A). A is replaced
/// by B. The kernel's SYN retransmission from the first port (1 s after the connect) and a
/// fresh connect from the second port (after closing the first attempt) must both connect,
/// to B.
fn syn_retry_reaches_replacement(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let a = lab.add_pod("a");
    let b = lab.add_pod("b");
    let _sa = a.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let _sb = b.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&[&a])));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    let (r, _) = client
        .tcp_request(WEB_VIP, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}] request before the freeze: {e}"));
    assert_eq!(r.backend, "a", "[{shape}] before the freeze");

    a.freeze_tcp(BACKEND_TCP)
        .unwrap_or_else(|e| panic!("[{shape}] {e}"));
    let dst = SocketAddrV4::new(WEB_VIP, WEB_TCP);
    let (p1, p2) = client.run(|| {
        (
            PendingConnect::start(SRC_SYN_RETRANSMIT, dst),
            PendingConnect::start(SRC_SYN_FRESH, dst),
        )
    });
    let (p1, p2) = (
        p1.unwrap_or_else(|e| panic!("[{shape}] connect from :{SRC_SYN_RETRANSMIT}: {e}")),
        p2.unwrap_or_else(|e| panic!("[{shape}] connect from :{SRC_SYN_FRESH}: {e}")),
    );
    let frozen = p1.wait_until(p1.started + Duration::from_millis(300));
    assert!(
        matches!(&frozen, Err(e) if e.kind() == io::ErrorKind::TimedOut),
        "[{shape}] connect to the frozen backend should hang, got {frozen:?}"
    );
    let a_addr = format!("{}:{BACKEND_TCP}", a.ip);
    for port in [p1.port, p2.port] {
        let f = flows_from(&lab, SocketAddrV4::new(client.ip, port), &tcp_frontend());
        assert!(
            f.len() == 1 && f[0].state == "syn_sent" && f[0].backend == a_addr,
            "[{shape}] inspect flows for {}:{port} while A is frozen: want one syn_sent flow to \
             {a_addr}: {f:#?}",
            client.ip
        );
    }
    // The second attempt is given up (no RST is sent for a SYN_SENT socket); its port is
    // reused below for a fresh connect.
    p2.abort();

    // Replace A by B.
    let t_write = Instant::now();
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&[&b])));
    let since_connect = p1.started.elapsed();

    // The kernel retransmits p1's SYN 1 s after the connect.
    let r1 = p1.wait_until(t_write + Duration::from_secs(4));
    let t1 = t_write.elapsed();
    eprintln!(
        "[{shape}] syn_retry: manifest written {since_connect:?} after the connect; retransmitted \
         SYN from :{SRC_SYN_RETRANSMIT}: {r1:?} after the connect, {t1:?} after the write"
    );
    let connected_after = r1.unwrap_or_else(|e| {
        panic!(
            "[{shape}] SYN retransmission from :{SRC_SYN_RETRANSMIT} after A was replaced by B: {e} \
             ({t1:?} after the write); flows: {:#?}\n{}",
            flows_from(&lab, SocketAddrV4::new(client.ip, SRC_SYN_RETRANSMIT), &tcp_frontend()),
            lab.diagnostics()
        )
    });
    assert!(
        t1 <= Duration::from_secs(2),
        "[{shape}] the retransmitted SYN connected {t1:?} after the write (want <= 2 s; \
         {connected_after:?} after the connect)"
    );
    let s1 = p1.into_stream(T);
    let who = stream_request(&s1)
        .unwrap_or_else(|e| panic!("[{shape}] request on :{SRC_SYN_RETRANSMIT}: {e}"));
    assert_eq!(
        who, "b",
        "[{shape}] the retransmitted SYN's connection is served by"
    );

    // A fresh connect from the other port that had a SYN_SENT flow to A.
    let p2 = client
        .run(|| PendingConnect::start(SRC_SYN_FRESH, dst))
        .unwrap_or_else(|e| panic!("[{shape}] fresh connect from :{SRC_SYN_FRESH}: {e}"));
    let r2 = p2.wait_until(p2.started + Duration::from_secs(3));
    eprintln!("[{shape}] syn_retry: fresh connect from :{SRC_SYN_FRESH}: {r2:?}");
    let c2 = r2.unwrap_or_else(|e| {
        panic!("[{shape}] fresh connect from :{SRC_SYN_FRESH} (had a SYN_SENT flow to A): {e}")
    });
    assert!(
        c2 < Duration::from_millis(500),
        "[{shape}] fresh connect from :{SRC_SYN_FRESH} took {c2:?} (want < 500 ms: no retransmission needed)"
    );
    let s2 = p2.into_stream(T);
    let who = stream_request(&s2)
        .unwrap_or_else(|e| panic!("[{shape}] request on :{SRC_SYN_FRESH}: {e}"));
    assert_eq!(
        who, "b",
        "[{shape}] the fresh connect's connection is served by"
    );

    let b_addr = format!("{}:{BACKEND_TCP}", b.ip);
    for port in [SRC_SYN_RETRANSMIT, SRC_SYN_FRESH] {
        let f = flows_from(&lab, SocketAddrV4::new(client.ip, port), &tcp_frontend());
        assert!(
            f.len() == 1 && f[0].state == "established" && f[0].backend == b_addr,
            "[{shape}] inspect flows for {}:{port} after connecting: want one established flow \
             to {b_addr}: {f:#?}",
            client.ip
        );
    }
}

// ---------------------------------------------------------------------------------------
// 3. A long-lived connection to a backend that turns terminating, then is removed
// ---------------------------------------------------------------------------------------

/// A connection to b2 keeps working while b2 is terminating (still serving), while new
/// connections go to b1 only. When b2 leaves the slice (its pod still serving), the next
/// request on the connection fails within 1 s with ECONNRESET, generated by the datapath
/// (`backend_gone_tcp_reset` counts it). Over IPv4 and over IPv6.
fn terminating_then_removed(shape: Shape, family: Family) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    web_in(&s, family, &[&b1, &b2]);
    let vip = web_vip(family);
    let shape = format!("{shape}, {family}");
    let mut conn: TcpConn = (0..50)
        .find_map(|_| {
            let mut c = s.client.connect(vip, WEB_TCP, T).ok()?;
            (c.request().ok()?.backend == "b2").then_some(c)
        })
        .unwrap_or_else(|| panic!("[{shape}] no connection landed on b2 in 50 tries"));

    // b2 turns terminating.
    s.lab.write_manifest(&web_objects(
        "web",
        vip,
        vec![
            Endpoint::ready(pod_addr(&b1, family)).pod("b1"),
            Endpoint::new(pod_addr(&b2, family), Conditions::TERMINATING_SERVING).pod("b2"),
        ],
    ));
    let applied = wait_service_backends(
        &s.lab,
        &tcp_frontend_in(family),
        &[backend_addr(&b1, family, BACKEND_TCP)],
        &format!("[{shape}] b2 terminating"),
    );
    let on_conn: Vec<_> = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            conn.request().map(|r| r.backend)
        })
        .collect();
    let fresh = s.client.tally(Proto::Tcp, vip, WEB_TCP, 20, T);
    eprintln!(
        "[{shape}] terminating: applied after {applied:?}; on the connection: {on_conn:?}; new: {fresh}"
    );
    assert!(
        on_conn.iter().all(|r| matches!(r, Ok(b) if b == "b2")),
        "[{shape}] the connection to b2 after b2 turned terminating (still serving): {on_conn:?}"
    );
    assert!(
        fresh.all_ok() && fresh.count("b1") == 20,
        "[{shape}] new connections while b2 is terminating and b1 ready must all go to b1: {fresh}"
    );

    // b2 leaves the slice.
    let resets_before = s.lab.drop_count("backend_gone_tcp_reset");
    let t_write = Instant::now();
    s.lab
        .write_manifest(&web_objects("web", vip, ready_in(family, &[&b1])));
    let mut log = Vec::new();
    let (err, took) = loop {
        let t = Instant::now();
        let r = conn.request();
        let took = t.elapsed();
        match r {
            Ok(reply) => {
                // Until the change applies, the connection stays on b2.
                assert_eq!(
                    reply.backend, "b2",
                    "[{shape}] the connection to b2 answered by another backend: {log:?}"
                );
                log.push(format!(
                    "{:?}: {} ({took:?})",
                    t_write.elapsed(),
                    reply.backend
                ))
            }
            Err(e) => break (e, took),
        }
        if t_write.elapsed() > Duration::from_secs(3) {
            panic!(
                "[{shape}] b2 removed: the connection was still answered 3 s after the write: {log:?}\n{}",
                s.lab.diagnostics()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let failed_at = t_write.elapsed();
    let resets_after = s.lab.drop_count("backend_gone_tcp_reset");
    eprintln!(
        "[{shape}] removed: request failed {failed_at:?} after the write with {:?} ({err}); the \
         failing request took {took:?}; backend_gone_tcp_reset {resets_before} -> {resets_after}; \
         answered before: {log:?}",
        err.kind()
    );
    assert!(
        matches!(
            err.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        ),
        "[{shape}] b2 removed: want ConnectionReset (or BrokenPipe after a reset), got {:?}: {err} \
         after {took:?}",
        err.kind()
    );
    assert!(
        took < Duration::from_secs(1) && failed_at < Duration::from_secs(1),
        "[{shape}] b2 removed: the failing request took {took:?}, {failed_at:?} after the write \
         (want both < 1 s)"
    );
    assert!(
        resets_after > resets_before,
        "[{shape}] the reset was not generated by the datapath: backend_gone_tcp_reset \
         {resets_before} -> {resets_after}"
    );
    let fresh = s.client.tally(Proto::Tcp, vip, WEB_TCP, 10, T);
    assert!(
        fresh.all_ok() && fresh.count("b1") == 10,
        "[{shape}] reconnecting after the reset: {fresh}"
    );
}

// ---------------------------------------------------------------------------------------
// 4. KEP-1669: serving+terminating endpoints are the fallback when none is ready
// ---------------------------------------------------------------------------------------

/// No endpoint ready: b1 serving+terminating, b2 terminating but not serving, b3 not ready
/// and not serving. New TCP connections and UDP flows go to b1 only. Once b3 turns ready,
/// they go to b3 only.
fn kep1669_fallback(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let (pods, _srv) = serving_pods(&lab, &["b1", "b2", "b3"]);
    let not_serving_terminating = Conditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(true),
    };
    let eps = |b3: Conditions| {
        vec![
            Endpoint::new(pods[0].ip, Conditions::TERMINATING_SERVING).pod("b1"),
            Endpoint::new(pods[1].ip, not_serving_terminating).pod("b2"),
            Endpoint::new(pods[2].ip, b3).pod("b3"),
        ]
    };
    lab.write_manifest(&web_objects("web", WEB_VIP, eps(Conditions::NOT_READY)));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);

    let t = client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 30, T);
    let u = client.tally(Proto::Udp, WEB_VIP, WEB_UDP, 30, T);
    eprintln!("[{shape}] kep1669, none ready: {t}; {u}");
    for x in [&t, &u] {
        assert!(
            x.all_ok() && x.count("b1") == 30,
            "[{shape}] no ready endpoint: every new connection must go to serving+terminating b1 \
             (never to not-serving b2 or b3): {x}\n{}",
            lab.diagnostics()
        );
    }

    lab.write_manifest(&web_objects("web", WEB_VIP, eps(Conditions::READY)));
    wait_service_backends(
        &lab,
        &tcp_frontend(),
        &[format!("{}:{BACKEND_TCP}", pods[2].ip)],
        &format!("[{shape}] b3 ready"),
    );
    let t = client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 30, T);
    let u = client.tally(Proto::Udp, WEB_VIP, WEB_UDP, 30, T);
    eprintln!("[{shape}] kep1669, b3 ready: {t}; {u}");
    for x in [&t, &u] {
        assert!(
            x.all_ok() && x.count("b3") == 30,
            "[{shape}] b3 ready: every new connection must go to b3 (the terminating b1 only \
             when none is ready): {x}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 5. Reject timings
// ---------------------------------------------------------------------------------------

/// Puts a sticky destination-options header (one PadN option, 8 bytes in all) on every
/// packet `sock` sends (`IPV6_DSTOPTS`, which needs CAP_NET_RAW: the tests run as root).
fn with_dest_opts(sock: &impl std::os::fd::AsRawFd) {
    // Next header (the kernel fills it in), length 0 (8 bytes), PadN of 4 zero bytes.
    let opts: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    // SAFETY: a valid socket and an 8-byte option buffer.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_DSTOPTS,
            opts.as_ptr().cast(),
            opts.len() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "setsockopt(IPV6_DSTOPTS): {}",
        io::Error::last_os_error()
    );
}

/// From `client`: a TCP connect and a connected UDP socket's datagram (from `udp_port`, 0
/// for any) to `vip`, an IPv6 one's packets with a destination-options header when
/// `dest_opts`. Each must fail with ECONNREFUSED within [`REJECT_WITHIN`].
fn refused_at_once(client: &Pod, vip: IpAddr, udp_port: u16, dest_opts: bool, what: &str) {
    let family = if vip.is_ipv6() {
        Family::V6
    } else {
        Family::V4
    };
    let (tcp, udp) = client.run(|| {
        let to = SocketAddr::new(vip, WEB_TCP);
        let t = socket2::Socket::new(
            socket2::Domain::for_address(to),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .unwrap();
        let u = UdpSocket::bind((any(family), udp_port)).unwrap();
        if dest_opts {
            with_dest_opts(&t);
            with_dest_opts(&u);
        }
        let started = Instant::now();
        let tcp = t
            .connect_timeout(&to.into(), Duration::from_secs(3))
            .map_err(|e| (e.kind(), started.elapsed()));
        u.connect((vip, WEB_UDP)).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let started = Instant::now();
        u.send(b"hello\n").unwrap();
        let udp = u
            .recv(&mut [0u8; 64])
            .map(|_| ())
            .map_err(|e| (e.kind(), started.elapsed()));
        (tcp, udp)
    });
    for (proto, r) in [("TCP", tcp), ("UDP", udp)] {
        assert!(
            matches!(r, Err((io::ErrorKind::ConnectionRefused, took)) if took < REJECT_WITHIN),
            "{what}: {proto} to {vip} without endpoints: want connection refused within \
             {REJECT_WITHIN:?}, got {r:?}"
        );
    }
}

/// Two services without a usable endpoint: `empty` (a slice with no endpoints) and `unready`
/// (one endpoint, not ready and not serving, whose pod does serve). TCP connects fail with
/// ECONNREFUSED and connected UDP sockets get ECONNREFUSED, each in < 100 ms; the
/// `no_backend_tcp_reset` and `no_backend_icmp_unreachable` counters count every one, and
/// `lbproxy monitor` shows the rejects with their addresses and service. Over IPv4 and over
/// IPv6 (single-stack Services); over IPv6 also with a destination-options header on every
/// packet, the answers still at once. `web`, beside them over the pod that serves, answers.
fn reject_timings(shape: Shape, family: Family) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let idle = lab.add_pod("idle");
    let _srv = idle.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let (empty_vip, unready_vip) = (vip_in(family, 20), vip_in(family, 21));
    let web = web_vip(family);
    // `empty`'s slice has no address, so it is written IPv4 whatever the Service's family: a
    // slice of the other family, which gives the Service no endpoint either.
    lab.write_manifest(&merge([
        web_objects("empty", empty_vip, vec![]),
        web_objects(
            "unready",
            unready_vip,
            vec![Endpoint::not_ready(pod_addr(&idle, family)).pod("idle")],
        ),
        web_objects("web", web, ready_in(family, &[&idle])),
    ]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    let shape = format!("{shape}, {family}");
    let tcp0 = lab.drop_count("no_backend_tcp_reset");
    let udp0 = lab.drop_count("no_backend_icmp_unreachable");

    const N: usize = 5;
    let results = client.run(|| {
        let mut out = Vec::new();
        for v in [empty_vip, unready_vip] {
            for i in 0..N {
                let t = Instant::now();
                let r = TcpStream::connect_timeout(
                    &SocketAddr::new(v, WEB_TCP),
                    Duration::from_secs(3),
                );
                out.push((
                    v,
                    Proto::Tcp,
                    i,
                    r.map(|_| ()).map_err(|e| e.kind()),
                    t.elapsed(),
                ));

                let t = Instant::now();
                let r = (|| -> io::Result<()> {
                    let u = UdpSocket::bind((any(family), 0))?;
                    u.connect((v, WEB_UDP))?;
                    u.set_read_timeout(Some(Duration::from_secs(3)))?;
                    u.send(b"hello\n")?;
                    let mut buf = [0u8; 64];
                    u.recv(&mut buf).map(|_| ())
                })();
                out.push((v, Proto::Udp, i, r.map_err(|e| e.kind()), t.elapsed()));
            }
        }
        out
    });
    let tcp1 = lab.drop_count("no_backend_tcp_reset");
    let udp1 = lab.drop_count("no_backend_icmp_unreachable");
    let summary: Vec<String> = results
        .iter()
        .map(|(v, p, i, r, t)| format!("{p} {v} #{i}: {r:?} in {t:?}"))
        .collect();
    eprintln!(
        "[{shape}] reject: {}\n  no_backend_tcp_reset {tcp0} -> {tcp1}, \
         no_backend_icmp_unreachable {udp0} -> {udp1}",
        summary.join("\n  ")
    );
    let bad: Vec<&String> = results
        .iter()
        .zip(&summary)
        .filter(|((_, _, _, r, t), _)| {
            *r != Err(io::ErrorKind::ConnectionRefused) || *t >= REJECT_WITHIN
        })
        .map(|(_, s)| s)
        .collect();
    assert!(
        bad.is_empty(),
        "[{shape}] without a usable endpoint, TCP connect and connected-UDP recv must fail with \
         ConnectionRefused in < {REJECT_WITHIN:?}; these did not:\n  {}",
        bad.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    let n = (2 * N) as u64;
    assert!(
        tcp1 - tcp0 >= n && udp1 - udp0 >= n,
        "[{shape}] counters: no_backend_tcp_reset +{} (want >= {n}), no_backend_icmp_unreachable \
         +{} (want >= {n})",
        tcp1 - tcp0,
        udp1 - udp0
    );

    // `lbproxy monitor` shows the rejects with their addresses and service.
    let mon = Monitor::start(&lab, &["--duration", "30"]);
    refused_at_once(
        &client,
        empty_vip,
        40_006,
        false,
        &format!("[{shape}] monitored"),
    );
    let events = mon.events(2, Duration::from_secs(3));
    let me = pod_addr(&client, family);
    let by_reason = |r: &str| {
        events.iter().find(|e| e["reason"] == r).unwrap_or_else(|| {
            panic!("[{shape}] no {r} event from lbproxy monitor among {events:#?}")
        })
    };
    let tcp_ev = by_reason("no_backend_tcp_reset");
    assert_eq!(tcp_ev["verdict"], "reject", "[{shape}] {tcp_ev}");
    assert_eq!(tcp_ev["protocol"], "TCP", "[{shape}] {tcp_ev}");
    assert_eq!(
        tcp_ev["dst"],
        SocketAddr::new(empty_vip, WEB_TCP).to_string(),
        "[{shape}] {tcp_ev}"
    );
    let src_prefix = match me {
        IpAddr::V4(a) => format!("{a}:"),
        IpAddr::V6(a) => format!("[{a}]:"),
    };
    assert!(
        tcp_ev["src"]
            .as_str()
            .is_some_and(|a| a.starts_with(&src_prefix)),
        "[{shape}] want a source {src_prefix}PORT: {tcp_ev}"
    );
    assert_eq!(
        tcp_ev["service"], "default/empty:http",
        "[{shape}] {tcp_ev}"
    );
    assert_eq!(tcp_ev["hook"], "from_pod", "[{shape}] {tcp_ev}");
    let udp_ev = by_reason("no_backend_icmp_unreachable");
    assert_eq!(
        udp_ev["src"],
        SocketAddr::new(me, 40_006).to_string(),
        "[{shape}] {udp_ev}"
    );
    assert_eq!(
        udp_ev["dst"],
        SocketAddr::new(empty_vip, WEB_UDP).to_string(),
        "[{shape}] {udp_ev}"
    );
    assert_eq!(udp_ev["service"], "default/empty:dns", "[{shape}] {udp_ev}");
    drop(mon);

    if family == Family::V6 {
        // The same with a destination-options header on every packet (a sticky
        // `IPV6_DSTOPTS` on the sockets): the answers still come at once, the extension
        // header removed from what is sent back.
        let counts = || {
            [
                "reject_failed",
                "no_backend_tcp_reset",
                "no_backend_icmp_unreachable",
            ]
            .map(|k| lab.drop_count(k))
        };
        let before = counts();
        refused_at_once(
            &client,
            empty_vip,
            0,
            true,
            &format!("[{shape}] with a destination-options header"),
        );
        let after = counts();
        assert_eq!(
            after[0],
            before[0],
            "[{shape}] no reject failed: {}",
            lab.diagnostics()
        );
        assert!(
            after[1] > before[1] && after[2] > before[2],
            "[{shape}] no_backend_tcp_reset and no_backend_icmp_unreachable counted with \
             extension headers: {before:?} -> {after:?}"
        );
    }
    // The frontend with an endpoint still serves, beside the ones without.
    for proto in [Proto::Tcp, Proto::Udp] {
        let port = if proto == Proto::Tcp {
            WEB_TCP
        } else {
            WEB_UDP
        };
        let t = client.tally(proto, web, port, 4, T);
        assert!(
            t.all_ok() && t.count("idle") == 4,
            "[{shape}] web beside the frontends without endpoints: {t}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 6. A restart keeps every flow
// ---------------------------------------------------------------------------------------

/// A TCP connection and a fixed-port UDP flow survive SIGTERM and a new `run` on the same
/// bpffs dir: they keep their backends, and `inspect flows` still lists the same entries
/// (their age counts from before the restart). The first flow collection after the restart
/// deletes neither (both idle for ~11 s, far below their timeouts).
fn restart_keeps_flows(shape: Shape) {
    let mut s = Setup::new(shape, &["b1", "b2", "b3"]);
    let mut conn = s
        .client
        .connect(WEB_VIP, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}] connect: {e}"));
    let opened = Instant::now();
    let x = conn.request().expect("first request").backend;
    let usock = s
        .client
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, SRC_RESTART_UDP)))
        .expect("bind UDP");
    let udp_dst = SocketAddr::from((WEB_VIP, WEB_UDP));
    let t0 = Instant::now();
    let y = udp_slot(&usock, udp_dst, Duration::from_millis(200), t0)
        .first()
        .map(|e| e.1.clone())
        .unwrap_or_else(|| panic!("[{shape}] no UDP answer"));
    let tcp_client = match conn.local {
        SocketAddr::V4(a) => SocketAddrV4::new(s.client.ip, a.port()),
        a => panic!("not IPv4: {a}"),
    };
    let udp_client = SocketAddrV4::new(s.client.ip, SRC_RESTART_UDP);
    let x_addr = format!("{}:{BACKEND_TCP}", s.backend(&x).ip);
    let y_addr = format!("{}:{BACKEND_UDP}", s.backend(&y).ip);
    let before = flows_from(&s.lab, tcp_client, &tcp_frontend());
    assert!(
        before.len() == 1 && before[0].backend == x_addr && before[0].state == "established",
        "[{shape}] inspect flows for {tcp_client} before the restart: {before:#?}"
    );
    // Let the entries age so that a re-created one would be visibly younger.
    std::thread::sleep(Duration::from_millis(1500));

    let (st, _) = s.lb.terminate(EXIT_WITHIN);
    assert_eq!(
        st.code(),
        Some(0),
        "[{shape}] exit after SIGTERM: {st}\n{}",
        s.lb.log()
    );
    let down = conn.request().map(|r| r.backend);
    s.lb = s.lab.start_lbproxy();
    let healthy = s.lb.expect_healthy(HEALTHY_WITHIN);
    let after_tcp: Vec<_> = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            conn.request().map(|r| r.backend)
        })
        .collect();
    let after_udp: Vec<_> = (0..5)
        .flat_map(|_| udp_slot(&usock, udp_dst, Duration::from_millis(100), t0))
        .collect();
    let age_floor = opened.elapsed().as_secs_f64() - 0.5;
    let tcp_flow = flows_from(&s.lab, tcp_client, &tcp_frontend());
    let udp_flow = flows_from(&s.lab, udp_client, &udp_frontend());
    eprintln!(
        "[{shape}] restart: TCP on {x}, UDP on {y}; while down: {down:?}; healthy {healthy:?} \
         after the new start; after: TCP {after_tcp:?}, UDP {}; flows: {tcp_flow:?} {udp_flow:?}",
        fmt_events(&after_udp)
    );
    assert!(
        matches!(&down, Ok(b) if *b == x),
        "[{shape}] the connection while lbproxy was down: {down:?} (want {x})"
    );
    assert!(
        after_tcp.iter().all(|r| matches!(r, Ok(b) if *b == x)),
        "[{shape}] the connection after the restart: {after_tcp:?} (want {x} every time)"
    );
    assert!(
        after_udp.len() == 5 && after_udp.iter().all(|e| e.1 == y && e.2 == udp_dst),
        "[{shape}] the UDP flow after the restart: {} (want 5 answers from {y})",
        fmt_events(&after_udp)
    );
    for (what, f, addr) in [("TCP", &tcp_flow, &x_addr), ("UDP", &udp_flow, &y_addr)] {
        let age = f.first().map(|e| e.age_seconds);
        assert!(
            f.len() == 1 && f[0].backend == **addr && age.is_some_and(|a| a >= age_floor),
            "[{shape}] {what} flow after the restart: want the same entry (backend {addr}, age >= \
             {age_floor:.2} s): {f:#?}"
        );
    }
    web_traffic_ok(
        &format!("[{shape}] after the restart"),
        &s.client,
        WEB_VIP,
        10,
    );

    // The first flow collection after the restart (10 s after the start) deletes nothing
    // live: both flows, idle meanwhile but far from their timeouts, are still there.
    let restarted = Instant::now() - healthy;
    std::thread::sleep((restarted + GC_FIRST_RUN).saturating_duration_since(Instant::now()));
    let age_floor = opened.elapsed().as_secs_f64() - 0.5;
    let tcp_flow = flows_from(&s.lab, tcp_client, &tcp_frontend());
    let udp_flow = flows_from(&s.lab, udp_client, &udp_frontend());
    let tcp_reply = conn.request().map(|r| r.backend);
    let udp_reply = udp_slot(&usock, udp_dst, Duration::from_millis(200), t0);
    eprintln!(
        "[{shape}] restart + {GC_FIRST_RUN:?} (first flow GC): flows {tcp_flow:?} {udp_flow:?}; \
         TCP {tcp_reply:?}, UDP {}",
        fmt_events(&udp_reply)
    );
    for (what, f, addr) in [("TCP", &tcp_flow, &x_addr), ("UDP", &udp_flow, &y_addr)] {
        let age = f.first().map(|e| e.age_seconds);
        assert!(
            f.len() == 1 && f[0].backend == **addr && age.is_some_and(|a| a >= age_floor),
            "[{shape}] {what} flow after the first flow GC following the restart: want the same \
             entry (backend {addr}, age >= {age_floor:.2} s): {f:#?}\n{}",
            s.lb.log()
        );
    }
    assert!(
        matches!(&tcp_reply, Ok(b) if *b == x) && udp_reply.len() == 1 && udp_reply[0].1 == y,
        "[{shape}] after the first flow GC: TCP {tcp_reply:?} (want {x}), UDP {} (want {y})",
        fmt_events(&udp_reply)
    );
}

/// The reply entries (`dir` 1) in the pinned flow map whose destination is `client`, as
/// their source `ip:port` (the backend), read with bpftool.
fn reply_entries_to(lab: &Lab, client: SocketAddrV4) -> Vec<String> {
    let addr = lbproxy_tests::lab::bpf::ipv4_of_json;
    // `port_be` fields are printed as the u16 in memory, read little-endian.
    let port = |p: &Value| p.as_u64().map(|n| (n as u16).swap_bytes());
    lab.map_dump("LB_FLOWS_V3")
        .iter()
        .filter_map(|e| {
            let k = &e["key"];
            (k["dir"] == 1
                && addr(&k["dst_addr"]) == Some(*client.ip())
                && port(&k["dst_port_be"]) == Some(client.port()))
            .then(|| {
                format!(
                    "{}:{}",
                    addr(&k["src_addr"]).map_or("?".into(), |a| a.to_string()),
                    port(&k["src_port_be"]).unwrap_or(0)
                )
            })
        })
        .collect()
}

/// Exactly one flow from `client` to the TCP frontend, to `backend` (`ip:port`): one forward
/// entry (`inspect flows`) and one reply entry (the map itself), so an earlier flow's entries
/// are gone.
fn assert_one_flow(lab: &Lab, client: SocketAddrV4, backend: &str, ctx: &str) {
    let f = flows_from(lab, client, &tcp_frontend());
    assert!(
        f.len() == 1 && f[0].backend == backend,
        "{ctx}: want one flow from {client} to {backend}: {f:#?}"
    );
    let r = reply_entries_to(lab, client);
    assert_eq!(
        r,
        vec![backend.to_owned()],
        "{ctx}: reply entries to {client}"
    );
}

/// Waits until no TCP socket in `netns` has `peer` as its remote end (the backend saw the
/// client's RST); `Err` after `within`, with what `ss` still lists.
fn backend_closed(netns: &str, peer: SocketAddrV4, within: Duration) -> Result<(), String> {
    let filter = format!("dst {peer}");
    let deadline = Instant::now() + within;
    loop {
        let out = ns_run(netns, &["ss", "-Htan", &filter])?;
        if out.trim().is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the backend still has a socket to {peer} {within:?} after the close:\n{out}"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// 7. Connections one after another from one source port (each closed with a RST, as a
///    client hammering a service with short connections does) all succeed on the backend
///    the tuple hashes to, and the flow table holds one forward and one reply entry for the
///    tuple throughout. After that backend leaves the service, the next connection from the
///    same port reaches another backend, and the old reply entry is gone.
fn source_port_reuse(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    let dst = SocketAddrV4::new(WEB_VIP, WEB_TCP);
    let me = SocketAddrV4::new(s.client.ip, SRC_REUSE);
    let connect_once = |ctx: &str| -> String {
        let c = s
            .client
            .run(|| PendingConnect::start(SRC_REUSE, dst))
            .unwrap_or_else(|e| {
                panic!(
                    "[{shape}] {ctx}: connect from :{SRC_REUSE}: {e}\nsockets: {:?}",
                    ns_run(&s.client.netns, &["ss", "-tanoe", "sport = :20031"])
                )
            });
        c.wait_until(c.started + T)
            .unwrap_or_else(|e| panic!("[{shape}] {ctx}: connect from :{SRC_REUSE}: {e}"));
        let stream = c.into_stream(T);
        let b = stream_request(&stream)
            .unwrap_or_else(|e| panic!("[{shape}] {ctx}: request from :{SRC_REUSE}: {e}"));
        // Closed with a RST: no TIME_WAIT keeps the port.
        reset_on_close(std::os::fd::AsRawFd::as_raw_fd(&stream))
            .unwrap_or_else(|e| panic!("[{shape}] SO_LINGER: {e}"));
        drop(stream);
        // The RST reaches the backend through lbproxy and closes its socket. Waiting for that
        // keeps the next SYN from overtaking the RST: a segment queued on one CPU's backlog
        // (softirqs deferred to ksoftirqd under load) can be passed by the client's next one
        // sent from another CPU, and a SYN that finds the old connection open gets a
        // challenge ACK and a 1 s retransmission, with or without a load balancer.
        backend_closed(&s.backend(&b).netns, me, T)
            .unwrap_or_else(|e| panic!("[{shape}] {ctx}: the client's RST: {e}"));
        b
    };
    let first = connect_once("connection 1");
    for i in 2..=8 {
        let b = connect_once(&format!("connection {i}"));
        assert_eq!(
            b, first,
            "[{shape}] connection {i} from the same tuple went to another backend"
        );
    }
    let first_addr = format!("{}:{BACKEND_TCP}", s.backend(&first).ip);
    assert_one_flow(
        &s.lab,
        me,
        &first_addr,
        &format!("[{shape}] after 8 connections"),
    );

    // The tuple's backend leaves the service.
    let rest: Vec<&Pod> = s.backends.iter().filter(|p| p.name != first).collect();
    s.lab
        .write_manifest(&web_objects("web", WEB_VIP, ready(&rest)));
    let want: Vec<String> = rest
        .iter()
        .map(|p| format!("{}:{BACKEND_TCP}", p.ip))
        .collect();
    wait_service_backends(
        &s.lab,
        &tcp_frontend(),
        &want,
        &format!("[{shape}] {first} removed"),
    );
    let next = connect_once("connection after the removal");
    assert_ne!(
        next, first,
        "[{shape}] the removed backend {first} still got the tuple"
    );
    let next_addr = format!("{}:{BACKEND_TCP}", s.backend(&next).ip);
    assert_one_flow(
        &s.lab,
        me,
        &next_addr,
        &format!("[{shape}] after the removal"),
    );
}

// ---------------------------------------------------------------------------------------
// 8. One pod behind two Services: it leaves one, and only that one's flows leave it
// ---------------------------------------------------------------------------------------

/// b1 is the one endpoint of `web` and of `metrics` (same address and ports, as a pod behind
/// its app's Service and its metrics Service). A UDP flow from a fixed source port and an
/// open TCP connection go through `web` to b1. b1 is replaced by b2 in `web` and stays in
/// `metrics`, and keeps serving. The UDP flow must move to b2 within 1 s of the write and
/// never come back to b1; the TCP connection must be reset at once by the datapath; and
/// `metrics` must still reach b1. Over IPv4 and over IPv6 (both Services single-stack IPv6).
fn shared_backend_leaves_one_service(shape: Shape, family: Family) {
    let s = Setup::with_members(shape, &["b1", "b2"], &["b1"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let (vip, metrics_vip) = (web_vip(family), vip_in(family, 13));
    let both = |web: &Pod| {
        merge([
            web_objects("web", vip, ready_in(family, &[web])),
            web_objects("metrics", metrics_vip, ready_in(family, &[&b1])),
        ])
    };
    s.lab.write_manifest(&both(&b1));
    let b1_tcp = SocketAddr::new(pod_addr(&b1, family), BACKEND_TCP).to_string();
    wait_service_backends(
        &s.lab,
        &format!("{}/TCP", SocketAddr::new(metrics_vip, WEB_TCP)),
        &[b1_tcp],
        &format!("[{shape}, {family}] metrics over b1"),
    );
    wait_service_backends(
        &s.lab,
        &format!("{}/TCP", SocketAddr::new(vip, WEB_TCP)),
        &[SocketAddr::new(pod_addr(&b1, family), BACKEND_TCP).to_string()],
        &format!("[{shape}, {family}] web over b1"),
    );
    let dst = SocketAddr::new(vip, WEB_UDP);
    let sock = s
        .client
        .run(|| UdpSocket::bind((any(family), SRC_SHARED)))
        .expect("bind the client's fixed UDP port");
    let slot = Duration::from_millis(50);
    let t0 = Instant::now();
    let before: Vec<_> = (0..5)
        .flat_map(|_| udp_slot(&sock, dst, slot, t0))
        .collect();
    assert!(
        before.len() == 5 && before.iter().all(|e| e.1 == "b1" && e.2 == dst),
        "[{shape}, {family}] before the change, 5 requests from port {SRC_SHARED} go to b1: {}\n{}",
        fmt_events(&before),
        s.lab.diagnostics()
    );
    let mut conn = s
        .client
        .connect(vip, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}, {family}] connect to web: {e}"));
    let first = conn
        .request()
        .unwrap_or_else(|e| panic!("[{shape}, {family}] a request on the connection: {e}"))
        .backend;
    assert_eq!(first, "b1", "[{shape}, {family}] web has b1 alone");

    // b1 leaves web, stays in metrics, keeps serving.
    let resets_before = s.lab.drop_count("backend_gone_tcp_reset");
    let t_write = Instant::now();
    s.lab.write_manifest(&both(&b2));
    let mut after = Vec::new();
    while t_write.elapsed() < Duration::from_secs(2) {
        after.extend(udp_slot(&sock, dst, slot, t_write));
    }
    let moved_at = after.iter().find(|e| e.1 == "b2").map(|e| e.0);
    eprintln!(
        "[{shape}, {family}] shared backend: web b1 -> b2, b1 stays in metrics; UDP moved at \
         {moved_at:?}: {}",
        fmt_events(&after)
    );
    let Some(moved_at) = moved_at else {
        panic!(
            "[{shape}, {family}] b1 left web (still in metrics): the UDP flow from port \
             {SRC_SHARED} stayed on b1 for 2 s: {}\n{}",
            fmt_events(&after),
            s.lab.diagnostics()
        );
    };
    assert!(
        moved_at <= MOVE_WITHIN,
        "[{shape}, {family}] the UDP flow moved {moved_at:?} after the write (want <= \
         {MOVE_WITHIN:?}): {}",
        fmt_events(&after)
    );
    let stray: Vec<_> = after
        .iter()
        .filter(|e| e.0 > moved_at && (e.1 != "b2" || e.2 != dst))
        .collect();
    assert!(
        stray.is_empty(),
        "[{shape}, {family}] after the flow moved to b2, answers came from elsewhere: {stray:?}"
    );
    // The change is applied (the UDP flow moved): the connection's next segment is reset.
    let t = Instant::now();
    let r = conn.request();
    let took = t.elapsed();
    let resets_after = s.lab.drop_count("backend_gone_tcp_reset");
    assert!(
        matches!(&r, Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe)),
        "[{shape}, {family}] b1 left web (still in metrics): the connection through web to b1 \
         must be reset, got {:?} after {took:?}",
        r.map(|x| x.backend)
    );
    assert!(
        took < Duration::from_secs(1) && resets_after > resets_before,
        "[{shape}, {family}] the reset took {took:?}; backend_gone_tcp_reset {resets_before} -> \
         {resets_after} (want it from the datapath, at once)"
    );
    let fresh = s.client.tally(Proto::Tcp, vip, WEB_TCP, 10, T);
    let metrics = s.client.tally(Proto::Tcp, metrics_vip, WEB_TCP, 10, T);
    let metrics_udp = s.client.tally(Proto::Udp, metrics_vip, WEB_UDP, 5, T);
    assert!(
        fresh.all_ok()
            && fresh.count("b2") == 10
            && metrics.all_ok()
            && metrics.count("b1") == 10
            && metrics_udp.all_ok()
            && metrics_udp.count("b1") == 5,
        "[{shape}, {family}] after the change: web {fresh} (want b2 only), metrics {metrics} \
         and {metrics_udp} (want b1 only)"
    );
}
