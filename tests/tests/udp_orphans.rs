//! UDP flows never outlive their endpoints or their Service (issue 28 §3; kube-proxy's
//! conntrack reconciler skipped both: kubernetes#139628, a Service scaled to zero, and
//! #141371, a deleted UDP Service).
//!
//! A one-way sender (a statsd client: it sends only, never reads, so it never sees an ICMP
//! error) sends 10 datagrams a second from a fixed source port to a Service whose only
//! endpoint is b1. Then either
//! - **scaled to zero**: b1 leaves the slice (now empty), and 2 s later b2 is added; or
//! - **deleted**: the Service is deleted, and 2 s later re-created at the same frontend
//!   addresses with b2 alone.
//!
//! b1 stays a pod and keeps its socket, so anything that still reaches it is seen. Both
//! backends only record, with the time `recv_from` returned at their socket
//! (`lab::paced::Arrivals`). The checks: b1 receives none of the sender's datagrams later
//! than 1.5 s after the change, b2 none before it is added and its first within 1.5 s
//! after, then the steady rate. Paths:
//! - ClusterIP from a pod (per packet), both pod-network shapes, IPv4 and IPv6; the
//!   scaled-to-zero case also with b1 still an endpoint of another Service, `metrics`
//!   (the shared-backend case of issue 27), which must still reach it afterwards;
//! - NodePort and externalIP from a client outside, through nodeA of the two-node lab
//!   (`lab::multinode`, routed pods only), b1 on nodeB (a source-NATed flow), b2 on nodeA;
//! - the same from the single-node lab's uplink namespace (a client outside the node, in
//!   both pod-network shapes, IPv4: that lab's node has no IPv6 address of its own);
//! - the socket-level path: a process of nodeA in the cgroup lbproxy's socket programs are
//!   attached to (`--cgroup-root`, a cgroup2 group the lab mounts), sending to the
//!   ClusterIP on an unconnected socket (`sendto`, translated per datagram) and on a
//!   connected one that connects again when a send fails (its socket is destroyed when its
//!   backend or Service goes).

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::cgroup::{Mode, Requests};
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_CLUSTER_IP, WEB_CLUSTER_IP6, WEB_EXTERNAL_IP, WEB_EXTERNAL_IP6,
    WEB_NODE_PORT_UDP, dual_stack_web_manifest, web_manifest,
};
use lbproxy_tests::lab::paced::{Arrivals, ONE_WAY_TAG, OneWay, show_arrivals};
use lbproxy_tests::lab::{Family, Lab, Pod, Shape, UPLINK_NODE_ADDR, ns_run};

both_shapes!(
    uplink_node_port_scaled_to_zero,
    uplink_node_port_deleted_and_recreated,
    uplink_external_ip_scaled_to_zero,
    uplink_external_ip_deleted_and_recreated,
);
both_shapes_and_families!(
    cluster_ip_scaled_to_zero,
    cluster_ip_scaled_to_zero_shared_backend,
    cluster_ip_deleted_and_recreated,
);
lbproxy_tests::both_families!(
    node_port_scaled_to_zero,
    node_port_deleted_and_recreated,
    external_ip_scaled_to_zero,
    external_ip_deleted_and_recreated,
    node_process_scaled_to_zero,
    node_process_deleted_and_recreated,
    node_process_connected_scaled_to_zero,
    node_process_connected_deleted_and_recreated,
);

/// The sender's pace: 10 datagrams a second.
const EVERY: Duration = Duration::from_millis(100);
/// The contract: b1 gets nothing later than this after the change, b2 its first datagram
/// within this of being added.
const WITHIN: Duration = Duration::from_millis(1500);
/// From the change to b2's addition.
const GAP: Duration = Duration::from_secs(2);
/// Watched after b2's addition.
const AFTER: Duration = Duration::from_secs(3);
/// How long the recording threads get to read what arrived before the arrivals are read.
const DRAIN: Duration = Duration::from_millis(500);
/// The sender's fixed source port (below the ephemeral range).
const SRC: u16 = 20061;
const HEALTHY: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    /// b1 leaves the slice, which becomes empty; b2 is added after [`GAP`].
    ScaledToZero,
    /// The Service is deleted, and re-created with b2 alone after [`GAP`].
    Deleted,
}

// ---------------------------------------------------------------------------------------
// The timeline and its checks
// ---------------------------------------------------------------------------------------

