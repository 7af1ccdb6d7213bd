//! Clients on the node itself (issue 12): processes in a node's own network namespace, in
//! the cgroup lbproxy's socket-level programs are attached to, reach every frontend kind the
//! node serves, see the frontend as their peer, are refused at once without endpoints, keep
//! session affinity, and lose a connected socket whose backend leaves.
//!
//! Each node runs its own lbproxy, started exactly as other harnesses start it:
//! `run --manifests FILE --pod-interfaces 'lxc*' --hostname-override nodeX
//! --nodeport-addresses 198.18.80.0/24 --cgroup-root CGROUP --bpffs-dir DIR
//! --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249`; the
//! clients are `lbt-client` processes in CGROUP (a group of a cgroup2 hierarchy the lab
//! mounts and removes itself) and in the node's network namespace.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::cgroup::{HostClient, Mode, Outcome, Requests};
use lbproxy_tests::lab::multinode::{MultiNodeLab, NodeId};
use lbproxy_tests::lab::{Backend, Family, Inspect as _, Lbproxy, Pod, run_lbproxy_cmd};

use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP, WEB_CLUSTER_IP as CLUSTER_IP,
    WEB_EXTERNAL_IP as EXTERNAL_IP, WEB_LB_IP as LB_IP, WEB_NODE_PORT_TCP as NODE_PORT_TCP,
    WEB_NODE_PORT_UDP as NODE_PORT_UDP, cluster_ip_manifest, web_manifest,
};
use lbproxy_tests::lab::multinode::{
    WEB_CLUSTER_IP6 as CLUSTER_IP6, WEB_EXTERNAL_IP6 as EXTERNAL_IP6, WEB_LB_IP6 as LB_IP6,
    dual_stack_web_manifest,
};

lbproxy_tests::both_families!(
    node_processes_reach_every_frontend_kind,
    an_open_tcp_connection_moves_when_its_backend_leaves,
    socket_lb_pods_translates_pods_at_the_socket,
);

const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
/// The ClusterIP of `metrics`, a second Service over a backend of `web`.
const METRICS_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 13);
const TIMEOUT: Duration = Duration::from_secs(2);
const HEALTHY_WITHIN: Duration = Duration::from_secs(20);

/// The lab's `web` service ([`web_manifest`]) over `eps`, and `empty`, a ClusterIP service
/// without endpoints.
fn manifest(lab: &MultiNodeLab, eps: &[&Pod], policy: &str, extra: &str) -> String {
    let eps: Vec<(Ipv4Addr, Option<&str>)> = eps
        .iter()
        .map(|p| (p.ip, Some(lab.node_of(&p.name).name())))
        .collect();
    format!(
        "{}---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: default}}
spec:
  clusterIP: {EMPTY_IP}
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: {BACKEND_TCP}}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: {BACKEND_UDP}}}
",
        web_manifest(&eps, policy, extra)
    )
}

struct Setup {
    // Dropped last: servers and lbproxys go first.
    lab: MultiNodeLab,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
    a1: Pod,
    b1: Pod,
}

impl Setup {
    fn new(policy: &str, extra: &str) -> Setup {
        Setup::with_args(policy, extra, &[])
    }

    /// [`Setup::new`], lbproxy started with `args` added to the contract command line.
    fn with_args(policy: &str, extra: &str, args: &[&str]) -> Setup {
        Setup::with_manifest(|lab, pods| manifest(lab, pods, policy, extra), args)
    }

    /// The `Cluster`-policy `web` serving `family`: [`Setup::new`]'s for IPv4, the
    /// dual-stack `web` ([`dual_stack_web_manifest`]) for IPv6.
    fn serving(family: Family) -> Setup {
        Setup::serving_with(family, &[])
    }

    /// [`Setup::serving`], lbproxy started with `args` added.
    fn serving_with(family: Family, args: &[&str]) -> Setup {
        match family {
            Family::V4 => Setup::with_args("Cluster", "", args),
            Family::V6 => Setup::with_manifest(
                |lab, pods| dual_stack_web_manifest(lab, pods, "Cluster", ""),
                args,
            ),
        }
    }

