//! One hash for the cluster (issue 30 §2): `--lb-algorithm maglev` with `--hash-seed-file`,
//! on two nodes, each lbproxy started as other harnesses start it plus these two flags.
//!
//! - [`same_seed_file_same_backend_through_either_node`] (both families): an external
//!   client's UDP flows to the LB IP, from 20 fixed source ports, first routed through nodeA, then through nodeB
//!   (the same 5-tuples, as after an upstream ECMP change): with one seed file on both
//!   nodes every tuple reaches the same backend both times.
//! - [`different_seed_files_pick_differently`]: with a file per node, some do not.
//! - [`removing_one_of_eight_moves_only_its_share`]: 8 backends, 400 tuples as new flows
//!   before and after the 4th backend leaves: besides the leaver's own tuples, at most 2%
//!   of the 400 change backend.
//! - [`a_short_seed_file_is_refused_before_anything_is_loaded`].
//!
//! Without Maglev (the jump hash, a random seed per node) the first fails (about half the
//! tuples change backend) and so does the third (the last slot moves into the leaver's).

mod north_south_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_LB_IP as LB_IP, WEB_LB_IP6, dual_stack_web_manifest, web_manifest,
};
use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP,
};
use lbproxy_tests::lab::{Backend, Family, Lbproxy, Pod, bpf, udp_request};

use north_south_common::{HEALTHY_WITHIN, TIMEOUT};

/// The UDP port of `web` on its LB IP.
const WEB_UDP: u16 = 53;
/// `LB_FLOWS_V3`'s key size.
const FLOW_KEY_SIZE: usize = 16;
/// How long a manifest change may take to reach the datapath.
const APPLY_WITHIN: Duration = Duration::from_secs(10);

struct Setup {
    lab: MultiNodeLab,
    /// IPv4: `web` single-stack, the tuples to its LB IP; IPv6: `web` dual-stack, the tuples
    /// to its IPv6 LB IP.
    family: Family,
    pods: Vec<Pod>,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
}

impl Setup {
    /// `n` backends, alternately on nodeA and nodeB (p1 on A, p2 on B, ...), behind `web`;
    /// lbproxy on each node with `--lb-algorithm maglev` and the seed file of that node
    /// (`seeds[0]` for nodeA, `seeds[1]` for nodeB: their contents).
    fn new(n: usize, seeds: [&str; 2]) -> Setup {
        Setup::in_family(Family::V4, n, seeds)
    }

    /// [`Setup::new`], the tuples in `family`.
    fn in_family(family: Family, n: usize, seeds: [&str; 2]) -> Setup {
        let lab = MultiNodeLab::new();
        let pods: Vec<Pod> = (1..=n)
            .map(|i| {
                let node = if i % 2 == 1 { NodeId::A } else { NodeId::B };
                lab.add_pod(node, &format!("p{i}"))
            })
            .collect();
        let servers = pods
            .iter()
            .map(|p| p.serve(&[BACKEND_TCP, BACKEND_UDP]))
            .collect();
        let s = Setup {
            lab,
            family,
            pods,
            _servers: servers,
            lbs: Vec::new(),
        };
        s.write_manifest(&s.pods.iter().collect::<Vec<_>>());
        let mut lbs = Vec::new();
        for (node, seed) in NodeId::ALL.into_iter().zip(seeds) {
            let file: PathBuf = s.lab.workdir().join(format!("seed-{}", node.name()));
            std::fs::write(&file, seed).unwrap();
            let file = file.display().to_string();
            let mut lb = s.lab.start_lbproxy(
                node,
                &["--lb-algorithm", "maglev", "--hash-seed-file", &file],
            );
            lb.expect_healthy(HEALTHY_WITHIN);
            lbs.push(lb);
        }
        let s = Setup { lbs, ..s };
        // `inspect services` says how each of web's frontends picks, on both nodes.
        for node in NodeId::ALL {
            let rows = s.lab.node(node).inspect_services();
            let web: Vec<_> = rows.iter().filter(|r| r.service == "default/web").collect();
            assert!(
                !web.is_empty() && web.iter().all(|r| r.selection == "maglev"),
                "{node}: web's frontends: {:?}",
                web.iter()
                    .map(|r| (&r.frontend, &r.selection))
                    .collect::<Vec<_>>()
            );
        }
        s
    }