/// A receiving socket on `pod`'s UDP backend port (dual-stack), recording arrivals.
fn record(pod: &Pod) -> Arrivals {
    let sock = pod
        .run(|| UdpSocket::bind((Ipv6Addr::UNSPECIFIED, BACKEND_UDP)))
        .unwrap_or_else(|e| panic!("{}: bind [::]:{BACKEND_UDP}: {e}", pod.name));
    Arrivals::start(sock)
}

/// The unspecified address of `family`.
fn any(family: Family) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::UNSPECIFIED.into(),
        Family::V6 => Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// With the sender running on b1: waits until b1 has its datagrams, makes the change
/// (`change`), waits [`GAP`], adds b2 (`add`), watches [`AFTER`], and checks both backends'
/// arrivals (see the module docs). `diag` is shown on a failure.
fn timeline(
    ctx: &str,
    (b1, b2): (&Arrivals, &Arrivals),
    change: impl FnOnce(),
    add: impl FnOnce(),
    diag: &dyn Fn() -> String,
) {
    let got = b1.wait_tagged(ONE_WAY_TAG, 5, Duration::from_secs(5));
    assert!(
        got >= 5 && b2.tagged(ONE_WAY_TAG).is_empty(),
        "[{ctx}] before the change: b1 got {got} of the sender's datagrams in 5 s (want 5), \
         b2 {} (want none)\n{}",
        b2.tagged(ONE_WAY_TAG).len(),
        diag()
    );
    let gone = Instant::now();
    change();
    std::thread::sleep(GAP.saturating_sub(gone.elapsed()));
    let back = Instant::now();
    add();
    std::thread::sleep(AFTER);
    // Datagrams that arrived by now are timed by the kernel; let the recording threads
    // read them all (the sender goes on meanwhile: the checks below bound their windows).
    std::thread::sleep(DRAIN);
    let (on_b1, on_b2) = (b1.tagged(ONE_WAY_TAG), b2.tagged(ONE_WAY_TAG));
    let report = format!(
        "b1: {}; b2: {} (times from the change; b2 added at +{:.2}s)",
        show_arrivals(&on_b1, gone),
        show_arrivals(&on_b2, gone),
        (back - gone).as_secs_f64()
    );
    eprintln!("[{ctx}] {report}");
    let late: Vec<_> = on_b1.iter().filter(|a| a.at > gone + WITHIN).collect();
    assert!(
        late.is_empty(),
        "[{ctx}] b1 received {} of the sender's datagrams later than {WITHIN:?} after the \
         change, the last {:.2}s after it: {report}\n{}",
        late.len(),
        late.last().map_or(0.0, |a| (a.at - gone).as_secs_f64()),
        diag()
    );
    let early: Vec<_> = on_b2.iter().filter(|a| a.at < back).collect();
    assert!(
        early.is_empty(),
        "[{ctx}] b2 received {} datagrams before it was added: {report}",
        early.len()
    );
    let Some(first) = on_b2.first() else {
        panic!(
            "[{ctx}] b2 received nothing in {AFTER:?} after it was added: {report}\n{}",
            diag()
        );
    };
    assert!(
        first.at - back <= WITHIN,
        "[{ctx}] b2's first datagram came {:?} after it was added (want <= {WITHIN:?}): \
         {report}\n{}",
        first.at - back,
        diag()
    );
    // Then every datagram: 15 sent in the last 1.5 s, allow for the pace's jitter.
    let steady = on_b2
        .iter()
        .filter(|a| a.at > back + WITHIN && a.at <= back + AFTER)
        .count();
    assert!(
        steady >= 12,
        "[{ctx}] b2 received {steady} datagrams in the last {:?} (want >= 12 of 15): {report}",
        AFTER - WITHIN
    );
}

// ---------------------------------------------------------------------------------------
// ClusterIP from a pod: the per-packet path
// ---------------------------------------------------------------------------------------

fn cluster_ip_scaled_to_zero(shape: Shape, family: Family) {
    cluster_ip(shape, family, Change::ScaledToZero, false);
}

fn cluster_ip_scaled_to_zero_shared_backend(shape: Shape, family: Family) {
    cluster_ip(shape, family, Change::ScaledToZero, true);
}

fn cluster_ip_deleted_and_recreated(shape: Shape, family: Family) {
    cluster_ip(shape, family, Change::Deleted, false);
}

