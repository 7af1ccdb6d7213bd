//! lbproxy taking two nodes over from kube-proxy, north-south (issue 29).
//!
//! The two-node lab (`lbproxy_tests::lab::multinode`): backends b1 and b2 on node B, the
//! `web` Service with NodePorts, and on both nodes kube-proxy's iptables rules for it
//! (`lbproxy_tests::lab::kube_proxy`, `--cluster-cidr` the two nodes' pod CIDRs). An
//! external client on the fabric runs the takeover load (`lbproxy_tests::lab::takeover_load`:
//! 6 long-lived TCP connections and 2 connected UDP sockets, a request each every 100 ms,
//! and 5 new connections a second) to node A's NodePorts. kube-proxy on node A DNATs each
//! flow to a backend on node B and masquerades it to node A's address (`KUBE-EXT-*` marks
//! NodePort traffic, `MASQUERADE --random-fully`): the backend sees node A's address and a
//! port conntrack chose.
//!
//! Then `lbproxy run --takeover` on node A and, [`BETWEEN`] after it is healthy, on node B.
//! Asserted:
//! - zero failed requests, from the load's start to [`WATCH`] after node B's lbproxy is
//!   healthy, and both lbproxies still running;
//! - every long-lived connection and socket is one of node A's lbproxy flows, to the backend
//!   the load saw answer it, source-NATed to the very address and port kube-proxy's
//!   masquerade had given it (read from node A's conntrack before the takeover);
//! - no `KUBE-SERVICES`, `KUBE-SVC-*` or `KUBE-SEP-*` chain left on either node, and no
//!   conntrack entry on node A whose original destination is its NodePort;
//! - node A's `takeover:` log line.
//!
//! Run: `cargo build -p lbproxy && LBPROXY_BIN=$PWD/target/debug/lbproxy cargo test -p
//! lbproxy-tests --test takeover_north_south -- --test-threads=1`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use common::{pod_addr, sleep_until};
use lbproxy::conntrack::{self as ct, Conntrack};
use lbproxy_tests::lab::kube_proxy::{self as fixture, NodeNet, ServicePort};
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_BACKEND_TCP, WEB_BACKEND_UDP, WEB_CLUSTER_IP, WEB_CLUSTER_IP6,
    WEB_NODE_PORT_TCP, WEB_NODE_PORT_UDP, dual_stack_web_manifest, web_manifest,
};
use lbproxy_tests::lab::takeover_load::{Load, show_failures};
use lbproxy_tests::lab::{Family, Inspect as _, Lbproxy, Pod, Proto, run_in_ns};

/// How long the load runs through kube-proxy's rules before lbproxy starts on node A.
const SETTLE: Duration = Duration::from_secs(2);
/// From node A's lbproxy healthy to node B's started.
const BETWEEN: Duration = Duration::from_secs(5);
/// How long the load goes on after node B's lbproxy is healthy.
const WATCH: Duration = Duration::from_secs(10);
const HEALTHY_WITHIN: Duration = Duration::from_secs(20);

lbproxy_tests::both_families!(north_south_on_two_nodes);

/// `node`'s fabric address in `family`.
fn node_addr(lab: &MultiNodeLab, node: NodeId, family: Family) -> IpAddr {
    let n = lab.node(node);
    match family {
        Family::V4 => n.ip.into(),
        Family::V6 => n.ip6.into(),
    }
}

/// `web` as kube-proxy sees it: TCP 80 (NodePort [`WEB_NODE_PORT_TCP`]) -> 8080 and UDP 53
/// (NodePort [`WEB_NODE_PORT_UDP`]) -> 5353 over `backends`; the cluster CIDR holds both
/// nodes' pod CIDRs and not the fabric, so NodePort traffic from the client is masqueraded.
fn kube_proxy_web(family: Family, backends: &[&Pod]) -> (Vec<ServicePort>, NodeNet) {
    let vip: IpAddr = match family {
        Family::V4 => WEB_CLUSTER_IP.into(),
        Family::V6 => WEB_CLUSTER_IP6.into(),
    };
    let eps = |port: u16| -> Vec<(IpAddr, u16)> {
        backends
            .iter()
            .map(|p| (pod_addr(p, family), port))
            .collect()
    };
    let ports = vec![
        ServicePort {
            node_port: Some(WEB_NODE_PORT_TCP),
            ..ServicePort::new("web", "http", Proto::Tcp, vip, 80, &eps(WEB_BACKEND_TCP))
        },
        ServicePort {
            node_port: Some(WEB_NODE_PORT_UDP),
            ..ServicePort::new("web", "dns", Proto::Udp, vip, 53, &eps(WEB_BACKEND_UDP))
        },
    ];
    let net = NodeNet {
        cluster_cidr: match family {
            Family::V4 => "198.18.0.0/22",
            Family::V6 => "fd00:c612::/46",
        }
        .into(),
        node_ips: Vec::new(),
    };
    (ports, net)
}

