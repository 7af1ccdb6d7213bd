//! North-south traffic on two nodes (issue 11): NodePorts, externalIPs and load-balancer IPs
//! reached from a client outside the cluster, answered by a backend on the node it reached
//! (which sees the client's own address) or on the other node (which sees the node's
//! address: SNAT), with every reply coming from the address and port the client used.
//!
//! Each node runs its own lbproxy, started exactly as other harnesses start it:
//! `run --manifests FILE --pod-interfaces 'lxc*' --hostname-override nodeX
//! --nodeport-addresses 198.18.80.0/24 --bpffs-dir DIR --healthz-bind-address
//! 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{
    Client, MultiNodeLab, NodeId, WEB_EXTERNAL_IP6, WEB_LB_IP6, dual_stack_web_manifest,
};
use lbproxy_tests::lab::{
    Backend, Family, HEALTHZ_ADDR, Lbproxy, Pod, http_get, tcp_request, udp_request, wait_for,
};

use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP, WEB_CLUSTER_IP as CLUSTER_IP,
    WEB_EXTERNAL_IP as EXTERNAL_IP, WEB_LB_IP as LB_IP, WEB_NODE_PORT_TCP as NODE_PORT_TCP,
    WEB_NODE_PORT_UDP as NODE_PORT_UDP, cluster_ip_manifest, web_manifest,
};

const TIMEOUT: Duration = Duration::from_secs(2);
const HEALTHY_WITHIN: Duration = Duration::from_secs(20);
/// The ClusterIP of `metrics`, a second Service over a backend of `web`.
const METRICS_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 13);

struct Setup {
    // Dropped last: servers and lbproxys go first.
    lab: MultiNodeLab,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
    a1: Pod,
    b1: Pod,
}

/// A service `web` of type LoadBalancer over one backend on each node (a1 on nodeA, b1 on
/// nodeB), with NodePorts, an externalIP and a load-balancer IP; `policy` is its
/// externalTrafficPolicy.
fn manifest(lab: &MultiNodeLab, pods: &[&Pod], policy: &str) -> String {
    manifest_with(lab, pods, policy, "")
}

/// [`dual_stack_web_manifest`] with `extra` (one spec line, as [`manifest_with`]'s) added.
fn dual_stack_manifest_with(
    lab: &MultiNodeLab,
    pods: &[&Pod],
    policy: &str,
    extra: &str,
) -> String {
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!("  {extra}\n")
    };
    dual_stack_web_manifest(lab, pods, policy, &extra)
}

/// [`manifest`] with `extra` added to the Service's spec (e.g. `healthCheckNodePort: N`).
fn manifest_with(lab: &MultiNodeLab, pods: &[&Pod], policy: &str, extra: &str) -> String {
    let eps: Vec<(Ipv4Addr, Option<&str>)> = pods
        .iter()
        .map(|p| (p.ip, Some(lab.node_of(&p.name).name())))
        .collect();
    web_manifest(&eps, policy, extra)
}

impl Setup {
    fn new(policy: &str) -> Setup {
        Setup::with(policy, true, "")
    }

    /// `b1_listed`: whether b1 is in the slice (a1 always is); `extra` as in
    /// [`manifest_with`].
    fn with(policy: &str, b1_listed: bool, extra: &str) -> Setup {
        Setup::build(b1_listed, |lab, pods| {
            manifest_with(lab, pods, policy, extra)
        })
    }

    /// [`Setup::new`] in `family`: for IPv6 the `web` Service is dual-stack
    /// ([`dual_stack_web_manifest`]), its IPv4 frontends as [`manifest`]'s.
    fn for_family(family: Family, policy: &str) -> Setup {
        Setup::for_family_with(family, policy, true, "")
    }

    /// [`Setup::with`] in `family` (see [`Setup::for_family`]).
    fn for_family_with(family: Family, policy: &str, b1_listed: bool, extra: &str) -> Setup {
        match family {
            Family::V4 => Setup::with(policy, b1_listed, extra),
            Family::V6 => Setup::build(b1_listed, |lab, pods| {
                dual_stack_manifest_with(lab, pods, policy, extra)
            }),
        }
    }

    /// a1 on nodeA and b1 on nodeB serve; `b1_listed`: whether b1 is an endpoint in the
    /// manifest `manifest` writes for the endpoints.
    fn build(b1_listed: bool, manifest: impl FnOnce(&MultiNodeLab, &[&Pod]) -> String) -> Setup {
        let lab = MultiNodeLab::new();
        let a1 = lab.add_pod(NodeId::A, "a1");
        let b1 = lab.add_pod(NodeId::B, "b1");
        let servers = vec![
            a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
            b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        ];
        let pods: Vec<&Pod> = if b1_listed { vec![&a1, &b1] } else { vec![&a1] };
        lab.write_manifest_text(&manifest(&lab, &pods));
        let lbs = lab.start_lbproxy_on_both(&[], HEALTHY_WITHIN);
        Setup {
            lab,
            _servers: servers,
            lbs,
            a1,
            b1,
        }
    }

    fn logs(&self) -> String {
        let mut out = self.lab.diagnostics();
        for node in NodeId::ALL {
            for what in ["services", "flows", "drops"] {
                out.push_str(&format!(
                    "\n--- {node}: inspect {what}\n{:#}",
                    self.lab.node(node).inspect_json(what)
                ));
            }
        }
        for lb in &self.lbs {
            out.push_str(&format!("\n--- lbproxy {:?}\n{}", lb.argv(), lb.log()));
        }
        out
    }
}

/// What answered: backend -> (the client address it saw, count), and every failure.
#[derive(Debug, Default)]
struct Seen {
    by_backend: BTreeMap<String, (Vec<String>, usize)>,
    wrong_source: Vec<(String, SocketAddr)>,
    errors: Vec<String>,
}

impl Seen {
    fn replies(&self) -> usize {
        self.by_backend.values().map(|e| e.1).sum()
    }
}

/// `n` requests (new TCP connections, or UDP datagrams each from a new socket) from `ns` to
/// `addr:port`; each reply must come from `addr:port`.
fn requests(ns: &str, udp: bool, addr: impl Into<IpAddr>, port: u16, n: usize) -> Seen {
    let addr = addr.into();
    let mut seen = Seen::default();
    for i in 0..n {
        let r = if udp {
            udp_request(ns, addr, port, TIMEOUT, None)
        } else {
            tcp_request(ns, addr, port, TIMEOUT)
        };
        match r {
            Ok((reply, from)) => {
                if from != SocketAddr::from((addr, port)) {
                    seen.wrong_source.push((reply.backend.clone(), from));
                }
                let client_ip = reply
                    .client_seen
                    .parse::<SocketAddr>()
                    .map_or(reply.client_seen.clone(), |a| a.ip().to_string());
                let e = seen.by_backend.entry(reply.backend).or_default();
                if !e.0.contains(&client_ip) {
                    e.0.push(client_ip);
                }
                e.1 += 1;
            }
            Err(e) => seen.errors.push(format!("#{i}: {e}")),
        }
    }
    seen
}

/// Every request answered from the frontend, by both backends; a1 (on `via`) sees
/// `local_sees`, b1 (on the other node) sees `remote_sees`, or the reverse when `via` is
/// nodeB.
fn assert_spread(s: &Setup, what: &str, seen: &Seen, via: NodeId, client: IpAddr) {
    let (local, remote) = match via {
        NodeId::A => (&s.a1, &s.b1),
        NodeId::B => (&s.b1, &s.a1),
    };
    // The node's address in the client's family.
    let node_ip: IpAddr = match client {
        IpAddr::V4(_) => s.lab.node(via).ip.into(),
        IpAddr::V6(_) => s.lab.node(via).ip6.into(),
    };
    assert!(
        seen.errors.is_empty() && seen.wrong_source.is_empty(),
        "{what}: {seen:?}\n{}",
        s.logs()
    );
    let sees = |p: &Pod| seen.by_backend.get(&p.name).map(|e| e.0.clone());
    assert_eq!(
        sees(local),
        Some(vec![client.to_string()]),
        "{what}: the backend on {via} sees the client's own address: {seen:?}\n{}",
        s.logs()
    );
    assert_eq!(
        sees(remote),
        Some(vec![node_ip.to_string()]),
        "{what}: the backend on the other node sees {via}'s address (SNAT): {seen:?}\n{}",
        s.logs()
    );
}

