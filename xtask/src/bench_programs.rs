//! `cargo xtask bench programs`: what each kind of packet costs each pod program, measured by
//! the kernel around the program alone.
//!
//! The connection-rate benchmark (`bench datapath`) reports the programs' mean run time
//! from `kernel.bpf_stats_enabled`, over real traffic. On a shared VM that figure moves by
//! ±15% between runs: a vCPU preempted in the middle of a program counts the wait as run
//! time, and the mix of packets is the load's. This benchmark takes the machine out as far
//! as it can: a real `lbproxy run` attaches the real programs to a lab pod's interface, over
//! N services, and each case's frame is run many times with `BPF_PROG_TEST_RUN` (one run
//! per call, on a fresh copy of the frame, so a translated packet is never translated
//! twice). The median of the kernel's per-run durations is the figure; the cases are
//! interleaved over rounds so a slow minute touches them all alike.
//!
//! The cases are the packets of a TCP or UDP exchange between a client pod and a backend
//! pod through a ClusterIP, as each program meets them (stack bypass off):
//! - `lb_from_pod` on the client's interface: a packet of an existing flow to the VIP, and a
//!   SYN that selects a backend again (a SYN on a flow still in SYN_SENT is a new flow: the
//!   new-flow path, source check and both inserts included);
//! - `lb_from_pod` on the backend's interface: its reply, not addressed to a frontend;
//! - `lb_to_pod` on the client's interface: that reply, reverse-translated; on the backend's:
//!   the forward packet after translation, which is no reply.
//!
//! And north-south, on the node's uplink (the target is also a NodePort of the uplink's
//! address, its backend on this node), with `--xdp-acceleration native`:
//! - `lb_xdp` and `lb_from_node` on the same packet of an existing flow: what XDP costs
//!   against TC for the packet it translates (XDP's run ends with `XDP_PASS` up to the pod,
//!   TC's with the stack);
//! - `lb_xdp` on a packet to the node that is not for a frontend: what every other packet on
//!   the uplink pays for XDP before it goes on.
//!
//! With `LBPROXY_BIN` set, that binary is measured instead of this tree's release build:
//! the way to compare two builds on one machine, one after the other.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use lbproxy_tests::lab::{
    Lab, Pod, Shape, UPLINK_IF, UPLINK_NODE_ADDR, UPLINK_PEER_ADDR, bpf, http_get,
};
use serde_json::{Value, json};

use crate::bench_datapath::median;
use crate::bench_datapath::rules::{
    Services, TCP_NODE_PORT, TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET,
};
use crate::{setup, util};

const TAG: &str = "bench programs";

#[derive(clap::Args, Clone, Debug)]
pub struct ProgramsArgs {
    /// Services in the maps (the target among N−1 fillers).
    #[arg(long, default_value_t = 10_000)]
    pub services: usize,
    /// Runs of each case per round.
    #[arg(long, default_value_t = 5_000)]
    pub runs: usize,
    /// Rounds; every case is measured once per round, in turn.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// lbproxy's `--lb-algorithm`: `maglev` measures the new-flow cases with the Maglev
    /// table lookup in place of the jump hash.
    #[arg(long, default_value = "jump")]
    pub lb_algorithm: String,
}

/// One packet and where it is run.
struct Case {
    name: &'static str,
    prog: &'static str,
    /// The pod whose host-side interface the program runs on, or `uplink`.
    on: &'static str,
    frame: Vec<u8>,
    /// Each run from another client port (`NEW_FLOW_PORTS`): a new flow every time.
    new_flow: bool,
}

/// The client ports the new-flow case cycles through, one per run: more than it ever makes
/// in one benchmark, so every SYN is a new flow.
const NEW_FLOW_PORTS: std::ops::Range<u16> = 1024..39_000;

impl Case {
    fn frame(&self, n: usize) -> Vec<u8> {
        let mut f = self.frame.clone();
        if self.new_flow {
            let span = usize::from(NEW_FLOW_PORTS.end - NEW_FLOW_PORTS.start);
            let port = NEW_FLOW_PORTS.start + (n % span) as u16;
            f[34..36].copy_from_slice(&port.to_be_bytes());
        }
        f
    }
}

const CLIENT_PORT: u16 = 40_000;
const SYN_PORT: u16 = 40_001;
const UDP_CLIENT_PORT: u16 = 40_002;
/// The external client's port of the north-south flow.
const NS_CLIENT_PORT: u16 = 40_003;
/// XDP's verdict for a packet that goes on to the stack, and TC's.
const XDP_PASS: i32 = 2;
const TC_ACT_UNSPEC: i32 = -1;

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

