//! The takeover's own time at scale (docs/benchmarks.md, "Takeover from kube-proxy"): a node
//! with 1,000 Services in kube-proxy's iptables layout and 10,000 of its DNATed conntrack
//! entries, then `lbproxy run --takeover`: the time from start to healthy, and the
//! `takeover:` line's own figure. Checked too: every entry adopted, the entries and the rules
//! gone.
//!
//! A benchmark, not part of the suite (`#[ignore]`): run it alone, on a quiet machine,
//! release build:
//! `cargo build --release -p lbproxy && LBPROXY_BIN=$PWD/target/release/lbproxy cargo test
//! -p lbproxy-tests --test takeover_scale -- --ignored --nocapture`.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::*;
use lbproxy::conntrack::{
    Conntrack, Entry, IPS_ASSURED, IPS_CONFIRMED, IPS_DST_NAT, IPS_SEEN_REPLY,
    TCP_CONNTRACK_ESTABLISHED, Tuple,
};
use lbproxy_tests::lab::kube_proxy::{self as fixture, NodeNet, ServicePort};
use lbproxy_tests::lab::{Family, Lab, Pod, Proto, Shape, run_in_ns};

const SERVICES: usize = 1_000;
const ENTRIES: usize = 10_000;
const ROUNDS: usize = 3;

/// Service `i`'s ClusterIP: 198.19.10.1 onwards, 200 to a /24.
fn vip_of(i: usize) -> IpAddr {
    let (hi, lo) = (10 + i / 200, 1 + i % 200);
    Ipv4Addr::new(198, 19, hi as u8, lo as u8).into()
}

/// Entry `n`: a client of the pod network that is no pod of the lab (no traffic is sent)
/// to service `n % SERVICES`, DNATed to backend `n % 3`.
fn entry(n: usize, backends: &[IpAddr]) -> Entry {
    let client: IpAddr =
        Ipv4Addr::new(198, 18, 200 + (n / 50_000) as u8, 1 + (n % 250) as u8).into();
    let sport = 20_000 + (n / 250) as u16;
    let orig = Tuple {
        src: client,
        dst: vip_of(n % SERVICES),
        src_port: sport,
        dst_port: 80,
        proto: 6,
    };
    Entry {
        orig,
        reply: Tuple {
            src: backends[n % backends.len()],
            dst: client,
            src_port: BACKEND_TCP,
            dst_port: sport,
            proto: 6,
        },
        status: IPS_CONFIRMED | IPS_DST_NAT | IPS_SEEN_REPLY | IPS_ASSURED,
        timeout_s: 86_400,
        tcp_state: Some(TCP_CONNTRACK_ESTABLISHED),
        mark: 0,
        zone: 0,
    }
}

/// One round: the lab, the rules, the entries; then lbproxy. Returns (start to healthy,
/// the takeover line's ms).
fn round() -> (Duration, u64) {
    let lab = Lab::new(Shape::Routed);
    let pods: Vec<Pod> = ["b1", "b2", "b3"].iter().map(|n| lab.add_pod(n)).collect();
    let refs: Vec<&Pod> = pods.iter().collect();
    let addrs: Vec<IpAddr> = pods.iter().map(|p| pod_addr(p, Family::V4)).collect();
    let eps: Vec<(IpAddr, u16)> = addrs.iter().map(|a| (*a, BACKEND_TCP)).collect();
    lab.write_manifest(&merge((0..SERVICES).map(|i| {
        web_objects(&format!("s{i}"), vip_of(i), ready_in(Family::V4, &refs))
    })));
    let ports: Vec<ServicePort> = (0..SERVICES)
        .map(|i| ServicePort::new(&format!("s{i}"), "http", Proto::Tcp, vip_of(i), 80, &eps))
        .collect();
    let net = NodeNet {
        cluster_cidr: "198.18.0.0/16".into(),
        node_ips: Vec::new(),
    };
    fixture::install_iptables(lab.node_ns(), Family::V4, &ports, &net)
        .unwrap_or_else(|e| panic!("installing kube-proxy's rules: {e}"));
    let entries: Vec<Entry> = (0..ENTRIES).map(|n| entry(n, &addrs)).collect();
    let failed = run_in_ns(lab.node_ns(), || {
        let mut ct = Conntrack::open().expect("ctnetlink");
        ct.create_many(&entries)
            .expect("creating the entries")
            .iter()
            .filter(|r| r.is_err())
            .count()
    });
    assert_eq!(failed, 0, "every synthetic entry created");
    let started = Instant::now();
    let mut lb = lab.start_lbproxy_with(&["--takeover"]);
    lb.wait_healthy(Duration::from_secs(120))
        .unwrap_or_else(|e| {
            panic!(
                "lbproxy --takeover did not become healthy: {e}\n{}",
                lb.log()
            )
        });
    let healthy = started.elapsed();
    let log = format!("{}\n{}", lb.stdout(), lb.stderr());
    let line = log
        .lines()
        .find(|l| l.contains("takeover: adopted"))
        .unwrap_or_else(|| panic!("no takeover line\n{log}"));
    assert!(
        line.contains(&format!("adopted {ENTRIES} flows")),
        "every entry adopted: {line}"
    );
    let ms: u64 = line
        .rsplit(" in ")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no time in: {line}"));
    let left = run_in_ns(lab.node_ns(), || {
        let mut ct = Conntrack::open().expect("ctnetlink");
        ct.dump(lbproxy::conntrack::Family::V4)
            .expect("dump")
            .iter()
            .filter(|e| e.dnat())
            .count()
    });
    assert_eq!(left, 0, "no DNATed entry left after the takeover");
    eprintln!("round: healthy {healthy:?} after start; {line}");
    (healthy, ms)
}

#[test]
#[ignore = "a benchmark: run alone with --ignored (docs/benchmarks.md)"]
fn takeover_at_1000_services_and_10000_entries() {
    let mut healthy = Vec::new();
    let mut own = Vec::new();
    for _ in 0..ROUNDS {
        let (h, ms) = round();
        healthy.push(h);
        own.push(ms);
    }
    healthy.sort();
    own.sort();
    eprintln!(
        "takeover at {SERVICES} Services and {ENTRIES} conntrack entries, {ROUNDS} rounds: \
         start to healthy {:?} (median; all {healthy:?}); the takeover itself {} ms (median; \
         all {own:?})",
        healthy[ROUNDS / 2],
        own[ROUNDS / 2]
    );
}