/// `web` (`family`'s VIP) over `pods`; with none, its slice is empty (of `family`'s
/// address type, as Kubernetes keeps it).
fn web_text(family: Family, pods: &[&Pod]) -> String {
    let text = web_objects("web", web_vip(family), ready_in(family, pods)).to_yaml();
    if pods.is_empty() && family == Family::V6 {
        text.replace("addressType: IPv4", "addressType: IPv6")
    } else {
        text
    }
}

/// A pod client's one-way sender to `web`'s ClusterIP, b1 its one endpoint; `change` made
/// on `web`; `shared`: b1 is also the one endpoint of `metrics` throughout, and must still
/// be reached through it afterwards.
fn cluster_ip(shape: Shape, family: Family, change: Change, shared: bool) {
    let ctx = format!("{shape}, {family}, ClusterIP, {change:?}, shared: {shared}");
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let (b1, b2) = (lab.add_pod("b1"), lab.add_pod("b2"));
    let (r1, r2) = (record(&b1), record(&b2));
    let metrics_vip = vip_in(family, 13);
    let metrics = || {
        if shared {
            let m = web_objects("metrics", metrics_vip, ready_in(family, &[&b1]));
            format!("---\n{}", m.to_yaml())
        } else {
            String::new()
        }
    };
    lab.write_manifest_text(&(web_text(family, &[&b1]) + &metrics()));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY);
    let sock = client
        .run(|| UdpSocket::bind((any(family), SRC)))
        .expect("bind the sender's fixed port");
    let sender = OneWay::start(sock, SocketAddr::new(web_vip(family), WEB_UDP), EVERY);
    let gone = match change {
        Change::ScaledToZero => web_text(family, &[]) + &metrics(),
        Change::Deleted => metrics(),
    };
    let diag = || format!("{}\n--- lbproxy\n{}", lab.diagnostics(), lb.log());
    timeline(
        &ctx,
        (&r1, &r2),
        || lab.write_manifest_text(&gone),
        || lab.write_manifest_text(&(web_text(family, &[&b2]) + &metrics())),
        &diag,
    );
    let log = sender.stop();
    eprintln!(
        "[{ctx}] sent {}, send errors {:?}",
        log.sent,
        log.errors.len()
    );
    if shared {
        // metrics still reaches b1, from another port of the client.
        let probe = client
            .run(|| UdpSocket::bind((any(family), SRC + 1)))
            .expect("bind the probe's port");
        for _ in 0..3 {
            let _ = probe.send_to(b"probe\n", SocketAddr::new(metrics_vip, WEB_UDP));
        }
        let got = r1.wait_tagged("probe", 3, Duration::from_secs(1));
        assert_eq!(got, 3, "[{ctx}] metrics must still reach b1\n{}", diag());
    }
}

// ---------------------------------------------------------------------------------------
// NodePort and externalIP from the single-node lab's uplink: both shapes, IPv4
// ---------------------------------------------------------------------------------------

/// `web`'s externalIP in the single-node lab.
const UPLINK_EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 7);

fn uplink_node_port_scaled_to_zero(shape: Shape) {
    from_uplink(shape, Outside::NodePort, Change::ScaledToZero);
}

fn uplink_node_port_deleted_and_recreated(shape: Shape) {
    from_uplink(shape, Outside::NodePort, Change::Deleted);
}

fn uplink_external_ip_scaled_to_zero(shape: Shape) {
    from_uplink(shape, Outside::ExternalIp, Change::ScaledToZero);
}

fn uplink_external_ip_deleted_and_recreated(shape: Shape) {
    from_uplink(shape, Outside::ExternalIp, Change::Deleted);
}

/// `web` of type NodePort (UDP 53, nodePort [`WEB_NODE_PORT_UDP`]) with externalIP
/// [`UPLINK_EXTERNAL_IP`] over `pods` (none: its slice empty).
fn node_port_web(pods: &[&Pod]) -> String {
    web_objects("web", WEB_VIP, ready_in(Family::V4, pods))
        .to_yaml()
        .replace(
            "  sessionAffinity: None\n",
            &format!("  externalIPs: [{UPLINK_EXTERNAL_IP}]\n  sessionAffinity: None\n"),
        )
        .replace("  type: ClusterIP\n", "  type: NodePort\n")
        .replace(
            &format!("    port: {WEB_UDP}\n"),
            &format!("    port: {WEB_UDP}\n    nodePort: {WEB_NODE_PORT_UDP}\n"),
        )
}

