//! SIGKILL under load (issue 10 §5): lbproxy killed with SIGKILL and started again at once,
//! while a client opens about 100 TCP connections a second to the VIP, loses no request,
//! and a connection established before the kill keeps working through the restart.
//!
//! The programs and maps stay attached and pinned when lbproxy dies, so the datapath never
//! stops; the new process takes over the pins. A request counts as lost if it fails in any
//! way within [`T`] (1 s): a SYN dropped while nothing serves the VIP would be retransmitted
//! only after 1 s, so it shows up here as a failure, not as a slow success.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::paced::{SinceKill, failures, paced, show};
use lbproxy_tests::lab::{Shape, TcpConn, tcp_request_here};

both_shapes!(sigkill_under_load);

/// How long the client load runs.
const LOAD_FOR: Duration = Duration::from_secs(8);
/// When, after the load starts, lbproxy is killed.
const KILL_AT: Duration = Duration::from_secs(2);
/// One new connection per tick: about 100 a second.
const TICK: Duration = Duration::from_millis(10);
/// The long-lived connection's request interval.
const LONG_TICK: Duration = Duration::from_millis(200);
/// Fewer new connections than this means the load itself did not run as planned (the
/// schedule allows `LOAD_FOR / TICK` = 800; a request takes well under a millisecond).
const MIN_TRIED: usize = 400;

fn sigkill_under_load(shape: Shape) {
    let mut s = Setup::new(shape, &["b1", "b2", "b3"]);
    let names: BTreeSet<&str> = s.backends.iter().map(|p| p.name.as_str()).collect();
    let mut conn: TcpConn = s
        .client
        .connect(WEB_VIP, WEB_TCP, T)
        .unwrap_or_else(|e| panic!("[{shape}] long-lived connection to the VIP: {e}"));
    let first = conn
        .request()
        .unwrap_or_else(|e| panic!("[{shape}] first request on the long-lived connection: {e}"))
        .backend;

    let start = Instant::now();
    let client = &s.client;
    let lab = &s.lab;
    let lb = &mut s.lb;
    // lbproxy is killed and started again on this thread: its child dies with the thread
    // that spawned it (PR_SET_PDEATHSIG), so the new handle must stay here.
    let (load, long, killed, mut lb2, healthy) = std::thread::scope(|sc| {
        let load = sc.spawn(|| {
            client.run(|| {
                paced(start, LOAD_FOR, TICK, || {
                    tcp_request_here(WEB_VIP, WEB_TCP, T)
                        .map(|(r, _)| r.backend)
                        .map_err(|e| e.to_string())
                })
            })
        });
        let long = sc.spawn(|| {
            paced(start, LOAD_FOR, LONG_TICK, || {
                conn.request().map(|r| r.backend).map_err(|e| e.to_string())
            })
        });
        std::thread::sleep((start + KILL_AT).saturating_duration_since(Instant::now()));
        lb.kill();
        let killed = start.elapsed();
        let mut lb2 = lab.start_lbproxy();
        let healthy = lb2.wait_healthy(HEALTHY_WITHIN);
        let healthy_at = start.elapsed();
        (
            load.join().expect("load thread"),
            long.join().expect("long-lived connection thread"),
            killed,
            lb2,
            healthy.map(|since_spawn| (since_spawn, healthy_at)),
        )
    });
    let (since_spawn, healthy_at) = healthy.unwrap_or_else(|e| panic!("[{shape}] restart: {e}"));
    assert_eq!(
        lb2.argv(),
        s.lb.argv(),
        "[{shape}] the restarted lbproxy's command line"
    );

    let in_phase =
        |from: Duration, to: Duration| load.iter().filter(|a| a.at >= from && a.at < to).count();
    let before = in_phase(Duration::ZERO, killed);
    let down = in_phase(killed, healthy_at);
    let after = in_phase(healthy_at, Duration::MAX);
    let slowest = load.iter().map(|a| a.took).max().unwrap_or_default();
    let failed = failures(&load, &|b| names.contains(b));
    let long_failed = failures(&long, &|b| b == first);
    eprintln!(
        "[{shape}] SIGKILL at {killed:?}; new lbproxy healthy {since_spawn:?} after spawn \
         ({} after the kill). New connections: {} tried ({before} before the kill, {down} until \
         healthy, {after} after), {} failed, slowest {slowest:?}. Long-lived connection to \
         {first}: {} requests, {} failed",
        SinceKill(healthy_at, killed),
        load.len(),
        failed.len(),
        long.len(),
        long_failed.len(),
    );

    assert!(
        failed.is_empty(),
        "[{shape}] {} of {} new connections failed (times relative to the SIGKILL; lbproxy \
         healthy again at {}):\n  {}\n{}\n{}",
        failed.len(),
        load.len(),
        SinceKill(healthy_at, killed),
        show(&failed, killed),
        lb2.log(),
        s.lab.diagnostics()
    );
    assert!(
        long_failed.is_empty(),
        "[{shape}] the connection established before the kill (to {first}): {} of {} requests \
         failed (times relative to the SIGKILL):\n  {}\n{}",
        long_failed.len(),
        long.len(),
        show(&long_failed, killed),
        lb2.log()
    );
    assert!(
        load.len() >= MIN_TRIED && before > 0 && down + after > 0,
        "[{shape}] the load did not run as planned: {} new connections ({before} before the \
         kill, {down} until healthy, {after} after), at least {MIN_TRIED} expected",
        load.len()
    );
    assert!(
        after > 0,
        "[{shape}] no request after the new lbproxy became healthy ({} after the kill); \
         load ran {LOAD_FOR:?}",
        SinceKill(healthy_at, killed)
    );
    assert!(
        lb2.is_running(),
        "[{shape}] the restarted lbproxy exited after the load\n{}",
        lb2.log()
    );
}