/// An Ethernet + IPv4 + TCP (flags `tcp`) or UDP (`tcp` = None) frame with 16 bytes of
/// payload. Checksums are whatever falls out: the programs update them incrementally and
/// never check them.
fn frame(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, tcp: Option<u8>) -> Vec<u8> {
    let l4_len = if tcp.is_some() { 20 } else { 8 };
    let payload = [0x61u8; 16];
    let tot = 20 + l4_len + payload.len();
    let mut f = Vec::with_capacity(14 + tot);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x08, 0x00]);
    f.extend_from_slice(&[0x45, 0, (tot >> 8) as u8, tot as u8, 0, 0, 0x40, 0, 64]);
    f.push(if tcp.is_some() { 6 } else { 17 });
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    match tcp {
        Some(flags) => {
            f.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
        }
        None => {
            let len = (8 + payload.len()) as u16;
            f.extend_from_slice(&len.to_be_bytes());
            f.extend_from_slice(&[0, 0]);
        }
    }
    f.extend_from_slice(&payload);
    f
}

fn cases(client: &Pod, backend: &Pod, vip: Ipv4Addr) -> Vec<Case> {
    let (c, b) = (client.ip, backend.ip);
    vec![
        Case {
            name: "TCP to a VIP, flow exists",
            prog: "lb_from_pod",
            on: "client",
            frame: frame(c, CLIENT_PORT, vip, TCP_PORT, Some(TCP_ACK)),
            new_flow: false,
        },
        Case {
            name: "TCP SYN again (SYN_SENT: reselected)",
            prog: "lb_from_pod",
            on: "client",
            frame: frame(c, SYN_PORT, vip, TCP_PORT, Some(TCP_SYN)),
            new_flow: false,
        },
        Case {
            name: "TCP SYN to a VIP, new flow",
            prog: "lb_from_pod",
            on: "client",
            frame: frame(c, 0, vip, TCP_PORT, Some(TCP_SYN)),
            new_flow: true,
        },
        Case {
            name: "TCP reply leaving the backend",
            prog: "lb_from_pod",
            on: "backend",
            frame: frame(b, TCP_TARGET, c, CLIENT_PORT, Some(TCP_ACK)),
            new_flow: false,
        },
        Case {
            name: "TCP reply entering the client",
            prog: "lb_to_pod",
            on: "client",
            frame: frame(b, TCP_TARGET, c, CLIENT_PORT, Some(TCP_ACK)),
            new_flow: false,
        },
        Case {
            name: "TCP forward entering the backend",
            prog: "lb_to_pod",
            on: "backend",
            frame: frame(c, CLIENT_PORT, b, TCP_TARGET, Some(TCP_ACK)),
            new_flow: false,
        },
        Case {
            name: "UDP to a VIP, flow exists",
            prog: "lb_from_pod",
            on: "client",
            frame: frame(c, UDP_CLIENT_PORT, vip, UDP_PORT, None),
            new_flow: false,
        },
        Case {
            name: "UDP reply leaving the backend",
            prog: "lb_from_pod",
            on: "backend",
            frame: frame(b, UDP_TARGET, c, UDP_CLIENT_PORT, None),
            new_flow: false,
        },
        Case {
            name: "UDP reply entering the client",
            prog: "lb_to_pod",
            on: "client",
            frame: frame(b, UDP_TARGET, c, UDP_CLIENT_PORT, None),
            new_flow: false,
        },
        Case {
            name: "NodePort TCP, flow exists (local)",
            prog: "lb_xdp",
            on: "uplink",
            frame: frame(
                UPLINK_PEER_ADDR,
                NS_CLIENT_PORT,
                UPLINK_NODE_ADDR,
                TCP_NODE_PORT,
                Some(TCP_ACK),
            ),
            new_flow: false,
        },
        Case {
            name: "NodePort TCP, flow exists (local)",
            prog: "lb_from_node",
            on: "uplink",
            frame: frame(
                UPLINK_PEER_ADDR,
                NS_CLIENT_PORT,
                UPLINK_NODE_ADDR,
                TCP_NODE_PORT,
                Some(TCP_ACK),
            ),
            new_flow: false,
        },
        Case {
            name: "TCP to the node, not a frontend",
            prog: "lb_xdp",
            on: "uplink",
            frame: frame(
                UPLINK_PEER_ADDR,
                NS_CLIENT_PORT,
                UPLINK_NODE_ADDR,
                22,
                Some(TCP_ACK),
            ),
            new_flow: false,
        },
    ]
}