    fn write_manifest(&self, pods: &[&Pod]) {
        let eps: Vec<(Ipv4Addr, Option<&str>)> = pods
            .iter()
            .map(|p| (p.ip, Some(self.lab.node_of(&p.name).name())))
            .collect();
        self.lab.write_manifest_text(&match self.family {
            Family::V4 => web_manifest(&eps, "Cluster", ""),
            Family::V6 => dual_stack_web_manifest(&self.lab, pods, "Cluster", ""),
        });
    }

    /// `web`'s LB IP in the setup's family.
    fn lb_ip(&self) -> IpAddr {
        match self.family {
            Family::V4 => LB_IP.into(),
            Family::V6 => WEB_LB_IP6.into(),
        }
    }

    /// The backend each source port's UDP request to the LB IP reaches, from `client`.
    fn backends(&self, client: &str, ports: &[u16], ctx: &str) -> BTreeMap<u16, String> {
        ports
            .iter()
            .map(|p| {
                let r = udp_request(client, self.lb_ip(), WEB_UDP, TIMEOUT, Some(*p))
                    .map(|(r, _)| r.backend)
                    .unwrap_or_else(|e| panic!("{ctx}: UDP from port {p}: {e}\n{}", self.logs()));
                (*p, r)
            })
            .collect()
    }

