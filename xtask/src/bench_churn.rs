//! `cargo xtask bench churn`: what happens to existing flows when a service's backends
//! change, for lbproxy and for kube-proxy-style iptables rules with conntrack, side by side.
//!
//! Two namespace labs of the same shape, each with a client pod and backend pods b1..b4
//! answering with their name on UDP 5353 and TCP 8081:
//! - **lbproxy**: `lbproxy run` (release build) on a manifest;
//! - **iptables**: no lbproxy; the node namespace holds kube-proxy's iptables-mode layout for
//!   the same services (nat table: PREROUTING -> `KUBE-SERVICES` -> `KUBE-SVC-*` with
//!   `-m statistic --mode random --probability` -> `KUBE-SEP-*` with `DNAT`), and the node's
//!   conntrack keeps each flow's NAT. A change is applied as kube-proxy applies it: one
//!   `iptables-restore --noflush` of the whole nat ruleset. Two variants share this lab:
//!   - without conntrack cleanup (a conntrack-based proxy without cleanup);
//!   - with kube-proxy's UDP cleanup: after the restore, `conntrack -D -p udp --orig-dst VIP
//!     --dst-nat <removed endpoint>` for each removed UDP endpoint. kube-proxy never cleans
//!     TCP entries.
//!
//! The rounds alternate between the paths. Two measurements:
//! - **UDP move.** Service `dns` (198.19.0.10:53/UDP) over b1, b2, b3. A client with a fixed
//!   source port sends a request every 20 ms; its flow's backend X is removed from the service
//!   (X keeps running and answering whatever reaches it, like a pod that is terminating or
//!   whose endpoint was removed by a readiness probe). The time from the change (manifest
//!   write, or the start of iptables-restore) until the first answer from a live backend,
//!   observed for at most `--udp-cap-secs`.
//! - **SYN retries.** Service `syn` (198.19.0.11:80/TCP) over b4 and b1, b4 frozen (its pod
//!   drops inbound TCP, so SYNs to it go unanswered). `--syn-clients` clients, each from its
//!   own fixed source port, connect at once with a `--connect-timeout-secs` timeout; those
//!   whose SYN went to b4 wait for the kernel's retransmission (1 s, then 3 s after the
//!   connect). 300 ms after the connects, b4 is replaced by b2. Counted: how many connects
//!   ultimately fail.
//!
//! Results: a table on stdout and `<target>/bench/churn.json`.
//!
//! `--sustained` runs the cluster-scale mode instead ([`sustained`]): 10,000 Services,
//! 100,000 endpoints, 100 endpoint changes a second for 60 s, against lbproxy on the test
//! API server and kube-proxy's iptables and nftables layouts with a model of its sync loop.

use std::collections::BTreeMap;
use std::io::{self, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use lbproxy_tests::lab::connect::PendingConnect;
use lbproxy_tests::lab::{
    Backend, Endpoint, EndpointSlice, Lab, Lbproxy, Manifest, Pod, Proto, Protocol, Service, Shape,
    vip,
};
use serde_json::{Value, json};

use crate::{setup, util};

mod sustained;

const TAG: &str = "bench churn";

const UDP_VIP_N: u8 = 10;
const UDP_PORT: u16 = 53;
const UDP_TARGET: u16 = 5353;
const SYN_VIP_N: u8 = 11;
const SYN_PORT: u16 = 80;
const SYN_TARGET: u16 = 8081;

const BACKENDS: [&str; 4] = ["b1", "b2", "b3", "b4"];
const UDP_MEMBERS: [&str; 3] = ["b1", "b2", "b3"];
/// The frozen backend of the SYN service, and its replacement.
const FROZEN: &str = "b4";
const SYN_STAYS: &str = "b1";
const SYN_REPLACEMENT: &str = "b2";

/// Interval between a UDP client's requests.
const UDP_INTERVAL: Duration = Duration::from_millis(20);
/// How long after the SYNs the frozen backend is replaced.
const REPLACE_AFTER: Duration = Duration::from_millis(300);

#[derive(clap::Args)]
pub struct ChurnArgs {
    /// Rounds per path (each round: one UDP move and one batch of SYN clients).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// SYN clients per round (each with its own fixed source port).
    #[arg(long, default_value_t = 20)]
    syn_clients: u32,
    /// How long a removed backend's UDP flow is watched for a move, in seconds.
    #[arg(long, default_value_t = 8)]
    udp_cap_secs: u64,
    /// Connect timeout of each SYN client, in seconds.
    #[arg(long, default_value_t = 3)]
    connect_timeout_secs: u64,
    /// Leave out the iptables variant with kube-proxy's UDP conntrack cleanup.
    #[arg(long)]
    no_cleanup_variant: bool,
    /// Use the bridge-shaped pod network (cni0-like) instead of routed veths (Calico-like).
    #[arg(long)]
    bridge: bool,
    /// Where to write churn.json / churn_sustained.json (default: <target>/bench).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    big: sustained::SustainedArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Lbproxy,
    Iptables,
    IptablesCleanup,
}

impl Path {
    fn key(self) -> &'static str {
        match self {
            Path::Lbproxy => "lbproxy",
            Path::Iptables => "iptables",
            Path::IptablesCleanup => "iptables_udp_cleanup",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Path::Lbproxy => "lbproxy",
            Path::Iptables => "iptables+conntrack",
            Path::IptablesCleanup => "iptables+conntrack+UDP cleanup",
        }
    }
}

