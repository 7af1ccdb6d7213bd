//! Direct server return (issue 30 §1): `--load-balancer-mode dsr|hybrid` on two nodes, each
//! lbproxy started as other harnesses start it plus exactly `--load-balancer-mode dsr` (or
//! `hybrid`). `web`'s only endpoint is b1 on nodeB; the client reaches it through nodeA's
//! NodePort.
//!
//! - [`dsr_backend_sees_the_client_and_answers_it_directly`] (both families): b1 sees the
//!   client's own address over TCP and UDP; the client's sockets see nodeA's NodePort as
//!   the source; nodeA's uplink receives only the requests (its receive counter grows by
//!   about one packet per UDP request, not two), nodeB counts every reply it sent straight
//!   to the client (`dsr_reply_to_client`), and `inspect flows` on nodeB lists the flows
//!   with the frontend. With `snat`, b1 sees nodeA's address and the test fails.
//! - [`hybrid_is_dsr_for_tcp_and_snat_for_udp`].
//! - [`dsr_with_xdp_sends_established_segments_from_xdp`].
//! - [`dsr_flows_survive_restarts_and_follow_churn`].
//! - [`dsr_keeps_path_mtu_discovery_working`] (both families): nodeB's link to b1 is 1280
//!   bytes; nodeB's "fragmentation needed" (Packet Too Big) about the client's full-size
//!   segments goes to the client directly, translated to quote the NodePort, and a 256 KiB
//!   request is answered.

mod north_south_common;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{
    Client, MultiNodeLab, NodeId, WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP,
    WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
    dual_stack_web_manifest, web_manifest,
};
use lbproxy_tests::lab::{Backend, Family, Lbproxy, Pod, TcpConn, udp_request};

use north_south_common::{
    HEALTHY_WITHIN, TIMEOUT, big_request, client_addr, delivered, ip_of, lab_logs, node_addr,
};

struct Setup {
    lab: MultiNodeLab,
    family: Family,
    b1: Pod,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
}

impl Setup {
    /// `web` (eTP=Cluster) with b1 on nodeB as its only endpoint (a1 on nodeA serves but is
    /// not listed), dual-stack for IPv6; lbproxy on both nodes with `--load-balancer-mode
    /// mode`.
    fn new(family: Family, mode: &str) -> Setup {
        Setup::with(family, &["--load-balancer-mode", mode])
    }

    /// [`Setup::new`] with lbproxy's `args` (the fabric set up for XDP when they ask for
    /// it).
    fn with(family: Family, args: &[&str]) -> Setup {
        let lab = MultiNodeLab::new();
        if args.contains(&"--xdp-acceleration") {
            lab.enable_xdp_tx();
        }
        let a1 = lab.add_pod(NodeId::A, "a1");
        let b1 = lab.add_pod(NodeId::B, "b1");
        let servers = vec![
            a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
            b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        ];
        let text = match family {
            Family::V4 => web_manifest(&[(b1.ip, Some("nodeB"))], "Cluster", ""),
            Family::V6 => dual_stack_web_manifest(&lab, &[&b1], "Cluster", ""),
        };
        lab.write_manifest_text(&text);
        let lbs = lab.start_lbproxy_on_both(args, HEALTHY_WITHIN);
        Setup {
            lab,
            family,
            b1,
            _servers: servers,
            lbs,
        }
    }

    fn node_a(&self) -> IpAddr {
        node_addr(&self.lab, NodeId::A, self.family)
    }

    fn client_ip(&self, c: &Client) -> String {
        client_addr(c, self.family).to_string()
    }

    fn logs(&self) -> String {
        lab_logs(&self.lab, &self.lbs, &["delivery", "flows", "drops"])
    }

    fn delivered(&self, node: NodeId, what: &str) -> u64 {
        delivered(&self.lab, node, what)
    }

    /// Packets `node`'s uplink (eth0) received so far.
    fn rx_packets(&self, node: NodeId) -> u64 {
        let out = self
            .lab
            .node_run(node, &["ip", "-s", "-j", "link", "show", "dev", "eth0"])
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v[0]["stats64"]["rx"]["packets"]
            .as_u64()
            .unwrap_or_else(|| panic!("no rx packets in {out}"))
    }