impl Case {
    /// The action every run of this case must end with: XDP_PASS for `lb_xdp`, on to the
    /// stack for the TC programs (no bypass).
    fn action(&self) -> i32 {
        if self.prog == "lb_xdp" {
            XDP_PASS
        } else {
            TC_ACT_UNSPEC
        }
    }
}

pub fn programs(args: &ProgramsArgs) -> Result<()> {
    if args.runs == 0 || args.rounds == 0 {
        bail!("--runs and --rounds must be at least 1");
    }
    setup::setup()?;
    let bin = util::bench_lbproxy("bench")?;
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    util::catch_interrupts();
    let results = run(args, &bin)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print!("{}", table(&results));
    }
    Ok(())
}

fn run(args: &ProgramsArgs, bin: &std::path::Path) -> Result<Value> {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let backend = lab.add_pod("b1");
    let services = Services::new(
        args.services.max(2),
        &[backend.ip.into()],
        backend.ip.into(),
    )
    .with_node_ports(&[UPLINK_NODE_ADDR.into()]);
    let std::net::IpAddr::V4(vip) = services.target_vip() else {
        bail!("the programs benchmark runs over IPv4");
    };
    lab.write_manifest_text(&services.manifest_yaml());
    eprintln!(
        "[{TAG}] {} with N = {}, --lb-algorithm {}",
        bin.display(),
        args.services,
        args.lb_algorithm
    );
    let mut lb = lab.start_lbproxy_with(&[
        "--lb-algorithm",
        &args.lb_algorithm,
        "--xdp-acceleration",
        "native",
    ]);
    let addr = lbproxy_tests::lab::HEALTHZ_ADDR
        .parse()
        .expect("healthz address");
    let t = Instant::now();
    while !matches!(http_get(lab.node_ns(), addr, "/healthz"), Ok(200)) {
        if let Some(st) = lb.try_exit() {
            bail!("lbproxy exited with {st}\n{}", lb.log());
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("lbproxy not healthy after 120 s\n{}", lb.log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let healthy_after = t.elapsed();
    eprintln!("[{TAG}] healthy after {} ms", healthy_after.as_millis());
    let att = lab.tcx_attachments();
    let prog = |pod: &Pod, name: &str| -> Result<(u32, u32)> {
        att.iter()
            .find(|a| a.ifname == pod.host_if && a.prog_name == name)
            .map(|a| (a.prog_id, a.ifindex))
            .ok_or_else(|| anyhow!("{name} is not attached to {}", pod.host_if))
    };
    let node = lab.node_ns().to_owned();
    let cases = cases(&client, &backend, vip);
    let uplink = bpf::interfaces(&node)
        .into_iter()
        .find(|(_, name)| name == UPLINK_IF)
        .map(|(i, _)| i)
        .ok_or_else(|| anyhow!("no {UPLINK_IF} in {node}"))?;
    let xdp = bpf::xdp_prog_id(&node, UPLINK_IF)
        .ok_or_else(|| anyhow!("lb_xdp is not attached to {UPLINK_IF}\n{}", lb.log()))?;
    let target = |c: &Case| -> Result<(u32, u32)> {
        match (c.on, c.prog) {
            ("uplink", "lb_xdp") => Ok((xdp, uplink)),
            ("uplink", name) => att
                .iter()
                .find(|a| a.ifindex == uplink && a.prog_name == name)
                .map(|a| (a.prog_id, a.ifindex))
                .ok_or_else(|| anyhow!("{name} is not attached to {UPLINK_IF}")),
            ("client", name) => prog(&client, name),
            (_, name) => prog(&backend, name),
        }
    };
    // The flows the cases meet: a SYN of each, so the packets that follow find their flow.
    for (sport, dport, tcp) in [
        (CLIENT_PORT, TCP_PORT, Some(TCP_SYN)),
        (UDP_CLIENT_PORT, UDP_PORT, None),
    ] {
        let (id, ifindex) = prog(&client, "lb_from_pod")?;
        let f = frame(client.ip, sport, vip, dport, tcp);
        let r = bpf::prog_test_run(&node, id, ifindex, &f).context("BPF_PROG_TEST_RUN")?;
        if r.data.get(30..34) != Some(&backend.ip.octets()[..]) {
            bail!(
                "the flow's first packet was not translated to {}",
                backend.ip
            );
        }
    }
    // The north-south flow, from the uplink's peer through the NodePort to the backend on
    // this node: its SYN through lb_from_node.
    {
        let (id, ifindex) = target(&cases[cases.len() - 2])?;
        let f = frame(
            UPLINK_PEER_ADDR,
            NS_CLIENT_PORT,
            UPLINK_NODE_ADDR,
            TCP_NODE_PORT,
            Some(TCP_SYN),
        );
        let r = bpf::prog_test_run(&node, id, ifindex, &f).context("BPF_PROG_TEST_RUN")?;
        if r.data.get(30..34) != Some(&backend.ip.octets()[..]) {
            bail!(
                "the north-south flow's SYN was not translated to {}",
                backend.ip
            );
        }
    }
    let mut samples: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    let mut retvals = vec![0; cases.len()];
    for round in 0..args.rounds {
        eprintln!("[{TAG}] round {}/{}", round + 1, args.rounds);
        for (i, c) in cases.iter().enumerate() {
            let (id, ifindex) = target(c)?;
            let first = round * args.runs;
            let frame = |n: usize| c.frame(first + n);
            let run = if c.prog == "lb_xdp" {
                bpf::xdp_test_run_durations(&node, id, ifindex, frame, args.runs)
            } else {
                bpf::prog_test_run_durations(&node, id, ifindex, frame, args.runs)
            };
            let (rc, d) =
                run.with_context(|| format!("BPF_PROG_TEST_RUN of {} ({})", c.prog, c.name))?;
            if rc != c.action() {
                bail!("{} ({}): action {rc}, want {}", c.prog, c.name, c.action());
            }
            retvals[i] = rc;
            samples[i].extend(d);
        }
    }
    drop(lb);
    let rows: Vec<Value> = cases
        .iter()
        .zip(&samples)
        .zip(&retvals)
        .map(|((c, s), rc)| {
            let v: Vec<f64> = s.iter().map(|&d| f64::from(d)).collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            let p90 = sorted.get(sorted.len() * 9 / 10).copied();
            json!({
                "program": c.prog,
                "on": c.on,
                "case": c.name,
                "median_ns": median(v),
                "p90_ns": p90,
                "runs": s.len(),
                "action": rc,
            })
        })
        .collect();
    Ok(json!({
        "lbproxy": bin.display().to_string(),
        "services": args.services,
        "lb_algorithm": args.lb_algorithm,
        "healthy_after_ms": healthy_after.as_millis() as u64,
        "runs_per_round": args.runs,
        "rounds": args.rounds,
        "cases": rows,
    }))
}

fn table(r: &Value) -> String {
    let mut out = format!(
        "lbproxy {} over {} services, --lb-algorithm {} (healthy after {} ms): each case {} runs × {} rounds\n\n",
        r["lbproxy"].as_str().unwrap_or("?"),
        r["services"],
        r["lb_algorithm"].as_str().unwrap_or("?"),
        r["healthy_after_ms"],
        r["runs_per_round"],
        r["rounds"]
    );
    out.push_str(&format!(
        "{:<12} {:<8} {:<36} {:>10} {:>8}\n",
        "program", "on", "packet", "median ns", "p90 ns"
    ));
    for c in r["cases"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<12} {:<8} {:<36} {:>10} {:>8}\n",
            c["program"].as_str().unwrap_or("?"),
            c["on"].as_str().unwrap_or("?"),
            c["case"].as_str().unwrap_or("?"),
            c["median_ns"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.0}")),
            c["p90_ns"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.0}")),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness itself on 3 services, a few runs: every case ran its program, which let
    /// the packet go on to the stack (no bypass, so TC_ACT_UNSPEC; XDP_PASS for lb_xdp), and
    /// has a median. Timings are not checked. Needs root and LBPROXY_BIN (as `cargo xtask test` provides).
    #[test]
    fn programs_harness_smoke() {
        let bin = lbproxy_tests::lab::lbproxy_bin();
        let args = ProgramsArgs {
            services: 3,
            runs: 20,
            rounds: 2,
            json: true,
            lb_algorithm: "jump".into(),
        };
        for algorithm in ["jump", "maglev"] {
            let args = ProgramsArgs {
                lb_algorithm: algorithm.into(),
                ..args.clone()
            };
            let r = run(&args, &bin).expect("bench programs");
            let cases = r["cases"].as_array().expect("cases");
            assert_eq!(cases.len(), 12, "{r:#}");
            for c in cases {
                assert_eq!(c["runs"], 40, "{algorithm}: {c}");
                let want = if c["program"] == "lb_xdp" { 2 } else { -1 };
                assert_eq!(c["action"], want, "{algorithm}: {c}");
                assert!(
                    c["median_ns"].as_f64().is_some_and(|m| m > 0.0),
                    "{algorithm}: {c}"
                );
            }
        }
    }
}
