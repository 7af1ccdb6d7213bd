//! `cargo xtask demo`: lbproxy balancing a ClusterIP Service in a network-namespace lab, no
//! cluster needed.
//!
//! The lab (`lbproxy_tests::lab`) is one node namespace with a client pod and three backend
//! pods answering with their name on TCP 8080 and UDP 5353. lbproxy runs in the node
//! namespace on `deploy/examples/demo.yaml` (Service `default/demo`, VIP 198.19.0.10, ports
//! tcp 80->8080 and udp 53->5353). The client sends new TCP connections and UDP requests (a
//! new source port each) to the VIP; the demo counts who answered and checks that every reply
//! came from the VIP. Everything is removed at the end, also on error or Ctrl-C.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use lbproxy_tests::lab::{
    self, Endpoint, EndpointSlice, Lab, Manifest, Proto, Protocol, Service, Shape,
};

use crate::util::{self, check_interrupted, interrupted};

const TAG: &str = "demo";
/// The documented example this demo runs.
const EXAMPLE: &str = "deploy/examples/demo.yaml";
const SERVICE: &str = "demo";
/// VIP 198.19.0.10.
const VIP_N: u8 = 10;
const BACKENDS: [&str; 3] = ["backend-1", "backend-2", "backend-3"];
/// (service port name, service port, target port, protocol)
const PORTS: [(&str, u16, u16, Proto); 2] =
    [("tcp", 80, 8080, Proto::Tcp), ("udp", 53, 5353, Proto::Udp)];
/// Requests per [`lab::tally`] call, so Ctrl-C is noticed quickly and progress is shown.
const CHUNK: usize = 50;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Use the bridge-shaped pod network (cni0-like) instead of routed veths (Calico-like).
    #[arg(long)]
    pub bridge: bool,
    /// Requests per protocol (new TCP connections / UDP requests from new source ports).
    #[arg(long, default_value_t = 300)]
    pub requests: usize,
    /// Only print the manifest for the lab's default addresses (the content of
    /// deploy/examples/demo.yaml) and exit.
    #[arg(long)]
    pub print_manifest: bool,
}

fn say(msg: impl std::fmt::Display) {
    eprintln!("[{TAG}] {msg}");
}

/// The demo's Service and EndpointSlice for backends `(pod name, ip)`.
fn manifest(backends: &[(String, Ipv4Addr)]) -> Manifest {
    let mut svc = Service::cluster_ip(SERVICE, lab::vip(VIP_N));
    let mut slice = EndpointSlice::new(&format!("{SERVICE}-x7k2p"), SERVICE);
    for (name, port, target, proto) in PORTS {
        svc = svc.port(name, port, Protocol::from(proto), target);
        slice = slice.port(name, target, Protocol::from(proto));
    }
    for (pod, ip) in backends {
        slice = slice.endpoint(Endpoint::ready(ip).pod(pod));
    }
    Manifest::new().with(svc).with(slice)
}

/// The backends at the addresses a fresh lab gives them: the client pod is added first
/// (index 0), then the backends (indexes 1..=3).
fn default_backends() -> Vec<(String, Ipv4Addr)> {
    BACKENDS
        .iter()
        .enumerate()
        .map(|(i, b)| (b.to_string(), lab::pod_ip(i as u32 + 1)))
        .collect()
}

const EXAMPLE_HEADER: &str = "\
# The example `cargo xtask demo` runs: one ClusterIP Service and its EndpointSlice, written the
# way Kubernetes serializes them. The addresses are those the demo's namespace lab gives its
# pods (198.18.0.2 is the client; the backends answer with their pod name on TCP 8080 and
# UDP 5353). Regenerate with `cargo xtask demo --print-manifest > deploy/examples/demo.yaml`.
#
#   lbproxy run --manifests deploy/examples/demo.yaml --pod-interfaces 'veth*'
";

/// The YAML documents of a manifest file, comment lines removed, for comparison.
fn strip_comments(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect()
}

pub fn demo(args: &DemoArgs) -> Result<()> {
    if args.print_manifest {
        print!(
            "{EXAMPLE_HEADER}{}",
            manifest(&default_backends()).to_yaml()
        );
        return Ok(());
    }
    if args.requests == 0 {
        bail!("--requests must be at least 1");
    }
    util::catch_interrupts();
    crate::setup::setup()?;
    let bin = util::build_lbproxy(TAG)?;
    // SAFETY: no other thread exists yet in this process (setup's helper threads are joined).
    unsafe { std::env::set_var("LBPROXY_BIN", &bin) };
    check_interrupted()?;

    // The lab library reports failures by panicking; unwinding drops (and so removes) the
    // lab. Turn that into an error here.
    match std::panic::catch_unwind(AssertUnwindSafe(|| run_demo(args))) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            say("stopped early: lbproxy was cleaned up and the lab removed");
            Err(e)
        }
        Err(_) => bail!("the demo failed (see the panic message above); the lab was removed"),
    }
}