    /// `n` TCP connections through nodeA's NodePort, 3 requests each: the addresses the
    /// backend saw. Each connection's socket must see the NodePort as its peer.
    fn tcp(&self, client: &str, n: usize) -> BTreeSet<(String, String)> {
        let mut seen = BTreeSet::new();
        for i in 0..n {
            let mut c = TcpConn::connect(client, self.node_a(), NODE_PORT_TCP, TIMEOUT)
                .unwrap_or_else(|e| panic!("TCP connection #{i}: {e}\n{}", self.logs()));
            assert_eq!(
                c.peer,
                SocketAddr::from((self.node_a(), NODE_PORT_TCP)),
                "the client's socket sees the NodePort"
            );
            for j in 0..3 {
                let r = c.request().unwrap_or_else(|e| {
                    panic!("TCP connection #{i}, request #{j}: {e}\n{}", self.logs())
                });
                seen.insert((r.backend, ip_of(&r.client_seen)));
            }
        }
        seen
    }

    /// `n` UDP requests through nodeA's NodePort, each from its own port: the addresses the
    /// backend saw. Each answer must come from the NodePort.
    fn udp(&self, client: &str, n: usize) -> BTreeSet<(String, String)> {
        let mut seen = BTreeSet::new();
        for i in 0..n {
            let (r, from) = udp_request(client, self.node_a(), NODE_PORT_UDP, TIMEOUT, None)
                .unwrap_or_else(|e| panic!("UDP request #{i}: {e}\n{}", self.logs()));
            assert_eq!(
                from,
                SocketAddr::from((self.node_a(), NODE_PORT_UDP)),
                "the answer comes from the NodePort"
            );
            seen.insert((r.backend, ip_of(&r.client_seen)));
        }
        seen
    }
}

fn dsr_backend_sees_the_client(family: Family) {
    let s = Setup::new(family, "dsr");
    let client = s.lab.add_client("ext");
    let me = s.client_ip(&client);
    let want: BTreeSet<(String, String)> = [(s.b1.name.clone(), me.clone())].into();
    assert_eq!(
        s.tcp(&client.netns, 10),
        want,
        "TCP: b1 sees the client's own address\n{}",
        s.logs()
    );
    const N: u64 = 40;
    let (rx_a, replies_b) = (
        s.rx_packets(NodeId::A),
        s.delivered(NodeId::B, "dsr_reply_to_client"),
    );
    assert_eq!(
        s.udp(&client.netns, N as usize),
        want,
        "UDP: b1 sees the client's own address\n{}",
        s.logs()
    );
    let rx = s.rx_packets(NodeId::A) - rx_a;
    let replies = s.delivered(NodeId::B, "dsr_reply_to_client") - replies_b;
    // Each request once; the replies not at all. A few packets of the lab's own (neighbour
    // discovery, ARP) may fall in the window.
    assert!(
        (N..N + 10).contains(&rx),
        "nodeA's uplink received {rx} packets during {N} UDP requests (want {N}, no replies)\n{}",
        s.logs()
    );
    assert!(
        replies >= N,
        "nodeB sent {replies} replies straight to the client (want >= {N})\n{}",
        s.logs()
    );
    assert!(
        s.delivered(NodeId::A, "dsr_to_backend") >= N
            && s.delivered(NodeId::B, "dsr_recorded") >= N,
        "nodeA dispatched and nodeB recorded every request\n{}",
        s.logs()
    );
    // Both nodes list the flows as dispatched, nodeB's with the frontend the client used.
    for node in NodeId::ALL {
        let rows = s.lab.node(node).inspect_flows();
        let dsr: Vec<_> = rows
            .iter()
            .filter(|r| r.dispatch.as_deref() == Some("dsr"))
            .collect();
        assert!(
            dsr.len() as u64 >= N
                && dsr.iter().all(|r| r.client.contains(&me)
                    && r.frontend.contains(&s.node_a().to_string())
                    && r.snat.is_none()),
            "{node}: inspect flows lists the dispatched flows (client, nodeA's NodePort, no \
             SNAT): {} of {} rows\n{rows:#?}",
            dsr.len(),
            rows.len()
        );
    }
}

