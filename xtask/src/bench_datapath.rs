//! `cargo xtask bench datapath`: lbproxy's datapath side by side with kube-proxy's iptables
//! and nftables layouts and with no load balancer at all (issue 5).
//!
//! For each N, one namespace lab (node, a client pod, backend pods b1..b4 running the tiny
//! servers of [`load`]) carries N services ([`rules::Services`]): the target service in the
//! middle (TCP 80 and UDP 53 over b1, b2, b3, or b1..bK with `--target-backends K`), an
//! iperf service next to it (b1 only), and N−2 filler services. Each round measures the six paths in a fixed order (direct,
//! iptables, nftables, lbproxy, lbproxy-bypass, lbproxy-socket), with only one path active
//! at a time:
//! - **direct**: the client talks to b1's pod IP;
//! - **iptables**: kube-proxy's iptables-mode ruleset, one `iptables-restore` in the node ns;
//! - **nftables**: kube-proxy's nftables-mode table `ip kube-proxy`, one `nft -f`;
//! - **lbproxy**: `lbproxy run --manifests` (release build) on the same services, default
//!   settings: translated packets still cross the node's stack;
//! - **lbproxy-bypass**: the same with `--stack-bypass`: packets are redirected straight into
//!   the destination pod.
//! - **lbproxy-socket**: the same with `--socket-lb pods`: the client's `connect()` (and
//!   unconnected `sendto`) is translated by the cgroup programs, so its packets go to the
//!   backend's address untranslated. The load runs in this process's threads, so for this
//!   path the process joins the lab's cgroup2 group (lbproxy's `--cgroup-root`), and leaves
//!   it before the next path.
//!
//! Between paths the node namespace's whole nftables ruleset (which holds iptables-nft's
//! tables too) is flushed, its conntrack table emptied, and lbproxy stopped and cleaned up.
//! Per path: new TCP connections per second with p50/p99 ([`load::tcp_crr`]), UDP
//! request/response ([`load::udp_rr`]), iperf3 throughput, the time to program all N, one
//! endpoint change until the first connection reaches the new backend, and for lbproxy its
//! RSS, BPF map memory and its programs' run time per packet (`kernel.bpf_stats_enabled`).
//! Medians over rounds are reported with ratios against direct; `results.json` and PNG plots
//! go to `--out`.
//!
//! Both families, in the same run (`--families`): after the IPv4 labs, the same paths in
//! IPv6 labs (the pods' IPv6 addresses, IPv6 ClusterIPs and EndpointSlices; the iptables
//! path is `ip6tables-restore`, the nftables path the table `ip6 kube-proxy`), each judged
//! against the IPv6 direct path. IPv4 results are `results` in `results.json`, IPv6 ones
//! `results_ipv6`; the plots are IPv4's.

pub(crate) mod load;
mod plot;
pub(crate) mod rules;

pub(crate) use lbproxy_tests::lab::kube_proxy::hash16;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use lbproxy_tests::lab::{Lab, Lbproxy, Pod, Shape, http_get, ns_run};
use serde_json::{Value, json};

use crate::{setup, util};

use self::load::{Load, Server};
use self::rules::{IPERF_PORT, Services, TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET};

const TAG: &str = "bench datapath";

#[derive(clap::Args, Clone, Debug, Default)]
pub struct DatapathArgs {
    /// N = 10 and 10,000, one round, shorter measurements: under 3 minutes (plus the build).
    #[arg(long)]
    pub quick: bool,
    /// Service counts, comma-separated [default: 10,1000,10000; --quick: 10,10000].
    #[arg(long, value_delimiter = ',')]
    pub services: Option<Vec<usize>>,
    /// Rounds per N; each round measures every path once [default: 3; --quick: 1].
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Seconds per TCP connection-rate measurement [default: 5; --quick: 2]. UDP takes 60%
    /// of it, iperf3 the same (at least 1 s).
    #[arg(long)]
    pub secs: Option<f64>,
    /// Concurrent client workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Output directory [default: <target>/bench/datapath].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Use the bridge-shaped pod network (cni0-like) instead of routed veths (Calico-like).
    #[arg(long)]
    pub bridge: bool,
    /// The target service's endpoints: b1..bK [default: 3]. The direct path always talks to
    /// b1 alone, so with K = 1 every path loads one server, and only the proxy differs.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub target_backends: Option<u8>,
    /// Only these paths (comma-separated: iptables, nftables, lbproxy, lbproxy-bypass,
    /// lbproxy-socket, lbproxy-no-svc-metrics); direct, the baseline, is always measured
    /// [default: all but lbproxy-no-svc-metrics, which is `lbproxy` with
    /// `--per-service-metrics=false`].
    #[arg(long, value_delimiter = ',')]
    pub paths: Option<Vec<String>>,
    /// Address families, comma-separated: ipv4, ipv6 [default: both, IPv4 first].
    #[arg(long, value_delimiter = ',')]
    pub families: Option<Vec<String>>,
    /// Another lbproxy build (an earlier commit's release binary), measured in the same run
    /// as path `lbproxy-baseline`, configured as path `lbproxy`: the way to compare two builds
    /// with every round's noise shared.
    #[arg(long)]
    pub baseline_bin: Option<PathBuf>,
}

/// The address family of one lab: its addresses, services and kube-proxy rulesets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Family {
    V4,
    V6,
}

impl Family {
    const ALL: [Family; 2] = [Family::V4, Family::V6];

    fn key(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }

    /// Where its results go in `results.json`.
    fn results_key(self) -> &'static str {
        match self {
            Family::V4 => "results",
            Family::V6 => "results_ipv6",
        }
    }

    /// How its tables and targets are labelled.
    fn label(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    fn unspecified(self) -> IpAddr {
        match self {
            Family::V4 => Ipv4Addr::UNSPECIFIED.into(),
            Family::V6 => Ipv6Addr::UNSPECIFIED.into(),
        }
    }
}

/// The resolved settings of a run.
#[derive(Clone, Debug)]
struct Config {
    services: Vec<usize>,
    rounds: u32,
    tcp: Duration,
    udp: Duration,
    iperf_secs: u32,
    workers: usize,
    shape: Shape,
    out: PathBuf,
    quick: bool,
    paths: Vec<Path>,
    families: Vec<Family>,
    target_backends: usize,
    baseline_bin: Option<PathBuf>,
}

