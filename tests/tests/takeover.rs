//! lbproxy taking a node over from kube-proxy under load (issue 29), in a single-node lab,
//! both families, both pod-network shapes (routed, and bridged, where a handed-over flow's
//! packets go through the node's stack and meet netfilter) for the takeovers, the hand-back
//! and the run without `--takeover`. Each takeover holds [`HOLD`] between deleting
//! kube-proxy's entries and owning the flows, so that the load's packets surely fall there.
//!
//! Each test: three backend pods serving TCP and UDP, the `web` Service written for lbproxy
//! (`--manifests`) and the same Service installed in the node namespace as kube-proxy's
//! rules (`lbproxy_tests::lab::kube_proxy`: iptables or nftables layout, masquerade rules
//! included), and the load of `lbproxy_tests::lab::takeover_load` from a client pod, started
//! BEFORE lbproxy so that its connections are kube-proxy's (DNATed by conntrack). After
//! [`SETTLE`] of load:
//! - `iptables_takeover`, `nftables_takeover`: `lbproxy run --takeover`; zero failed
//!   requests from the load's start to [`WATCH`] after lbproxy is healthy, kube-proxy's
//!   rules and the VIP's conntrack entries gone, the long-lived flows in `inspect flows`
//!   with the backends the load saw, the `takeover:` log line and the
//!   `lbproxy_takeover_adopted_flows_total` metric counting them.
//! - `without_takeover_rules_stay`: `lbproxy run` without it; zero failures, kube-proxy's
//!   chains still there, and one warning naming them and `--takeover`.
//! - `naive_switch_baseline`: kube-proxy's rules and conntrack flushed, then lbproxy started
//!   without `--takeover`: the failures this causes are printed and must exist (what the
//!   feature prevents; none would mean the load measures nothing).
//! - `load_is_clean_under_kube_proxy`: the load alone through kube-proxy's rules, no
//!   lbproxy: zero failures, and its flows are conntrack's DNAT entries.
//! - `hand_back`: after a takeover, kube-proxy's rules back and `cleanup --hand-back`: zero
//!   failures, the programs detached, conntrack holding the load's flows.
//!
//! Run: `cargo build -p lbproxy && LBPROXY_BIN=$PWD/target/debug/lbproxy cargo test -p
//! lbproxy-tests --test takeover -- --test-threads=1`.

mod common;
mod kube_common;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use common::*;
use kube_common::Scrape;
use lbproxy::conntrack::{self as ct, Conntrack};
use lbproxy::takeover::kube_proxy as kp;
use lbproxy::takeover::untrack as kp_untrack;
use lbproxy_tests::lab::kube_proxy::{self as fixture, NodeNet, ServicePort};
use lbproxy_tests::lab::takeover_load::{Load, Report, TCP_CONNS, UDP_SOCKETS, show_failures};
use lbproxy_tests::lab::{
    Backend, Family, Inspect as _, Lab, Lbproxy, METRICS_ADDR, Pod, Proto, Shape, http_get_full,
    run_in_ns, wait_for,
};

/// How long the load runs through kube-proxy's rules before lbproxy starts.
const SETTLE: Duration = Duration::from_secs(2);
/// How long the load goes on after lbproxy is healthy.
const WATCH: Duration = Duration::from_secs(10);
/// The adoption metric.
const ADOPTED_METRIC: &str = "lbproxy_takeover_adopted_flows_total";

/// `LBPROXY_TEST_TAKEOVER_HOLD_MS` of every takeover here: several of the load's requests
/// (one per connection every 100 ms) fall between the entries' delete and the flows
/// becoming lbproxy's own.
const HOLD: &str = "500";

both_shapes_and_families!(
    a_flow_handed_over_half_by_half_loses_nothing,
    iptables_takeover,
    nftables_takeover,
    without_takeover_rules_stay,
    hand_back,
);
lbproxy_tests::both_families!(
    naive_switch_baseline,
    load_is_clean_under_kube_proxy,
    killed_takeover_finished_at_next_start,
);

/// How kube-proxy's rules are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rules {
    Iptables,
    Nft,
}

/// A lab node running kube-proxy's rules for `web`, and lbproxy's manifest of it. Fields
/// drop in order: the servers before the lab.
struct Node {
    family: Family,
    client: Pod,
    backends: Vec<Pod>,
    _servers: Vec<Backend>,
    lab: Lab,
}