/// Waits (at most [`HEALTHY_WITHIN`]) until `addr:port` answers a TCP request from `client`
/// (both lbproxys programmed it).
fn wait_served(client: &Client, addr: IpAddr, port: u16) {
    let deadline = Instant::now() + HEALTHY_WITHIN;
    while client.tcp_request(addr, port, TIMEOUT).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}

lbproxy_tests::both_families!(node_port_external_ip_and_lb_ip_through_either_node);

/// externalTrafficPolicy: Cluster, in each family. From a client outside the cluster,
/// through either node: the NodePorts (TCP and UDP) on the node's address, the externalIP
/// and the load-balancer IP are answered by both backends, always from the address and port
/// the client used; the backend on the node reached sees the client's own address, the
/// other one sees that node's address (SNAT, with each family's own port space). Over IPv6
/// the Service is dual-stack, and its IPv4 NodePort answers too.
fn node_port_external_ip_and_lb_ip_through_either_node(family: Family) {
    let s = Setup::for_family(family, "Cluster");
    let client = s.lab.add_client("ext");
    let (client_ip, vips): (IpAddr, [IpAddr; 2]) = match family {
        Family::V4 => (client.ip.into(), [EXTERNAL_IP.into(), LB_IP.into()]),
        Family::V6 => (
            client.ip6.into(),
            [WEB_EXTERNAL_IP6.into(), WEB_LB_IP6.into()],
        ),
    };
    let node_addr = |via: NodeId| -> IpAddr {
        match family {
            Family::V4 => s.lab.node(via).ip.into(),
            Family::V6 => s.lab.node(via).ip6.into(),
        }
    };
    if family == Family::V6 {
        wait_served(&client, node_addr(NodeId::A), NODE_PORT_TCP);
    }
    let proto = |udp: bool| if udp { "UDP" } else { "TCP" };
    for via in NodeId::ALL {
        let node_ip = node_addr(via);
        for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
            let seen = requests(&client.netns, udp, node_ip, port, 24);
            let what = format!(
                "{} NodePort {} via {via}",
                proto(udp),
                SocketAddr::from((node_ip, port))
            );
            eprintln!("{what}: {seen:?}");
            assert_spread(&s, &what, &seen, via, client_ip);
        }
        match family {
            Family::V4 => client.route_via("198.19.0.0/16", s.lab.node(via)),
            Family::V6 => client.route_via6("fd00:c612:ffff::/64", s.lab.node(via)),
        }
        for vip in vips {
            for (udp, port) in [(false, 80), (true, 53)] {
                let seen = requests(&client.netns, udp, vip, port, 24);
                let what = format!("{} {} via {via}", proto(udp), SocketAddr::from((vip, port)));
                eprintln!("{what}: {seen:?}");
                assert_spread(&s, &what, &seen, via, client_ip);
            }
        }
    }
    if family == Family::V6 {
        // The IPv4 NodePort of the same Service, at the same time.
        let a = s.lab.node(NodeId::A).ip;
        let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 12);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "TCP {a}:{NODE_PORT_TCP}: {seen:?}"
        );
        assert_eq!(
            seen.by_backend.len(),
            2,
            "TCP {a}:{NODE_PORT_TCP}: both backends answer: {seen:?}"
        );
    }
}

/// A pod on nodeB reaches nodeA's NodePort (nodeA load-balances it as traffic from outside)
/// and its own node's NodePort (its own node's pod interface translates it, without SNAT);
/// every reply comes from the address the pod used.
#[test]
fn pods_reach_node_ports_on_either_node() {
    let s = Setup::new("Cluster");
    let c = s.lab.add_pod(NodeId::B, "podclient");
    s.lab.wait_programs_on(&c, HEALTHY_WITHIN);
    for via in NodeId::ALL {
        let node_ip = s.lab.node(via).ip;
        for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
            let seen = requests(&c.netns, udp, node_ip, port, 24);
            let what = format!("pod on nodeB -> {node_ip}:{port}");
            eprintln!("{what}: {seen:?}");
            assert!(
                seen.errors.is_empty() && seen.wrong_source.is_empty(),
                "{what}: {seen:?}\n{}",
                s.logs()
            );
            assert_eq!(
                seen.by_backend.len(),
                2,
                "{what}: both backends answer: {seen:?}"
            );
        }
    }
}

/// 400 concurrent connections from one client through nodeA's NodePort to the one backend
/// on nodeB: each gets its own SNAT port (the backend sees 400 distinct source ports of
/// nodeA's address), all at once.
#[test]
fn four_hundred_concurrent_connections_get_their_own_snat_ports() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let node_ip = s.lab.node(NodeId::A).ip;
    let mut conns = Vec::new();
    for i in 0..400 {
        let c = client
            .connect(node_ip, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}\n{}", s.logs()));
        conns.push(c);
    }
    let mut ports = std::collections::BTreeSet::new();
    for (i, c) in conns.iter_mut().enumerate() {
        let r = c
            .request()
            .unwrap_or_else(|e| panic!("request on connection #{i}: {e}\n{}", s.logs()));
        assert_eq!(r.backend, "b1");
        let (ip, port) = r.client_seen.rsplit_once(':').unwrap();
        assert_eq!(ip, node_ip.to_string(), "SNAT to nodeA's address");
        let port: u16 = port.parse().unwrap();
        assert!(
            (1024..=29_999).contains(&port),
            "SNAT port {port} outside the default range"
        );
        ports.insert(port);
    }
    assert_eq!(ports.len(), 400, "each connection its own SNAT port");
    // Every allocation is in the tries histogram, and in the default range of 28,976 ports
    // the client's own port (in the range) or the first random one is nearly always free.
    let count = metric_until(&s.lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
        v >= 400.0
    });
    let first = metric_until(
        &s.lab,
        NodeId::A,
        "lbproxy_snat_port_tries_bucket{le=\"2.0\"}",
        |v| v >= 390.0,
    );
    assert!(
        count.is_some_and(|c| c >= 400.0) && first.is_some_and(|f| f >= 390.0),
        "lbproxy_snat_port_tries: count {count:?} (want >= 400), within 2 tries {first:?} \
         (want >= 390)"
    );
}

/// A SNAT range of 4 ports: 4 connections to the remote backend hold them all, a 5th is
/// dropped and counted (`snat_no_port`), while a connection to the backend on the node
/// itself (no SNAT) still works.
#[test]
fn a_full_snat_range_drops_and_counts_while_local_backends_work() {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _servers = [
        a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
    ];
    // Two services: "web" only on b1 (remote from nodeA), "local" only on a1.
    let remote = manifest(&lab, &[&b1], "Cluster");
    let local = manifest(&lab, &[&a1], "Cluster")
        .replace("name: web,", "name: local,")
        .replace("service-name: web", "service-name: local")
        .replace("name: web-1", "name: local-1")
        .replace(&CLUSTER_IP.to_string(), "198.19.0.11")
        .replace(&EXTERNAL_IP.to_string(), "198.19.0.51")
        .replace(&LB_IP.to_string(), "198.19.0.61")
        .replace("nodePort: 30080", "nodePort: 30081")
        .replace("nodePort: 30053", "nodePort: 30054");
    lab.write_manifest_text(&format!("{remote}---\n{local}"));
    let lbs = lab.start_lbproxy_on_both(&["--snat-port-range", "20000-20003"], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let node_ip = lab.node(NodeId::A).ip;
    let mut held = Vec::new();
    for i in 0..4 {
        let mut c = client
            .connect(node_ip, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}\n{}", lbs[0].log()));
        let r = c.request().unwrap();
        assert_eq!(r.backend, "b1");
        held.push(c);
    }
    let drops = || lab.node(NodeId::A).drop_count("snat_no_port");
    let before = drops();
    let fifth = client.connect(node_ip, NODE_PORT_TCP, Duration::from_millis(1500));
    assert!(
        fifth.is_err(),
        "a 5th connection found no SNAT port and must not connect"
    );
    assert!(drops() > before, "snat_no_port counted");
    // The tries histogram: the 4 allocations that got a port, each within the 17 tries
    // there are (the client's ports are not in 20000-20003, so each starts at random and
    // the last ones need more tries); the failed ones are not in it.
    let count = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
        v >= 4.0
    });
    let sum = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_sum", |v| v >= 4.0);
    let within = metric_until(
        &lab,
        NodeId::A,
        "lbproxy_snat_port_tries_bucket{le=\"17.0\"}",
        |v| v >= 4.0,
    );
    assert!(
        count == Some(4.0) && within == Some(4.0) && sum.is_some_and(|s| (4.0..=68.0).contains(&s)),
        "lbproxy_snat_port_tries: count {count:?} (want 4), le=17 {within:?} (want 4), sum \
         {sum:?} (want 4..=68)\n{}",
        lbs[0].log()
    );
    let r = tcp_request(&client.netns, node_ip, 30081, TIMEOUT)
        .unwrap_or_else(|e| panic!("the local backend still answers: {e}\n{}", lbs[0].log()));
    assert_eq!(r.0.backend, "a1");
    // Closed flows give their ports back at once, as a closed conntrack entry's tuple may
    // be reused: once the 4 connections are closed (FINs both ways), new connections get
    // their ports long before the collector would remove the closed flows (10 s).
    drop(held);
    let reused = wait_for(Duration::from_secs(3), Duration::from_millis(100), || {
        let seen = requests(&client.netns, false, node_ip, NODE_PORT_TCP, 4);
        (seen.errors.is_empty() && seen.by_backend.get("b1").is_some_and(|e| e.1 == 4))
            .then_some(seen)
    });
    assert!(
        reused.is_ok(),
        "after the 4 connections closed, 4 new ones through the 4-port range: {:?}\n{}",
        requests(&client.netns, false, node_ip, NODE_PORT_TCP, 4),
        lbs[0].log()
    );
    assert_eq!(
        r.0.client_seen.rsplit_once(':').unwrap().0,
        client.ip.to_string()
    );
}