/// Which backends each service has.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Members {
    udp: Vec<&'static str>,
    syn: Vec<&'static str>,
}

impl Members {
    fn initial() -> Members {
        Members {
            udp: UDP_MEMBERS.to_vec(),
            syn: vec![FROZEN, SYN_STAYS],
        }
    }
}

/// One lab. Field order is drop order: lbproxy and the servers go before the lab.
struct Env {
    lb: Option<Lbproxy>,
    _servers: Vec<Backend>,
    client: Pod,
    pods: BTreeMap<&'static str, Pod>,
    lab: Lab,
}

impl Env {
    fn new(shape: Shape, lbproxy: bool) -> Result<Env> {
        let lab = Lab::new(shape);
        let client = lab.add_pod("client");
        let pods: BTreeMap<&'static str, Pod> =
            BACKENDS.iter().map(|n| (*n, lab.add_pod(n))).collect();
        let servers = pods
            .values()
            .map(|p| p.serve(&[UDP_TARGET, SYN_TARGET]))
            .collect();
        pods[FROZEN]
            .freeze_tcp(SYN_TARGET)
            .map_err(|e| anyhow::anyhow!(e))?;
        let mut env = Env {
            lb: None,
            _servers: servers,
            client,
            pods,
            lab,
        };
        let m = Members::initial();
        if lbproxy {
            env.lab.write_manifest(&env.manifest(&m));
            let mut lb = env.lab.start_lbproxy();
            lb.wait_healthy(Duration::from_secs(30))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            env.lb = Some(lb);
            env.wait_applied(&m)?;
        } else {
            env.iptables_restore(&m)?;
            env.lab
                .node_run(&[
                    "iptables",
                    "-t",
                    "nat",
                    "-I",
                    "PREROUTING",
                    "-m",
                    "comment",
                    "--comment",
                    "kubernetes service portals",
                    "-j",
                    "KUBE-SERVICES",
                ])
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        env.sanity_check()?;
        Ok(env)
    }

    fn ip(&self, name: &str) -> Ipv4Addr {
        self.pods[name].ip
    }

    fn manifest(&self, m: &Members) -> Manifest {
        let eps = |names: &[&str]| -> Vec<Endpoint> {
            names
                .iter()
                .map(|n| Endpoint::ready(self.ip(n)).pod(n))
                .collect()
        };
        let mut dns = EndpointSlice::new("dns-1", "dns").port("dns", UDP_TARGET, Protocol::Udp);
        dns.endpoints = eps(&m.udp);
        let mut syn = EndpointSlice::new("syn-1", "syn").port("http", SYN_TARGET, Protocol::Tcp);
        syn.endpoints = eps(&m.syn);
        Manifest::new()
            .with(Service::cluster_ip("dns", vip(UDP_VIP_N)).port(
                "dns",
                UDP_PORT,
                Protocol::Udp,
                UDP_TARGET,
            ))
            .with(dns)
            .with(Service::cluster_ip("syn", vip(SYN_VIP_N)).port(
                "http",
                SYN_PORT,
                Protocol::Tcp,
                SYN_TARGET,
            ))
            .with(syn)
    }

    /// kube-proxy's iptables-mode nat ruleset for `m`, as one iptables-restore input.
    fn ruleset(&self, m: &Members) -> String {
        let svcs = [
            (
                "default/dns:dns",
                "udp",
                vip(UDP_VIP_N),
                UDP_PORT,
                UDP_TARGET,
                &m.udp,
            ),
            (
                "default/syn:http",
                "tcp",
                vip(SYN_VIP_N),
                SYN_PORT,
                SYN_TARGET,
                &m.syn,
            ),
        ];
        let mut decl = vec!["*nat".to_owned(), ":KUBE-SERVICES - [0:0]".to_owned()];
        let mut rules = Vec::new();
        let mut stale = Vec::new();
        for (name, proto, vip, port, target, members) in svcs {
            let svc_chain = chain("SVC", &format!("{name}/{proto}"));
            decl.push(format!(":{svc_chain} - [0:0]"));
            rules.push(format!(
                "-A KUBE-SERVICES -d {vip}/32 -p {proto} -m comment --comment \"{name} cluster IP\" \
                 -m {proto} --dport {port} -j {svc_chain}"
            ));
            let sep = |b: &str| chain("SEP", &format!("{name}/{proto}/{}:{target}", self.ip(b)));
            for b in BACKENDS {
                decl.push(format!(":{} - [0:0]", sep(b)));
                if !members.contains(&b) {
                    stale.push(format!("-X {}", sep(b)));
                }
            }
            // kube-proxy: rule i of n jumps with probability 1/(n-i), the last always.
            let n = members.len();
            for (i, b) in members.iter().enumerate() {
                let ip = self.ip(b);
                let jump = if i + 1 < n {
                    format!(
                        "-m statistic --mode random --probability {:.10} ",
                        1.0 / (n - i) as f64
                    )
                } else {
                    String::new()
                };
                rules.push(format!(
                    "-A {svc_chain} -m comment --comment \"{name} -> {ip}:{target}\" {jump}-j {}",
                    sep(b)
                ));
                rules.push(format!(
                    "-A {} -p {proto} -m comment --comment \"{name}\" -m {proto} -j DNAT \
                     --to-destination {ip}:{target}",
                    sep(b)
                ));
            }
        }
        let mut out = decl;
        out.extend(rules);
        out.extend(stale);
        out.push("COMMIT".to_owned());
        out.join("\n") + "\n"
    }

    fn iptables_restore(&self, m: &Members) -> Result<()> {
        let rules = self.ruleset(m);
        let mut child = self
            .lab
            .node_command("iptables-restore")
            .arg("--noflush")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting iptables-restore")?;
        child
            .stdin
            .take()
            .context("iptables-restore stdin")?
            .write_all(rules.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "iptables-restore failed ({}): {}\ninput:\n{rules}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// kube-proxy's cleanup of a removed UDP endpoint's conntrack entries.
    fn conntrack_cleanup_udp(&self, removed: &str) -> Result<()> {
        let out = self
            .lab
            .node_command("conntrack")
            .args([
                "-D",
                "-p",
                "udp",
                "--orig-dst",
                &vip(UDP_VIP_N).to_string(),
                "--dst-nat",
                &self.ip(removed).to_string(),
            ])
            .output()
            .context("running conntrack -D")?;
        let err = String::from_utf8_lossy(&out.stderr);
        // conntrack exits 1 when nothing matched ("0 flow entries have been deleted").
        if !out.status.success() && !err.contains("0 flow entries") {
            bail!("conntrack -D failed ({}): {err}", out.status);
        }
        Ok(())
    }

    /// Applies `m` the way the path applies changes.
    fn apply(&self, path: Path, m: &Members, removed_udp: Option<&str>) -> Result<()> {
        match path {
            Path::Lbproxy => {
                self.lab.write_manifest(&self.manifest(m));
                Ok(())
            }
            Path::Iptables => self.iptables_restore(m),
            Path::IptablesCleanup => {
                self.iptables_restore(m)?;
                if let Some(r) = removed_udp {
                    self.conntrack_cleanup_udp(r)?;
                }
                Ok(())
            }
        }
    }

    /// For lbproxy: waits until `inspect services` shows `m` (iptables applies synchronously).
    fn wait_applied(&self, m: &Members) -> Result<()> {
        if self.lb.is_none() {
            return Ok(());
        }
        let want = |names: &[&str], port: u16| -> Vec<String> {
            let mut v: Vec<String> = names
                .iter()
                .map(|n| format!("{}:{port}", self.ip(n)))
                .collect();
            v.sort();
            v
        };
        let want_udp = want(&m.udp, UDP_TARGET);
        let want_syn = want(&m.syn, SYN_TARGET);
        let start = Instant::now();
        loop {
            let svcs = self.lab.inspect_json("services");
            let got = |frontend: String| -> Vec<String> {
                let mut v: Vec<String> = svcs
                    .as_array()
                    .and_then(|a| a.iter().find(|s| s["frontend"] == frontend.as_str()))
                    .and_then(|s| s["backends"].as_array().cloned())
                    .unwrap_or_default()
                    .iter()
                    .map(|b| format!("{}:{}", b["addr"].as_str().unwrap_or("?"), b["port"]))
                    .collect();
                v.sort();
                v.dedup();
                v
            };
            if got(format!("{}:{UDP_PORT}/UDP", vip(UDP_VIP_N))) == want_udp
                && got(format!("{}:{SYN_PORT}/TCP", vip(SYN_VIP_N))) == want_syn
            {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(5) {
                bail!("lbproxy did not apply {m:?} within 5 s: {svcs:#}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// UDP reaches every member from fresh source ports; TCP to the SYN service connects
    /// (to its live member) at least sometimes.
    fn sanity_check(&self) -> Result<()> {
        let u = self.client.tally(
            Proto::Udp,
            vip(UDP_VIP_N),
            UDP_PORT,
            60,
            Duration::from_secs(1),
        );
        if !u.all_ok() || UDP_MEMBERS.iter().any(|b| u.count(b) == 0) {
            bail!(
                "sanity check: UDP through {} does not reach all of {UDP_MEMBERS:?}: {u}\n{}",
                vip(UDP_VIP_N),
                self.lab.diagnostics()
            );
        }
        let t = self.client.tally(
            Proto::Tcp,
            vip(SYN_VIP_N),
            SYN_PORT,
            6,
            Duration::from_millis(300),
        );
        if t.count(SYN_STAYS) == 0 || t.count(FROZEN) > 0 {
            bail!(
                "sanity check: TCP through {} should reach only {SYN_STAYS} ({FROZEN} is frozen): {t}",
                vip(SYN_VIP_N)
            );
        }
        Ok(())
    }
}

/// A kube-proxy-like chain name: `KUBE-<kind>-` and 16 base32 characters of a hash (the
/// datapath benchmark's, so both benchmarks name chains alike).
fn chain(kind: &str, key: &str) -> String {
    format!("KUBE-{kind}-{}", crate::bench_datapath::hash16(key))
}

// ---- the UDP move ----

struct UdpRun {
    removed: String,
    /// Time from the start of the change to the first answer from a live backend.
    moved_after: Option<Duration>,
    /// How long applying the change took (manifest write; iptables-restore [+ conntrack -D]).
    apply: Duration,
    /// Answers from the removed backend after the change started.
    answers_from_removed: usize,
    requests: usize,
}

/// Sends one request and collects the answers arriving within one interval: (time since
/// `t0`, backend).
fn udp_slot(sock: &UdpSocket, dst: SocketAddr, t0: Instant) -> Result<Vec<(Duration, String)>> {
    sock.send_to(b"hello\n", dst)?;
    let end = Instant::now() + UDP_INTERVAL;
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(out);
        }
        sock.set_read_timeout(Some(left))?;
        match sock.recv_from(&mut buf) {
            Ok((n, _)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                out.push((
                    t0.elapsed(),
                    text.split_whitespace().next().unwrap_or("?").to_owned(),
                ));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn udp_move(env: &Env, path: Path, src_port: u16, cap: Duration) -> Result<UdpRun> {
    let dst = SocketAddr::from((vip(UDP_VIP_N), UDP_PORT));
    let sock = env
        .client
        .run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, src_port)))
        .with_context(|| format!("binding UDP :{src_port} in the client pod"))?;
    let t = Instant::now();
    let mut pinned = Vec::new();
    while pinned.len() < 10 {
        pinned.extend(udp_slot(&sock, dst, t)?);
        if t.elapsed() > Duration::from_secs(3) {
            bail!(
                "{}: UDP flow from :{src_port} got {} answers in 3 s",
                path.key(),
                pinned.len()
            );
        }
    }
    let x = pinned[0].1.clone();
    if pinned.iter().any(|p| p.1 != x) {
        bail!(
            "{}: UDP flow from :{src_port} was not pinned before the change: {pinned:?}",
            path.key()
        );
    }
    let x_static = *UDP_MEMBERS
        .iter()
        .find(|b| **b == x)
        .with_context(|| format!("answered by unknown backend {x}"))?;
    let mut m = Members::initial();
    m.udp.retain(|b| *b != x_static);

    let t0 = Instant::now();
    env.apply(path, &m, Some(x_static))?;
    let apply = t0.elapsed();
    let mut moved_after = None;
    let mut answers_from_removed = 0;
    let mut requests = 0;
    while t0.elapsed() < cap && moved_after.is_none() {
        requests += 1;
        for (at, b) in udp_slot(&sock, dst, t0)? {
            if b == x {
                answers_from_removed += 1;
            } else if moved_after.is_none() {
                moved_after = Some(at);
            }
        }
    }
    env.apply(path, &Members::initial(), None)?;
    env.wait_applied(&Members::initial())?;
    Ok(UdpRun {
        removed: x,
        moved_after,
        apply,
        answers_from_removed,
        requests,
    })
}

// ---- SYN retries ----

struct SynRun {
    clients: u32,
    /// Connects still pending when the frozen backend was replaced (their SYN went to it).
    pending_at_change: u32,
    /// Connects that ended in an error (timeout).
    failed: u32,
    /// Connect times of the connects that were pending at the change and then succeeded.
    retried_connect: Vec<Duration>,
    apply: Duration,
}

fn syn_round(env: &Env, path: Path, base_port: u16, n: u32, timeout: Duration) -> Result<SynRun> {
    let dst = SocketAddrV4::new(vip(SYN_VIP_N), SYN_PORT);
    let conns: Vec<PendingConnect> = env
        .client
        .run(|| {
            (0..n)
                .map(|i| PendingConnect::start(base_port + i as u16, dst))
                .collect::<io::Result<Vec<_>>>()
        })
        .context("starting the SYN clients")?;
    let first = conns
        .iter()
        .map(|c| c.started)
        .min()
        .unwrap_or_else(Instant::now);
    std::thread::sleep(REPLACE_AFTER.saturating_sub(first.elapsed()));
    let early: Vec<Option<io::Result<Duration>>> =
        conns.iter().map(|c| c.poll(Duration::ZERO)).collect();
    let pending_at_change = early.iter().filter(|r| r.is_none()).count() as u32;

    let mut m = Members::initial();
    m.syn = vec![SYN_STAYS, SYN_REPLACEMENT];
    let t0 = Instant::now();
    env.apply(path, &m, None)?;
    let apply = t0.elapsed();

    let mut failed = 0;
    let mut retried_connect = Vec::new();
    for (c, e) in conns.iter().zip(early) {
        match e {
            Some(Ok(_)) => {}
            Some(Err(_)) => failed += 1,
            // Pending at the change: its SYN went to the frozen backend.
            None => {
                let r = loop {
                    let left = (c.started + timeout).saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break Err(io::Error::new(io::ErrorKind::TimedOut, "connect timeout"));
                    }
                    if let Some(r) = c.poll(left) {
                        break r;
                    }
                };
                match r {
                    Ok(t) => retried_connect.push(t),
                    Err(_) => failed += 1,
                }
            }
        }
    }
    drop(conns);
    env.apply(path, &Members::initial(), None)?;
    env.wait_applied(&Members::initial())?;
    Ok(SynRun {
        clients: n,
        pending_at_change,
        failed,
        retried_connect,
        apply,
    })
}

// ---- report ----

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

pub fn churn(args: &ChurnArgs) -> Result<()> {
    if args.big.sustained {
        return sustained::sustained(&args.big, args);
    }
    if args.rounds == 0 || args.rounds > 20 {
        bail!("--rounds must be in 1..=20");
    }
    if args.syn_clients == 0 || args.syn_clients > 100 {
        bail!("--syn-clients must be in 1..=100");
    }
    setup::setup()?;
    let bin = util::bench_lbproxy("bench")?;
    // The lab starts lbproxy, and runs `lbproxy cleanup` on drop, with this binary.
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    util::catch_interrupts();

    let shape = if args.bridge {
        Shape::Bridge
    } else {
        Shape::Routed
    };
    let cap = Duration::from_secs(args.udp_cap_secs);
    let timeout = Duration::from_secs(args.connect_timeout_secs);
    let mut paths = vec![Path::Lbproxy, Path::Iptables];
    if !args.no_cleanup_variant {
        paths.push(Path::IptablesCleanup);
    }
    eprintln!(
        "[{TAG}] {shape} pods, {} rounds, paths: {}",
        args.rounds,
        paths.iter().map(|p| p.key()).collect::<Vec<_>>().join(", ")
    );
    let lb_env = Env::new(shape, true).context("lbproxy lab")?;
    let ipt_env = Env::new(shape, false).context("iptables lab")?;
    let env_of = |p: Path| {
        if p == Path::Lbproxy {
            &lb_env
        } else {
            &ipt_env
        }
    };

    let np = paths.len() as u32;
    let mut udp: BTreeMap<&str, Vec<UdpRun>> = BTreeMap::new();
    let mut syn: BTreeMap<&str, Vec<SynRun>> = BTreeMap::new();
    for r in 0..args.rounds {
        for (pi, &p) in paths.iter().enumerate() {
            util::check_interrupted()?;
            let k = r * np + pi as u32;
            let run = udp_move(env_of(p), p, 21_000 + k as u16, cap)?;
            eprintln!(
                "[{TAG}] round {} {:<22} UDP: removed {}, {} (apply {:.1} ms, {} answers from the removed backend, {} requests)",
                r + 1,
                p.key(),
                run.removed,
                run.moved_after
                    .map_or(format!("not moved in {}s", cap.as_secs()), |d| format!(
                        "moved after {:.3} s",
                        secs(d)
                    )),
                secs(run.apply) * 1000.0,
                run.answers_from_removed,
                run.requests
            );
            udp.entry(p.key()).or_default().push(run);
        }
        for (pi, &p) in paths.iter().enumerate() {
            util::check_interrupted()?;
            let k = r * np + pi as u32;
            let base = 23_000 + (k * args.syn_clients) as u16;
            let run = syn_round(env_of(p), p, base, args.syn_clients, timeout)?;
            eprintln!(
                "[{TAG}] round {} {:<22} SYN: {} clients, {} pending at the change, {} failed, retried connected after {:?}",
                r + 1,
                p.key(),
                run.clients,
                run.pending_at_change,
                run.failed,
                run.retried_connect
                    .iter()
                    .map(|d| format!("{:.2}s", secs(*d)))
                    .collect::<Vec<_>>()
            );
            syn.entry(p.key()).or_default().push(run);
        }
    }
    drop(lb_env);
    drop(ipt_env);

    // Table.
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut results = serde_json::Map::new();
    let mut udp_cells = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut syn_cells = (Vec::new(), Vec::new(), Vec::new());
    for p in &paths {
        let runs = &udp[p.key()];
        let moved: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.moved_after.map(secs))
            .collect();
        // Not moved counts as longer than the cap for the median.
        let mut all: Vec<f64> = runs
            .iter()
            .map(|r| r.moved_after.map_or(f64::INFINITY, secs))
            .collect();
        let med = median(&mut all);
        udp_cells.0.push(match med {
            Some(m) if m.is_finite() => format!("{:.3} s", m),
            _ => format!("not moved in {} s", cap.as_secs()),
        });
        udp_cells.1.push(format!("{}/{}", moved.len(), runs.len()));
        udp_cells.2.push(if moved.is_empty() {
            "-".into()
        } else {
            format!(
                "{:.3} / {:.3} s",
                moved.iter().copied().fold(f64::INFINITY, f64::min),
                moved.iter().copied().fold(0.0, f64::max)
            )
        });
        let mut applies: Vec<f64> = runs.iter().map(|r| secs(r.apply) * 1000.0).collect();
        udp_cells.3.push(format!(
            "{:.1} ms",
            median(&mut applies).unwrap_or(f64::NAN)
        ));

        let sruns = &syn[p.key()];
        let clients: u32 = sruns.iter().map(|r| r.clients).sum();
        let pending: u32 = sruns.iter().map(|r| r.pending_at_change).sum();
        let failed: u32 = sruns.iter().map(|r| r.failed).sum();
        let mut retried: Vec<f64> = sruns
            .iter()
            .flat_map(|r| r.retried_connect.iter().map(|d| secs(*d)))
            .collect();
        syn_cells.0.push(format!("{failed} of {clients}"));
        syn_cells.1.push(format!("{pending}"));
        syn_cells.2.push(
            median(&mut retried).map_or("-".into(), |m| format!("{m:.2} s ({})", retried.len())),
        );

        results.insert(
            p.key().into(),
            json!({
                "udp_move": {
                    "runs": runs.iter().map(|r| json!({
                        "removed": r.removed,
                        "moved_after_s": r.moved_after.map(secs),
                        "apply_ms": secs(r.apply) * 1000.0,
                        "answers_from_removed": r.answers_from_removed,
                        "requests": r.requests,
                    })).collect::<Vec<Value>>(),
                    "median_s": med.filter(|m| m.is_finite()),
                    "moved": moved.len(),
                },
                "syn_retries": {
                    "runs": sruns.iter().map(|r| json!({
                        "clients": r.clients,
                        "pending_at_change": r.pending_at_change,
                        "failed": r.failed,
                        "retried_connect_s": r.retried_connect.iter().map(|d| secs(*d)).collect::<Vec<_>>(),
                        "apply_ms": secs(r.apply) * 1000.0,
                    })).collect::<Vec<Value>>(),
                    "clients": clients,
                    "pending_at_change": pending,
                    "failed": failed,
                },
            }),
        );
    }
    rows.push((
        "removed backend's UDP flow: moved after (median)".into(),
        udp_cells.0,
    ));
    rows.push(("  runs moved within the cap".into(), udp_cells.1));
    rows.push(("  moved after, min / max".into(), udp_cells.2));
    rows.push(("  applying the change (median)".into(), udp_cells.3));
    rows.push((
        format!("SYN connects failed ({} s timeout)", timeout.as_secs()),
        syn_cells.0,
    ));
    rows.push(("  whose SYN went to the frozen backend".into(), syn_cells.1));
    rows.push((
        "  of those, connected after (median, n)".into(),
        syn_cells.2,
    ));

    println!(
        "\nchurn benchmark: {shape} pods, {} rounds, {} SYN clients per round, lbproxy release build\n",
        args.rounds, args.syn_clients
    );
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let widths: Vec<usize> = (0..paths.len())
        .map(|i| {
            rows.iter()
                .map(|r| r.1[i].len())
                .chain([paths[i].title().len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut header = format!("{:<w0$}", "MEASURE");
    for (i, p) in paths.iter().enumerate() {
        header.push_str(&format!("  {:<w$}", p.title(), w = widths[i]));
    }
    println!("{}", header.trim_end());
    for (m, cells) in &rows {
        let mut line = format!("{m:<w0$}");
        for (i, c) in cells.iter().enumerate() {
            line.push_str(&format!("  {c:<w$}", w = widths[i]));
        }
        println!("{}", line.trim_end());
    }

    let doc = json!({
        "shape": shape.to_string(),
        "rounds": args.rounds,
        "syn_clients": args.syn_clients,
        "udp_cap_s": args.udp_cap_secs,
        "udp_interval_ms": UDP_INTERVAL.as_millis() as u64,
        "connect_timeout_s": args.connect_timeout_secs,
        "replace_after_ms": REPLACE_AFTER.as_millis() as u64,
        "paths": Value::Object(results),
    });
    let out = match &args.out {
        Some(d) => d.clone(),
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let file = out.join("churn.json");
    std::fs::write(&file, serde_json::to_string_pretty(&doc)?)?;
    println!("\nresults: {}", file.display());
    Ok(())
}
