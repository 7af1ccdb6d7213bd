//! The two-node north-south suites' shared setup (north_south*.rs): the `web` Service
//! (single- or dual-stack) over a1 on nodeA and b1 on nodeB, lbproxy on both nodes, and the
//! requests and checks every suite makes.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{Client, MultiNodeLab, NodeId, dual_stack_web_manifest};
use lbproxy_tests::lab::{Backend, Family, Lbproxy, Pod, tcp_request, udp_request, wait_for};

use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP,
    WEB_NODE_PORT_TCP as NODE_PORT_TCP, web_manifest,
};

pub const TIMEOUT: Duration = Duration::from_secs(2);
pub const HEALTHY_WITHIN: Duration = Duration::from_secs(20);
/// The ClusterIP of `metrics`, a second Service over a backend of `web`.
pub const METRICS_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 13);

pub struct Setup {
    // Dropped last: servers and lbproxys go first.
    pub lab: MultiNodeLab,
    pub _servers: Vec<Backend>,
    pub lbs: Vec<Lbproxy>,
    pub a1: Pod,
    pub b1: Pod,
}

/// A service `web` of type LoadBalancer over one backend on each node (a1 on nodeA, b1 on
/// nodeB), with NodePorts, an externalIP and a load-balancer IP; `policy` is its
/// externalTrafficPolicy.
pub fn manifest(lab: &MultiNodeLab, pods: &[&Pod], policy: &str) -> String {
    manifest_with(lab, pods, policy, "")
}