/// A client that reuses its source port right after closing (as a busy client does within
/// seconds) towards a source-NATed backend gets the same SNAT port again: the new flow
/// starts in its predecessor's halves instead of searching the range and allocating both
/// again. The backend sees nodeA's address and the same port both times, and the tries
/// histogram counts the reuse as one try.
#[test]
fn a_reused_client_port_keeps_its_snat_port() {
    use std::io::{BufRead as _, BufReader, Write as _};
    use std::net::SocketAddrV4;

    use lbproxy_tests::lab::connect::PendingConnect;
    let lab = MultiNodeLab::new();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _server = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest_text(&manifest(&lab, &[&b1], "Cluster"));
    let lbs = lab.start_lbproxy_on_both(&[], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let node_ip = lab.node(NodeId::A).ip;
    let dst = SocketAddrV4::new(node_ip, NODE_PORT_TCP);
    // Outside the default SNAT range (1024-29999), so the first flow's port is a random one
    // of the range, not the client's own.
    const PORT: u16 = 40_123;
    let seen_from = |i: u32| -> String {
        let c = client
            .run(|| PendingConnect::start(PORT, dst))
            .unwrap_or_else(|e| panic!("connection {i} from :{PORT}: {e}"));
        c.wait_until(c.started + TIMEOUT)
            .unwrap_or_else(|e| panic!("connection {i} from :{PORT}: {e}\n{}", lbs[0].log()));
        let stream = c.into_stream(TIMEOUT);
        (&stream).write_all(b"hello\n").unwrap();
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("answer {i}: {e}\n{}", lbs[0].log()));
        // Closed with a RST (SO_LINGER 0), so the port is free at once.
        lbproxy_tests::lab::connect::reset_on_close(std::os::fd::AsRawFd::as_raw_fd(&stream))
            .unwrap();
        let (backend, seen) = line.trim_end().split_once(' ').expect("answer");
        assert_eq!(backend, "b1");
        seen.to_owned()
    };
    // (allocations, allocations of one try) on nodeA, once the count reaches `least`.
    let tries = |least: f64| {
        let count = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
            v >= least
        });
        let one = metric_until(
            &lab,
            NodeId::A,
            "lbproxy_snat_port_tries_bucket{le=\"1.0\"}",
            |_| true,
        );
        (count.unwrap_or(0.0), one.unwrap_or(0.0))
    };
    let first = seen_from(1);
    let before = tries(1.0);
    let second = seen_from(2);
    assert!(
        first.starts_with(&format!("{node_ip}:")),
        "b1 must see nodeA's address: {first}"
    );
    assert_eq!(
        second,
        first,
        "the same client port again got another SNAT port\n{}",
        lbs[0].log()
    );
    let after = tries(before.0 + 1.0);
    assert!(
        after == (before.0 + 1.0, before.1 + 1.0),
        "the reuse must count as one allocation of one try: (count, le=1) {before:?} -> {after:?}"
    );
}

/// The value of the sample `series` (name and labels, exactly as exported) on `node`'s
/// `/metrics`; `None` when it is not there. The counters reach the metrics every 2 s, so
/// this waits up to 5 s for `until` to hold.
fn metric_until(
    lab: &MultiNodeLab,
    node: NodeId,
    series: &str,
    until: impl Fn(f64) -> bool,
) -> Option<f64> {
    let addr: SocketAddr = lbproxy_tests::lab::METRICS_ADDR.parse().unwrap();
    let read = || {
        let r = lbproxy_tests::lab::http_get_full(
            lab.node_ns(node),
            addr,
            "/metrics",
            Duration::from_secs(2),
        )
        .ok()?;
        r.body.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    };
    match wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
        read().filter(|v| until(*v))
    }) {
        Ok((v, _)) => Some(v),
        Err(_) => read(),
    }
}

/// Rewrites the manifest so that only b1 (on nodeB) serves `web`, and waits until both
/// nodes' maps say so and requests through nodeA get only b1. (Requests alone are not
/// enough: four of them all land on b1 by chance once in 16 before the change is written,
/// and a connection opened then to a1 is reset when a1 leaves.)
fn only_b1(s: &Setup, client_ns: &str) {
    s.lab
        .write_manifest_text(&manifest(&s.lab, &[&s.b1], "Cluster"));
    let programmed = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        NodeId::ALL
            .iter()
            .all(|&node| s.lab.serves_only(node, "default/web", s.b1.ip.into()))
            .then_some(())
    });
    assert!(
        programmed.is_ok(),
        "both nodes serve web with b1 only\n{}",
        s.logs()
    );
    let a = s.lab.node(NodeId::A).ip;
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = requests(client_ns, false, a, NODE_PORT_TCP, 4);
        if seen.by_backend.keys().all(|b| b == "b1") && seen.errors.is_empty() {
            return;
        }
        assert!(
            Instant::now() < until,
            "only b1 should answer: {seen:?}\n{}",
            s.logs()
        );
    }
}

const HC_PORT: u16 = 32000;

lbproxy_tests::both_families!(external_traffic_policy_local_and_health_check_node_port);

