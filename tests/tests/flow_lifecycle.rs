//! Flow lifecycle under endpoint churn (issue 4 §1–§3, §6 restarts): what lbproxy's own flow
//! table does when a flow's backend leaves, turns terminating, or never answers, and what a
//! client of a service without usable endpoints sees. Real `lbproxy run`, real sockets, both
//! pod-network shapes. Every assertion is timed and panics with what was observed.
//!
//! Each test fails under conntrack-style behaviour (a flow pinned to its first backend until
//! it times out; a black hole for a service without endpoints):
//! 1. [`udp_flow_moves`]: the removed backend keeps serving, so a pinned flow keeps getting
//!    its answers.
//! 2. [`syn_retry_reaches_replacement`]: a SYN_SENT flow pinned to the frozen backend never
//!    connects.
//! 3. [`terminating_then_removed`]: a pinned connection keeps being answered by the removed
//!    (still serving) backend instead of reset.
//! 4. [`kep1669_fallback`]: without the fallback the service has no usable endpoint.
//! 5. [`reject_timings`]: a black hole makes connect and recv time out instead of failing
//!    at once.
//! 6. [`restart_keeps_flows`]: a flow table rebuilt on start shows a young entry (or none).
//! 7. [`source_port_reuse`]: one connection after another from one source port each gets a
//!    working flow, and the table keeps exactly one flow (two entries) for the tuple, also
//!    when the backend changes between them.
//! 8. [`shared_backend_leaves_one_service`]: a backend that leaves `web` but stays in
//!    `metrics` keeps its `web` flows (its backend id lives on through `metrics`).

mod common;

use std::io::{self, BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::connect::{PendingConnect, reset_on_close};
use lbproxy_tests::lab::{
    Conditions, Endpoint, Lab, Pod, Proto, Shape, TcpConn, ns_run, vip, wait_for,
};
use serde_json::Value;

both_shapes!(
    udp_flow_moves,
    syn_retry_reaches_replacement,
    terminating_then_removed,
    kep1669_fallback,
    reject_timings,
    restart_keeps_flows,
    source_port_reuse,
    shared_backend_leaves_one_service,
);

/// Fixed client source ports (below the ephemeral range, so nothing else takes them).
const SRC_UDP: u16 = 20001;
const SRC_SYN_RETRANSMIT: u16 = 20011;
const SRC_SYN_FRESH: u16 = 20012;
const SRC_RESTART_UDP: u16 = 20021;
const SRC_REUSE: u16 = 20031;
const SRC_SHARED: u16 = 20041;

/// The ClusterIP of `metrics`, a second Service over a backend of `web`.
const METRICS_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 13);

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
fn flows_from(lab: &Lab, client: SocketAddrV4, frontend: &str) -> Vec<Value> {
    let all = lab.inspect_json("flows");
    let all = all
        .as_array()
        .unwrap_or_else(|| panic!("inspect flows --json: not an array: {all}"))
        .clone();
    let c = client.to_string();
    all.into_iter()
        .filter(|f| f["client"] == c.as_str() && f["frontend"] == frontend)
        .collect()
}

/// The distinct backend addresses (`ip:port`) `inspect services --json` lists for `frontend`.
fn service_backends(lab: &Lab, frontend: &str) -> Option<Vec<String>> {
    let svcs = lab.inspect_json("services");
    let svc = svcs
        .as_array()?
        .iter()
        .find(|s| s["frontend"] == frontend)?
        .clone();
    svc["backends"].as_array()?;
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
    format!("{WEB_VIP}:{WEB_TCP}/TCP")
}

