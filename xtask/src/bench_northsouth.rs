//! `cargo xtask bench northsouth`: an external client connects through node A's NodePort to
//! a backend on node B, on the two-node lab (`lbproxy_tests::lab::multinode`), through four
//! paths measured side by side in one run:
//!
//! | path | what is loaded on node A |
//! |---|---|
//! | direct | nothing: the client talks to the backend pod's address, routed through node B |
//! | iptables | kube-proxy's iptables layout with the target's NodePort (`KUBE-NODEPORTS` -> `KUBE-EXT-*` -> masquerade mark -> `KUBE-SVC-*`), after the N ClusterIP rules of `KUBE-SERVICES`, as kube-proxy orders them |
//! | nftables | kube-proxy's nftables layout with `nodeport-ips` and the `service-nodeports` verdict map |
//! | lbproxy | `lbproxy run` on node A (the same N services as manifests, the target of type NodePort), started with the harness command line of `tests/tests/north_south.rs` |
//! | lbproxy-xdp | the same, plus `--xdp-acceleration native`: established flows translated at XDP on node A's uplink |
//! | lbproxy-dsr | `lbproxy run` on both nodes with `--load-balancer-mode dsr`: node B answers the client directly |
//! | lbproxy-xdp-dsr | both nodes with `--load-balancer-mode dsr --xdp-acceleration native` |
//!
//! Every path runs on the same fabric, set up as a wire behaves under XDP
//! (`MultiNodeLab::enable_xdp_tx`: an XDP pass program on the fabric's side of each uplink,
//! which a veth needs to take `XDP_TX` frames, and checksums completed there).
//!
//! The direct path is one hop shorter and has no NAT: it is the ceiling, not a peer. The
//! backend answers 1 byte per TCP connection (`bench_datapath::load`), and runs `iperf3 -s`
//! for throughput through the iperf service's NodePort.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use lbproxy_tests::lab::multinode::{Client, MultiNodeLab, NodeId};
use lbproxy_tests::lab::{Lbproxy, http_get, ns_command};
use serde_json::{Value, json};

use crate::bench_datapath::load::{self, Load, Server};
use crate::bench_datapath::rules::{
    IPERF_NODE_PORT, IPERF_PORT, Services, TCP_NODE_PORT, TCP_TARGET,
};
use crate::bench_datapath::{IperfServer, median, pipe};
use crate::{setup, util};

const TAG: &str = "bench northsouth";

#[derive(clap::Args, Clone, Debug, Default)]
pub struct NorthSouthArgs {
    /// N = 10 and 10,000, one round, shorter measurements.
    #[arg(long)]
    pub quick: bool,
    /// Service counts, comma-separated [default: 10,10000].
    #[arg(long, value_delimiter = ',')]
    pub services: Option<Vec<usize>>,
    /// Rounds per N; each round measures every path once [default: 3; --quick: 1].
    #[arg(long)]
    pub rounds: Option<u32>,
    /// Seconds per TCP connection-rate measurement [default: 4; --quick: 2].
    #[arg(long)]
    pub secs: Option<f64>,
    /// Concurrent client workers.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Output directory [default: <target>/bench/northsouth].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only these paths (comma-separated: iptables, nftables, lbproxy, lbproxy-xdp,
    /// lbproxy-dsr, lbproxy-xdp-dsr); direct, the
    /// baseline, is always measured [default: all].
    #[arg(long, value_delimiter = ',')]
    pub paths: Option<Vec<String>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Direct,
    Iptables,
    Nftables,
    Lbproxy,
    LbproxyXdp,
    LbproxyDsr,
    LbproxyXdpDsr,
}

impl Path {
    const ALL: [Path; 7] = [
        Path::Direct,
        Path::Iptables,
        Path::Nftables,
        Path::Lbproxy,
        Path::LbproxyXdp,
        Path::LbproxyDsr,
        Path::LbproxyXdpDsr,
    ];