/// externalTrafficPolicy: Local with its only endpoint (a1) on nodeA, in each family (over
/// IPv6 the Service is dual-stack and every address below is the IPv6 one):
/// - through nodeA, a1 answers and sees the client's own address (no SNAT);
/// - through nodeB, which has no local endpoint, the traffic is dropped and counted
///   (`no_local_endpoint`), not answered: a TCP connect times out rather than being refused;
/// - the healthCheckNodePort says so on both nodes, with kube-proxy's body: 200 and one
///   local endpoint on nodeA, 503 and none on nodeB;
/// - with no endpoint at all, the client is rejected at once (connection refused).
fn external_traffic_policy_local_and_health_check_node_port(family: Family) {
    let extra = format!("healthCheckNodePort: {HC_PORT}");
    let s = Setup::for_family_with(family, "Local", false, &extra);
    let client = s.lab.add_client("ext");
    let (a, b, client_ip): (IpAddr, IpAddr, IpAddr) = match family {
        Family::V4 => (
            s.lab.node(NodeId::A).ip.into(),
            s.lab.node(NodeId::B).ip.into(),
            client.ip.into(),
        ),
        Family::V6 => (
            s.lab.node(NodeId::A).ip6.into(),
            s.lab.node(NodeId::B).ip6.into(),
            client.ip6.into(),
        ),
    };
    if family == Family::V6 {
        wait_served(&client, a, NODE_PORT_TCP);
    }
    for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
        let seen = requests(&client.netns, udp, a, port, 12);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "via nodeA: {seen:?}\n{}",
            s.logs()
        );
        assert_eq!(
            seen.by_backend.get("a1").map(|e| e.0.clone()),
            Some(vec![client_ip.to_string()]),
            "only a1, seeing the client's own address: {seen:?}"
        );
        assert_eq!(seen.by_backend.len(), 1, "{seen:?}");
    }
    let before = s.lab.node(NodeId::B).drop_count("no_local_endpoint");
    let started = Instant::now();
    let r = tcp_request(&client.netns, b, NODE_PORT_TCP, Duration::from_millis(700));
    let e = r.expect_err("nodeB has no local endpoint: no answer");
    assert!(
        e.kind() == std::io::ErrorKind::TimedOut || e.kind() == std::io::ErrorKind::WouldBlock,
        "dropped, not refused: {e} after {:?}",
        started.elapsed()
    );
    let u = udp_request(
        &client.netns,
        b,
        NODE_PORT_UDP,
        Duration::from_millis(300),
        None,
    );
    assert!(u.is_err(), "UDP through nodeB is not answered: {u:?}");
    let dropped = s.lab.node(NodeId::B).drop_count("no_local_endpoint") - before;
    assert!(
        dropped >= 2,
        "no_local_endpoint counted on nodeB: {dropped}\n{}",
        s.logs()
    );

    for (node, ip, status, n) in [(NodeId::A, a, 200, 1), (NodeId::B, b, 503, 0)] {
        let r = lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((ip, HC_PORT)),
            "/any/path",
            Duration::from_secs(2),
        )
        .unwrap_or_else(|e| panic!("health check on {node}: {e}\n{}", s.logs()));
        assert_eq!(r.status, status, "health check on {node}: {}", r.body);
        let body: serde_json::Value = serde_json::from_str(r.body.trim())
            .unwrap_or_else(|e| panic!("health check body on {node} ({e}): {:?}", r.body));
        assert_eq!(
            body,
            serde_json::json!({
                "service": {"namespace": "default", "name": "web"},
                "localEndpoints": n,
                "serviceProxyHealthy": true
            }),
            "on {node}"
        );
    }

    // No endpoint at all: rejected at once.
    s.lab.write_manifest_text(&match family {
        Family::V4 => manifest_with(&s.lab, &[], "Local", &extra),
        Family::V6 => dual_stack_manifest_with(&s.lab, &[], "Local", &extra),
    });
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let started = Instant::now();
        match tcp_request(&client.netns, a, NODE_PORT_TCP, Duration::from_secs(1)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                assert!(started.elapsed() < Duration::from_millis(500));
                break;
            }
            other => assert!(
                Instant::now() < until,
                "no endpoint: want connection refused, got {other:?}\n{}",
                s.logs()
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The change reached node A's health check too (a sync of the changed service only):
    // no local endpoint now, 503.
    let r = wait_for(Duration::from_secs(2), Duration::from_millis(50), || {
        lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((a, HC_PORT)),
            "/",
            Duration::from_secs(1),
        )
        .ok()
        .filter(|r| r.status == 503 && r.body.contains("\"localEndpoints\": 0"))
    });
    assert!(
        r.is_ok(),
        "health check on {} after its endpoint left: want 503 with localEndpoints 0\n{}",
        NodeId::A,
        s.logs()
    );
}

/// `lbproxy inspect snat` lists the destinations of source-NATed flows with their ports in
/// use out of the range, and `inspect flows` shows the source the backend sees.
#[test]
fn inspect_shows_snat_ports_per_destination() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let mut conns = Vec::new();
    for i in 0..5 {
        let mut c = client
            .connect(a, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}"));
        c.request().unwrap();
        conns.push(c);
    }
    let snat = s.lab.node(NodeId::A).inspect_json("snat");
    let row = snat
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["destination"] == format!("{}:{BACKEND_TCP}", s.b1.ip).as_str())
        .unwrap_or_else(|| panic!("b1 in inspect snat: {snat:#}"))
        .clone();
    assert_eq!(row["snat_address"], a.to_string().as_str(), "{row:#}");
    assert_eq!(row["protocol"], "TCP", "{row:#}");
    assert!(row["ports_in_use"].as_u64().unwrap() >= 5, "{row:#}");
    assert_eq!(row["range_size"], 29_999 - 1024 + 1, "{row:#}");
    let flows = s.lab.node(NodeId::A).inspect_json("flows");
    let client_prefix = format!("{}:", client.ip);
    let snat_prefix = format!("{a}:");
    let snated = flows
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(&client_prefix))
                && f["snat"]
                    .as_str()
                    .is_some_and(|x| x.starts_with(&snat_prefix))
        })
        .count();
    assert!(
        snated >= 5,
        "inspect flows shows the SNAT source: {flows:#}"
    );
    drop(conns);
}

/// Restarting nodeA's lbproxy (SIGTERM, then a new run on the same pins) keeps an open
/// source-NATed connection through it working, with the same SNAT port: the flow and the
/// node's programs are adopted. New connections work too.
#[test]
fn restart_keeps_snat_flows() {
    let mut s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let mut conn = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
    let first = conn.request().unwrap();
    assert_eq!(first.backend, "b1");
    let mut old = s.lbs.remove(0);
    old.terminate(Duration::from_secs(5));
    let mut lb = s.lab.start_lbproxy(NodeId::A, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    s.lbs.insert(0, lb);
    for i in 0..5 {
        let r = conn
            .request()
            .unwrap_or_else(|e| panic!("request {i} after the restart: {e}\n{}", s.logs()));
        assert_eq!(r.backend, "b1");
        assert_eq!(
            r.client_seen, first.client_seen,
            "the same SNAT source port"
        );
    }
    let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 8);
    assert!(seen.errors.is_empty(), "{seen:?}\n{}", s.logs());
}

/// `loadBalancerSourceRanges` apply to the load-balancer IP only: a client inside the range
/// reaches it, one outside is dropped and counted (`source_range_denied`), and both reach
/// the NodePort and the externalIP.
#[test]
fn load_balancer_source_ranges_filter_the_lb_ip_only() {
    let inside = Ipv4Addr::new(198, 18, 80, 100);
    let s = Setup::with(
        "Cluster",
        true,
        &format!("loadBalancerSourceRanges: ['{inside}/32']"),
    );
    let ok = s.lab.add_client("ok");
    let other = s.lab.add_client("other");
    assert_eq!(ok.ip, inside, "the first client is the one in the range");
    let a = s.lab.node(NodeId::A).ip;
    for c in [&ok, &other] {
        c.route_via("198.19.0.0/16", s.lab.node(NodeId::A));
    }
    let seen = requests(&ok.netns, false, LB_IP, 80, 8);
    assert!(
        seen.errors.is_empty() && seen.replies() == 8,
        "inside the range: {seen:?}\n{}",
        s.logs()
    );
    let before = s.lab.node(NodeId::A).drop_count("source_range_denied");
    let r = tcp_request(&other.netns, LB_IP, 80, Duration::from_millis(700));
    assert!(
        r.is_err(),
        "outside the range the LB IP must not answer: {r:?}"
    );
    let u = udp_request(&other.netns, LB_IP, 53, Duration::from_millis(300), None);
    assert!(u.is_err(), "outside the range, UDP: {u:?}");
    assert!(
        s.lab.node(NodeId::A).drop_count("source_range_denied") >= before + 2,
        "source_range_denied counted\n{}",
        s.logs()
    );
    for (addr, port) in [(a, NODE_PORT_TCP), (EXTERNAL_IP, 80)] {
        let seen = requests(&other.netns, false, addr, port, 4);
        assert!(
            seen.errors.is_empty() && seen.replies() == 4,
            "the ranges do not apply to {addr}:{port}: {seen:?}"
        );
    }
}