#[test]
fn dsr_backend_sees_the_client_and_answers_it_directly() {
    dsr_backend_sees_the_client(Family::V4);
}

#[test]
fn dsr_backend_sees_the_client_and_answers_it_directly_ipv6() {
    dsr_backend_sees_the_client(Family::V6);
}

#[test]
fn hybrid_is_dsr_for_tcp_and_snat_for_udp() {
    let s = Setup::new(Family::V4, "hybrid");
    let client = s.lab.add_client("ext");
    let tcp = s.tcp(&client.netns, 5);
    let udp = s.udp(&client.netns, 10);
    let node_a = s.node_a().to_string();
    assert_eq!(
        tcp,
        [(s.b1.name.clone(), s.client_ip(&client))].into(),
        "TCP direct: b1 sees the client\n{}",
        s.logs()
    );
    assert_eq!(
        udp,
        [(s.b1.name.clone(), node_a)].into(),
        "UDP source-NATed: b1 sees nodeA\n{}",
        s.logs()
    );
}

/// DSR with XDP on the uplinks (`--load-balancer-mode dsr --xdp-acceleration native`): the
/// SYN goes through TC (it carries the option), the segments after it through XDP, sent
/// back out towards nodeB, translated (`xdp_to_backend`); b1 still sees the client.
#[test]
fn dsr_with_xdp_sends_established_segments_from_xdp() {
    let s = Setup::with(
        Family::V4,
        &[
            "--load-balancer-mode",
            "dsr",
            "--xdp-acceleration",
            "native",
        ],
    );
    let client = s.lab.add_client("ext");
    let before = s.delivered(NodeId::A, "xdp_to_backend");
    assert_eq!(
        s.tcp(&client.netns, 5),
        [(s.b1.name.clone(), s.client_ip(&client))].into(),
        "b1 sees the client\n{}",
        s.logs()
    );
    // Per connection at least the handshake's ACK and three requests.
    let at_xdp = s.delivered(NodeId::A, "xdp_to_backend") - before;
    assert!(
        at_xdp >= 5 * 4,
        "{at_xdp} segments to b1 sent from XDP (want >= 20)\n{}",
        s.logs()
    );
}

fn dsr_pmtu(family: Family) {
    let s = Setup::new(family, "dsr");
    let client = s.lab.add_client("ext");
    assert_eq!(
        s.tcp(&client.netns, 1).len(),
        1,
        "served before the MTU change"
    );
    s.lab
        .node_run(
            NodeId::B,
            &["ip", "link", "set", "dev", &s.b1.host_if, "mtu", "1280"],
        )
        .unwrap();
    let answer = big_request(&client, s.node_a(), NODE_PORT_TCP);
    assert!(
        answer.as_ref().is_ok_and(|a| a.starts_with("b1 ")),
        "a 256 KiB request through nodeA's {family} NodePort to b1 over a 1280-byte hop: \
         {answer:?}\n{}",
        s.logs()
    );
}

#[test]
fn dsr_keeps_path_mtu_discovery_working() {
    dsr_pmtu(Family::V4);
}

#[test]
fn dsr_keeps_path_mtu_discovery_working_ipv6() {
    dsr_pmtu(Family::V6);
}