impl Config {
    fn from_args(a: &DatapathArgs, default_out: PathBuf) -> Result<Config> {
        let services = a.services.clone().unwrap_or_else(|| {
            if a.quick {
                vec![10, 10_000]
            } else {
                vec![10, 1000, 10_000]
            }
        });
        if services.is_empty() || services.iter().any(|n| !(3..=30_000).contains(n)) {
            bail!("--services: each N must be in 3..=30000");
        }
        let mut services = services;
        services.sort_unstable();
        services.dedup();
        let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 });
        if !(1..=20).contains(&rounds) {
            bail!("--rounds must be in 1..=20");
        }
        let secs = a.secs.unwrap_or(if a.quick { 2.0 } else { 5.0 });
        if !(0.2..=120.0).contains(&secs) {
            bail!("--secs must be in 0.2..=120");
        }
        if !(1..=256).contains(&a.workers) {
            bail!("--workers must be in 1..=256");
        }
        let mut paths = vec![Path::Direct];
        for name in a.paths.iter().flatten() {
            let p = Path::ALL
                .into_iter()
                .find(|p| p.key() == name.trim())
                .ok_or_else(|| anyhow!("--paths: unknown path {name:?}"))?;
            if !paths.contains(&p) {
                paths.push(p);
            }
        }
        if a.paths.is_none() {
            paths = Path::ALL.to_vec();
            paths.retain(|p| *p != Path::LbproxyNoSvcMetrics);
        }
        match &a.baseline_bin {
            Some(bin) if !bin.is_file() => {
                bail!("--baseline-bin {}: no such file", bin.display())
            }
            Some(_) if !paths.contains(&Path::LbproxyBaseline) => {
                paths.push(Path::LbproxyBaseline);
            }
            Some(_) => {}
            None if a.paths.is_some() && paths.contains(&Path::LbproxyBaseline) => {
                bail!("--paths lbproxy-baseline needs --baseline-bin")
            }
            None => paths.retain(|p| *p != Path::LbproxyBaseline),
        }
        paths.sort();
        let mut families = Vec::new();
        for name in a.families.iter().flatten() {
            let f = Family::ALL
                .into_iter()
                .find(|f| f.key() == name.trim())
                .ok_or_else(|| anyhow!("--families: unknown family {name:?} (ipv4, ipv6)"))?;
            if !families.contains(&f) {
                families.push(f);
            }
        }
        if families.is_empty() {
            families = Family::ALL.to_vec();
        }
        families.sort();
        Ok(Config {
            paths,
            families,
            services,
            rounds,
            tcp: Duration::from_secs_f64(secs),
            udp: Duration::from_secs_f64(secs * 0.6),
            iperf_secs: (secs * 0.6).ceil().max(1.0) as u32,
            workers: a.workers,
            shape: if a.bridge {
                Shape::Bridge
            } else {
                Shape::Routed
            },
            out: a.out.clone().unwrap_or(default_out),
            quick: a.quick,
            target_backends: usize::from(a.target_backends.unwrap_or(3)),
            baseline_bin: a.baseline_bin.clone(),
        })
    }
}

/// Load sent through a path before it is measured, and not counted (at most as long as the
/// TCP measurement itself, so the harness's smoke test stays short).
const WARM_UP: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Direct,
    Iptables,
    Nftables,
    Lbproxy,
    LbproxyBypass,
    LbproxySocket,
    /// `--baseline-bin`'s build, configured as [`Path::Lbproxy`].
    LbproxyBaseline,
    /// [`Path::Lbproxy`] with `--per-service-metrics=false`: what the per-Service counters
    /// cost. Only when `--paths` names it.
    LbproxyNoSvcMetrics,
}

impl Path {
    const ALL: [Path; 8] = [
        Path::Direct,
        Path::Iptables,
        Path::Nftables,
        Path::Lbproxy,
        Path::LbproxyBypass,
        Path::LbproxySocket,
        Path::LbproxyBaseline,
        Path::LbproxyNoSvcMetrics,
    ];
    /// The lbproxy configurations, judged against issue 5's targets.
    const LBPROXY: [Path; 3] = [Path::Lbproxy, Path::LbproxyBypass, Path::LbproxySocket];

    fn key(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Iptables => "iptables",
            Path::Nftables => "nftables",
            Path::Lbproxy => "lbproxy",
            Path::LbproxyBypass => "lbproxy-bypass",
            Path::LbproxySocket => "lbproxy-socket",
            Path::LbproxyBaseline => "lbproxy-baseline",
            Path::LbproxyNoSvcMetrics => "lbproxy-no-svc-metrics",
        }
    }

    /// The `lbproxy run` arguments that make this configuration.
    fn lbproxy_args(self) -> &'static [&'static str] {
        match self {
            Path::LbproxyBypass => &["--stack-bypass"],
            Path::LbproxySocket => &["--socket-lb", "pods"],
            Path::LbproxyNoSvcMetrics => &["--per-service-metrics=false"],
            _ => &[],
        }
    }
}

/// This process, moved into a cgroup2 group for as long as it lives, and back to the
/// hierarchy's root when dropped: the socket-level programs on `--cgroup-root` see only the
/// sockets of processes in that group, and the load runs in this process's threads.
struct InCgroup {
    root: PathBuf,
}

impl InCgroup {
    fn join(group: &std::path::Path) -> Result<InCgroup> {
        let root = group
            .parent()
            .ok_or_else(|| anyhow!("cgroup {} has no parent", group.display()))?
            .to_path_buf();
        let me = std::process::id().to_string();
        std::fs::write(group.join("cgroup.procs"), &me)
            .with_context(|| format!("moving this process into {}", group.display()))?;
        Ok(InCgroup { root })
    }
}

impl Drop for InCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(
            self.root.join("cgroup.procs"),
            std::process::id().to_string(),
        ) {
            eprintln!(
                "[{TAG}] cannot move this process back to {}: {e}",
                self.root.display()
            );
        }
    }
}