/// As kube-proxy: `loadBalancerSourceRanges` that hold one of the node's addresses also
/// admit the load-balancer IP itself as a source (a load balancer that loops traffic back
/// keeps it); ranges that hold none do not. The client sends from the LB IP to the LB IP
/// through nodeA (the address on its loopback, a policy rule sending its own packets to it
/// out through nodeA, `accept_local` for the answer); the backend is on nodeA, so it sees
/// that source itself, and the answer comes back from the LB IP.
#[test]
fn source_ranges_holding_a_node_ip_admit_the_lb_ip_as_source() {
    let node_a = NodeId::A.fabric_ip();
    for (range, admitted) in [
        (format!("{node_a}/32"), true),
        ("198.18.80.250/32".to_string(), false),
    ] {
        let s = Setup::with(
            "Cluster",
            false,
            &format!("loadBalancerSourceRanges: ['{range}']"),
        );
        let client = s.lab.add_client("loop");
        let ns = client.netns.clone();
        let run = |argv: &[&str]| {
            lbproxy_tests::lab::ns::ns_run(&ns, argv)
                .unwrap_or_else(|e| panic!("{argv:?} in {ns}: {e}"));
        };
        let lb_ip = LB_IP.to_string();
        let via = s.lab.node(NodeId::A).ip.to_string();
        run(&["ip", "addr", "add", &format!("{lb_ip}/32"), "dev", "lo"]);
        // Its own packets to the LB IP leave through nodeA, from the LB IP; what arrives
        // on eth0 is delivered locally (the local table, moved behind that rule).
        run(&[
            "ip",
            "route",
            "add",
            &format!("{lb_ip}/32"),
            "via",
            &via,
            "dev",
            "eth0",
            "src",
            &lb_ip,
            "table",
            "200",
        ]);
        run(&[
            "ip", "rule", "add", "pref", "10", "iif", "lo", "to", &lb_ip, "lookup", "200",
        ]);
        run(&["ip", "rule", "add", "pref", "100", "lookup", "local"]);
        run(&["ip", "rule", "del", "pref", "0"]);
        for dev in ["all", "eth0"] {
            run(&[
                "sysctl",
                "-q",
                "-w",
                &format!("net.ipv4.conf.{dev}.accept_local=1"),
            ]);
        }
        // nodeA sends the answer for the LB IP back to the client.
        s.lab
            .node_run(
                NodeId::A,
                &[
                    "ip",
                    "route",
                    "add",
                    &format!("{lb_ip}/32"),
                    "via",
                    &client.ip.to_string(),
                    "dev",
                    "eth0",
                ],
            )
            .unwrap();
        let before = s.lab.node(NodeId::A).drop_count("source_range_denied");
        let r = udp_request(&ns, LB_IP, 53, Duration::from_millis(700), None);
        if admitted {
            let (reply, from) = r.unwrap_or_else(|e| {
                panic!("range {range}: the LB IP as source: {e}\n{}", s.logs())
            });
            assert_eq!(reply.backend, "a1");
            assert_eq!(
                from,
                SocketAddr::from((LB_IP, 53)),
                "answered from the LB IP"
            );
            assert!(
                reply.client_seen.starts_with(&format!("{lb_ip}:")),
                "the backend sees the LB IP as the source: {}",
                reply.client_seen
            );
            assert_eq!(
                s.lab.node(NodeId::A).drop_count("source_range_denied"),
                before
            );
        } else {
            assert!(
                r.is_err(),
                "range {range} holds no node IP: the LB IP as source is refused: {r:?}"
            );
            assert!(
                s.lab.node(NodeId::A).drop_count("source_range_denied") > before,
                "source_range_denied counted\n{}",
                s.logs()
            );
        }
    }
}

/// The flow lifecycle holds for north-south flows as for ClusterIP ones: a UDP flow from a
/// fixed source port through nodeA's NodePort moves to a live backend on its next datagram
/// once its backend leaves the slice, and an open TCP connection to the backend that left
/// is reset on its next segment instead of hanging.
#[test]
fn a_removed_backends_north_south_flows_move_or_reset() {
    removed_backends_flows_move_or_reset(false);
}

/// [`a_removed_backends_north_south_flows_move_or_reset`] with the backend that leaves `web`
/// still an endpoint, same address and ports, of another Service (`metrics`): its flows
/// through `web` must move or reset all the same. (Until the flow checked its backend's
/// membership of the flow's own Service, they stayed on the old backend: 203 UDP answers
/// after the change, none from the new one, and the TCP connection stayed open.)
#[test]
fn a_backend_leaving_one_of_two_services_loses_that_services_north_south_flows() {
    removed_backends_flows_move_or_reset(true);
}

/// The body of the two tests above; `shared`: the backend that leaves `web` stays in
/// `metrics`.
fn removed_backends_flows_move_or_reset(shared: bool) {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    // A UDP flow from one source port, and a TCP connection, both on one backend.
    let (first, _) = udp_request(&client.netns, a, NODE_PORT_UDP, TIMEOUT, Some(40_053))
        .unwrap_or_else(|e| panic!("UDP: {e}\n{}", s.logs()));
    let mut conn = loop {
        let mut c = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
        if c.request().unwrap().backend == first.backend {
            break c;
        }
    };
    let (keep, gone) = if first.backend == "a1" {
        (&s.b1, &s.a1)
    } else {
        (&s.a1, &s.b1)
    };
    let mut after = manifest(&s.lab, &[keep], "Cluster");
    if shared {
        let gone_ep = (gone.ip, Some(s.lab.node_of(&gone.name).name()));
        after.push_str(&cluster_ip_manifest("metrics", METRICS_IP, &[gone_ep]));
    }
    s.lab.write_manifest_text(&after);
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let r = udp_request(
            &client.netns,
            a,
            NODE_PORT_UDP,
            Duration::from_millis(500),
            Some(40_053),
        );
        match r {
            Ok((reply, _)) if reply.backend == keep.name => break,
            other => assert!(
                Instant::now() < until,
                "the UDP flow stays on {}: {other:?}\n{}",
                first.backend,
                s.logs()
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = conn.request();
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the open TCP connection to {} is reset: {r:?}",
        first.backend
    );
    if shared {
        // The other Service still reaches the backend, through its own flows.
        let pod = s.lab.add_pod(NodeId::A, "mclient");
        s.lab.wait_programs_on(&pod, HEALTHY_WITHIN);
        let seen = requests(&pod.netns, true, METRICS_IP, 53, 5);
        assert!(
            seen.errors.is_empty() && seen.by_backend.keys().eq([&gone.name]),
            "metrics (only {}) through node A after it left web: {seen:?}\n{}",
            gone.name,
            s.logs()
        );
    }
}

/// A NodePort answered by backends on the node itself, for both pod-network shapes (one
/// node; the client is the lab's uplink namespace, outside the node): the backends see the
/// client's own address, and replies come from the NodePort. On a bridged pod network the
/// route to a local pod leads to the bridge, which must count as local (no SNAT), not as a
/// route elsewhere.
fn node_port_to_local_backends(shape: lbproxy_tests::lab::Shape) {
    use lbproxy_tests::lab::{Lab, UPLINK_NODE_ADDR, UPLINK_PEER_ADDR};
    let lab = Lab::new(shape);
    let b1 = lab.add_pod("b1");
    let b2 = lab.add_pod("b2");
    let _servers = [
        b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        b2.serve(&[BACKEND_TCP, BACKEND_UDP]),
    ];
    // The NodePorts of the LoadBalancer service the two-node tests use, over these two.
    lab.write_manifest_text(&web_manifest(
        &[(b1.ip, None), (b2.ip, None)],
        "Cluster",
        "",
    ));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
        let seen = requests(lab.uplink_ns(), udp, UPLINK_NODE_ADDR, port, 16);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "[{shape}] NodePort {port}: {seen:?}\n{}\n{}",
            lab.diagnostics(),
            lb.log()
        );
        assert_eq!(seen.by_backend.len(), 2, "[{shape}] both answer: {seen:?}");
        for (b, (saw, _)) in &seen.by_backend {
            assert_eq!(
                saw,
                &vec![UPLINK_PEER_ADDR.to_string()],
                "[{shape}] {b} sees the client's own address"
            );
        }
    }
}

mod node_port_to_local_backends {
    #[test]
    fn routed() {
        super::node_port_to_local_backends(lbproxy_tests::lab::Shape::Routed)
    }
    #[test]
    fn bridge() {
        super::node_port_to_local_backends(lbproxy_tests::lab::Shape::Bridge)
    }
}

lbproxy_tests::both_families!(node_port_addresses_primary_follows_the_default_route);