/// A client in the uplink namespace (outside the node) sends to `web`'s NodePort on the
/// node's uplink address, or to its externalIP (routed through the node).
fn from_uplink(shape: Shape, kind: Outside, change: Change) {
    let ctx = format!("{shape}, IPv4, uplink {kind:?}, {change:?}");
    let lab = Lab::new(shape);
    let (b1, b2) = (lab.add_pod("b1"), lab.add_pod("b2"));
    let (r1, r2) = (record(&b1), record(&b2));
    lab.write_manifest_text(&node_port_web(&[&b1]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY);
    let dst: SocketAddr = match kind {
        Outside::NodePort => (UPLINK_NODE_ADDR, WEB_NODE_PORT_UDP).into(),
        Outside::ExternalIp => {
            let route = format!("{UPLINK_EXTERNAL_IP}/32");
            let via = UPLINK_NODE_ADDR.to_string();
            ns_run(
                lab.uplink_ns(),
                &["ip", "route", "add", &route, "via", &via],
            )
            .unwrap_or_else(|e| panic!("[{ctx}] uplink: ip route add {route}: {e}"));
            (UPLINK_EXTERNAL_IP, WEB_UDP).into()
        }
    };
    let sock = lbproxy_tests::lab::run_in_ns(lab.uplink_ns(), || {
        UdpSocket::bind((Ipv4Addr::UNSPECIFIED, SRC))
    })
    .expect("bind the sender's fixed port");
    let sender = OneWay::start(sock, dst, EVERY);
    let gone = match change {
        Change::ScaledToZero => node_port_web(&[]),
        Change::Deleted => String::new(),
    };
    let diag = || format!("{}\n--- lbproxy\n{}", lab.diagnostics(), lb.log());
    timeline(
        &ctx,
        (&r1, &r2),
        || lab.write_manifest_text(&gone),
        || lab.write_manifest_text(&node_port_web(&[&b2])),
        &diag,
    );
    let log = sender.stop();
    eprintln!(
        "[{ctx}] sent {}, send errors {}",
        log.sent,
        log.errors.len()
    );
}

// ---------------------------------------------------------------------------------------
// The two-node lab: NodePort and externalIP from outside, and nodeA's own processes
// ---------------------------------------------------------------------------------------

/// The two-node lab with b1 on nodeB and b2 on nodeA recording, `web` (type LoadBalancer:
/// ClusterIP, externalIP, NodePorts; dual-stack for IPv6) over b1, lbproxy on both nodes.
struct TwoNodes {
    lab: MultiNodeLab,
    lbs: Vec<lbproxy_tests::lab::Lbproxy>,
    family: Family,
    b1: Pod,
    b2: Pod,
    r1: Arrivals,
    r2: Arrivals,
}

impl TwoNodes {
    fn new(family: Family) -> TwoNodes {
        let lab = MultiNodeLab::new();
        let b1 = lab.add_pod(NodeId::B, "b1");
        let b2 = lab.add_pod(NodeId::A, "b2");
        let (r1, r2) = (record(&b1), record(&b2));
        let mut s = TwoNodes {
            lab,
            lbs: Vec::new(),
            family,
            b1,
            b2,
            r1,
            r2,
        };
        s.lab.write_manifest_text(&s.web(&[&s.b1]));
        s.lbs = s.lab.start_lbproxy_on_both(&[], HEALTHY);
        s
    }

    /// `web` over `pods` (none: its slices empty).
    fn web(&self, pods: &[&Pod]) -> String {
        match self.family {
            Family::V4 => {
                let eps: Vec<_> = pods
                    .iter()
                    .map(|p| (p.ip, Some(self.lab.node_of(&p.name).name())))
                    .collect();
                web_manifest(&eps, "Cluster", "")
            }
            Family::V6 => dual_stack_web_manifest(&self.lab, pods, "Cluster", ""),
        }
    }

    /// Makes `change`, then adds b2, checking the arrivals ([`timeline`]).
    fn timeline(&self, ctx: &str, change: Change) {
        let gone = match change {
            Change::ScaledToZero => self.web(&[]),
            Change::Deleted => String::new(),
        };
        let diag = || {
            let logs: Vec<String> = self.lbs.iter().map(|l| l.log()).collect();
            format!(
                "{}\n--- lbproxy\n{}",
                self.lab.diagnostics(),
                logs.join("\n")
            )
        };
        timeline(
            ctx,
            (&self.r1, &self.r2),
            || self.lab.write_manifest_text(&gone),
            || self.lab.write_manifest_text(&self.web(&[&self.b2])),
            &diag,
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum Outside {
    NodePort,
    ExternalIp,
}

fn node_port_scaled_to_zero(family: Family) {
    from_outside(family, Outside::NodePort, Change::ScaledToZero);
}

fn node_port_deleted_and_recreated(family: Family) {
    from_outside(family, Outside::NodePort, Change::Deleted);
}

fn external_ip_scaled_to_zero(family: Family) {
    from_outside(family, Outside::ExternalIp, Change::ScaledToZero);
}

fn external_ip_deleted_and_recreated(family: Family) {
    from_outside(family, Outside::ExternalIp, Change::Deleted);
}

/// A client outside sends through nodeA to `web`'s NodePort or externalIP.
fn from_outside(family: Family, kind: Outside, change: Change) {
    let ctx = format!("{family}, {kind:?}, {change:?}");
    let s = TwoNodes::new(family);
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A);
    let dst: SocketAddr = match (kind, family) {
        (Outside::NodePort, Family::V4) => (a.ip, WEB_NODE_PORT_UDP).into(),
        (Outside::NodePort, Family::V6) => (a.ip6, WEB_NODE_PORT_UDP).into(),
        (Outside::ExternalIp, Family::V4) => {
            client.route_via(&format!("{WEB_EXTERNAL_IP}/32"), a);
            (WEB_EXTERNAL_IP, WEB_UDP).into()
        }
        (Outside::ExternalIp, Family::V6) => {
            client.route_via6(&format!("{WEB_EXTERNAL_IP6}/128"), a);
            (WEB_EXTERNAL_IP6, WEB_UDP).into()
        }
    };
    let sock = client
        .run(|| UdpSocket::bind((any(family), SRC)))
        .expect("bind the sender's fixed port");
    let sender = OneWay::start(sock, dst, EVERY);
    s.timeline(&ctx, change);
    let log = sender.stop();
    eprintln!(
        "[{ctx}] sent {}, send errors {}",
        log.sent,
        log.errors.len()
    );
}

fn node_process_scaled_to_zero(family: Family) {
    node_process(family, Mode::UdpOneWay, Change::ScaledToZero);
}

fn node_process_deleted_and_recreated(family: Family) {
    node_process(family, Mode::UdpOneWay, Change::Deleted);
}

fn node_process_connected_scaled_to_zero(family: Family) {
    node_process(family, Mode::UdpOneWayConnected, Change::ScaledToZero);
}

fn node_process_connected_deleted_and_recreated(family: Family) {
    node_process(family, Mode::UdpOneWayConnected, Change::Deleted);
}

/// A process of nodeA, in the socket programs' cgroup, sends to `web`'s ClusterIP from a
/// fixed port: `mode` unconnected (`sendto`) or connected (connects again when a send
/// fails).
fn node_process(family: Family, mode: Mode, change: Change) {
    let ctx = format!("{family}, node process {mode:?}, {change:?}");
    let s = TwoNodes::new(family);
    let vip: IpAddr = match family {
        Family::V4 => WEB_CLUSTER_IP.into(),
        Family::V6 => WEB_CLUSTER_IP6.into(),
    };
    let req = Requests::new(mode, SocketAddr::new(vip, WEB_UDP), 200)
        .interval(EVERY)
        .bind_port(SRC);
    if family == Family::V6 {
        // nodeA routes IPv6 as it routes IPv4 (`default dev eth0`), as a node with an IPv6
        // default route does: a socket can then connect to the ClusterIP while it is no
        // frontend, and its datagrams leave without an error, as on a real node. (Without
        // the route, connect() fails with ENETUNREACH and the socket never holds the bare
        // address.)
        s.lab
            .node_run(
                NodeId::A,
                &["ip", "-6", "route", "add", "default", "dev", "eth0"],
            )
            .unwrap_or_else(|e| panic!("[{ctx}] nodeA: ip -6 route add default: {e}"));
    }
    let sender = s.lab.host_client(NodeId::A, &req);
    s.timeline(&ctx, change);
    let out = sender.stop();
    let errors: Vec<_> = out.iter().filter(|o| !o.ok).map(|o| &o.error).collect();
    eprintln!("[{ctx}] {} sends, errors: {errors:?}", out.len());
}