impl Node {
    fn new(shape: Shape, family: Family, rules: Rules) -> Node {
        let lab = Lab::new(shape);
        let client = lab.add_pod("client");
        let (backends, servers) = serving_pods(&lab, &["b1", "b2", "b3"]);
        let refs: Vec<&Pod> = backends.iter().collect();
        // One pod behind two Services, as clusters have it: `metrics` over the same pods
        // and ports, for lbproxy and for kube-proxy.
        lab.write_manifest(&merge([
            web_objects("web", web_vip(family), ready_in(family, &refs)),
            web_objects("metrics", metrics_vip(family), ready_in(family, &refs)),
        ]));
        let (ports, net) = kube_proxy_service(family, &backends);
        match rules {
            Rules::Iptables => fixture::install_iptables(lab.node_ns(), family, &ports, &net),
            Rules::Nft => fixture::install_nft(lab.node_ns(), family, &ports, &net),
        }
        .unwrap_or_else(|e| panic!("[{family} {rules:?}] installing kube-proxy's rules: {e}"));
        Node {
            family,
            client,
            backends,
            _servers: servers,
            lab,
        }
    }

    /// kube-proxy's rules written again, as its restart would.
    fn reinstall(&self, rules: Rules) {
        let (ports, net) = kube_proxy_service(self.family, &self.backends);
        match rules {
            Rules::Iptables => {
                fixture::install_iptables(self.lab.node_ns(), self.family, &ports, &net)
            }
            Rules::Nft => fixture::install_nft(self.lab.node_ns(), self.family, &ports, &net),
        }
        .unwrap_or_else(|e| {
            panic!(
                "[{} {rules:?}] re-installing kube-proxy's rules: {e}",
                self.family
            )
        });
    }

    fn tcp_vip(&self) -> SocketAddr {
        SocketAddr::new(web_vip(self.family), WEB_TCP)
    }

    fn udp_vip(&self) -> SocketAddr {
        SocketAddr::new(web_vip(self.family), WEB_UDP)
    }

    /// The address of the backend pod named `name`.
    fn backend_addr(&self, name: &str) -> IpAddr {
        let pod = self
            .backends
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no backend pod {name:?}"));
        pod_addr(pod, self.family)
    }

    /// `iptables-save` (or `ip6tables-save`) of the node.
    fn iptables_save(&self) -> String {
        let save = format!("{}-save", iptables(self.family));
        self.lab
            .node_run(&[&save])
            .unwrap_or_else(|e| panic!("{save} in the node: {e}"))
    }

    /// The nft tables of the node.
    fn nft_tables(&self) -> String {
        self.lab
            .node_run(&["nft", "list", "tables"])
            .unwrap_or_else(|e| panic!("nft list tables in the node: {e}"))
    }

    /// The node's conntrack entries whose original destination is the VIP.
    fn vip_conntrack(&self) -> Vec<ct::Entry> {
        let fam = match self.family {
            Family::V4 => ct::Family::V4,
            Family::V6 => ct::Family::V6,
        };
        let vip = web_vip(self.family);
        let all = run_in_ns(self.lab.node_ns(), || {
            Conntrack::open().and_then(|mut c| c.dump(fam))
        })
        .unwrap_or_else(|e| panic!("conntrack dump in the node: {e}"));
        all.into_iter().filter(|e| e.orig.dst == vip).collect()
    }

    /// kube-proxy's rules and every conntrack entry of the node flushed, as a naive switch
    /// would: the finder's `remove()`, then `conntrack -F`.
    fn flush_kube_proxy(&self) {
        let state = run_in_ns(self.lab.node_ns(), kp::find)
            .unwrap_or_else(|e| panic!("finding kube-proxy's rules: {e}"));
        assert!(
            !state.is_empty(),
            "kube-proxy's rules are in place to flush"
        );
        run_in_ns(self.lab.node_ns(), || kp::remove(&state))
            .unwrap_or_else(|e| panic!("removing kube-proxy's rules: {e}"));
        let fam = match self.family {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        };
        self.lab
            .node_run(&["conntrack", "-F", "-f", fam])
            .unwrap_or_else(|e| panic!("conntrack -F in the node: {e}"));
    }