/// `--nodeport-addresses primary`, in each family: NodePorts are served on the node's
/// primary address of that family only, the one its default route prefers, and follow it
/// when the route changes. Node A gets a second address on its fabric interface; the second
/// address refuses the NodePort (the node's stack answers: nothing listens there); once the
/// default route prefers the second address, the two swap.
///
/// - IPv4: at first the default route has no preferred source, so the primary is the
///   interface's first address (the node's own), served as soon as lbproxy is healthy.
/// - IPv6 (the Service dual-stack): node A's IPv6 default route at first prefers its own
///   address. (The IPv4 NodePort keeps to the IPv4 primary, as before.)
fn node_port_addresses_primary_follows_the_default_route(family: Family) {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let node = lab.node(NodeId::A).clone();
    let run = |argv: &[&str]| {
        lab.node_run(NodeId::A, argv)
            .unwrap_or_else(|e| panic!("{argv:?} on nodeA: {e}"));
    };
    let (first, second, ip_family) = match family {
        Family::V4 => {
            lab.write_manifest_text(&manifest(&lab, &[&a1], "Cluster"));
            let second = Ipv4Addr::new(198, 18, 80, 201);
            run(&["ip", "addr", "add", &format!("{second}/24"), "dev", "eth0"]);
            (IpAddr::V4(node.ip), IpAddr::V4(second), "-4")
        }
        Family::V6 => {
            lab.write_manifest_text(&dual_stack_web_manifest(&lab, &[&a1], "Cluster", ""));
            let second = Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, 0x201);
            run(&[
                "ip",
                "addr",
                "add",
                &format!("{second}/64"),
                "dev",
                "eth0",
                "nodad",
            ]);
            (IpAddr::V6(node.ip6), IpAddr::V6(second), "-6")
        }
    };
    let default_from = |src: IpAddr| {
        run(&[
            "ip",
            ip_family,
            "route",
            "replace",
            "default",
            "dev",
            "eth0",
            "src",
            &src.to_string(),
        ]);
    };
    if family == Family::V6 {
        default_from(first);
    }
    let mut args = lab.lbproxy_run_args(NodeId::A, &[]);
    let at = args
        .iter()
        .position(|a| a == "--nodeport-addresses")
        .expect("the lab passes --nodeport-addresses");
    args[at + 1] = "primary".into();
    let mut lb = lab.start_lbproxy_argv(NodeId::A, args, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let logs = |lb: &Lbproxy| format!("{}\n--- lbproxy\n{}", lab.diagnostics(), lb.log());
    // Served on `on` by a1, from `on`; refused on `off`.
    let serves = |on: IpAddr, off: IpAddr| {
        let served = client.tcp_request(on, NODE_PORT_TCP, TIMEOUT);
        let refused = client.tcp_request(off, NODE_PORT_TCP, TIMEOUT);
        match (&served, &refused) {
            (Ok((reply, from)), Err(e))
                if reply.backend == "a1"
                    && *from == SocketAddr::from((on, NODE_PORT_TCP))
                    && e.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                Ok(())
            }
            _ => Err(format!("{on}: {served:?}; {off}: {refused:?}")),
        }
    };
    let within = |on, off| {
        wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
            serves(on, off).ok()
        })
    };
    match family {
        Family::V4 => serves(first, second).unwrap_or_else(|e| {
            panic!(
                "primary = the interface's first address: {e}\n{}",
                logs(&lb)
            )
        }),
        Family::V6 => assert!(
            within(first, second).is_ok(),
            "primary = the IPv6 default route's preferred source: {:?}\n{}",
            serves(first, second),
            logs(&lb)
        ),
    }
    default_from(second);
    assert!(
        within(second, first).is_ok(),
        "primary = the {family} default route's new preferred source, within 5 s: {:?}\n{}",
        serves(second, first),
        logs(&lb)
    );
    assert!(
        lb.log()
            .lines()
            .any(|l| l.contains("nodePortAddresses: primary") && l.contains(&second.to_string())),
        "the new primary {family} address is logged\n{}",
        lb.log()
    );
}

/// nodeA's lbproxy killed with SIGKILL and started again at once (the same command line)
/// while an external client opens about 100 TCP connections and sends about 100 UDP
/// requests a second through nodeA's NodePorts, to a1 on nodeA and, source-NATed, to b1 on
/// nodeB: no request is lost (each must be answered from the NodePort within 1 s, which a
/// dropped SYN would not be), and a connection source-NATed to b1 before the kill keeps its
/// backend and its SNAT port through the restart.
#[test]
fn sigkill_under_node_port_load() {
    use lbproxy_tests::lab::paced::{SinceKill, failures, paced, show};
    use lbproxy_tests::lab::{tcp_request_here, udp_request_here};
    const LOAD_FOR: Duration = Duration::from_secs(8);
    const KILL_AT: Duration = Duration::from_secs(2);
    const TICK: Duration = Duration::from_millis(10);
    const T: Duration = Duration::from_secs(1);
    let mut s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    let (mut conn, seen_before) = loop {
        let mut c = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
        let r = c.request().unwrap();
        if r.backend == "b1" {
            break (c, r.client_seen);
        }
    };
    // An answer from a1 or b1, from the NodePort the client used.
    let answered = |r: std::io::Result<(lbproxy_tests::lab::Reply, SocketAddr)>, port: u16| match r
    {
        Ok((reply, from)) if from == SocketAddr::from((a, port)) => Ok(reply.backend),
        Ok((reply, from)) => Err(format!("{} answered from {from}", reply.backend)),
        Err(e) => Err(e.to_string()),
    };
    let start = Instant::now();
    let lab = &s.lab;
    let lb = &mut s.lbs[0];
    // Killed and started again on this thread: the child dies with the thread that spawned
    // it (PR_SET_PDEATHSIG).
    let (tcp, udp, long, killed, lb2, healthy) = std::thread::scope(|sc| {
        let tcp = sc.spawn(|| {
            client.run(|| {
                paced(start, LOAD_FOR, TICK, || {
                    answered(tcp_request_here(a, NODE_PORT_TCP, T), NODE_PORT_TCP)
                })
            })
        });
        let udp = sc.spawn(|| {
            client.run(|| {
                paced(start, LOAD_FOR, TICK, || {
                    answered(udp_request_here(a, NODE_PORT_UDP, T, None), NODE_PORT_UDP)
                })
            })
        });
        let long = sc.spawn(|| {
            paced(start, LOAD_FOR, Duration::from_millis(200), || {
                conn.request()
                    .map(|r| format!("{} as {}", r.backend, r.client_seen))
                    .map_err(|e| e.to_string())
            })
        });
        std::thread::sleep((start + KILL_AT).saturating_duration_since(Instant::now()));
        lb.kill();
        let killed = start.elapsed();
        let mut lb2 = lab.start_lbproxy(NodeId::A, &[]);
        let healthy = lb2.wait_healthy(HEALTHY_WITHIN).map(|_| start.elapsed());
        (
            tcp.join().expect("TCP load"),
            udp.join().expect("UDP load"),
            long.join().expect("long-lived connection"),
            killed,
            lb2,
            healthy,
        )
    });
    let healthy_at = healthy.unwrap_or_else(|e| panic!("restart: {e}\n{}", lb2.log()));
    let backend = |b: &str| b == "a1" || b == "b1";
    let same = format!("b1 as {seen_before}");
    for (what, v, ok) in [
        (
            "new TCP connections",
            &tcp,
            &backend as &dyn Fn(&str) -> bool,
        ),
        ("UDP requests", &udp, &backend),
        (
            "the SNAT connection opened before the kill",
            &long,
            &|b: &str| b == same,
        ),
    ] {
        let failed = failures(v, ok);
        let after = v.iter().filter(|x| x.at >= healthy_at).count();
        eprintln!(
            "{what}: {} tried, {} failed, {after} after the new lbproxy was healthy ({})",
            v.len(),
            failed.len(),
            SinceKill(healthy_at, killed)
        );
        assert!(
            failed.is_empty(),
            "{what}: {} of {} failed (times relative to the SIGKILL; healthy again at {}):\n  \
             {}\n{}",
            failed.len(),
            v.len(),
            SinceKill(healthy_at, killed),
            show(&failed, killed),
            lb2.log()
        );
        assert!(after > 0, "{what}: nothing ran after the restart");
    }
    assert!(
        tcp.len() >= 400 && udp.len() >= 400,
        "the load did not run as planned: {} TCP, {} UDP (800 each scheduled)",
        tcp.len(),
        udp.len()
    );
    s.lbs[0] = lb2;
}