/// `node`'s conntrack entries whose original destination is `to` (an address and one of
/// `web`'s NodePorts).
fn node_port_conntrack(lab: &MultiNodeLab, node: NodeId, to: IpAddr) -> Vec<ct::Entry> {
    let fam = if to.is_ipv6() {
        ct::Family::V6
    } else {
        ct::Family::V4
    };
    let all = run_in_ns(lab.node_ns(node), || {
        Conntrack::open().and_then(|mut c| c.dump(fam))
    })
    .unwrap_or_else(|e| panic!("conntrack dump in {node}: {e}"));
    all.into_iter()
        .filter(|e| {
            e.orig.dst == to && [WEB_NODE_PORT_TCP, WEB_NODE_PORT_UDP].contains(&e.orig.dst_port)
        })
        .collect()
}

/// kube-proxy's service chains in `node`'s `iptables-save` (or `ip6tables-save`).
fn service_chains(lab: &MultiNodeLab, node: NodeId, family: Family) -> BTreeSet<String> {
    let save = match family {
        Family::V4 => "iptables-save",
        Family::V6 => "ip6tables-save",
    };
    let text = lab
        .node_run(node, &[save])
        .unwrap_or_else(|e| panic!("{save} in {node}: {e}"));
    fixture::service_chains(&text)
}

/// Starts `lbproxy run --takeover` on `node` and waits until it is healthy; panics with the
/// load's failures so far if it does not become so. Returns it and when it was healthy.
fn take_over(lab: &MultiNodeLab, node: NodeId, load: &Load, what: &str) -> (Lbproxy, Instant) {
    let spawned = Instant::now();
    // Held between deleting kube-proxy's entries and owning the flows, as in `takeover.rs`:
    // no packet of the load may depend on that moment.
    let mut lb = lab.start_lbproxy_argv(
        node,
        lab.lbproxy_run_args(node, &["--takeover"]),
        &[("LBPROXY_TEST_TAKEOVER_HOLD_MS", "500")],
    );
    if let Err(e) = lb.wait_healthy(HEALTHY_WITHIN) {
        panic!(
            "[{what}] lbproxy --takeover on {node} did not become healthy: {e}\nload failures \
             so far (relative to its start):{}\n{}",
            show_failures(
                &load.failures_since(load.started()),
                load.started(),
                spawned
            ),
            lb.log()
        );
    }
    (lb, Instant::now())
}