/// DSR flows keep working as SNAT ones do across restarts and endpoint churn: `web` over b1
/// and b2 on nodeB, a TCP connection and a UDP flow (one source port) through nodeA.
/// - Both lbproxys restarted (killed, started again with the same flags): the connection's
///   next request reaches its backend, which still sees the client (flows are pinned on
///   both nodes).
/// - The connection's backend leaves `web`: its next request is reset at once (nodeA
///   rejects a segment whose backend left), and a new connection reaches the other
///   backend, seeing the client; the UDP flow's next datagram reaches the remaining
///   backend.
#[test]
fn dsr_flows_survive_restarts_and_follow_churn() {
    let lab = MultiNodeLab::new();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let b2 = lab.add_pod(NodeId::B, "b2");
    let _servers = [
        b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        b2.serve(&[BACKEND_TCP, BACKEND_UDP]),
    ];
    let eps = |pods: &[&Pod]| -> Vec<(std::net::Ipv4Addr, Option<&str>)> {
        pods.iter().map(|p| (p.ip, Some("nodeB"))).collect()
    };
    lab.write_manifest_text(&web_manifest(&eps(&[&b1, &b2]), "Cluster", ""));
    let args = ["--load-balancer-mode", "dsr"];
    let mut lbs = lab.start_lbproxy_on_both(&args, HEALTHY_WITHIN);
    let logs = |lbs: &[Lbproxy]| -> String {
        let mut out = lab.diagnostics();
        for lb in lbs {
            out.push_str(&format!("\n--- lbproxy {:?}\n{}", lb.argv(), lb.log()));
        }
        out
    };
    let client = lab.add_client("ext");
    let a = lab.node(NodeId::A).ip;
    let me = client.ip.to_string();
    let mut conn = TcpConn::connect(&client.netns, a, NODE_PORT_TCP, TIMEOUT)
        .unwrap_or_else(|e| panic!("TCP connection: {e}\n{}", logs(&lbs)));
    let first = conn.request().unwrap();
    assert_eq!(ip_of(&first.client_seen), me, "the backend sees the client");
    const PORT: u16 = 41_500;
    let (u, _) = udp_request(&client.netns, a, NODE_PORT_UDP, TIMEOUT, Some(PORT)).unwrap();

    for lb in &mut lbs {
        lb.kill();
    }
    let mut lbs = lab.start_lbproxy_on_both(&args, HEALTHY_WITHIN);
    let again = conn
        .request()
        .unwrap_or_else(|e| panic!("the connection after both restarts: {e}\n{}", logs(&lbs)));
    assert_eq!(
        (again.backend.as_str(), ip_of(&again.client_seen)),
        (first.backend.as_str(), me.clone()),
        "the same backend, still seeing the client, after both restarts"
    );
    let (u2, _) = udp_request(&client.netns, a, NODE_PORT_UDP, TIMEOUT, Some(PORT)).unwrap();
    assert_eq!(u2.backend, u.backend, "the UDP flow keeps its backend");

    // The connection's backend leaves.
    let (gone, stays) = if first.backend == b1.name {
        (&b1, &b2)
    } else {
        (&b2, &b1)
    };
    lab.write_manifest_text(&web_manifest(&eps(&[stays]), "Cluster", ""));
    let programmed =
        lbproxy_tests::lab::wait_for(Duration::from_secs(10), Duration::from_millis(100), || {
            lab.serves_only(NodeId::A, "default/web", stays.ip.into())
                .then_some(())
        });
    assert!(
        programmed.is_ok(),
        "nodeA serves web with {} only",
        stays.name
    );
    let started = Instant::now();
    let r = conn.request();
    assert!(
        r.is_err() && started.elapsed() < TIMEOUT,
        "a request on the connection to {} (gone) after {:?}: {r:?} (want a reset at once)\n{}",
        gone.name,
        started.elapsed(),
        logs(&lbs)
    );
    let mut fresh = TcpConn::connect(&client.netns, a, NODE_PORT_TCP, TIMEOUT).unwrap();
    let r = fresh.request().unwrap();
    assert_eq!(
        (r.backend.as_str(), ip_of(&r.client_seen)),
        (stays.name.as_str(), me.clone()),
        "a new connection reaches {}, seeing the client",
        stays.name
    );
    let (u3, _) = udp_request(&client.netns, a, NODE_PORT_UDP, TIMEOUT, Some(PORT)).unwrap();
    assert_eq!(
        (u3.backend.as_str(), ip_of(&u3.client_seen)),
        (stays.name.as_str(), me),
        "the UDP flow's next datagram reaches {}\n{}",
        stays.name,
        logs(&lbs)
    );
    for lb in &mut lbs {
        lb.kill();
    }
}