/// kube-proxy's short-circuit of `externalTrafficPolicy: Local`: this node's pods reach the
/// service's external frontends (the NodePorts on their own node's address, the externalIP
/// and the load-balancer IP) with every endpoint and their own address, not only the
/// node's endpoints: from a pod on nodeB, which has no endpoint of its own, a1 on nodeA
/// answers, sees the pod's address, and the answer comes from the frontend; with b1 listed
/// as well, both answer. Outside clients through nodeB still get nodeB's endpoints only
/// (none at first: dropped and counted).
#[test]
fn pods_reach_local_policy_frontends_through_every_endpoint() {
    let s = Setup::with("Local", false, "");
    let pb = s.lab.add_pod(NodeId::B, "pb");
    s.lab.wait_programs_on(&pb, HEALTHY_WITHIN);
    let b = s.lab.node(NodeId::B).ip;
    let frontends = [
        (false, b, NODE_PORT_TCP),
        (true, b, NODE_PORT_UDP),
        (false, LB_IP, 80),
        (true, LB_IP, 53),
        (false, EXTERNAL_IP, 80),
    ];
    for (udp, addr, port) in frontends {
        let seen = requests(&pb.netns, udp, addr, port, 8);
        let what = format!(
            "pod on nodeB -> {addr}:{port} ({})",
            if udp { "UDP" } else { "TCP" }
        );
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "{what}: {seen:?}\n{}",
            s.logs()
        );
        assert_eq!(
            seen.by_backend.get("a1"),
            Some(&(vec![pb.ip.to_string()], 8)),
            "{what}: a1 on nodeA answers every request and sees the pod's own address: \
             {seen:?}"
        );
    }
    // Outside traffic through nodeB keeps the Local policy: no endpoint there, dropped.
    let client = s.lab.add_client("ext");
    let before = s.lab.node(NodeId::B).drop_count("no_local_endpoint");
    let r = client.tcp_request(b, NODE_PORT_TCP, Duration::from_millis(700));
    assert!(
        r.is_err(),
        "outside -> nodeB's NodePort, no local endpoint: {r:?}"
    );
    assert!(s.lab.node(NodeId::B).drop_count("no_local_endpoint") > before);
    // Both endpoints listed: the pod gets both.
    s.lab
        .write_manifest_text(&manifest(&s.lab, &[&s.a1, &s.b1], "Local"));
    let both = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        let seen = requests(&pb.netns, false, b, NODE_PORT_TCP, 16);
        (seen.errors.is_empty() && seen.by_backend.len() == 2).then_some(seen)
    });
    assert!(
        both.is_ok(),
        "pod on nodeB -> nodeB's NodePort reaches a1 and b1 once both are listed\n{}",
        s.logs()
    );
}

/// `web` over `web_eps` and the lab's UDP NodePort Service `closed` (nodePort 30055 -> port
/// 5555, where nothing listens) over `backend`.
fn closed_manifest(lab: &MultiNodeLab, web_eps: &[&Pod], backend: &Pod) -> String {
    format!(
        "{}{}",
        manifest(lab, web_eps, "Cluster"),
        lab.closed_service(backend, false)
    )
}

/// ICMP errors about north-south flows reach the outside client translated, so its socket
/// sees them (issue 10's ICMP handling, for NodePorts):
/// - the port unreachable of a backend on nodeB, about a datagram source-NATed by nodeA: the
///   client's connected UDP socket to nodeA's NodePort gets "connection refused" at once
///   (addressed to nodeA's SNAT address, it is translated and sent on to the client);
/// - the same from a backend on nodeA itself (no SNAT; translated as it leaves the node);
/// - PMTU: nodeB's link to b1 is narrower than the path before it, so nodeB answers the
///   client's full-size segments, source-NATed by nodeA, with "fragmentation needed" to
///   nodeA's address; translated and sent on, the client lowers its path MTU and a 256 KiB
///   request through the NodePort is answered.
#[test]
fn icmp_errors_about_node_port_flows_reach_the_client() {
    use std::io::{BufRead as _, Write as _};
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    for (backend, what) in [(&s.b1, "on nodeB, source-NATed"), (&s.a1, "on nodeA")] {
        s.lab
            .write_manifest_text(&closed_manifest(&s.lab, &[&s.a1, &s.b1], backend));
        // Programmed on nodeA first: until then nodeA's own stack would refuse the datagram.
        let programmed = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
            s.lab
                .serves_only(NodeId::A, "default/closed", backend.ip.into())
                .then_some(())
        });
        assert!(
            programmed.is_ok(),
            "nodeA serves closed's NodePort with {} only\n{}",
            backend.name,
            s.logs()
        );
        let refused = wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
            let u = client
                .run(|| lbproxy_tests::lab::socket2_udp(0))
                .expect("UDP socket");
            u.connect((a, 30055)).unwrap();
            u.set_read_timeout(Some(Duration::from_millis(900)))
                .unwrap();
            let started = Instant::now();
            u.send(b"hello\n").unwrap();
            let r = u.recv(&mut [0u8; 64]);
            (matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
                && started.elapsed() < Duration::from_secs(1))
            .then_some(())
        });
        assert!(
            refused.is_ok(),
            "UDP through nodeA's NodePort to {} ({what}), where nothing listens: want \
             connection refused within 1 s\n{}",
            backend.name,
            s.logs()
        );
    }
    // PMTU, source-NATed to b1 on nodeB.
    only_b1(&s, &client.netns);
    s.lab
        .node_run(
            NodeId::B,
            &["ip", "link", "set", "dev", &s.b1.host_if, "mtu", "1280"],
        )
        .unwrap();
    let stream = client
        .run(|| {
            std::net::TcpStream::connect_timeout(&SocketAddr::from((a, NODE_PORT_TCP)), TIMEOUT)
        })
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut line = vec![b'x'; 256 * 1024];
    line.push(b'\n');
    let started = Instant::now();
    let w = (&stream).write_all(&line);
    let mut answer = String::new();
    let r = std::io::BufReader::new(&stream).read_line(&mut answer);
    assert!(
        w.is_ok() && r.is_ok() && answer.starts_with("b1 "),
        "a 256 KiB request through nodeA's NodePort to b1 over a 1280-byte hop: write {w:?}, \
         read {r:?}, answer {answer:?} after {:?}\n{}",
        started.elapsed(),
        s.logs()
    );
}

/// A `healthCheckNodePort` that cannot be bound (another process holds it on nodeA's
/// address) is reported once, a log line naming the service and the port, not once per
/// sync that retries it; nothing else stops: the NodePort is served, nodeB's health check
/// answers, lbproxy stays healthy. Once the port is free, the next sync's retry starts the
/// server and it answers with a1 counted.
#[test]
fn a_health_check_port_that_cannot_be_bound_is_reported_once() {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let extra = format!("healthCheckNodePort: {HC_PORT}");
    lab.write_manifest_text(&manifest_with(&lab, &[&a1], "Local", &extra));
    let (a, b) = (lab.node(NodeId::A).ip, lab.node(NodeId::B).ip);
    let squatter = lbproxy_tests::lab::run_in_ns(lab.node_ns(NodeId::A), || {
        std::net::TcpListener::bind((a, HC_PORT))
    })
    .expect("bind the health-check port first");
    // Full syncs every second, each of which retries the port.
    let lbs = lab.start_lbproxy_on_both(&["--sync-period", "1s"], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    std::thread::sleep(Duration::from_secs(4));
    let failed_lines = |lb: &Lbproxy| {
        lb.log()
            .lines()
            .filter(|l| {
                l.contains("health check server")
                    && l.contains("default/web")
                    && l.contains(&HC_PORT.to_string())
            })
            .count()
    };
    assert_eq!(
        failed_lines(&lbs[0]),
        1,
        "the bind failure is logged once over about 4 syncs\n{}",
        lbs[0].log()
    );
    let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 4);
    assert!(
        seen.errors.is_empty() && seen.by_backend.contains_key("a1"),
        "the NodePort is still served: {seen:?}"
    );
    let hc = |ip: Ipv4Addr| {
        lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((ip, HC_PORT)),
            "/",
            Duration::from_secs(1),
        )
    };
    let on_b = hc(b);
    assert!(
        matches!(&on_b, Ok(r) if r.status == 503),
        "nodeB's health check answers (no local endpoint there): {on_b:?}"
    );
    assert!(
        matches!(
            http_get(
                lab.node_ns(NodeId::A),
                HEALTHZ_ADDR.parse().unwrap(),
                "/healthz"
            ),
            Ok(200)
        ),
        "nodeA's lbproxy stays healthy"
    );
    drop(squatter);
    let started = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        hc(a)
            .ok()
            .filter(|r| r.status == 200 && r.body.contains("\"localEndpoints\": 1"))
    });
    assert!(
        started.is_ok(),
        "once the port is free, nodeA's health check starts and counts a1: {:?}\n{}",
        hc(a),
        lbs[0].log()
    );
}