    /// a1 on nodeA and b1 on nodeB serving, `manifest(lab, [a1, b1])` written, lbproxy
    /// started on both nodes with `args` added.
    fn with_manifest(manifest: impl Fn(&MultiNodeLab, &[&Pod]) -> String, args: &[&str]) -> Setup {
        let lab = MultiNodeLab::new();
        let a1 = lab.add_pod(NodeId::A, "a1");
        let b1 = lab.add_pod(NodeId::B, "b1");
        let servers = vec![
            a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
            b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        ];
        lab.write_manifest_text(&manifest(&lab, &[&a1, &b1]));
        let lbs = lab.start_lbproxy_on_both(args, HEALTHY_WITHIN);
        Setup {
            lab,
            _servers: servers,
            lbs,
            a1,
            b1,
        }
    }

    fn requests(&self, node: NodeId, mode: Mode, to: SocketAddr, n: usize) -> Vec<Outcome> {
        self.lab
            .host_client(node, &Requests::new(mode, to, n).timeout(TIMEOUT))
            .all()
    }

    /// Node A's `lbproxy inspect sockets --json` events.
    fn socket_events(&self) -> BTreeMap<String, u64> {
        self.lab.node(NodeId::A).inspect_sockets().events
    }

    fn logs(&self) -> String {
        self.lbs
            .iter()
            .map(|l| l.log())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// Counts of each backend among `out`, panicking (with `ctx`) on any failed request or on a
/// peer other than `peer`.
fn tally(out: &[Outcome], peer: SocketAddr, ctx: &str) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in out {
        assert!(o.ok, "{ctx}: request failed: {o:?}");
        assert_eq!(
            o.peer,
            peer.to_string(),
            "{ctx}: the client must see the frontend as its peer: {o:?}"
        );
        *m.entry(o.backend.clone()).or_insert(0) += 1;
    }
    m
}

/// The address a backend saw, without the port.
fn seen_ip(o: &Outcome) -> IpAddr {
    o.client_seen
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .unwrap_or_else(|e| panic!("client_seen {:?}: {e}", o.client_seen))
}

/// TCP, unconnected and connected UDP from node A's own namespace to the ClusterIP, the
/// externalIP and the LB IP reach both backends (one on each node; a connected UDP socket
/// at least one), and `getpeername` / `recvfrom` show the frontend. The backends see node
/// A's address: the socket connects from the node itself. Over IPv4 and over IPv6 (the
/// dual-stack `web`), where the NodePorts on either node's IPv6 address are asked too (the
/// IPv4 ones are [`node_processes_reach_node_ports_on_both_nodes`]'s).
fn node_processes_reach_every_frontend_kind(family: Family) {
    let s = Setup::serving(family);
    let node_a: IpAddr = match family {
        Family::V4 => s.lab.node(NodeId::A).ip.into(),
        Family::V6 => s.lab.node(NodeId::A).ip6.into(),
    };
    let mut frontends: Vec<(IpAddr, u16, u16)> = match family {
        Family::V4 => [CLUSTER_IP, EXTERNAL_IP, LB_IP]
            .map(|ip| (ip.into(), 80, 53))
            .to_vec(),
        Family::V6 => [CLUSTER_IP6, EXTERNAL_IP6, LB_IP6]
            .map(|ip| (ip.into(), 80, 53))
            .to_vec(),
    };
    if family == Family::V6 {
        for node in NodeId::ALL {
            frontends.push((s.lab.node(node).ip6.into(), NODE_PORT_TCP, NODE_PORT_UDP));
        }
    }
    let node_ports = |ip: IpAddr| {
        NodeId::ALL
            .iter()
            .any(|&n| IpAddr::from(s.lab.node(n).ip6) == ip)
    };
    for (ip, tcp, udp) in frontends {
        for (mode, port) in [
            (Mode::Tcp, tcp),
            (Mode::Udp, udp),
            (Mode::UdpConnected, udp),
        ] {
            let to = SocketAddr::new(ip, port);
            let out = s.requests(NodeId::A, mode, to, 16);
            let ctx = format!("[{family}] {mode:?} from nodeA to {to}\n{}", s.logs());
            let m = tally(&out, to, &ctx);
            if matches!(mode, Mode::UdpConnected) {
                assert!(!m.is_empty(), "{ctx}: want a backend, got {m:?}");
            } else {
                assert!(
                    m.contains_key(&s.a1.name) && m.contains_key(&s.b1.name),
                    "{ctx}: 16 sockets should reach both backends: {m:?}"
                );
            }
            if !node_ports(ip) {
                for o in &out {
                    assert_eq!(seen_ip(o), node_a, "{ctx}: {o:?}");
                }
            }
        }
    }
}

/// NodePorts on node A's own address and on node B's, TCP and UDP, from node A's own
/// namespace: every request is answered from the address and port asked for.
#[test]
fn node_processes_reach_node_ports_on_both_nodes() {
    let s = Setup::new("Cluster", "");
    for node in NodeId::ALL {
        let ip = s.lab.node(node).ip;
        for (mode, port) in [(Mode::Tcp, NODE_PORT_TCP), (Mode::Udp, NODE_PORT_UDP)] {
            let to = sa(ip, port);
            let out = s.requests(NodeId::A, mode, to, 16);
            let ctx = format!("{mode:?} from nodeA to {to}\n{}", s.logs());
            let m = tally(&out, to, &ctx);
            assert!(
                m.contains_key(&s.a1.name) && m.contains_key(&s.b1.name),
                "{ctx}: 16 sockets should reach both backends: {m:?}"
            );
        }
    }
}

/// A dual-stack IPv6 socket talking IPv4 (an IPv4-mapped address, as a Java client or any
/// `AF_INET6` socket given `::ffff:a.b.c.d` uses): TCP, unconnected UDP and connected UDP
/// to the ClusterIP's mapped address reach both backends, the peer shown is the mapped
/// ClusterIP, and the mapped address of a frontend without endpoints is refused at once.
/// Translated by `lb_connect6`/`lb_sendmsg6`/`lb_recvmsg6`/`lb_getpeername6`; without them
/// these sockets would go to the ClusterIP itself, which answers nothing.
#[test]
fn dual_stack_sockets_reach_ipv4_frontends_through_mapped_addresses() {
    let s = Setup::new("Cluster", "");
    let mapped = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip.to_ipv6_mapped(), port));
    for (mode, port) in [(Mode::Tcp, 80), (Mode::Udp, 53), (Mode::UdpConnected, 53)] {
        let to = mapped(CLUSTER_IP, port);
        let out = s.requests(NodeId::A, mode, to, 16);
        let ctx = format!("{mode:?} to {to}\n{}", s.logs());
        let m = tally(&out, to, &ctx);
        let want = if matches!(mode, Mode::UdpConnected) {
            1
        } else {
            2
        };
        assert!(
            m.len() >= want,
            "{ctx}: want {want} backend(s) reached, got {m:?}"
        );
    }
    for (mode, port) in [(Mode::Tcp, 80), (Mode::UdpConnected, 53)] {
        let out = s.requests(NodeId::A, mode, mapped(EMPTY_IP, port), 2);
        for o in &out {
            assert_eq!(o.errno, Some(libc::ECONNREFUSED), "{mode:?} mapped: {o:?}");
            assert!(
                o.ms < 100.0,
                "{mode:?} mapped: refused only after {} ms",
                o.ms
            );
        }
    }
}