/// One path's figures in one round.
#[derive(Debug, Default)]
struct Sample {
    tcp: Load,
    udp: Load,
    /// The same with one worker: latency without queueing.
    tcp1: Load,
    udp1: Load,
    gbps: Option<f64>,
    programming: Option<Duration>,
    /// Change applied → first connection answered by the new backend.
    change: Option<Duration>,
    /// The apply step alone (iptables-restore / nft -f), or lbproxy's own write time
    /// (`synced … took_us`).
    change_apply: Option<Duration>,
    rss_kib: Option<u64>,
    map_bytes: Option<u64>,
    prog_ns: BTreeMap<String, f64>,
    runs_per_conn: Option<f64>,
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

// ---- commands in namespaces ----

/// Runs `cmd` with `input` on stdin; fails with its stderr. Returns the wall time from spawn
/// to exit.
pub(crate) fn pipe(mut cmd: Command, input: &str) -> Result<Duration> {
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", util::display(&cmd)))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    let took = t.elapsed();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let head: String = err.chars().take(2000).collect();
        bail!("`{}` failed ({}): {head}", util::display(&cmd), out.status);
    }
    Ok(took)
}

/// An `iperf3 -s` in a pod, killed on drop.
pub(crate) struct IperfServer(pub(crate) Child);

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn iperf(client: &Pod, dst: IpAddr, secs: u32) -> Result<f64> {
    let (ok, out, err) = util::capture(
        lbproxy_tests::lab::ns_command(&client.netns, "iperf3").args([
            "-c",
            &dst.to_string(),
            "-p",
            &IPERF_PORT.to_string(),
            "-t",
            &secs.to_string(),
            "-J",
        ]),
    )?;
    let v: Value = serde_json::from_str(&out)
        .map_err(|e| anyhow!("iperf3 -c {dst}: bad JSON ({e}); ok={ok} stderr={err}"))?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| b / 1e9)
        .ok_or_else(|| anyhow!("iperf3 -c {dst}: no result: {}", v["error"]))
}

use crate::bench::{map_memlock_bytes, rss_kib};

/// (run_time_ns, run_cnt) of program `id` (needs kernel.bpf_stats_enabled=1).
fn prog_stats(id: u32) -> Option<(u64, u64)> {
    let out = util::output_of("bpftool", &["prog", "show", "id", &id.to_string(), "-j"])?;
    let v: Value = serde_json::from_str(&out).ok()?;
    Some((v["run_time_ns"].as_u64()?, v["run_cnt"].as_u64()?))
}

// ---- one lab, one N ----

struct Bench<'a> {
    cfg: &'a Config,
    family: Family,
    lab: &'a Lab,
    client: Pod,
    pods: BTreeMap<&'static str, Pod>,
    services: Services,
    changed: Services,
    /// Pre-rendered inputs.
    ipt_full: String,
    ipt_change: String,
    nft_full: String,
    nft_change: String,
    yaml: String,
    yaml_change: String,
}

const BACKENDS: [&str; 4] = ["b1", "b2", "b3", "b4"];