fn udp_frontend() -> String {
    format!("{WEB_VIP}:{WEB_UDP}/UDP")
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
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("UDP recv: {e}"),
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
/// its new backend.
fn udp_flow_moves(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2", "b3"]);
    let dst = SocketAddr::from((WEB_VIP, WEB_UDP));
    let sock = s
        .client
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, SRC_UDP)))
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
        .write_manifest(&web_objects("web", WEB_VIP, ready(&keep)));
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
    let flows = flows_from(
        &s.lab,
        SocketAddrV4::new(s.client.ip, SRC_UDP),
        &udp_frontend(),
    );
    let y_ip = s.backend(&y).ip;
    assert!(
        flows.len() == 1 && flows[0]["backend"] == format!("{y_ip}:{BACKEND_UDP}").as_str(),
        "[{shape}] inspect flows for {}:{SRC_UDP}: want one flow to {y} ({y_ip}): {flows:#?}",
        s.client.ip
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
            f.len() == 1 && f[0]["state"] == "syn_sent" && f[0]["backend"] == a_addr.as_str(),
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
            f.len() == 1 && f[0]["state"] == "established" && f[0]["backend"] == b_addr.as_str(),
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
/// (`backend_gone_tcp_reset` counts it).
fn terminating_then_removed(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let mut conn: TcpConn = (0..50)
        .find_map(|_| {
            let mut c = s.client.connect(WEB_VIP, WEB_TCP, T).ok()?;
            (c.request().ok()?.backend == "b2").then_some(c)
        })
        .unwrap_or_else(|| panic!("[{shape}] no connection landed on b2 in 50 tries"));

    // b2 turns terminating.
    s.lab.write_manifest(&web_objects(
        "web",
        WEB_VIP,
        vec![
            Endpoint::ready(b1.ip).pod("b1"),
            Endpoint::new(b2.ip, Conditions::TERMINATING_SERVING).pod("b2"),
        ],
    ));
    let applied = wait_service_backends(
        &s.lab,
        &tcp_frontend(),
        &[format!("{}:{BACKEND_TCP}", b1.ip)],
        &format!("[{shape}] b2 terminating"),
    );
    let on_conn: Vec<_> = (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            conn.request().map(|r| r.backend)
        })
        .collect();
    let fresh = s.client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 20, T);
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
        .write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    let mut log = Vec::new();
    let (err, took) = loop {
        let t = Instant::now();
        let r = conn.request();
        let took = t.elapsed();
        match r {
            Ok(reply) => log.push(format!(
                "{:?}: {} ({took:?})",
                t_write.elapsed(),
                reply.backend
            )),
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
    let fresh = s.client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 10, T);
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

/// Two services without a usable endpoint: `empty` (a slice with no endpoints) and `unready`
/// (one endpoint, not ready and not serving, whose pod does serve). TCP connects fail with
/// ECONNREFUSED and connected UDP sockets get ECONNREFUSED, each in < 100 ms; the
/// `no_backend_tcp_reset` and `no_backend_icmp_unreachable` counters count every one.
fn reject_timings(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let idle = lab.add_pod("idle");
    let _srv = idle.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let (empty_vip, unready_vip) = (vip(20), vip(21));
    lab.write_manifest(&merge([
        web_objects("empty", empty_vip, vec![]),
        web_objects(
            "unready",
            unready_vip,
            vec![Endpoint::not_ready(idle.ip).pod("idle")],
        ),
    ]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    let tcp0 = lab.drop_count("no_backend_tcp_reset");
    let udp0 = lab.drop_count("no_backend_icmp_unreachable");

    const N: usize = 5;
    let results = client.run(|| {
        let mut out = Vec::new();
        for v in [empty_vip, unready_vip] {
            for i in 0..N {
                let t = Instant::now();
                let r = TcpStream::connect_timeout(
                    &SocketAddr::from((v, WEB_TCP)),
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
                    let u = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
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
        before.len() == 1
            && before[0]["backend"] == x_addr.as_str()
            && before[0]["state"] == "established",
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
        let age = f.first().and_then(|e| e["age_seconds"].as_f64());
        assert!(
            f.len() == 1 && f[0]["backend"] == addr.as_str() && age.is_some_and(|a| a >= age_floor),
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
        let age = f.first().and_then(|e| e["age_seconds"].as_f64());
        assert!(
            f.len() == 1 && f[0]["backend"] == addr.as_str() && age.is_some_and(|a| a >= age_floor),
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
        f.len() == 1 && f[0]["backend"] == backend,
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
/// `metrics` must still reach b1.
fn shared_backend_leaves_one_service(shape: Shape) {
    let s = Setup::with_members(shape, &["b1", "b2"], &["b1"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    let both = |web: &Pod| {
        merge([
            web_objects("web", WEB_VIP, ready(&[web])),
            web_objects("metrics", METRICS_VIP, ready(&[&b1])),
        ])
    };
    s.lab.write_manifest(&both(&b1));
    let b1_tcp = format!("{}:{BACKEND_TCP}", b1.ip);
    wait_service_backends(
        &s.lab,
        &format!("{METRICS_VIP}:{WEB_TCP}/TCP"),
        &[b1_tcp],
        &format!("[{shape}] metrics over b1"),
    );
    let dst = SocketAddr::from((WEB_VIP, WEB_UDP));
    let sock = s
        .client
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, SRC_SHARED)))
        .expect("bind the client's fixed UDP port");
    let slot = Duration::from_millis(50);
    let t0 = Instant::now();
    let before: Vec<_> = (0..5)
        .flat_map(|_| udp_slot(&sock, dst, slot, t0))
        .collect();
    assert!(
        before.len() == 5 && before.iter().all(|e| e.1 == "b1" && e.2 == dst),
        "[{shape}] before the change, 5 requests from port {SRC_SHARED} go to b1: {}\n{}",
        fmt_events(&before),
        s.lab.diagnostics()
    );
    let mut conn = s
        .client
        .connect(WEB_VIP, WEB_TCP, T)
        .expect("connect to web");
    let first = conn.request().expect("a request on the connection").backend;
    assert_eq!(first, "b1", "[{shape}] web has b1 alone");

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
        "[{shape}] shared backend: web b1 -> b2, b1 stays in metrics; UDP moved at \
         {moved_at:?}: {}",
        fmt_events(&after)
    );
    let Some(moved_at) = moved_at else {
        panic!(
            "[{shape}] b1 left web (still in metrics): the UDP flow from port {SRC_SHARED} \
             stayed on b1 for 2 s: {}\n{}",
            fmt_events(&after),
            s.lab.diagnostics()
        );
    };
    assert!(
        moved_at <= MOVE_WITHIN,
        "[{shape}] the UDP flow moved {moved_at:?} after the write (want <= {MOVE_WITHIN:?}): {}",
        fmt_events(&after)
    );
    let stray: Vec<_> = after
        .iter()
        .filter(|e| e.0 > moved_at && (e.1 != "b2" || e.2 != dst))
        .collect();
    assert!(
        stray.is_empty(),
        "[{shape}] after the flow moved to b2, answers came from elsewhere: {stray:?}"
    );
    // The change is applied (the UDP flow moved): the connection's next segment is reset.
    let t = Instant::now();
    let r = conn.request();
    let took = t.elapsed();
    let resets_after = s.lab.drop_count("backend_gone_tcp_reset");
    assert!(
        matches!(&r, Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe)),
        "[{shape}] b1 left web (still in metrics): the connection through web to b1 must be \
         reset, got {:?} after {took:?}",
        r.map(|x| x.backend)
    );
    assert!(
        took < Duration::from_secs(1) && resets_after > resets_before,
        "[{shape}] the reset took {took:?}; backend_gone_tcp_reset {resets_before} -> \
         {resets_after} (want it from the datapath, at once)"
    );
    let fresh = s.client.tally(Proto::Tcp, WEB_VIP, WEB_TCP, 10, T);
    let metrics = s.client.tally(Proto::Tcp, METRICS_VIP, WEB_TCP, 10, T);
    assert!(
        fresh.all_ok() && fresh.count("b2") == 10 && metrics.all_ok() && metrics.count("b1") == 10,
        "[{shape}] after the change: web {fresh} (want b2 only), metrics {metrics} (want b1 only)"
    );
}