/// A frontend without endpoints: `connect()` fails at once with ECONNREFUSED, for TCP and
/// for a UDP socket being connected, and an unconnected UDP `sendto` fails the same way.
#[test]
fn node_processes_are_refused_at_once_without_endpoints() {
    let s = Setup::new("Cluster", "");
    for (mode, port) in [(Mode::Tcp, 80), (Mode::UdpConnected, 53), (Mode::Udp, 53)] {
        let out = s.requests(NodeId::A, mode, sa(EMPTY_IP, port), 3);
        for o in &out {
            assert!(!o.ok, "{mode:?}: answered without endpoints: {o:?}");
            assert_eq!(o.errno, Some(libc::ECONNREFUSED), "{mode:?}: {o:?}");
            assert!(o.ms < 100.0, "{mode:?}: refused only after {} ms", o.ms);
        }
    }
}

/// `sessionAffinity: ClientIP` holds for the node's own processes: every socket, TCP or
/// UDP, gets the backend the first one got.
#[test]
fn node_processes_keep_session_affinity() {
    let s = Setup::new(
        "Cluster",
        "sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
    );
    for (mode, port) in [(Mode::Tcp, 80), (Mode::Udp, 53)] {
        let to = sa(CLUSTER_IP, port);
        let out = s.requests(NodeId::A, mode, to, 12);
        let m = tally(&out, to, &format!("{mode:?}\n{}", s.logs()));
        assert_eq!(m.len(), 1, "{mode:?}: affinity broken: {m:?}");
    }
}