impl Bench<'_> {
    fn ip(&self, name: &str) -> IpAddr {
        pod_ip(&self.pods[name], self.family)
    }

    fn tcp_dst(&self, p: Path) -> SocketAddr {
        match p {
            Path::Direct => SocketAddr::new(self.ip("b1"), TCP_TARGET),
            _ => SocketAddr::new(self.services.target_vip(), TCP_PORT),
        }
    }

    fn udp_dst(&self, p: Path) -> SocketAddr {
        match p {
            Path::Direct => SocketAddr::new(self.ip("b1"), UDP_TARGET),
            _ => SocketAddr::new(self.services.target_vip(), UDP_PORT),
        }
    }

    fn iperf_dst(&self, p: Path) -> IpAddr {
        match p {
            Path::Direct => self.ip("b1"),
            _ => self.services.iperf_vip(),
        }
    }

    /// Programs path `p` from nothing. Returns the programming time and lbproxy's handle.
    fn activate(&self, p: Path) -> Result<(Option<Duration>, Option<Lbproxy>)> {
        match p {
            Path::Direct => Ok((None, None)),
            Path::Iptables => Ok((
                Some(pipe(
                    self.lab.node_command(self.services.iptables_restore()),
                    &self.ipt_full,
                )?),
                None,
            )),
            Path::Nftables => Ok((
                Some(pipe(
                    {
                        let mut c = self.lab.node_command("nft");
                        c.args(["-f", "-"]);
                        c
                    },
                    &self.nft_full,
                )?),
                None,
            )),
            Path::Lbproxy
            | Path::LbproxyBypass
            | Path::LbproxySocket
            | Path::LbproxyBaseline
            | Path::LbproxyNoSvcMetrics => {
                self.lab.write_manifest_text(&self.yaml);
                let t = Instant::now();
                let mut lb = match (&self.cfg.baseline_bin, p) {
                    (Some(bin), Path::LbproxyBaseline) => {
                        self.lab.start_lbproxy_bin_with(bin, p.lbproxy_args())
                    }
                    _ => self.lab.start_lbproxy_with(p.lbproxy_args()),
                };
                let addr: SocketAddr = lbproxy_tests::lab::HEALTHZ_ADDR.parse().unwrap();
                let node = self.lab.node_ns().to_owned();
                loop {
                    if let Some(st) = lb.try_exit() {
                        bail!("lbproxy exited with {st}\n{}", lb.log());
                    }
                    if let Ok(200) = http_get(&node, addr, "/healthz") {
                        break;
                    }
                    if t.elapsed() > Duration::from_secs(120) {
                        bail!("lbproxy not healthy after 120 s\n{}", lb.log());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok((Some(t.elapsed()), Some(lb)))
            }
        }
    }

    fn deactivate(&self, p: Path, lb: Option<Lbproxy>) -> Result<()> {
        if let Some(mut lb) = lb {
            lb.terminate(Duration::from_secs(20));
            let out = self.lab.lbproxy_cleanup();
            if !out.status.success() {
                bail!(
                    "lbproxy cleanup failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        if matches!(p, Path::Iptables | Path::Nftables) {
            self.lab
                .node_run(&["nft", "flush", "ruleset"])
                .map_err(|e| anyhow!("{e}"))?;
        }
        // Empty the node's conntrack table, both families (exit 1 when already empty).
        let _ = self.lab.node_run(&["conntrack", "-F"]);
        let _ = self.lab.node_run(&["conntrack", "-F", "-f", "ipv6"]);
        Ok(())
    }

    /// Waits until a connection to the target (or b1 directly) succeeds.
    fn wait_reachable(&self, p: Path) -> Result<()> {
        let dst = self.tcp_dst(p);
        let t = Instant::now();
        let mut last = None;
        while t.elapsed() < Duration::from_secs(10) {
            match self
                .client
                .run(|| load::tcp_once(dst, Duration::from_millis(300)))
            {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "{}: {dst} not reachable from the client within 10 s: {last:?}\n{}",
            p.key(),
            self.lab.diagnostics()
        )
    }

    /// Connects to the target until the new backend (b4) answers; the time since `t0`.
    fn probe_new_backend(&self, t0: Instant) -> Result<Duration> {
        let dst = self.tcp_dst(Path::Lbproxy);
        // Up to 15 s after the apply step returned.
        let deadline = Instant::now() + Duration::from_secs(15);
        self.client.run(|| {
            while Instant::now() < deadline {
                if let Ok(b'4') = load::tcp_once(dst, Duration::from_millis(200)) {
                    return Ok(t0.elapsed());
                }
            }
            bail!("the new backend b4 was not reached within 15 s after the change was applied ({:.1} s after its start)", t0.elapsed().as_secs_f64())
        })
    }

    /// One endpoint change (the last target backend out, b4 in) on an active path.
    fn change(&self, p: Path, lb: Option<&Lbproxy>) -> Result<(Duration, Duration)> {
        match p {
            Path::Direct => bail!("no change on the direct path"),
            Path::Iptables => {
                let c = self.lab.node_command(self.services.iptables_restore());
                let t0 = Instant::now();
                let apply = pipe(c, &self.ipt_change)?;
                Ok((self.probe_new_backend(t0)?, apply))
            }
            Path::Nftables => {
                let mut c = self.lab.node_command("nft");
                c.args(["-f", "-"]);
                let t0 = Instant::now();
                let apply = pipe(c, &self.nft_change)?;
                Ok((self.probe_new_backend(t0)?, apply))
            }
            Path::Lbproxy
            | Path::LbproxyBypass
            | Path::LbproxySocket
            | Path::LbproxyBaseline
            | Path::LbproxyNoSvcMetrics => {
                let lb = lb.context("lbproxy handle")?;
                let off = lb.stderr_len();
                let off_out = lb.stdout().len();
                let t0 = Instant::now();
                self.lab.write_manifest_text(&self.yaml_change);
                let seen = self.probe_new_backend(t0)?;
                // lbproxy's own timing of the write, from its log.
                let wait = Instant::now();
                loop {
                    let log = format!(
                        "{}\n{}",
                        lb.stderr_since(off),
                        lb.stdout().get(off_out..).unwrap_or_default()
                    );
                    if let Some(us) = log
                        .lines()
                        .rev()
                        .filter(|l| l.contains(" synced") || l.contains("\"synced\""))
                        .find_map(|l| {
                            let rest = &l[l.find("took_us=")? + 8..];
                            rest.split(|c: char| !c.is_ascii_digit())
                                .next()?
                                .parse::<u64>()
                                .ok()
                        })
                    {
                        return Ok((seen, Duration::from_micros(us)));
                    }
                    if wait.elapsed() > Duration::from_secs(3) {
                        bail!("no `synced … took_us=` line in lbproxy's log after the change");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// lbproxy's programs' mean run time per invocation and invocations per connection,
    /// over a short connection-rate run with `kernel.bpf_stats_enabled=1`.
    fn bpf_profile(&self, p: Path, dur: Duration) -> (BTreeMap<String, f64>, Option<f64>) {
        let key = "/proc/sys/kernel/bpf_stats_enabled";
        let before = std::fs::read_to_string(key).unwrap_or_default();
        if std::fs::write(key, "1").is_err() {
            return (BTreeMap::new(), None);
        }
        let mut ids: BTreeMap<u32, String> = BTreeMap::new();
        for a in self.lab.tcx_attachments() {
            ids.insert(a.prog_id, a.prog_name.clone());
        }
        let snap = |ids: &BTreeMap<u32, String>| -> BTreeMap<String, (u64, u64)> {
            let mut m: BTreeMap<String, (u64, u64)> = BTreeMap::new();
            for (id, name) in ids {
                if let Some((t, c)) = prog_stats(*id) {
                    let e = m.entry(name.clone()).or_default();
                    e.0 += t;
                    e.1 += c;
                }
            }
            m
        };
        let a = snap(&ids);
        let load = load::tcp_crr(&self.client.netns, self.tcp_dst(p), self.cfg.workers, dur);
        let b = snap(&ids);
        let _ = std::fs::write(key, before.trim());
        let mut out = BTreeMap::new();
        let mut runs = 0u64;
        for (name, (t1, c1)) in &b {
            let (t0, c0) = a.get(name).copied().unwrap_or_default();
            let (dt, dc) = (t1 - t0, c1 - c0);
            runs += dc;
            if dc > 0 {
                out.insert(name.clone(), dt as f64 / dc as f64);
            }
        }
        let per_conn = (load.ok > 0).then(|| runs as f64 / load.ok as f64);
        (out, per_conn)
    }

    fn measure(&self, p: Path, last_round: bool) -> Result<Sample> {
        let (programming, lb) = self.activate(p)?;
        // The socket-level path translates only the sockets of processes in its group.
        let in_group = match p {
            Path::LbproxySocket => Some(InCgroup::join(self.lab.cgroup())),
            _ => None,
        };
        let r = (|| -> Result<Sample> {
            if let Some(Err(e)) = &in_group {
                bail!("{e:#}");
            }
            self.wait_reachable(p)?;
            // Warm-up, discarded: the first connections after a path change can meet the
            // previous path's leftovers, and one lost SYN costs a worker a whole second of
            // a short measurement. (Before `lbproxy cleanup` detached its links itself, the
            // old programs outlived it briefly and reset the direct path's first
            // connections: 8 errors and a 20-50% lower direct rate in every later round.)
            let warm_up = WARM_UP.min(self.cfg.tcp);
            load::tcp_crr(
                &self.client.netns,
                self.tcp_dst(p),
                self.cfg.workers,
                warm_up,
            );
            load::udp_rr(
                &self.client.netns,
                self.udp_dst(p),
                self.cfg.workers,
                warm_up,
            );
            let mut s = Sample {
                programming,
                ..Sample::default()
            };
            s.tcp = load::tcp_crr(
                &self.client.netns,
                self.tcp_dst(p),
                self.cfg.workers,
                self.cfg.tcp,
            );
            s.udp = load::udp_rr(
                &self.client.netns,
                self.udp_dst(p),
                self.cfg.workers,
                self.cfg.udp,
            );
            s.tcp1 = load::tcp_crr(&self.client.netns, self.tcp_dst(p), 1, self.cfg.tcp / 2);
            s.udp1 = load::udp_rr(&self.client.netns, self.udp_dst(p), 1, self.cfg.udp / 2);
            s.gbps = Some(iperf(&self.client, self.iperf_dst(p), self.cfg.iperf_secs)?);
            if let Some(lb) = &lb {
                s.rss_kib = rss_kib(lb.pid());
                s.map_bytes = map_memlock_bytes(self.lab.bpffs_dir());
                if last_round {
                    let (ns, per) = self.bpf_profile(p, Duration::from_secs(1));
                    s.prog_ns = ns;
                    s.runs_per_conn = per;
                }
            }
            if p != Path::Direct {
                let (seen, apply) = self.change(p, lb.as_ref())?;
                s.change = Some(seen);
                s.change_apply = Some(apply);
            }
            Ok(s)
        })();
        drop(in_group);
        let d = self.deactivate(p, lb);
        let s = r?;
        d?;
        Ok(s)
    }
}

/// A pod's address in `family`.
fn pod_ip(pod: &Pod, family: Family) -> IpAddr {
    match family {
        Family::V4 => pod.ip.into(),
        Family::V6 => pod
            .ip6
            .expect("the single-node lab's pods are dual-stack")
            .into(),
    }
}

fn bench_n(cfg: &Config, n: usize, family: Family) -> Result<BTreeMap<Path, Vec<Sample>>> {
    let lab = Lab::new(cfg.shape);
    let client = lab.add_pod("client");
    let pods: BTreeMap<&'static str, Pod> = BACKENDS.iter().map(|b| (*b, lab.add_pod(b))).collect();
    let mut servers = Vec::new();
    for (i, b) in BACKENDS.iter().enumerate() {
        servers.push(Server::start_on(
            &pods[b].netns,
            family.unspecified(),
            b'1' + i as u8,
            TCP_TARGET,
            UDP_TARGET,
        )?);
    }
    let _iperf = IperfServer(
        lbproxy_tests::lab::ns_command(&pods["b1"].netns, "iperf3")
            .args(["-s", "-p", &IPERF_PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s")?,
    );
    // The client never runs short of ephemeral ports.
    lbproxy_tests::lab::ns::sysctl_write(
        &client.netns,
        "net/ipv4/ip_local_port_range",
        "1024 65000",
    )?;
    let existing = ns_run(lab.node_ns(), &["nft", "list", "ruleset"]).map_err(|e| anyhow!(e))?;
    if !existing.trim().is_empty() {
        bail!("the lab's node namespace already has nftables rules:\n{existing}");
    }
    // The target's endpoints b1..bK; the change replaces bK with b4.
    let members: Vec<IpAddr> = BACKENDS[..cfg.target_backends]
        .iter()
        .map(|b| pod_ip(&pods[b], family))
        .collect();
    let services = Services::new(n, &members, pod_ip(&pods["b1"], family));
    let mut changed_members = members.clone();
    *changed_members.last_mut().expect("at least one backend") = pod_ip(&pods["b4"], family);
    let changed = services.with_target(&changed_members);
    let t = Instant::now();
    let bench = Bench {
        cfg,
        family,
        lab: &lab,
        ipt_full: services.iptables_full(),
        ipt_change: changed.iptables_full(),
        nft_full: services.nft_full(),
        nft_change: changed.nft_incremental(&services),
        yaml: services.manifest_yaml(),
        yaml_change: changed.manifest_yaml(),
        client,
        pods,
        services,
        changed,
    };
    eprintln!(
        "[{TAG}] {} N={n}: rulesets and manifests rendered in {:.1} s ({} iptables-restore lines, {} nft lines, {} KiB of YAML)",
        family.label(),
        t.elapsed().as_secs_f64(),
        bench.ipt_full.lines().count(),
        bench.nft_full.lines().count(),
        bench.yaml.len() / 1024
    );
    debug_assert_eq!(bench.changed.n, n);
    let mut out: BTreeMap<Path, Vec<Sample>> = BTreeMap::new();
    for r in 0..cfg.rounds {
        for &p in &cfg.paths {
            util::check_interrupted()?;
            let s = bench.measure(p, r + 1 == cfg.rounds).with_context(|| {
                format!("{} N={n}, round {}, {}", family.label(), r + 1, p.key())
            })?;
            eprintln!(
                "[{TAG}] {} N={n} round {} {:<8}: TCP {:>7.0} conn/s p50 {:>4.0} µs p99 {:>5.0} µs ({} err) | UDP {:>7.0} req/s p50 {:>4.0} µs | {:>5.2} Gbit/s | program {} | change {}",
                family.label(),
                r + 1,
                p.key(),
                s.tcp.rate(),
                s.tcp.pct(0.5),
                s.tcp.pct(0.99),
                s.tcp.errors + s.udp.errors,
                s.udp.rate(),
                s.udp.pct(0.5),
                s.gbps.unwrap_or(f64::NAN),
                s.programming
                    .map_or("-".into(), |d| format!("{:.1} ms", ms(d))),
                s.change.map_or("-".into(), |d| format!(
                    "{:.1} ms (apply {:.2} ms)",
                    ms(d),
                    s.change_apply.map_or(f64::NAN, ms)
                )),
            );
            out.entry(p).or_default().push(s);
        }
    }
    drop(bench);
    drop(servers);
    Ok(out)
}

// ---- results ----

fn load_json(v: &[&Load]) -> Value {
    let rate = median(v.iter().map(|l| l.rate()).collect());
    json!({
        "rate_per_s": rate,
        "p50_us": median(v.iter().map(|l| l.pct(0.5)).collect()),
        "p99_us": median(v.iter().map(|l| l.pct(0.99)).collect()),
        "errors": v.iter().map(|l| l.errors).sum::<u64>(),
        "rounds": v.iter().map(|l| json!({
            "rate_per_s": l.rate(), "ok": l.ok, "errors": l.errors, "secs": l.secs,
            "p50_us": l.pct(0.5), "p99_us": l.pct(0.99),
        })).collect::<Vec<_>>(),
    })
}

fn path_json(p: Path, v: &[Sample]) -> Value {
    let opt_ms = |f: &dyn Fn(&Sample) -> Option<Duration>| -> Value {
        json!(median(v.iter().filter_map(f).map(ms).collect()))
    };
    let mut j = json!({
        "tcp_crr": load_json(&v.iter().map(|s| &s.tcp).collect::<Vec<_>>()),
        "udp_rr": load_json(&v.iter().map(|s| &s.udp).collect::<Vec<_>>()),
        "tcp_crr_1worker": load_json(&v.iter().map(|s| &s.tcp1).collect::<Vec<_>>()),
        "udp_rr_1worker": load_json(&v.iter().map(|s| &s.udp1).collect::<Vec<_>>()),
        "throughput_gbps": median(v.iter().filter_map(|s| s.gbps).collect()),
        "programming_ms": opt_ms(&|s| s.programming),
        "endpoint_change": if p == Path::Direct { Value::Null } else { json!({
            "to_new_backend_ms": opt_ms(&|s| s.change),
            "apply_ms": opt_ms(&|s| s.change_apply),
            "how": match p {
                Path::Iptables => "iptables-restore of the whole changed ruleset (nat and filter tables, as on a full sync), then connections until one reaches the new backend",
                Path::Nftables => "incremental nft -f transaction (new endpoint chain, service chain flushed and refilled, old endpoint chain deleted; kube-proxy's partial sync), then connections until one reaches the new backend",
                _ => "manifest file rewritten, then connections until one reaches the new backend; apply_ms is lbproxy's own `synced took_us` for that change",
            },
        })},
    });
    if Path::LBPROXY.contains(&p) {
        let last = v.last();
        j["memory"] = json!({
            "rss_mib": last.and_then(|s| s.rss_kib).map(|k| k as f64 / 1024.0),
            "bpf_map_mib": last.and_then(|s| s.map_bytes).map(|b| b as f64 / 1048576.0),
        });
        j["bpf_profile"] = json!({
            "ns_per_run": last.map(|s| s.prog_ns.clone()).unwrap_or_default(),
            "program_runs_per_connection": last.and_then(|s| s.runs_per_conn),
        });
    }
    j
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn k(rate: Option<f64>) -> String {
    rate.map_or("n/a".into(), |r| {
        if r >= 10_000.0 {
            format!("{:.1}k", r / 1000.0)
        } else {
            format!("{r:.0}")
        }
    })
}

fn ratio(x: Option<f64>, base: Option<f64>) -> String {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!(" ({:.2}×)", x / b),
        _ => String::new(),
    }
}

/// The terminal/markdown table for one N of one family.
fn table(n: usize, family: Family, r: &Value) -> String {
    let p = |path: Path| &r[path.key()];
    let d = p(Path::Direct);
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, cell: &dyn Fn(Path, &Value) -> String| {
        rows.push((
            name.to_owned(),
            Path::ALL.iter().map(|&x| cell(x, p(x))).collect(),
        ));
    };
    row("TCP connections/s", &|_, v| {
        let x = f(&v["tcp_crr"]["rate_per_s"]);
        format!("{}{}", k(x), ratio(x, f(&d["tcp_crr"]["rate_per_s"])))
    });
    row("  p50 / p99 latency (µs)", &|_, v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["tcp_crr"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["tcp_crr"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    row("  p50 / p99 with 1 worker (µs)", &|_, v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["tcp_crr_1worker"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["tcp_crr_1worker"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    row("UDP requests/s", &|_, v| {
        let x = f(&v["udp_rr"]["rate_per_s"]);
        format!("{}{}", k(x), ratio(x, f(&d["udp_rr"]["rate_per_s"])))
    });
    row("  p50 / p99 latency (µs)", &|_, v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["udp_rr"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["udp_rr"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    row("  p50 / p99 with 1 worker (µs)", &|_, v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["udp_rr_1worker"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["udp_rr_1worker"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    row("TCP throughput (iperf3, Gbit/s)", &|_, v| {
        let x = f(&v["throughput_gbps"]);
        format!(
            "{}{}",
            x.map_or("n/a".into(), |x| format!("{x:.2}")),
            ratio(x, f(&d["throughput_gbps"]))
        )
    });
    row("programming all N", &|path, v| {
        if path == Path::Direct {
            return "-".into();
        }
        f(&v["programming_ms"]).map_or("n/a".into(), |m| format!("{m:.0} ms"))
    });
    row("one endpoint change → new backend used", &|path, v| {
        if path == Path::Direct {
            return "-".into();
        }
        let c = &v["endpoint_change"];
        format!(
            "{:.1} ms (apply {:.2} ms)",
            f(&c["to_new_backend_ms"]).unwrap_or(f64::NAN),
            f(&c["apply_ms"]).unwrap_or(f64::NAN)
        )
    });
    let w0 = rows
        .iter()
        .map(|r| r.0.chars().count())
        .chain([format!("N = {n}, IPv6").len()])
        .max()
        .unwrap_or(0);
    let widths: Vec<usize> = (0..Path::ALL.len())
        .map(|i| {
            rows.iter()
                .map(|r| r.1[i].chars().count())
                .chain([Path::ALL[i].key().len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    let title = match family {
        Family::V4 => format!("N = {n}"),
        Family::V6 => format!("N = {n}, IPv6"),
    };
    let mut out = format!("| {} |", pad(&title, w0));
    for (i, x) in Path::ALL.iter().enumerate() {
        out.push_str(&format!(" {} |", pad(x.key(), widths[i])));
    }
    out.push('\n');
    out.push_str(&format!("|{}|", "-".repeat(w0 + 2)));
    for w in &widths {
        out.push_str(&format!("{}|", "-".repeat(w + 2)));
    }
    out.push('\n');
    for (name, cells) in &rows {
        out.push_str(&format!("| {} |", pad(name, w0)));
        for (i, c) in cells.iter().enumerate() {
            out.push_str(&format!(" {} |", pad(c, widths[i])));
        }
        out.push('\n');
    }
    for path in Path::LBPROXY {
        let lb = p(path);
        if lb.is_null() {
            continue;
        }
        out.push_str(&format!(
            "\n{}: controller RSS {:.1} MiB, BPF maps (memlock) {:.1} MiB; programs per connection {:.1}, mean run time {}",
            path.key(),
            f(&lb["memory"]["rss_mib"]).unwrap_or(f64::NAN),
            f(&lb["memory"]["bpf_map_mib"]).unwrap_or(f64::NAN),
            f(&lb["bpf_profile"]["program_runs_per_connection"]).unwrap_or(f64::NAN),
            lb["bpf_profile"]["ns_per_run"]
                .as_object()
                .map(|m| m
                    .iter()
                    .map(|(k, v)| format!("{k} {:.0} ns", v.as_f64().unwrap_or(f64::NAN)))
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        ));
    }
    out.push('\n');
    out
}

/// Issue 5's targets for each lbproxy configuration that was measured, at the largest N
/// (flatness: largest against smallest N), in one family against that family's direct path.
fn targets(ns: &[usize], family: Family, results: &Value) -> Vec<Value> {
    let mut t = Vec::new();
    for lbp in Path::LBPROXY {
        if !results[ns.last().copied().unwrap_or(0).to_string()][lbp.key()].is_null() {
            t.extend(targets_of(lbp, ns, family, results));
        }
    }
    t
}

/// Issue 5's targets for one lbproxy configuration, `lbp`.
fn targets_of(lbp: Path, ns: &[usize], family: Family, results: &Value) -> Vec<Value> {
    let hi = ns.last().copied().unwrap_or(0);
    let lo = ns.first().copied().unwrap_or(0);
    let at = |n: usize, p: Path| &results[n.to_string()][p.key()];
    let g = |n: usize, p: Path, a: &str, b: &str| f(&at(n, p)[a][b]);
    let mut t = Vec::new();
    let mut push = |name: String, value: Option<f64>, shown: String, met: Option<bool>| {
        t.push(
            json!({"path": lbp.key(), "family": family.key(), "target": name, "value": value, "shown": shown, "met": met}),
        );
    };
    for (what, key) in [
        ("TCP connection rate", "tcp_crr"),
        ("UDP request rate", "udp_rr"),
    ] {
        let r = match (
            g(hi, lbp, key, "rate_per_s"),
            g(hi, Path::Direct, key, "rate_per_s"),
        ) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        push(
            format!("{what} ≥ 0.95× direct at N={hi}"),
            r,
            r.map_or("n/a".into(), |r| format!("{r:.2}×")),
            r.map(|r| r >= 0.95),
        );
        let key1 = format!("{key}_1worker");
        let dp = match (
            g(hi, lbp, &key1, "p50_us"),
            g(hi, Path::Direct, &key1, "p50_us"),
        ) {
            (Some(a), Some(b)) => Some(a - b),
            _ => None,
        };
        push(
            format!("{what}: p50 (1 worker) within 5 µs of direct at N={hi}"),
            dp,
            dp.map_or("n/a".into(), |d| format!("{d:+.0} µs")),
            dp.map(|d| d <= 5.0),
        );
        let flat = if hi == lo {
            None
        } else {
            match (g(hi, lbp, key, "rate_per_s"), g(lo, lbp, key, "rate_per_s")) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            }
        };
        push(
            format!("{what} flat in N: N={hi} within 5% of N={lo}"),
            flat,
            flat.map_or("n/a (one N)".into(), |r| format!("{r:.2}×")),
            flat.map(|r| r >= 0.95),
        );
    }
    let thr = match (
        f(&at(hi, lbp)["throughput_gbps"]),
        f(&at(hi, Path::Direct)["throughput_gbps"]),
    ) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    push(
        format!("TCP throughput ≥ 0.95× direct at N={hi}"),
        thr,
        thr.map_or("n/a".into(), |r| format!("{r:.2}×")),
        thr.map(|r| r >= 0.95),
    );
    let c = &at(hi, lbp)["endpoint_change"];
    let apply = f(&c["apply_ms"]);
    push(
        format!("one endpoint change written ≤ 1 ms after the controller's decision at N={hi}"),
        apply,
        apply.map_or("n/a".into(), |m| format!("{m:.3} ms")),
        apply.map(|m| m <= 1.0),
    );
    let seen = f(&c["to_new_backend_ms"]);
    push(
        format!("one endpoint change used ≤ 100 ms after the manifest write at N={hi}"),
        seen,
        seen.map_or("n/a".into(), |m| format!("{m:.1} ms")),
        seen.map(|m| m <= 100.0),
    );
    t
}

fn plots(cfg: &Config, ns: &[usize], results: &Value) -> Result<Vec<PathBuf>> {
    let series = |paths: &[Path], get: &dyn Fn(&Value) -> Option<f64>| -> Vec<plot::Series> {
        paths
            .iter()
            .map(|&p| plot::Series {
                name: p.key().into(),
                color: plot::COLORS[Path::ALL.iter().position(|x| *x == p).unwrap()],
                points: ns
                    .iter()
                    .filter_map(|n| Some((*n as f64, get(&results[n.to_string()][p.key()])?)))
                    .collect(),
            })
            .collect()
    };
    let mut files = Vec::new();
    let shape = cfg.shape.to_string();
    let out = |name: &str| cfg.out.join(name);
    let f1 = out("connection_rate.png");
    plot::line_plot(
        &f1,
        &format!("New TCP connections per second ({shape} pods)"),
        "connections/s",
        &series(&Path::ALL, &|v| f(&v["tcp_crr"]["rate_per_s"])),
        false,
    )?;
    files.push(f1);
    let f2 = out("p50_latency.png");
    plot::line_plot(
        &f2,
        &format!("TCP connect+request p50 latency ({shape} pods)"),
        "p50 (µs)",
        &series(&Path::ALL, &|v| f(&v["tcp_crr"]["p50_us"])),
        false,
    )?;
    files.push(f2);
    let f3 = out("programming_time.png");
    plot::line_plot(
        &f3,
        "Time to program all N services",
        "milliseconds (log)",
        &series(&Path::ALL[1..], &|v| f(&v["programming_ms"])),
        true,
    )?;
    files.push(f3);
    Ok(files)
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default();
    json!({
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kernel": util::output_of("uname", &["-r"]).unwrap_or_default().trim(),
        "date": util::output_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default().trim(),
    })
}

/// Runs the whole benchmark with an lbproxy binary already in `LBPROXY_BIN`; writes
/// `results.json` and the plots into `cfg.out` and returns the results.
fn run(cfg: &Config) -> Result<Value> {
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    eprintln!(
        "[{TAG}] {} pods, target over {} backend(s), N = {:?}, {} round(s), TCP {:.1} s / UDP {:.1} s / iperf3 {} s per path, {} workers",
        cfg.shape,
        cfg.target_backends,
        cfg.services,
        cfg.rounds,
        cfg.tcp.as_secs_f64(),
        cfg.udp.as_secs_f64(),
        cfg.iperf_secs,
        cfg.workers
    );
    let started = Instant::now();
    let mut by_family = serde_json::Map::new();
    let mut targets_all = Vec::new();
    for &family in &cfg.families {
        let mut results = serde_json::Map::new();
        for &n in &cfg.services {
            let samples = bench_n(cfg, n, family)?;
            let mut per = serde_json::Map::new();
            for (p, v) in &samples {
                per.insert(p.key().into(), path_json(*p, v));
            }
            results.insert(n.to_string(), Value::Object(per));
        }
        let results = Value::Object(results);
        targets_all.extend(targets(&cfg.services, family, &results));
        by_family.insert(family.results_key().into(), results);
    }
    let mut doc = json!({
        "machine": machine(),
        "config": {
            "shape": cfg.shape.to_string(),
            "services": cfg.services,
            "rounds": cfg.rounds,
            "tcp_secs": cfg.tcp.as_secs_f64(),
            "udp_secs": cfg.udp.as_secs_f64(),
            "iperf_secs": cfg.iperf_secs,
            "workers": cfg.workers,
            "quick": cfg.quick,
            "target_backends": cfg.target_backends,
        },
        "paths": Path::ALL.iter().map(|p| p.key()).collect::<Vec<_>>(),
        "families": cfg.families.iter().map(|f| f.key()).collect::<Vec<_>>(),
        "targets": targets_all,
        "elapsed_s": started.elapsed().as_secs_f64(),
    });
    for (k, v) in by_family {
        doc[k] = v;
    }
    // The plots are the first family's (IPv4 unless only IPv6 ran).
    let plotted = cfg.families.first().copied().unwrap_or(Family::V4);
    let files = plots(cfg, &cfg.services, &doc[plotted.results_key()])?;
    doc["plots"] = json!(
        files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
    );
    let file = cfg.out.join("results.json");
    std::fs::write(&file, serde_json::to_string_pretty(&doc)?)?;

    let m = &doc["machine"];
    println!(
        "\ndatapath benchmark: {} ({} CPUs), Linux {}, {} pods, {} round(s), medians; ratios against direct\n",
        m["cpu"].as_str().unwrap_or("?"),
        m["cpus"],
        m["kernel"].as_str().unwrap_or("?"),
        cfg.shape,
        cfg.rounds
    );
    for &family in &cfg.families {
        for n in &cfg.services {
            println!(
                "{}",
                table(*n, family, &doc[family.results_key()][n.to_string()])
            );
        }
    }
    println!("issue 5 targets:");
    for t in doc["targets"].as_array().unwrap() {
        let verdict = match t["met"].as_bool() {
            Some(true) => "MET   ",
            Some(false) => "MISSED",
            None => "n/a   ",
        };
        println!(
            "  {verdict} {} {}: {}: {}",
            t["family"]
                .as_str()
                .map_or("", |f| if f == "ipv6" { "IPv6" } else { "IPv4" }),
            t["path"].as_str().unwrap_or(""),
            t["target"].as_str().unwrap_or(""),
            t["shown"].as_str().unwrap_or("")
        );
    }
    println!("\nresults: {}", file.display());
    for f in &files {
        println!("plot:    {}", f.display());
    }
    Ok(doc)
}

pub fn datapath(args: &DatapathArgs) -> Result<()> {
    let default_out = util::target_dir()?.join("bench").join("datapath");
    let cfg = Config::from_args(args, default_out)?;
    setup::setup()?;
    let bin = util::bench_lbproxy("bench")?;
    // The lab starts lbproxy, and runs `lbproxy cleanup` on drop, with this binary.
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    util::catch_interrupts();
    run(&cfg).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness itself on 3 services, one short round: every path and figure is in
    /// results.json and the plots are PNG files. Timings are not checked. Needs root and
    /// LBPROXY_BIN (as `cargo xtask test` provides).
    #[test]
    fn datapath_harness_smoke() {
        let out =
            std::env::temp_dir().join(format!("lbproxy-bench-datapath-{}", std::process::id()));
        let cfg = Config::from_args(
            &DatapathArgs {
                services: Some(vec![3]),
                rounds: Some(1),
                secs: Some(0.5),
                workers: 2,
                ..DatapathArgs::default()
            },
            out.clone(),
        )
        .unwrap();
        let doc = run(&cfg).unwrap();
        let on_disk: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap())
                .unwrap();
        // Same document (floats may differ in the last bit after the round trip).
        assert_eq!(on_disk["paths"], doc["paths"]);
        // 9 targets for each of the three lbproxy configurations, in each family.
        assert_eq!(on_disk["targets"].as_array().map(Vec::len), Some(54));
        for r in [&on_disk["results"]["3"], &on_disk["results_ipv6"]["3"]] {
            // Every path measured (lbproxy-baseline is one only with --baseline-bin).
            for &p in &cfg.paths {
                let v = &r[p.key()];
                for key in ["tcp_crr", "udp_rr", "tcp_crr_1worker", "udp_rr_1worker"] {
                    for fig in ["rate_per_s", "p50_us", "p99_us"] {
                        assert!(
                            v[key][fig].as_f64().is_some(),
                            "{} {key} {fig}: {v:#}",
                            p.key()
                        );
                    }
                    assert!(
                        v[key]["rate_per_s"].as_f64().unwrap() > 0.0,
                        "{}: no traffic",
                        p.key()
                    );
                }
                assert!(
                    v["throughput_gbps"].as_f64().is_some(),
                    "{}: {v:#}",
                    p.key()
                );
                if p == Path::Direct {
                    assert!(v["programming_ms"].is_null());
                } else {
                    assert!(v["programming_ms"].as_f64().is_some(), "{}: {v:#}", p.key());
                    assert!(
                        v["endpoint_change"]["to_new_backend_ms"].as_f64().is_some()
                            && v["endpoint_change"]["apply_ms"].as_f64().is_some(),
                        "{}: {v:#}",
                        p.key()
                    );
                }
            }
            for p in Path::LBPROXY {
                let lb = &r[p.key()];
                assert!(lb["memory"]["rss_mib"].as_f64().is_some(), "{lb:#}");
                assert!(lb["memory"]["bpf_map_mib"].as_f64().is_some(), "{lb:#}");
            }
        }
        for name in [
            "connection_rate.png",
            "p50_latency.png",
            "programming_time.png",
        ] {
            let png = std::fs::read(out.join(name)).unwrap();
            assert!(png.len() > 1000, "{name}: {} bytes", png.len());
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}: not a PNG");
            assert_eq!(&png[12..16], b"IHDR", "{name}");
            assert_eq!(&png[png.len() - 8..png.len() - 4], b"IEND", "{name}");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}