/// [`dual_stack_web_manifest`] with `extra` (one spec line, as [`manifest_with`]'s) added.
pub fn dual_stack_manifest_with(
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
pub fn manifest_with(lab: &MultiNodeLab, pods: &[&Pod], policy: &str, extra: &str) -> String {
    let eps: Vec<(Ipv4Addr, Option<&str>)> = pods
        .iter()
        .map(|p| (p.ip, Some(lab.node_of(&p.name).name())))
        .collect();
    web_manifest(&eps, policy, extra)
}

impl Setup {
    pub fn new(policy: &str) -> Setup {
        Setup::with(policy, true, "")
    }

    /// `b1_listed`: whether b1 is in the slice (a1 always is); `extra` as in
    /// [`manifest_with`].
    pub fn with(policy: &str, b1_listed: bool, extra: &str) -> Setup {
        Setup::build(b1_listed, |lab, pods| {
            manifest_with(lab, pods, policy, extra)
        })
    }

    /// [`Setup::new`] in `family`: for IPv6 the `web` Service is dual-stack
    /// ([`dual_stack_web_manifest`]), its IPv4 frontends as [`manifest`]'s.
    pub fn for_family(family: Family, policy: &str) -> Setup {
        Setup::for_family_with(family, policy, true, "")
    }

    /// [`Setup::with`] in `family` (see [`Setup::for_family`]).
    pub fn for_family_with(family: Family, policy: &str, b1_listed: bool, extra: &str) -> Setup {
        match family {
            Family::V4 => Setup::with(policy, b1_listed, extra),
            Family::V6 => Setup::build(b1_listed, |lab, pods| {
                dual_stack_manifest_with(lab, pods, policy, extra)
            }),
        }
    }

    /// a1 on nodeA and b1 on nodeB serve; `b1_listed`: whether b1 is an endpoint in the
    /// manifest `manifest` writes for the endpoints.
    pub fn build(
        b1_listed: bool,
        manifest: impl FnOnce(&MultiNodeLab, &[&Pod]) -> String,
    ) -> Setup {
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

    pub fn logs(&self) -> String {
        lab_logs(&self.lab, &self.lbs, &["services", "flows", "drops"])
    }
}

/// What answered: backend -> (the client address it saw, count), and every failure.
#[derive(Debug, Default)]
pub struct Seen {
    pub by_backend: BTreeMap<String, (Vec<String>, usize)>,
    pub wrong_source: Vec<(String, SocketAddr)>,
    pub errors: Vec<String>,
}

impl Seen {
    pub fn replies(&self) -> usize {
        self.by_backend.values().map(|e| e.1).sum()
    }
}

/// `n` requests (new TCP connections, or UDP datagrams each from a new socket) from `ns` to
/// `addr:port`; each reply must come from `addr:port`.
pub fn requests(ns: &str, udp: bool, addr: impl Into<IpAddr>, port: u16, n: usize) -> Seen {
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
pub fn assert_spread(s: &Setup, what: &str, seen: &Seen, via: NodeId, client: IpAddr) {
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
pub fn wait_served(client: &Client, addr: IpAddr, port: u16) {
    let deadline = Instant::now() + HEALTHY_WITHIN;
    while client.tcp_request(addr, port, TIMEOUT).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of the sample `series` (name and labels, exactly as exported) on `node`'s
/// `/metrics`; `None` when it is not there. The counters reach the metrics every 2 s, so
/// this waits up to 5 s for `until` to hold.
pub fn metric_until(
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
pub fn only_b1(s: &Setup, client_ns: &str) {
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

pub const HC_PORT: u16 = 32000;

/// `web` over `web_eps` and the lab's UDP NodePort Service `closed` (nodePort 30055 -> port
/// 5555, where nothing listens) over `backend`.
pub fn closed_manifest(lab: &MultiNodeLab, web_eps: &[&Pod], backend: &Pod) -> String {
    format!(
        "{}{}",
        manifest(lab, web_eps, "Cluster"),
        lab.closed_service(backend, false)
    )
}

/// A failure message's context: the lab's diagnostics, `inspect WHAT --json` of each node for
/// each of `whats`, and the logs of `lbs`.
pub fn lab_logs(lab: &MultiNodeLab, lbs: &[Lbproxy], whats: &[&str]) -> String {
    let mut out = lab.diagnostics();
    for node in NodeId::ALL {
        for what in whats {
            out.push_str(&format!(
                "\n--- {node}: inspect {what}\n{:#}",
                lab.node(node).inspect_json(what)
            ));
        }
    }
    for lb in lbs {
        out.push_str(&format!("\n--- lbproxy {:?}\n{}", lb.argv(), lb.log()));
    }
    out
}

/// `node`'s fabric address in `family`.
pub fn node_addr(lab: &MultiNodeLab, node: NodeId, family: Family) -> IpAddr {
    match family {
        Family::V4 => lab.node(node).ip.into(),
        Family::V6 => lab.node(node).ip6.into(),
    }
}

/// `client`'s fabric address in `family`.
pub fn client_addr(client: &Client, family: Family) -> IpAddr {
    match family {
        Family::V4 => client.ip.into(),
        Family::V6 => client.ip6.into(),
    }
}

/// `node`'s delivery counter `what` (`inspect delivery`), 0 when it is not listed.
pub fn delivered(lab: &MultiNodeLab, node: NodeId, what: &str) -> u64 {
    lab.node(node)
        .inspect_delivery()
        .packets
        .get(what)
        .copied()
        .unwrap_or(0)
}

/// The IP address of a backend's `client_seen` (`addr:port`).
pub fn ip_of(client_seen: &str) -> String {
    client_seen
        .parse::<SocketAddr>()
        .map_or(client_seen.to_string(), |a| a.ip().to_string())
}

/// A 256 KiB request on a new TCP connection from `client` to `addr:port`, read and write
/// timeouts 5 s: the answer line, or what failed and after how long. Crossing a narrower
/// hop, it needs path MTU discovery to work.
pub fn big_request(client: &Client, addr: IpAddr, port: u16) -> Result<String, String> {
    use std::io::{BufRead as _, Write as _};
    let stream = client
        .run(|| std::net::TcpStream::connect_timeout(&SocketAddr::from((addr, port)), TIMEOUT))
        .map_err(|e| format!("connect: {e}"))?;
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
    match (w, r) {
        (Ok(()), Ok(_)) => Ok(answer),
        (w, r) => Err(format!(
            "write {w:?}, read {r:?}, answer {answer:?} after {:?}",
            started.elapsed()
        )),
    }
}