/// Scope: pods keep the per-packet path. A process of a pod, in the same cgroup as the
/// node's clients, reaches the ClusterIP; the socket-level programs see its `connect()` as
/// another namespace's and leave it alone, and its flow is in the per-packet flow table.
#[test]
fn pods_keep_the_per_packet_path() {
    let s = Setup::new("Cluster", "");
    let client = s.lab.add_pod(NodeId::A, "client");
    s.lab.wait_programs_on(&client, Duration::from_secs(10));
    let before = s.socket_events();
    let to = sa(CLUSTER_IP, 80);
    let out = HostClient::spawn(
        &client.netns,
        Some(s.lab.cgroup()),
        &Requests::new(Mode::Tcp, to, 4).timeout(TIMEOUT),
    )
    .all();
    let m = tally(&out, to, &format!("pod to ClusterIP\n{}", s.logs()));
    for o in &out {
        assert_eq!(seen_ip(o), client.ip, "the backend must see the pod: {o:?}");
    }
    let after = s.socket_events();
    assert_eq!(
        n(&after, "connect_translated"),
        n(&before, "connect_translated"),
        "a pod's connect() was translated at the socket ({m:?})"
    );
    assert!(
        n(&after, "other_netns") >= n(&before, "other_netns") + 4,
        "the pod's 4 connect() calls were not seen as another namespace's: {after:?}"
    );
    let flows = s.lab.node(NodeId::A).inspect_json("flows").to_string();
    assert!(
        flows.contains(&client.ip.to_string()),
        "no per-packet flow of the pod {}: {flows}",
        client.ip
    );
}

/// Scope with `--socket-lb off`: no cgroup program is attached, and a pod's process in the
/// group is still served, per packet: the backend sees the pod, and its flow is in the
/// per-packet flow table.
#[test]
fn socket_lb_off_leaves_pods_to_the_per_packet_path() {
    let s = Setup::with_args("Cluster", "", &["--socket-lb", "off"]);
    let client = s.lab.add_pod(NodeId::A, "client");
    s.lab.wait_programs_on(&client, Duration::from_secs(10));
    let sockets = s.lab.node(NodeId::A).inspect_sockets();
    assert!(
        sockets.mode == "off" && sockets.hooks.is_empty(),
        "inspect sockets with --socket-lb off: {sockets:#?}"
    );
    pod_requests_reach_the_cluster_ip(&s, &client);
    let events = s.socket_events();
    assert!(
        events.values().all(|&v| v == 0),
        "a socket-level program ran with --socket-lb off: {events:?}"
    );
    let flows = s.lab.node(NodeId::A).inspect_flows();
    let ours = flows
        .iter()
        .filter(|f| f.client.starts_with(&format!("{}:", client.ip)))
        .count();
    assert!(
        ours >= 8,
        "want the pod's 8 flows in the per-packet table, found {ours}: {flows:#?}"
    );
}

/// 4 TCP connections and 4 UDP requests from a process of `client` (a pod on nodeA) in the
/// lab's group to the ClusterIP, each answered from the ClusterIP by a backend that sees the
/// pod's own address.
fn pod_requests_reach_the_cluster_ip(s: &Setup, client: &Pod) {
    pod_requests_reach_the_cluster_ip_in(s, client, Family::V4, 4);
}

/// `n` TCP and `n` UDP requests from `client`'s process in the lab's group to the ClusterIP
/// of `family`: each answered, the ClusterIP as the peer, the backend seeing the pod's own
/// address.
fn pod_requests_reach_the_cluster_ip_in(s: &Setup, client: &Pod, family: Family, n: usize) {
    let (ip, me): (IpAddr, IpAddr) = match family {
        Family::V4 => (CLUSTER_IP.into(), client.ip.into()),
        Family::V6 => (CLUSTER_IP6.into(), client.ip6.unwrap().into()),
    };
    for (mode, port) in [(Mode::Tcp, 80), (Mode::Udp, 53)] {
        let to = SocketAddr::new(ip, port);
        let out = HostClient::spawn(
            &client.netns,
            Some(s.lab.cgroup()),
            &Requests::new(mode, to, n).timeout(TIMEOUT),
        )
        .all();
        tally(
            &out,
            to,
            &format!("[{family}] pod {mode:?} to {to}\n{}", s.logs()),
        );
        for o in &out {
            assert_eq!(
                seen_ip(o),
                me,
                "[{family}] the backend must see the pod: {o:?}"
            );
        }
    }
}

/// An event counter of `lbproxy inspect sockets --json`.
fn n(events: &BTreeMap<String, u64>, k: &str) -> u64 {
    events.get(k).copied().unwrap_or(0)
}