    fn key(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Iptables => "iptables",
            Path::Nftables => "nftables",
            Path::Lbproxy => "lbproxy",
            Path::LbproxyXdp => "lbproxy-xdp",
            Path::LbproxyDsr => "lbproxy-dsr",
            Path::LbproxyXdpDsr => "lbproxy-xdp-dsr",
        }
    }

    /// The flags lbproxy runs with on this path (none for the baselines).
    fn lbproxy_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Path::Lbproxy => Some(&[]),
            Path::LbproxyXdp => Some(&["--xdp-acceleration", "native"]),
            Path::LbproxyDsr => Some(&["--load-balancer-mode", "dsr"]),
            Path::LbproxyXdpDsr => Some(&[
                "--load-balancer-mode",
                "dsr",
                "--xdp-acceleration",
                "native",
            ]),
            Path::Direct | Path::Iptables | Path::Nftables => None,
        }
    }
}

#[derive(Debug, Default)]
struct Sample {
    tcp: Load,
    tcp1: Load,
    gbps: Option<f64>,
    programming: Option<Duration>,
}

struct Bench {
    lab: MultiNodeLab,
    client: Client,
    backend: Ipv4Addr,
    services: Services,
    ipt: String,
    nft: String,
    yaml: String,
    secs: Duration,
    workers: usize,
}

impl Bench {
    fn node_a(&self) -> Ipv4Addr {
        self.lab.node(NodeId::A).ip
    }

    fn tcp_dst(&self, p: Path) -> SocketAddr {
        match p {
            Path::Direct => SocketAddrV4::new(self.backend, TCP_TARGET).into(),
            _ => SocketAddrV4::new(self.node_a(), TCP_NODE_PORT).into(),
        }
    }

    fn iperf_dst(&self, p: Path) -> (Ipv4Addr, u16) {
        match p {
            Path::Direct => (self.backend, IPERF_PORT),
            _ => (self.node_a(), IPERF_NODE_PORT),
        }
    }

    /// Loads path `p`: how long programming took, and the lbproxys it runs (node A's
    /// first).
    fn activate(&self, p: Path) -> Result<(Option<Duration>, Vec<Lbproxy>)> {
        let node = |prog: &str| self.lab.node_command(NodeId::A, prog);
        match p {
            Path::Direct => Ok((None, Vec::new())),
            Path::Iptables => Ok((Some(pipe(node("iptables-restore"), &self.ipt)?), Vec::new())),
            Path::Nftables => {
                let mut c = node("nft");
                c.args(["-f", "-"]);
                Ok((Some(pipe(c, &self.nft)?), Vec::new()))
            }
            Path::Lbproxy | Path::LbproxyXdp | Path::LbproxyDsr | Path::LbproxyXdpDsr => {
                let flags = p.lbproxy_flags().unwrap_or_default();
                self.lab.write_manifest_text(&self.yaml);
                let mut lbs = Vec::new();
                if matches!(p, Path::LbproxyDsr | Path::LbproxyXdpDsr) {
                    // Node B records the dispatched flows and answers the client itself:
                    // running before node A takes the first SYN.
                    lbs.push(self.start_healthy(NodeId::B, flags)?.1);
                }
                let (took, lb) = self.start_healthy(NodeId::A, flags)?;
                lbs.insert(0, lb);
                Ok((Some(took), lbs))
            }
        }
    }