    /// Empties node `node`'s flow table: the next packet of every flow is a new flow.
    fn clear_flows(&self, node: NodeId) -> usize {
        let path = self.lab.node(node).bpffs_dir.join("LB_FLOWS_V3");
        let map = bpf::pinned_map(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        bpf::map_clear(&map, FLOW_KEY_SIZE).unwrap_or_else(|e| panic!("clearing flows: {e}"))
    }

    fn logs(&self) -> String {
        let mut out = self.lab.diagnostics();
        for lb in &self.lbs {
            out.push_str(&format!("\n--- lbproxy {:?}\n{}", lb.argv(), lb.log()));
        }
        out
    }
}

/// Fixed client source ports, below the ephemeral range.
fn ports(n: u16) -> Vec<u16> {
    (21_001..21_001 + n).collect()
}

/// The tuples whose backend differs between `a` and `b`.
fn moved(a: &BTreeMap<u16, String>, b: &BTreeMap<u16, String>) -> Vec<(u16, String, String)> {
    a.iter()
        .filter(|(p, x)| b.get(p) != Some(x))
        .map(|(p, x)| (*p, x.clone(), b.get(p).cloned().unwrap_or_default()))
        .collect()
}

/// The backend of each of 20 UDP tuples from an external client to the LB IP routed
/// through nodeA, then of the same tuples routed through nodeB.
fn through_either_node(s: &Setup) -> (BTreeMap<u16, String>, BTreeMap<u16, String>) {
    let client = s.lab.add_client("ext");
    let ports = ports(20);
    let via = |node: NodeId| match s.family {
        Family::V4 => client.route_via(&format!("{LB_IP}/32"), s.lab.node(node)),
        Family::V6 => client.route_via6(&format!("{WEB_LB_IP6}/128"), s.lab.node(node)),
    };
    via(NodeId::A);
    let via_a = s.backends(&client.netns, &ports, "via nodeA");
    via(NodeId::B);
    let via_b = s.backends(&client.netns, &ports, "via nodeB");
    (via_a, via_b)
}

lbproxy_tests::both_families!(same_seed_file_same_backend_through_either_node);

/// The same 5-tuples through nodeA, then through nodeB: the same backend each (20/20), in
/// each family.
fn same_seed_file_same_backend_through_either_node(family: Family) {
    let s = Setup::in_family(family, 4, ["0123456789abcdef\n"; 2]);
    let (via_a, via_b) = through_either_node(&s);
    eprintln!("via nodeA: {via_a:?}\nvia nodeB: {via_b:?}");
    let spread: std::collections::BTreeSet<&String> = via_a.values().collect();
    assert!(
        spread.len() >= 3,
        "20 tuples over 4 backends reached only {spread:?}"
    );
    let m = moved(&via_a, &via_b);
    assert!(
        m.is_empty(),
        "{} of 20 tuples reached another backend through nodeB: {m:?}\n{}",
        m.len(),
        s.logs()
    );
}

/// A seed file per node: the two nodes' tables differ, so some tuples do not meet.
#[test]
fn different_seed_files_pick_differently() {
    let s = Setup::new(4, ["0123456789abcdef\n", "fedcba9876543210\n"]);
    let (via_a, via_b) = through_either_node(&s);
    let m = moved(&via_a, &via_b);
    eprintln!("{} of 20 tuples differ: {m:?}", m.len());
    assert!(
        !m.is_empty(),
        "all 20 tuples met with different seed files: {via_a:?}\n{}",
        s.logs()
    );
}

/// 8 backends; the 4th of the list leaves. Of 400 tuples sent as new flows before and after,
/// those that change backend are the leaver's and at most 2% (8) of the others.
#[test]
fn removing_one_of_eight_moves_only_its_share() {
    let s = Setup::new(8, ["0123456789abcdef\n"; 2]);
    let client = s.lab.add_client("ext");
    client.route_via(&format!("{LB_IP}/32"), s.lab.node(NodeId::A));
    let ports = ports(400);
    let before = s.backends(&client.netns, &ports, "before");
    let gone = s.pods[3].name.clone();
    let share = before.values().filter(|b| **b == gone).count();
    let rest: Vec<&Pod> = s.pods.iter().filter(|p| p.name != gone).collect();
    s.write_manifest(&rest);
    // Applied when the leaver no longer answers new flows.
    let deadline = Instant::now() + APPLY_WITHIN;
    loop {
        s.clear_flows(NodeId::A);
        let probe = s.backends(&client.netns, &ports[..40], "while applying");
        if !probe.values().any(|b| *b == gone) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{gone} still answers {APPLY_WITHIN:?} on\n{}",
            s.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    s.clear_flows(NodeId::A);
    let after = s.backends(&client.netns, &ports, "after");
    let m = moved(&before, &after);
    let others: Vec<_> = m.iter().filter(|(_, was, _)| *was != gone).collect();
    eprintln!(
        "{gone} had {share} of 400 tuples; {} moved, {} of them from other backends: {others:?}",
        m.len(),
        others.len()
    );
    assert_eq!(m.len() - others.len(), share, "every tuple of {gone} moved");
    assert!(
        others.len() <= 8,
        "{} tuples of staying backends moved (at most 8, 2% of 400): {others:?}\n{}",
        others.len(),
        s.logs()
    );
}

/// A seed file of fewer than 8 bytes is refused at start, naming the file and the reason,
/// before anything is loaded: nothing is pinned on the node.
#[test]
fn a_short_seed_file_is_refused_before_anything_is_loaded() {
    let lab = MultiNodeLab::new();
    lab.write_manifest_text(&web_manifest(&[], "Cluster", ""));
    let file = lab.workdir().join("short-seed");
    std::fs::write(&file, "abc").unwrap();
    let file = file.display().to_string();
    let mut lb = lab.start_lbproxy(
        NodeId::A,
        &["--lb-algorithm", "maglev", "--hash-seed-file", &file],
    );
    let st = lb.wait_exit(Duration::from_secs(10));
    let log = lb.log();
    assert!(
        st.is_some_and(|s| !s.success()),
        "a 3-byte seed file: exit {st:?}\n{log}"
    );
    let want = format!("hashSeedFile {file}: holds 3 bytes; at least 8 are needed");
    assert!(
        log.contains(&want),
        "the error names the file and why ({want:?}):\n{log}"
    );
    let dir = &lab.node(NodeId::A).bpffs_dir;
    let pinned: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(pinned.is_empty(), "pinned in {}: {pinned:?}", dir.display());
}