    /// `/metrics`, parsed.
    fn scrape(&self) -> Scrape {
        let addr: SocketAddr = METRICS_ADDR.parse().unwrap();
        let r = http_get_full(self.lab.node_ns(), addr, "/metrics", Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("scraping /metrics: {e}"));
        Scrape::parse(&r.body).unwrap_or_else(|e| panic!("/metrics does not parse: {e}"))
    }
}

/// `web` as kube-proxy sees it: TCP `WEB_TCP` -> [`BACKEND_TCP`] and UDP `WEB_UDP` ->
/// [`BACKEND_UDP`] over `backends`, and the node's cluster CIDR (the pods' network, so the
/// client pod's traffic is not masqueraded).
fn kube_proxy_service(family: Family, backends: &[Pod]) -> (Vec<ServicePort>, NodeNet) {
    let eps = |port: u16| -> Vec<(IpAddr, u16)> {
        backends
            .iter()
            .map(|p| (pod_addr(p, family), port))
            .collect()
    };
    let ports = [("web", web_vip(family)), ("metrics", metrics_vip(family))]
        .into_iter()
        .flat_map(|(name, vip)| {
            [
                ServicePort::new(name, "http", Proto::Tcp, vip, WEB_TCP, &eps(BACKEND_TCP)),
                ServicePort::new(name, "dns", Proto::Udp, vip, WEB_UDP, &eps(BACKEND_UDP)),
            ]
        })
        .collect();
    let net = NodeNet {
        cluster_cidr: match family {
            Family::V4 => "198.18.0.0/16",
            Family::V6 => "fd00:c612::/64",
        }
        .into(),
        node_ips: Vec::new(),
    };
    (ports, net)
}

/// The second Service over the same pods.
fn metrics_vip(family: Family) -> IpAddr {
    vip_in(family, 13)
}

/// The load, started through kube-proxy's rules and left running [`SETTLE`].
fn settled_load(n: &Node) -> Load {
    let load = Load::start(&n.client, n.tcp_vip(), n.udp_vip());
    sleep_until(load.started() + SETTLE);
    load
}

/// Starts lbproxy with `args` and waits until it is healthy; panics with the load's
/// summary if it does not become so. Returns it, when it was started and when healthy.
fn start_lbproxy(n: &Node, load: &Load, args: &[&str]) -> (Lbproxy, Instant, Instant) {
    let spawned = Instant::now();
    let mut argv = n.lab.lbproxy_run_args();
    argv.extend(args.iter().map(|a| a.to_string()));
    let mut lb = n
        .lab
        .start_lbproxy_argv(argv, &[("LBPROXY_TEST_TAKEOVER_HOLD_MS", HOLD)]);
    if let Err(e) = lb.wait_healthy(HEALTHY_WITHIN) {
        panic!(
            "[{}] lbproxy {args:?} did not become healthy: {e}\nload failures so far \
             (relative to lbproxy's start):{}",
            n.family,
            show_failures(
                &load.failures_since(load.started()),
                load.started(),
                spawned
            )
        );
    }
    (lb, spawned, Instant::now())
}

/// The whole log of `lb`.
fn log_text(lb: &Lbproxy) -> String {
    format!("{}\n{}", lb.stdout(), lb.stderr())
}

/// The adoption metric's samples for `protocol` (any case), summed.
fn adopted(sc: &Scrape, protocol: &str) -> f64 {
    sc.samples
        .iter()
        .filter(|s| s.name == ADOPTED_METRIC)
        .filter(|s| {
            s.labels
                .get("protocol")
                .is_some_and(|p| p.eq_ignore_ascii_case(protocol))
        })
        .map(|s| s.value)
        .sum()
}

fn iptables_takeover(shape: Shape, family: Family) {
    takeover(shape, family, Rules::Iptables);
}

fn nftables_takeover(shape: Shape, family: Family) {
    takeover(shape, family, Rules::Nft);
}