/// `--socket-lb pods`: a pod's process (in the group) is translated at the socket like the
/// node's own: `connect()` and an unconnected `sendto()` go straight to a backend, which
/// sees the pod's address, `getpeername`/`recvfrom` show the frontend, the events count the
/// translations (none as another namespace's), and the per-packet path keeps no flow of it.
/// Over IPv4 and over IPv6 (`connect6`, `sendmsg6`; the dual-stack `web`'s IPv6 ClusterIP).
fn socket_lb_pods_translates_pods_at_the_socket(family: Family) {
    let s = Setup::serving_with(family, &["--socket-lb", "pods"]);
    let client = s.lab.add_pod(NodeId::A, "client");
    s.lab.wait_programs_on(&client, Duration::from_secs(10));
    let me = match family {
        Family::V4 => client.ip.to_string(),
        Family::V6 => client.ip6.unwrap().to_string(),
    };
    let before = s.socket_events();
    pod_requests_reach_the_cluster_ip_in(&s, &client, family, 8);
    let after = s.socket_events();
    for (event, least) in [("connect_translated", 8), ("sendmsg_translated", 8)] {
        assert!(
            n(&after, event) >= n(&before, event) + least,
            "[{family}] {event}: {} -> {}, want at least {least} more\n{after:?}",
            n(&before, event),
            n(&after, event)
        );
    }
    assert_eq!(
        n(&after, "other_netns"),
        n(&before, "other_netns"),
        "[{family}] a pod's socket was left to the per-packet path: {after:?}"
    );
    let flows = s.lab.node(NodeId::A).inspect_json("flows").to_string();
    assert!(
        !flows.contains(&me),
        "[{family}] a per-packet flow of the pod {me}: {flows}"
    );
}

/// Churn: a node process's connected UDP socket (a resolver's to a DNS ClusterIP) whose
/// backend leaves the service is destroyed by lbproxy; the process sees an error on its next
/// query, reconnects, and is answered by the live backend. Measures how long after the
/// change that takes.
#[test]
fn a_connected_udp_socket_moves_when_its_backend_leaves() {
    connected_socket_moves_when_its_backend_leaves(Mode::UdpConnected, 53, false, Family::V4);
}

/// [`a_connected_udp_socket_moves_when_its_backend_leaves`], with the backend that leaves
/// `web` still an endpoint (same address and port) of another Service, `metrics`: the
/// socket was given it for `web`, so it must move all the same. (The reaper used to keep it,
/// since the backend's id still resolved: every query after the change reached it.)
#[test]
fn a_connected_udp_socket_moves_when_its_backend_leaves_one_of_two_services() {
    connected_socket_moves_when_its_backend_leaves(Mode::UdpConnected, 53, true, Family::V4);
}

/// The TCP case of the test above: an open connection given a backend for `web` is
/// destroyed when that backend leaves `web`, though it stays in `metrics`.
#[test]
fn an_open_tcp_connection_moves_when_its_backend_leaves_one_of_two_services() {
    connected_socket_moves_when_its_backend_leaves(Mode::TcpConnected, 80, true, Family::V4);
}

/// Churn, TCP: a node process's open connection to a ClusterIP whose backend leaves is
/// destroyed by lbproxy (the old backend still serves, so without that the connection
/// would go on talking to it); the next request fails, and the process's new connection is
/// answered by the live backend. Over IPv4 and over IPv6 (the dual-stack `web`'s IPv6
/// ClusterIP: `LB_SOCKREV6_V1`, the reaper's IPv6 `sock_diag` dump).
fn an_open_tcp_connection_moves_when_its_backend_leaves(family: Family) {
    connected_socket_moves_when_its_backend_leaves(Mode::TcpConnected, 80, false, family);
}