/// Load-balancer ingress entries with `ipMode: Proxy` (KEP-1860) or only a hostname program
/// nothing: nodeA does not answer for the Proxy-mode address, while the VIP-mode one is
/// served; `inspect services` lists neither the Proxy address nor the hostname.
#[test]
fn lb_ingress_with_ip_mode_proxy_or_a_hostname_programs_nothing() {
    let proxied = Ipv4Addr::new(198, 19, 0, 61);
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let text = manifest(&lab, &[&a1], "Cluster").replace(
        &format!("ingress: [{{ip: {LB_IP}}}]"),
        &format!(
            "ingress: [{{ip: {LB_IP}}}, {{ip: {proxied}, ipMode: Proxy}}, {{hostname: lb.example}}]"
        ),
    );
    assert!(text.contains("ipMode: Proxy"), "{text}");
    lab.write_manifest_text(&text);
    let mut lb = lab.start_lbproxy(NodeId::A, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    client.route_via("198.19.0.0/16", lab.node(NodeId::A));
    let served = requests(&client.netns, false, LB_IP, 80, 4);
    assert!(
        served.errors.is_empty() && served.replies() == 4,
        "the VIP-mode LB IP is served: {served:?}\n{}",
        lb.log()
    );
    let r = tcp_request(&client.netns, proxied, 80, Duration::from_millis(700));
    assert!(
        r.is_err(),
        "the Proxy-mode LB IP is not served by lbproxy: {r:?}"
    );
    let services = lab.node(NodeId::A).inspect_json("services").to_string();
    assert!(
        services.contains(&LB_IP.to_string())
            && !services.contains(&proxied.to_string())
            && !services.contains("lb.example"),
        "inspect services lists only the VIP-mode LB IP: {services}"
    );
}

/// A node interface that appears while lbproxy runs gets the north-south programs, and
/// source NAT picks the address of the interface towards the backend, not one address for
/// the node: nodeA and nodeB get a second, direct link (198.18.81.0/24), and nodeA's route
/// to nodeB's pods moves onto it, so b1 sees nodeA's address on that link; once the link is
/// gone and the route is back on the fabric, b1 sees nodeA's fabric address again.
#[test]
fn snat_uses_the_address_of_the_interface_towards_the_backend() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let (a2, b2) = ("198.18.81.1", "198.18.81.2");
    let b_ns = s.lab.node_ns(NodeId::B).to_owned();
    let pods_b = NodeId::B.pod_cidr();
    let sees = |want: &str| {
        let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 4);
        (seen.errors.is_empty()
            && seen.by_backend.get("b1").map(|e| e.0.clone()) == Some(vec![want.to_string()]))
        .then_some(())
        .ok_or(seen)
    };
    sees(&a.to_string()).unwrap_or_else(|e| panic!("over the fabric: {e:?}\n{}", s.logs()));
    for argv in [
        vec![
            "ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1", "netns", &b_ns,
        ],
        vec!["ip", "addr", "add", &format!("{a2}/24"), "dev", "eth1"],
        vec!["ip", "link", "set", "eth1", "up"],
    ] {
        s.lab.node_run(NodeId::A, &argv).unwrap();
    }
    for argv in [
        vec!["ip", "addr", "add", &format!("{b2}/24"), "dev", "eth1"],
        vec!["ip", "link", "set", "eth1", "up"],
    ] {
        s.lab.node_run(NodeId::B, &argv).unwrap();
    }
    for (node, ns) in [
        (NodeId::A, s.lab.node_ns(NodeId::A)),
        (NodeId::B, b_ns.as_str()),
    ] {
        for key in [
            "net/ipv4/conf/eth1/rp_filter",
            "net/ipv4/conf/eth1/send_redirects",
        ] {
            lbproxy_tests::lab::run_in_ns(ns, || std::fs::write(format!("/proc/sys/{key}"), "0"))
                .unwrap_or_else(|e| panic!("{node}: {key}: {e}"));
        }
    }
    s.lab
        .node_run(
            NodeId::A,
            &["ip", "route", "replace", &pods_b, "via", b2, "dev", "eth1"],
        )
        .unwrap();
    let moved = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        sees(a2).ok()
    });
    assert!(
        moved.is_ok(),
        "over the new link b1 sees nodeA's address on it ({a2}): {:?}\n{}",
        sees(a2),
        s.logs()
    );
    let on_eth1: Vec<String> = lbproxy_tests::lab::bpf::tcx_attachments(s.lab.node_ns(NodeId::A))
        .into_iter()
        .filter(|t| t.ifname == "eth1")
        .map(|t| t.prog_name)
        .collect();
    assert!(
        on_eth1.contains(&"lb_from_node".to_string())
            && on_eth1.contains(&"lb_to_node".to_string()),
        "the new node interface has the north-south programs: {on_eth1:?}"
    );
    s.lab
        .node_run(NodeId::A, &["ip", "link", "del", "eth1"])
        .unwrap();
    s.lab
        .node_run(
            NodeId::A,
            &[
                "ip",
                "route",
                "replace",
                &pods_b,
                "via",
                &NodeId::B.fabric_ip().to_string(),
                "dev",
                "eth0",
            ],
        )
        .unwrap();
    let back = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        sees(&a.to_string()).ok()
    });
    assert!(
        back.is_ok(),
        "back over the fabric: {:?}\n{}",
        sees(&a.to_string()),
        s.logs()
    );
}

/// An outside client's own ICMP error about a reply it got through a NodePort reaches the
/// backend translated: b1 (on nodeB, source-NATed by nodeA) answers after the client has
/// closed its socket, the client's kernel sends port unreachable to nodeA's NodePort
/// address (which is also nodeA's SNAT address) quoting nodeA:30056 -> client, and nodeA
/// readdresses it to b1 with the quote as b1 sent its reply, so b1's connected socket gets
/// "connection refused".
#[test]
fn a_clients_icmp_error_about_a_node_port_reply_reaches_the_backend() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    let server =
        s.b1.run(|| std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 5656)))
            .expect("bind 5656 in b1");
    let text = closed_manifest(&s.lab, &[&s.a1, &s.b1], &s.b1)
        .replace(
            "targetPort: 5555, nodePort: 30055",
            "targetPort: 5656, nodePort: 30056",
        )
        .replace("port: 5555, protocol: UDP}", "port: 5656, protocol: UDP}");
    assert!(
        text.contains("nodePort: 30056") && text.contains("port: 5656,"),
        "{text}"
    );
    s.lab.write_manifest_text(&text);
    server
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 64];
    // Until nodeA serves 30056 (its own stack would refuse the first datagrams).
    let mut ports = Vec::new();
    let from = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        let u = client
            .run(|| lbproxy_tests::lab::socket2_udp(0))
            .expect("UDP socket");
        u.connect((a, 30056)).unwrap();
        ports.push(u.local_addr().unwrap().port());
        u.send(b"hello\n").unwrap();
        server.recv_from(&mut buf).ok().map(|(_, from)| from)
    });
    let (from, _) =
        from.unwrap_or_else(|t| panic!("b1 got no datagram through 30056 in {t:?}\n{}", s.logs()));
    assert_eq!(
        from.ip(),
        std::net::IpAddr::V4(a),
        "b1 sees nodeA's address (SNAT)"
    );
    // The client's sockets are closed by now, and no copy of one lives on in a child process
    // that another test thread is starting (see `wait_udp_port_released`).
    for port in ports {
        client
            .run(|| lbproxy_tests::lab::wait_udp_port_released(port, TIMEOUT))
            .unwrap_or_else(|e| panic!("the client's socket: {e}"));
    }
    let (r, took) = lbproxy_tests::lab::answer_after_close(&server, from);
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "b1's connected socket after the client's port unreachable: {r:?} after {took:?} \
         (want connection refused)\n{}",
        s.logs()
    );
}