fn run_demo(args: &DemoArgs) -> Result<()> {
    let shape = if args.bridge {
        Shape::Bridge
    } else {
        Shape::Routed
    };
    say(format_args!("creating a {shape} lab"));
    // Declared first, so it is dropped last: backends and lbproxy go before the lab.
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let pods: Vec<_> = BACKENDS.iter().map(|b| lab.add_pod(b)).collect();
    let target_ports: Vec<u16> = PORTS.iter().map(|p| p.2).collect();
    let _servers: Vec<_> = pods.iter().map(|p| p.serve(&target_ports)).collect();
    say(format_args!(
        "node namespace {} (/run/netns/{}), client {} ({}), backends {}",
        lab.node_ns(),
        lab.node_ns(),
        client.ip,
        client.netns,
        pods.iter()
            .map(|p| format!("{} {}", p.name, p.ip))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    check_interrupted()?;

    // Manifest: the documented example, if its addresses are the lab's (they are by default).
    let backends: Vec<_> = pods.iter().map(|p| (p.name.clone(), p.ip)).collect();
    let rendered = manifest(&backends).to_yaml();
    let example_path = util::repo_root().join(EXAMPLE);
    match std::fs::read_to_string(&example_path) {
        Ok(text) if strip_comments(&text) == rendered => {
            say(format_args!("manifest: {EXAMPLE}"));
            lab.write_manifest_text(&text);
        }
        Ok(_) => {
            say(format_args!(
                "warning: {EXAMPLE} does not match the lab's addresses; using a manifest \
                 rendered from the lab instead (regenerate the example with `cargo xtask demo \
                 --print-manifest`)"
            ));
            lab.write_manifest_text(&rendered);
        }
        Err(e) => {
            say(format_args!(
                "warning: cannot read {EXAMPLE} ({e}); using a manifest rendered from the lab"
            ));
            lab.write_manifest_text(&rendered);
        }
    }

    let mut lb = lab.start_lbproxy();
    say(format_args!(
        "started `{}` in the node namespace (pid {})",
        lb.argv().join(" "),
        lb.pid()
    ));
    match lb.wait_healthy(Duration::from_secs(30)) {
        Ok(t) => say(format_args!(
            "lbproxy healthy (/healthz 200) after {} ms",
            t.as_millis()
        )),
        Err(e) => bail!("{e}"),
    }
    check_interrupted()?;

    let vip = lab::vip(VIP_N);
    let mut results = Vec::new();
    for (name, port, _, proto) in PORTS {
        let t = send(&client, proto, vip, port, args.requests)?;
        say(format_args!(
            "{proto} {vip}:{port} ({name}): {} requests, {} replies, {} errors in {} ms",
            t.attempts,
            t.replies,
            t.errors.len(),
            t.elapsed.as_millis()
        ));
        results.push(t);
    }

    print_table(&pods, &results);

    println!();
    let dir = lab.bpffs_dir().display().to_string();
    println!(
        "$ nsenter --net={} -- lbproxy inspect services --bpffs-dir {dir}",
        lab::netns_path(lab.node_ns()).display()
    );
    let out = lab.lbproxy_cmd(&["inspect", "services", "--bpffs-dir", &dir]);
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        say(format_args!(
            "warning: lbproxy inspect failed ({})",
            out.status
        ));
    }
    println!();

    // Teardown: stop lbproxy, clean up its pins and links, then drop everything.
    if lb.is_running() {
        lb.sigterm();
        match lb.wait_exit(Duration::from_secs(10)) {
            Some(st) => say(format_args!("lbproxy stopped ({st})")),
            None => {
                say("lbproxy did not stop within 10 s of SIGTERM; killing it");
                lb.kill();
            }
        }
    } else {
        say(format_args!(
            "warning: lbproxy had already exited ({:?})\n{}",
            lb.try_exit(),
            lb.log()
        ));
    }
    let cleanup = lab.lbproxy_cleanup();
    if cleanup.status.success() {
        say("lbproxy cleanup: done");
    } else {
        say(format_args!(
            "warning: lbproxy cleanup failed ({}): {}",
            cleanup.status,
            String::from_utf8_lossy(&cleanup.stderr).trim()
        ));
    }
    drop(lb);
    drop(_servers);
    drop(lab);
    say("lab removed");

    let mut problems = Vec::new();
    for t in &results {
        if !t.errors.is_empty() {
            problems.push(format!(
                "{} {}: {} of {} requests failed (first: {})",
                t.proto,
                t.target,
                t.errors.len(),
                t.attempts,
                t.errors[0]
            ));
        }
        if !t.wrong_source.is_empty() {
            problems.push(format!(
                "{} {}: {} replies did not come from the VIP (first: {} from {})",
                t.proto,
                t.target,
                t.wrong_source.len(),
                t.wrong_source[0].0,
                t.wrong_source[0].1
            ));
        }
        for b in BACKENDS {
            if t.by_backend.get(b).copied().unwrap_or(0) == 0 {
                problems.push(format!("{} {}: {b} got no requests", t.proto, t.target));
            }
        }
    }
    if interrupted() {
        bail!("interrupted");
    }
    if !problems.is_empty() {
        bail!("the demo found problems:\n  {}", problems.join("\n  "));
    }
    say("ok: every request was answered, by all three backends, from the VIP");
    Ok(())
}

/// Requests to one frontend, summed over [`lab::tally`] chunks.
struct Sent {
    proto: Proto,
    target: SocketAddrV4,
    attempts: usize,
    replies: usize,
    by_backend: BTreeMap<String, usize>,
    wrong_source: Vec<(String, SocketAddr)>,
    errors: Vec<String>,
    elapsed: Duration,
}

fn send(client: &lab::Pod, proto: Proto, vip: Ipv4Addr, port: u16, n: usize) -> Result<Sent> {
    let mut s = Sent {
        proto,
        target: SocketAddrV4::new(vip, port),
        attempts: 0,
        replies: 0,
        by_backend: BTreeMap::new(),
        wrong_source: Vec::new(),
        errors: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let start = Instant::now();
    let mut last_progress = Instant::now();
    while s.attempts < n {
        check_interrupted()?;
        let k = CHUNK.min(n - s.attempts);
        let t = client.tally(proto, vip, port, k, Duration::from_secs(1));
        s.attempts += t.attempts;
        s.replies += t.replies();
        for (b, c) in t.by_backend {
            *s.by_backend.entry(b).or_default() += c;
        }
        s.wrong_source.extend(t.wrong_source);
        s.errors.extend(t.errors);
        if s.errors.len() >= lab::net::TALLY_MAX_ERRORS {
            s.errors
                .push(format!("gave up after {} of {n} requests", s.attempts));
            break;
        }
        if last_progress.elapsed() >= Duration::from_secs(2) && s.attempts < n {
            say(format_args!("{proto} {vip}:{port}: {}/{n}", s.attempts));
            last_progress = Instant::now();
        }
    }
    s.elapsed = start.elapsed();
    Ok(s)
}

fn print_table(pods: &[lab::Pod], results: &[Sent]) {
    println!();
    let mut header = format!("{:<12} {:<14}", "backend", "pod address");
    for t in results {
        header.push_str(&format!(
            " {:>16}",
            format!("{} :{}", t.proto, t.target.port())
        ));
    }
    println!("{header}");
    println!("{}", "-".repeat(header.len()));
    let row = |label: &str, addr: &str, f: &dyn Fn(&Sent) -> String| {
        let mut line = format!("{label:<12} {addr:<14}");
        for t in results {
            line.push_str(&format!(" {:>16}", f(t)));
        }
        println!("{line}");
    };
    for p in pods {
        let ip = p.ip.to_string();
        row(&p.name, &ip, &|t| {
            let c = t.by_backend.get(&p.name).copied().unwrap_or(0);
            let pct = if t.replies == 0 {
                0.0
            } else {
                100.0 * c as f64 / t.replies as f64
            };
            format!("{c} ({pct:.0}%)")
        });
    }
    let others: BTreeMap<&String, usize> = results
        .iter()
        .flat_map(|t| t.by_backend.iter())
        .filter(|(b, _)| !pods.iter().any(|p| &p.name == *b))
        .map(|(b, c)| (b, *c))
        .collect();
    for b in others.keys() {
        row(b, "?", &|t| {
            t.by_backend.get(*b).copied().unwrap_or(0).to_string()
        });
    }
    println!("{}", "-".repeat(header.len()));
    row("replies", "", &|t| format!("{}/{}", t.replies, t.attempts));
    row("errors", "", &|t| t.errors.len().to_string());
    row("from VIP", "", &|t| {
        format!("{}/{}", t.replies - t.wrong_source.len(), t.replies)
    });
    for t in results {
        println!(
            "{} replies came from {}: {}",
            t.proto,
            t.target,
            if t.wrong_source.is_empty() && t.replies > 0 {
                "all of them"
            } else if t.replies == 0 {
                "none received"
            } else {
                "NOT all (see the errors below)"
            }
        );
    }
}