/// A node process sends a request every 50 ms on one socket of `mode` to the ClusterIP's
/// `port`; its backend leaves the service; the socket must fail at least once (destroyed)
/// and the process be answered by the other backend within 2 s. `shared`: the backend that
/// leaves stays an endpoint of another Service, `metrics` (IPv4), which keeps reaching it.
/// Over `family`: IPv6 with the dual-stack `web`, the backend leaving both its slices.
fn connected_socket_moves_when_its_backend_leaves(
    mode: Mode,
    port: u16,
    shared: bool,
    family: Family,
) {
    assert!(
        !shared || family == Family::V4,
        "the shared case is written for IPv4"
    );
    let s = Setup::serving(family);
    let to = match family {
        Family::V4 => sa(CLUSTER_IP, port),
        Family::V6 => SocketAddr::from((CLUSTER_IP6, port)),
    };
    let mut c = s.lab.host_client(
        NodeId::A,
        &Requests::new(mode, to, 100)
            .interval(Duration::from_millis(50))
            .timeout(Duration::from_millis(500)),
    );
    // The backend this socket was given.
    let mut first = None;
    for _ in 0..5 {
        let o = c.next_outcome().expect("client running");
        assert!(o.ok, "[{family}] before the change: {o:?}\n{}", s.logs());
        assert_eq!(o.peer, to.to_string(), "[{family}] {o:?}");
        if let Some(f) = &first {
            assert_eq!(
                &o.backend, f,
                "[{family}] a connected socket must keep its backend"
            );
        }
        first = Some(o.backend.clone());
    }
    let gone = first.unwrap();
    let (stays, left) = if gone == s.a1.name {
        (&s.b1, &s.a1)
    } else {
        (&s.a1, &s.b1)
    };
    let mut after = match family {
        Family::V4 => manifest(&s.lab, &[stays], "Cluster", ""),
        Family::V6 => dual_stack_web_manifest(&s.lab, &[stays], "Cluster", ""),
    };
    if shared {
        let ep = (left.ip, Some(s.lab.node_of(&left.name).name()));
        after.push_str(&cluster_ip_manifest("metrics", METRICS_IP, &[ep]));
    }
    s.lab.write_manifest_text(&after);
    let changed = Instant::now();
    let mut errors = Vec::new();
    let moved = loop {
        let Some(o) = c.next_outcome() else {
            panic!(
                "[{family}] client ended before its socket moved; errors {errors:?}\n{}",
                s.logs()
            );
        };
        if !o.ok {
            errors.push((changed.elapsed(), o.error.clone(), o.errno));
            continue;
        }
        if o.backend == stays.name {
            break changed.elapsed();
        }
        assert!(
            changed.elapsed() < Duration::from_secs(3),
            "[{family}] still answered by {gone} 3 s after it left\n{}",
            s.logs()
        );
    };
    println!(
        "[{family}] {mode:?}: socket moved {moved:?} after the change; errors seen: {errors:?}"
    );
    assert!(
        !errors.is_empty(),
        "[{family}] the socket moved without being destroyed?\n{}",
        s.logs()
    );
    assert!(
        moved < Duration::from_secs(2),
        "[{family}] the socket moved only {moved:?} after the change\n{}",
        s.logs()
    );
    // From then on, only the live backend.
    for _ in 0..5 {
        let o = c.next_outcome().expect("client running");
        assert!(
            o.ok && o.backend == stays.name,
            "[{family}] after the move: {o:?}"
        );
        assert_eq!(o.peer, to.to_string(), "[{family}] {o:?}");
    }
    if shared {
        let m = s.requests(NodeId::A, mode, sa(METRICS_IP, port), 5);
        let seen = tally(&m, sa(METRICS_IP, port), "metrics after the change");
        assert!(
            seen.keys().eq([&left.name]),
            "metrics (only {}) from a node process: {seen:?}",
            left.name
        );
    }
}

/// `lbproxy cleanup` detaches the socket-level programs: before it, a node process's
/// `connect()` to a frontend without endpoints is refused at once by them; after it, the
/// same `connect()` is an ordinary one to an address nobody answers (it times out).
#[test]
fn cleanup_detaches_the_socket_programs() {
    let mut s = Setup::new("Cluster", "");
    let to = sa(EMPTY_IP, 80);
    let before = s.requests(NodeId::A, Mode::Tcp, to, 1);
    assert_eq!(before[0].errno, Some(libc::ECONNREFUSED), "{before:?}");
    for lb in &mut s.lbs {
        lb.kill();
    }
    let dir = s.lab.node(NodeId::A).bpffs_dir.display().to_string();
    let out = run_lbproxy_cmd(s.lab.node_ns(NodeId::A), &["cleanup", "--bpffs-dir", &dir]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for p in [
        "lb_connect4",
        "lb_sendmsg4",
        "lb_recvmsg4",
        "lb_getpeername4",
        "lb_connect6",
        "lb_sendmsg6",
        "lb_recvmsg6",
        "lb_getpeername6",
    ] {
        assert!(text.contains(p), "cleanup did not report {p}: {text}");
    }
    let after = s
        .lab
        .host_client(
            NodeId::A,
            &Requests::new(Mode::Tcp, to, 1).timeout(Duration::from_millis(500)),
        )
        .all();
    assert_ne!(
        after[0].errno,
        Some(libc::ECONNREFUSED),
        "still refused by a socket program after cleanup: {after:?}"
    );
    assert!(!after[0].ok, "{after:?}");
}