/// `lbproxy run --takeover` while the load runs through kube-proxy's `rules`.
fn takeover(shape: Shape, family: Family, rules: Rules) {
    let what = format!("{shape} {family} {rules:?} takeover");
    let n = Node::new(shape, family, rules);
    let load = settled_load(&n);
    let conns = load.conns().to_vec();
    let (mut lb, spawned, healthy) = start_lbproxy(&n, &load, &["--takeover"]);
    sleep_until(healthy + WATCH);

    // Read while the load still runs, so its connections are alive.
    let flows = n.lab.inspect_flows();
    let vip_ct = n.vip_conntrack();
    let save = n.iptables_save();
    let nft = n.nft_tables();
    let scrape = n.scrape();
    let running = lb.is_running();
    let report = load.stop();
    let log = log_text(&lb);
    eprintln!(
        "[{what}] lbproxy healthy {:?} after its start; {}",
        healthy - spawned,
        report.summary(spawned)
    );

    // ASSERT 1: zero failed requests, from the load's start to WATCH after healthy.
    report.assert_clean(&what, spawned, "lbproxy's start", &lb.log());
    assert!(running, "[{what}] lbproxy kept running\n{}", lb.log());

    // ASSERT 2: kube-proxy's rules are gone.
    let left = fixture::service_chains(&save);
    assert!(
        left.is_empty(),
        "[{what}] kube-proxy's service chains left in the node: {left:?}\n{save}"
    );
    assert!(
        !nft.contains("kube-proxy"),
        "[{what}] kube-proxy's nft table left in the node:\n{nft}"
    );
    // ... and so is lbproxy's untrack rule of the takeover.
    assert!(
        !nft.contains(kp_untrack::NFT_TABLE) && !save.contains(kp_untrack::COMMENT),
        "[{what}] the untrack rule is left in the node:\n{nft}\n{save}"
    );

    // ASSERT 3: no conntrack entry to the VIP is left.
    assert!(
        vip_ct.is_empty(),
        "[{what}] conntrack entries to the VIP left after the takeover:\n{}",
        vip_ct
            .iter()
            .map(|e| format!("  {} (reply {}) status {:#x}", e.orig, e.reply, e.status))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // ASSERT 4: each long-lived connection and socket is one of lbproxy's flows, to the
    // backend the load saw answer it.
    for c in &conns {
        let want = n.backend_addr(&c.backend);
        let row = flows
            .iter()
            .find(|f| f.client.parse::<SocketAddr>().ok() == Some(c.local));
        let row = row.unwrap_or_else(|| {
            panic!(
                "[{what}] {} from {} (answered by {}) is not among lbproxy's flows:\n{}",
                c.lane,
                c.local,
                c.backend,
                serde_json::to_string_pretty(&n.lab.inspect_json("flows")).unwrap()
            )
        });
        assert!(
            row.service.contains("web") && !row.service.contains("metrics"),
            "[{what}] {} from {}: lbproxy's flow is of service {:?}, not web (its backend is \
             also a metrics endpoint)",
            c.lane,
            c.local,
            row.service
        );
        let got = row.backend.parse::<SocketAddr>().map(|b| b.ip());
        assert_eq!(
            got,
            Ok(want),
            "[{what}] {} from {}: lbproxy's flow goes to {}, the load saw {} ({want}) answer",
            c.lane,
            c.local,
            row.backend,
            c.backend
        );
    }

    // ASSERT 5: the log says what the takeover did.
    assert!(
        log.lines().any(|l| l.contains("takeover:")),
        "[{what}] no \"takeover:\" line in the log\n{}",
        lb.log()
    );

    // ASSERT 6: the metric counts the adopted flows (at least the load's).
    let (tcp, udp) = (adopted(&scrape, "tcp"), adopted(&scrape, "udp"));
    assert!(
        tcp >= TCP_CONNS as f64 && udp >= UDP_SOCKETS as f64,
        "[{what}] {ADOPTED_METRIC}: tcp {tcp}, udp {udp}; at least {TCP_CONNS} and \
         {UDP_SOCKETS} expected:\n{}",
        scrape
            .text
            .lines()
            .filter(|l| l.contains("takeover"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A takeover killed half-way on a bridged pod network: its flows handed over (translated,
/// untracked), kube-proxy's rules and the flows' entries already deleted, the flows not yet
/// lbproxy's own. A restart resets the datapath's flags, so those flows' packets would pass
/// to nothing: the next start finishes them first (the flows lbproxy's own), and finds no
/// kube-proxy left to take over. Zero failed requests from the first start to WATCH after
/// the second is healthy; the warning says what was finished; nothing of kube-proxy's and
/// no untrack rule is left. (Killed earlier, at the hold before kube-proxy's rules go, the
/// next takeover adopts the entries again: also tested by hand, zero failures.)
fn killed_takeover_finished_at_next_start(family: Family) {
    let what = format!("bridge {family} takeover killed half-way");
    let n = Node::new(Shape::Bridge, family, Rules::Iptables);
    let load = settled_load(&n);
    let spawned = Instant::now();
    let mut argv = n.lab.lbproxy_run_args();
    argv.push("--takeover".into());
    let mut first = n
        .lab
        .start_lbproxy_argv(argv, &[("LBPROXY_TEST_TAKEOVER_HOLD_MS", "3000")]);
    let held = wait_for(Duration::from_secs(20), Duration::from_millis(20), || {
        first
            .stderr()
            .contains("after deleting kube-proxy's entries")
            .then_some(())
    });
    assert!(
        held.is_ok(),
        "[{what}] the first lbproxy never reached its hold after deleting the entries\n{}",
        first.log()
    );
    first.kill();
    let (mut lb, _, healthy) = start_lbproxy(&n, &load, &["--takeover"]);
    sleep_until(healthy + WATCH);
    let vip_ct = n.vip_conntrack();
    let (save, nft) = (n.iptables_save(), n.nft_tables());
    let handed: Vec<String> = n
        .lab
        .inspect_flows()
        .into_iter()
        .filter(|f| f.adopted.is_some())
        .map(|f| format!("{} -> {} ({:?})", f.client, f.backend, f.adopted))
        .collect();
    let running = lb.is_running();
    let report = load.stop();
    let log = log_text(&lb);
    eprintln!("[{what}] {}", report.summary(spawned));
    assert!(
        handed.is_empty(),
        "[{what}] flows still handed over or conntrack's after the restart: {handed:?}"
    );
    report.assert_clean(&what, spawned, "the first lbproxy's start", &lb.log());
    assert!(running, "[{what}] lbproxy kept running\n{}", lb.log());
    assert!(
        log.contains("an earlier takeover did not finish"),
        "[{what}] no warning about the earlier takeover\n{}",
        lb.log()
    );
    assert!(
        fixture::service_chains(&save).is_empty() && vip_ct.is_empty(),
        "[{what}] kube-proxy's chains or entries to the VIP left:\n{save}\n{vip_ct:?}"
    );
    assert!(
        !nft.contains(kp_untrack::NFT_TABLE),
        "[{what}] the untrack rule is left:\n{nft}"
    );
}

/// The handover writes each flow's forward half, then its reply half. A packet crossing
/// that gap found a forward half (the handed-over service and backend ids) and a reply half
/// (still conntrack's, ids 0) that did not pair, so the flow was balanced anew and the
/// backend it moved to reset the connection (a clean-clone CI run under load,
/// `killed_takeover_finished_at_next_start::ipv6`, one connection). With
/// `LBPROXY_TEST_TAKEOVER_HALF_HOLD_MS` every flow's halves disagree for 250 ms, so each
/// connection's requests (one every 100 ms) surely meet it; on the bridged network every
/// answer goes through the node's stack, on the routed one past it. The pods are behind two
/// Services (`metrics_vip`). Zero failed requests.
fn a_flow_handed_over_half_by_half_loses_nothing(shape: Shape, family: Family) {
    let what = format!("{shape} {family} takeover, flows handed over half by half");
    let n = Node::new(shape, family, Rules::Iptables);
    let load = settled_load(&n);
    let spawned = Instant::now();
    let mut argv = n.lab.lbproxy_run_args();
    argv.push("--takeover".into());
    let mut lb = n.lab.start_lbproxy_argv(
        argv,
        &[
            ("LBPROXY_TEST_TAKEOVER_HOLD_MS", HOLD),
            ("LBPROXY_TEST_TAKEOVER_HALF_HOLD_MS", "250"),
        ],
    );
    let healthy = lb.wait_healthy(Duration::from_secs(30));
    sleep_until(Instant::now() + WATCH);
    let running = lb.is_running();
    let report = load.stop();
    eprintln!("[{what}] {}", report.summary(spawned));
    assert!(
        healthy.is_ok(),
        "[{what}] not healthy: {healthy:?}\n{}",
        lb.log()
    );
    report.assert_clean(&what, spawned, "lbproxy's start", &lb.log());
    assert!(running, "[{what}] lbproxy kept running\n{}", lb.log());
}

/// `lbproxy run` without `--takeover` while the load runs through kube-proxy's iptables
/// rules: they stay, the flows stay conntrack's, nothing fails, and one warning says so.
fn without_takeover_rules_stay(shape: Shape, family: Family) {
    let what = format!("{shape} {family} without --takeover");
    let n = Node::new(shape, family, Rules::Iptables);
    let load = settled_load(&n);
    let (mut lb, spawned, healthy) = start_lbproxy(&n, &load, &[]);
    sleep_until(healthy + WATCH);
    let save = n.iptables_save();
    let running = lb.is_running();
    let report = load.stop();
    let log = log_text(&lb);
    eprintln!(
        "[{what}] lbproxy healthy {:?} after its start; {}",
        healthy - spawned,
        report.summary(spawned)
    );

    // ASSERT 1: zero failed requests.
    report.assert_clean(&what, spawned, "lbproxy's start", &lb.log());
    assert!(running, "[{what}] lbproxy kept running\n{}", lb.log());

    // ASSERT 2: kube-proxy's chains are all still there.
    let (ports, _) = kube_proxy_service(family, &n.backends);
    let chains = fixture::service_chains(&save);
    let mut want: BTreeSet<String> = ["KUBE-SERVICES".to_owned()].into();
    for p in &ports {
        want.insert(fixture::ipt_svc(p));
        for (e, t) in &p.endpoints {
            want.insert(fixture::ipt_sep(p, *e, *t));
        }
    }
    assert_eq!(
        chains, want,
        "[{what}] kube-proxy's service chains after lbproxy ran without --takeover"
    );

    // ASSERT 3: one warning naming kube-proxy's rules and --takeover.
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("kube-proxy") && l.contains("--takeover"))
        .collect();
    assert_eq!(
        warnings.len(),
        1,
        "[{what}] one warning naming kube-proxy's rules and --takeover: {warnings:#?}\n{}",
        lb.log()
    );
}

/// The switch the feature exists for, done naively: kube-proxy's rules and conntrack
/// flushed under the load, lbproxy started without `--takeover`. Prints the failures; there
/// must be some.
fn naive_switch_baseline(family: Family) {
    let what = format!("{family} naive switch");
    let n = Node::new(Shape::Routed, family, Rules::Iptables);
    let load = settled_load(&n);
    let flushed = Instant::now();
    n.flush_kube_proxy();
    let (lb, spawned, healthy) = start_lbproxy(&n, &load, &[]);
    sleep_until(healthy + WATCH);
    let report = load.stop();
    eprintln!(
        "[{what}] BASELINE: kube-proxy's rules and conntrack flushed at the mark, lbproxy \
         started {:?} and healthy {:?} after it; {}",
        spawned - flushed,
        healthy - flushed,
        report.summary(flushed)
    );

    // ASSERT: the naive switch fails requests (else the load measures nothing).
    assert!(
        !report.failures.is_empty(),
        "[{what}] no failure at all: the load does not notice a naive switch\n{}\n{}",
        report.summary(flushed),
        lb.log()
    );
}

/// The load through kube-proxy's rules alone, no lbproxy: zero failures, answers from
/// several backends, and its long-lived flows are conntrack's DNAT entries to their
/// backends (what the takeover tests take over).
fn load_is_clean_under_kube_proxy(family: Family) {
    let what = format!("{family} load under kube-proxy");
    let n = Node::new(Shape::Routed, family, Rules::Iptables);
    let load = Load::start(&n.client, n.tcp_vip(), n.udp_vip());
    sleep_until(load.started() + SETTLE + Duration::from_secs(3));
    let entries = n.vip_conntrack();
    let report = load.stop();
    eprintln!("[{what}] {}", report.summary(report.start));

    // ASSERT 1: zero failed requests, every lane busy all along.
    report.assert_clean(&what, report.start, "the load's start", "");
    let ran = report.stopped - report.start;
    let per_lane = (ran.as_millis() / 100) as usize;
    for c in &report.conns {
        assert!(
            c.requests + 2 >= per_lane * 9 / 10 && c.answered == c.requests,
            "[{what}] {} sent {} requests in {ran:?} ({per_lane} due), {} answered",
            c.conn.lane,
            c.requests,
            c.answered
        );
    }

    // ASSERT 2: kube-proxy's random choice shows in the new connections' answers, and
    // every answer names one of the backends.
    let names: BTreeSet<&str> = n.backends.iter().map(|p| p.name.as_str()).collect();
    let seen: BTreeSet<&str> = report.new.by_backend.keys().map(String::as_str).collect();
    assert!(
        seen.len() >= 2 && seen.is_subset(&names) && report.new.tried >= 20,
        "[{what}] new connections: {} tried, answers {:?}",
        report.new.tried,
        report.new.by_backend
    );

    // ASSERT 3: each long-lived flow is a conntrack entry from it to the VIP, DNATed to the
    // backend that answered it.
    for c in &report.conns {
        let e = entries
            .iter()
            .find(|e| SocketAddr::new(e.orig.src, e.orig.src_port) == c.conn.local);
        let e = e.unwrap_or_else(|| {
            panic!(
                "[{what}] no conntrack entry from {} ({}) to the VIP: {entries:#?}",
                c.conn.local, c.conn.lane
            )
        });
        assert!(
            e.dnat() && e.reply.src == n.backend_addr(&c.conn.backend),
            "[{what}] {} from {}: conntrack entry {} (reply {}, status {:#x}); DNAT to {} \
             expected",
            c.conn.lane,
            c.conn.local,
            e.orig,
            e.reply,
            e.status,
            c.conn.backend
        );
    }
}

/// A rollback: after a takeover, lbproxy is stopped (its programs stay attached), kube-proxy's
/// rules come back, and `lbproxy cleanup --hand-back` writes lbproxy's flows as conntrack
/// entries and detaches: the load's connections keep working under kube-proxy, on their
/// backends, with zero failed requests up to WATCH after.
fn hand_back(shape: Shape, family: Family) {
    let what = format!("{shape} {family} hand-back");
    let n = Node::new(shape, family, Rules::Iptables);
    let load = settled_load(&n);
    let (mut lb, _spawned, healthy) = start_lbproxy(&n, &load, &["--takeover"]);
    sleep_until(healthy + SETTLE);
    let (status, _) = lb.terminate(Duration::from_secs(10));
    n.reinstall(Rules::Iptables);
    let handing = Instant::now();
    let dir = n.lab.bpffs_dir().display().to_string();
    let out = n
        .lab
        .lbproxy_cmd(&["cleanup", "--hand-back", "--bpffs-dir", &dir]);
    let handed = Instant::now();
    sleep_until(handed + WATCH);
    let vip_ct = n.vip_conntrack();
    let attached = n.lab.tcx_attachments();
    let (nft, save) = (n.nft_tables(), n.iptables_save());
    let report = load.stop();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "[{what}] lbproxy stopped ({status}); hand-back took {:?}: {said}\n{}",
        handed - handing,
        report.summary(handing)
    );
    assert!(
        out.status.success(),
        "[{what}] cleanup --hand-back failed: {said}"
    );
    // ASSERT 1: zero failed requests, through the takeover and the hand-back, to WATCH after.
    report.assert_clean(&what, handing, "the hand-back", &said);
    // ASSERT 2: lbproxy is gone from the node, and conntrack holds the load's flows.
    assert!(
        attached.is_empty(),
        "[{what}] programs still attached: {attached:?}"
    );
    assert!(
        !nft.contains(kp_untrack::NFT_TABLE) && !save.contains(kp_untrack::COMMENT),
        "[{what}] the hand-back's untrack rule is left in the node:\n{nft}\n{save}"
    );
    for c in load_conns(&report) {
        assert!(
            vip_ct.iter().any(|e| e.orig.src_port == c.port()),
            "[{what}] no conntrack entry to the VIP for {c} after the hand-back"
        );
    }
}

/// The client ends of the load's long-lived connections and sockets.
fn load_conns(r: &Report) -> Vec<SocketAddr> {
    r.conns.iter().map(|c| c.conn.local).collect()
}