    /// lbproxy on `node` with `flags`, once its /healthz answers 200, and how long that took.
    fn start_healthy(&self, node: NodeId, flags: &[&str]) -> Result<(Duration, Lbproxy)> {
        let t = Instant::now();
        let mut lb = self.lab.start_lbproxy(node, flags);
        let addr: SocketAddr = lbproxy_tests::lab::HEALTHZ_ADDR.parse().unwrap();
        let ns = self.lab.node_ns(node).to_owned();
        loop {
            if let Some(st) = lb.try_exit() {
                bail!("lbproxy on {node} exited with {st}\n{}", lb.log());
            }
            if let Ok(200) = http_get(&ns, addr, "/healthz") {
                return Ok((t.elapsed(), lb));
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!("lbproxy on {node} not healthy after 120 s\n{}", lb.log());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn deactivate(&self, p: Path, lbs: Vec<Lbproxy>) -> Result<()> {
        for (mut lb, node) in lbs.into_iter().zip(NodeId::ALL) {
            let dir = self.lab.node(node).bpffs_dir.clone();
            let bin = lbproxy_tests::lab::lbproxy_bin();
            // What the datapath dropped or rejected during the path's load, so a connection
            // error has a reason beside it.
            let drops = ns_command(self.lab.node_ns(node), &bin)
                .args(["inspect", "drops", "--json", "--bpffs-dir"])
                .arg(&dir)
                .output()?;
            if let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(&drops.stdout) {
                let moved: Vec<String> = m
                    .iter()
                    .filter(|(_, v)| v.as_u64().is_some_and(|n| n > 0))
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                eprintln!("[{TAG}] {node}: lbproxy drop counters after the load: {moved:?}");
            }
            // The controller's own CPU over the path, and what its flow collector did: a
            // collection competes with the load for the same cores.
            if let Some(cpu) = process_cpu(lb.pid()) {
                eprintln!(
                    "[{TAG}] {node}: lbproxy CPU over the path: {:.2} s; flow gc: {:?}",
                    cpu.as_secs_f64(),
                    lb.stdout()
                        .lines()
                        .chain(lb.stderr().lines())
                        .filter(|l| l.contains("flow gc"))
                        .filter_map(|l| l.split_once("scanned").map(|(_, r)| format!("scanned{r}")))
                        .collect::<Vec<_>>()
                );
            }
            lb.terminate(Duration::from_secs(20));
            let out = ns_command(self.lab.node_ns(node), &bin)
                .args(["cleanup", "--bpffs-dir"])
                .arg(&dir)
                .output()?;
            if !out.status.success() {
                bail!(
                    "lbproxy cleanup failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        if matches!(p, Path::Iptables | Path::Nftables) {
            self.lab
                .node_run(NodeId::A, &["nft", "flush", "ruleset"])
                .map_err(|e| anyhow!("{e}"))?;
        }
        let _ = self.lab.node_run(NodeId::A, &["conntrack", "-F"]);
        Ok(())
    }

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

    fn iperf(&self, p: Path) -> Result<f64> {
        let (dst, port) = self.iperf_dst(p);
        let secs = (self.secs.as_secs_f64() * 0.6).ceil().max(1.0) as u32;
        let (ok, out, err) = util::capture(ns_command(&self.client.netns, "iperf3").args([
            "-c",
            &dst.to_string(),
            "-p",
            &port.to_string(),
            "-t",
            &secs.to_string(),
            "-J",
        ]))?;
        let v: Value = serde_json::from_str(&out)
            .map_err(|e| anyhow!("iperf3 -c {dst}:{port}: bad JSON ({e}); ok={ok} {err}"))?;
        v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .map(|b| b / 1e9)
            .ok_or_else(|| anyhow!("iperf3 -c {dst}:{port}: no result: {}", v["error"]))
    }

    fn measure(&self, p: Path) -> Result<Sample> {
        let (programming, lbs) = self.activate(p)?;
        let r = (|| -> Result<Sample> {
            self.wait_reachable(p)?;
            // Warm-up, not counted.
            load::tcp_crr(
                &self.client.netns,
                self.tcp_dst(p),
                self.workers,
                self.secs.min(Duration::from_millis(1500)),
            );
            Ok(Sample {
                programming,
                tcp: load::tcp_crr(&self.client.netns, self.tcp_dst(p), self.workers, self.secs),
                tcp1: load::tcp_crr(&self.client.netns, self.tcp_dst(p), 1, self.secs / 2),
                gbps: Some(self.iperf(p)?),
            })
        })();
        let d = self.deactivate(p, lbs);
        let s = r?;
        d?;
        Ok(s)
    }
}

fn bench_n(
    n: usize,
    paths: &[Path],
    rounds: u32,
    secs: Duration,
    workers: usize,
) -> Result<BTreeMap<Path, Vec<Sample>>> {
    let lab = MultiNodeLab::new();
    lab.enable_xdp_tx();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _server = Server::start(&b1.netns, b'1', TCP_TARGET, 5353)?;
    let _iperf = IperfServer(
        ns_command(&b1.netns, "iperf3")
            .args(["-s", "-p", &IPERF_PORT.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("iperf3 -s")?,
    );
    let client = lab.add_client("ext");
    client.route_to_pods(lab.node(NodeId::B));
    let services = Services::new(n, &[b1.ip.into()], b1.ip.into())
        .with_node_ports(&[lab.node(NodeId::A).ip.into()]);
    let t = Instant::now();
    let (ipt, nft, yaml) = (
        services.iptables_full(),
        services.nft_full(),
        services.manifest_yaml(),
    );
    eprintln!(
        "[{TAG}] N={n}: rulesets and manifests rendered in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let b = Bench {
        lab,
        client,
        backend: b1.ip,
        services,
        ipt,
        nft,
        yaml,
        secs,
        workers,
    };
    let _ = &b.services;
    // iperf3's server needs a moment.
    std::thread::sleep(Duration::from_millis(200));
    let mut out: BTreeMap<Path, Vec<Sample>> = BTreeMap::new();
    for round in 1..=rounds {
        for &p in paths {
            let s = b.measure(p)?;
            eprintln!(
                "[{TAG}] N={n} round {round} {:<8}: TCP {:>7.0} conn/s p50 {:>5.0} µs p99 {:>6.0} µs ({} err) | 1 worker p50 {:>4.0} µs | {:>5.2} Gbit/s | program {}",
                p.key(),
                s.tcp.rate(),
                s.tcp.pct(0.5),
                s.tcp.pct(0.99),
                s.tcp.errors,
                s.tcp1.pct(0.5),
                s.gbps.unwrap_or(f64::NAN),
                s.programming
                    .map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
            );
            out.entry(p).or_default().push(s);
        }
    }
    Ok(out)
}

fn summarize(v: &[Sample]) -> Value {
    let m = |f: &dyn Fn(&Sample) -> f64| median(v.iter().map(f).collect());
    json!({
        "tcp_crr": {
            "rate_per_s": m(&|s| s.tcp.rate()),
            "p50_us": m(&|s| s.tcp.pct(0.5)),
            "p99_us": m(&|s| s.tcp.pct(0.99)),
            "errors": v.iter().map(|s| s.tcp.errors).sum::<u64>(),
        },
        "tcp_crr_1worker": {
            "rate_per_s": m(&|s| s.tcp1.rate()),
            "p50_us": m(&|s| s.tcp1.pct(0.5)),
            "p99_us": m(&|s| s.tcp1.pct(0.99)),
        },
        "throughput_gbps": m(&|s| s.gbps.unwrap_or(f64::NAN)),
        "programming_ms": m(&|s| s.programming.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)),
    })
}

fn table(n: usize, r: &Value) -> String {
    let f = |v: &Value| v.as_f64();
    let direct = f(&r["direct"]["tcp_crr"]["rate_per_s"]);
    let dgbps = f(&r["direct"]["throughput_gbps"]);
    let ratio = |x: Option<f64>, base: Option<f64>| match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!(" ({:.2}×)", x / b),
        _ => String::new(),
    };
    let keys: Vec<&str> = Path::ALL.iter().map(|p| p.key()).collect();
    let mut out = format!(
        "| N = {n} | {} |\n|---|{}\n",
        keys.join(" | "),
        "---|".repeat(keys.len())
    );
    let row = |name: &str, cell: &dyn Fn(&Value) -> String| {
        let cells: Vec<String> = Path::ALL.iter().map(|p| cell(&r[p.key()])).collect();
        format!("| {name} | {} |\n", cells.join(" | "))
    };
    out += &row("TCP connections/s", &|v| {
        let x = f(&v["tcp_crr"]["rate_per_s"]);
        format!(
            "{}{}",
            x.map_or("-".into(), |x| format!("{x:.0}")),
            ratio(x, direct)
        )
    });
    out += &row("p50 / p99 (µs), 8 workers", &|v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["tcp_crr"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["tcp_crr"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    out += &row("p50 / p99 (µs), 1 worker", &|v| {
        format!(
            "{:.0} / {:.0}",
            f(&v["tcp_crr_1worker"]["p50_us"]).unwrap_or(f64::NAN),
            f(&v["tcp_crr_1worker"]["p99_us"]).unwrap_or(f64::NAN)
        )
    });
    out += &row("TCP throughput (Gbit/s)", &|v| {
        let x = f(&v["throughput_gbps"]);
        format!(
            "{}{}",
            x.map_or("-".into(), |x| format!("{x:.2}")),
            ratio(x, dgbps)
        )
    });
    out += &row("programming all N", &|v| {
        f(&v["programming_ms"]).map_or("-".into(), |x| format!("{x:.0} ms"))
    });
    out
}

pub fn northsouth(args: &NorthSouthArgs) -> Result<()> {
    let mut ns = args.services.clone().unwrap_or_else(|| vec![10, 10_000]);
    if ns.is_empty() || ns.iter().any(|n| !(3..=30_000).contains(n)) {
        bail!("--services: each N must be in 3..=30000");
    }
    ns.sort_unstable();
    ns.dedup();
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 });
    if !(1..=20).contains(&rounds) {
        bail!("--rounds must be in 1..=20");
    }
    let secs = args.secs.unwrap_or(if args.quick { 2.0 } else { 4.0 });
    if !(0.2..=120.0).contains(&secs) {
        bail!("--secs must be in 0.2..=120");
    }
    if !(1..=256).contains(&args.workers) {
        bail!("--workers must be in 1..=256");
    }
    let paths = match &args.paths {
        None => Path::ALL.to_vec(),
        Some(names) => {
            let mut paths = vec![Path::Direct];
            for name in names {
                let p = Path::ALL
                    .into_iter()
                    .find(|p| p.key() == name.trim())
                    .ok_or_else(|| anyhow!("--paths: unknown path {name:?}"))?;
                if !paths.contains(&p) {
                    paths.push(p);
                }
            }
            paths.sort();
            paths
        }
    };
    let out_dir = match &args.out {
        Some(d) => d.clone(),
        None => util::target_dir()?.join("bench").join("northsouth"),
    };
    setup::setup()?;
    let bin = util::bench_lbproxy("bench")?;
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    util::catch_interrupts();
    eprintln!(
        "[{TAG}] external client -> node A NodePort -> backend on node B; N = {ns:?}, {rounds} round(s), TCP {secs} s per path, {} workers",
        args.workers
    );
    let mut results = serde_json::Map::new();
    let mut tables = Vec::new();
    for n in &ns {
        let samples = bench_n(
            *n,
            &paths,
            rounds,
            Duration::from_secs_f64(secs),
            args.workers,
        )?;
        let mut r = serde_json::Map::new();
        for (p, v) in &samples {
            r.insert(p.key().into(), summarize(v));
        }
        let r = Value::Object(r);
        tables.push(table(*n, &r));
        results.insert(n.to_string(), r);
    }
    let doc = json!({
        "what": "north-south: an external client through node A's NodePort to a backend on node B",
        "rounds": rounds,
        "secs": secs,
        "workers": args.workers,
        "results": results,
    });
    std::fs::create_dir_all(&out_dir)?;
    std::fs::write(
        out_dir.join("results.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    println!();
    for t in &tables {
        println!("{t}");
    }
    println!("results: {}", out_dir.join("results.json").display());
    Ok(())
}

/// User plus system CPU time of process `pid` so far, from `/proc/PID/stat`.
fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th
    // fields of the line, the 12th and 13th after it.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    Some(Duration::from_millis(ticks * 1000 / hz.max(1)))
}