/// See the module docs.
fn north_south_on_two_nodes(family: Family) {
    let what = format!("{family} north-south takeover");
    let lab = MultiNodeLab::new();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let b2 = lab.add_pod(NodeId::B, "b2");
    let _servers = [&b1, &b2].map(|p| p.serve(&[WEB_BACKEND_TCP, WEB_BACKEND_UDP]));
    lab.write_manifest_text(&match family {
        Family::V4 => web_manifest(
            &[(b1.ip, Some("nodeB")), (b2.ip, Some("nodeB"))],
            "Cluster",
            "",
        ),
        Family::V6 => dual_stack_web_manifest(&lab, &[&b1, &b2], "Cluster", ""),
    });
    let (ports, net) = kube_proxy_web(family, &[&b1, &b2]);
    for node in NodeId::ALL {
        fixture::install_iptables(lab.node_ns(node), family, &ports, &net)
            .unwrap_or_else(|e| panic!("[{what}] kube-proxy's rules on {node}: {e}"));
    }
    let backend_addr: BTreeMap<&str, IpAddr> = [&b1, &b2]
        .iter()
        .map(|p| (p.name.as_str(), pod_addr(p, family)))
        .collect();

    let client = lab.add_client("ext");
    let a = node_addr(&lab, NodeId::A, family);
    let load = Load::start_in(
        &client.netns,
        SocketAddr::new(a, WEB_NODE_PORT_TCP),
        SocketAddr::new(a, WEB_NODE_PORT_UDP),
    );
    sleep_until(load.started() + SETTLE);
    let conns = load.conns().to_vec();

    // Before: each long-lived flow is kube-proxy's on node A, DNATed to its backend on node
    // B and masqueraded to node A's address. Its masquerade is what lbproxy must keep.
    let before = node_port_conntrack(&lab, NodeId::A, a);
    let mut masquerade = BTreeMap::new();
    for c in &conns {
        let e = before
            .iter()
            .find(|e| SocketAddr::new(e.orig.src, e.orig.src_port) == c.local)
            .unwrap_or_else(|| {
                panic!(
                    "[{what}] no conntrack entry on nodeA for {} from {}: {before:#?}",
                    c.lane, c.local
                )
            });
        assert!(
            e.dnat() && e.reply.src == backend_addr[c.backend.as_str()] && e.reply.dst == a,
            "[{what}] {} from {}: kube-proxy's entry {} (reply {}) should be DNATed to {} and \
             masqueraded to {a}",
            c.lane,
            c.local,
            e.orig,
            e.reply,
            c.backend
        );
        masquerade.insert(c.local, SocketAddr::new(e.reply.dst, e.reply.dst_port));
    }

    let (mut lb_a, healthy_a) = take_over(&lab, NodeId::A, &load, &what);
    sleep_until(healthy_a + BETWEEN);
    let (mut lb_b, healthy_b) = take_over(&lab, NodeId::B, &load, &what);
    sleep_until(healthy_b + WATCH);

    // Read while the load still runs, so its connections are alive.
    let flows = lab.node(NodeId::A).inspect_flows();
    let after = node_port_conntrack(&lab, NodeId::A, a);
    let chains: Vec<(NodeId, BTreeSet<String>)> = NodeId::ALL
        .iter()
        .map(|&n| (n, service_chains(&lab, n, family)))
        .collect();
    let running = (lb_a.is_running(), lb_b.is_running());
    let report = load.stop();
    let drops = lab.node(NodeId::A).inspect_json("drops");
    let logs = format!(
        "--- nodeA's lbproxy\n{}\n--- nodeB's lbproxy\n{}\n--- nodeA's inspect drops\n{drops}",
        lb_a.log(),
        lb_b.log()
    );
    eprintln!(
        "[{what}] nodeA healthy at the mark, nodeB {:?} after; {}",
        healthy_b - healthy_a,
        report.summary(healthy_a)
    );

    // ASSERT 1: zero failed requests from the load's start to WATCH after node B's takeover.
    report.assert_clean(&what, healthy_a, "nodeA's lbproxy healthy", &logs);
    assert!(
        running == (true, true),
        "[{what}] both lbproxies kept running: {running:?}\n{logs}"
    );

    // ASSERT 2: each long-lived flow is node A's lbproxy's, to its backend, source-NATed to
    // kube-proxy's masquerade address and port.
    for c in &conns {
        let row = flows
            .iter()
            .find(|f| f.client.parse::<SocketAddr>().ok() == Some(c.local))
            .unwrap_or_else(|| {
                panic!(
                    "[{what}] {} from {} (answered by {}) is not among nodeA's flows:\n{}",
                    c.lane,
                    c.local,
                    c.backend,
                    serde_json::to_string_pretty(&lab.node(NodeId::A).inspect_json("flows"))
                        .unwrap()
                )
            });
        let backend = row.backend.parse::<SocketAddr>().map(|b| b.ip());
        assert_eq!(
            backend,
            Ok(backend_addr[c.backend.as_str()]),
            "[{what}] {} from {}: nodeA's flow goes to {}, the load saw {} answer",
            c.lane,
            c.local,
            row.backend,
            c.backend
        );
        let snat = row
            .snat
            .as_deref()
            .and_then(|s| s.parse::<SocketAddr>().ok());
        assert_eq!(
            snat,
            Some(masquerade[&c.local]),
            "[{what}] {} from {}: nodeA's flow is source-NATed to {:?}; kube-proxy had \
             masqueraded it to {}",
            c.lane,
            c.local,
            row.snat,
            masquerade[&c.local]
        );
        assert!(
            row.adopted.is_none(),
            "[{what}] {} from {}: still {:?}, not lbproxy's own",
            c.lane,
            c.local,
            row.adopted
        );
    }

    // ASSERT 3: kube-proxy's rules are gone from both nodes, and node A's conntrack holds no
    // entry to its NodePorts.
    for (n, left) in &chains {
        assert!(
            left.is_empty(),
            "[{what}] kube-proxy's service chains left on {n}: {left:?}"
        );
    }
    assert!(
        after.is_empty(),
        "[{what}] conntrack entries to nodeA's NodePorts after the takeover:\n{}",
        after
            .iter()
            .map(|e| format!("  {} (reply {}) status {:#x}", e.orig, e.reply, e.status))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // ASSERT 4: node A's log says what its takeover did.
    assert!(
        lb_a.log().lines().any(|l| l.contains("takeover:")),
        "[{what}] no \"takeover:\" line in nodeA's log\n{logs}"
    );
}
