//! North-south at XDP (issue 30 §3): `--xdp-acceleration native|best-effort|disabled` on
//! two nodes, each lbproxy started as other harnesses start it plus exactly
//! `--xdp-acceleration native` (or another value of it).
//!
//! - [`native_serves_node_ports_at_xdp`] (both families): `lb_xdp` runs on nodeA's uplink in
//!   driver mode (the kernel says so, and `inspect status`), and an external client's TCP
//!   connections and UDP flows through nodeA's NodePort reach both backends: b1 on nodeB
//!   source-NATed (it sees nodeA's address), a1 on nodeA with the client's own address, and
//!   the client sees the NodePort as the source. The packets after each flow's first are
//!   translated at XDP, both ways: the delivery counters `xdp_to_backend`, `xdp_to_client`
//!   and `xdp_to_local_backend` count them.
//! - [`disabled_attaches_nothing_and_cleanup_detaches`]: with `disabled` (the default) no
//!   XDP program is attached and the same traffic counts nothing at XDP; a restart with
//!   `disabled` detaches what `native` attached; `cleanup` leaves no XDP program.
//! - [`an_interface_without_xdp`]: a node interface whose driver has no XDP (an ifb):
//!   `native` refuses to start and names it; `best-effort` starts, says so, and runs XDP on
//!   the uplink only.
//!
//! Without `lb_xdp` attached (watched: the flag ignored) the first test fails on the kernel's
//! listing and on the counters, which stay 0.
//!
//! A veth takes frames its peer sends back with `XDP_TX` only when it has an XDP program of
//! its own, and a local socket's packet may cross veths with a partial checksum that an XDP
//! frame loses: the lab puts an XDP pass program on the fabric's side of the uplinks and
//! turns its checksum offload off, as a wire behaves ([`MultiNodeLab::enable_xdp_tx`]).

mod north_south_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP,
    WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
    dual_stack_web_manifest, web_manifest,
};
use lbproxy_tests::lab::{Backend, Family, Lbproxy, Pod, TcpConn, udp_request};

use north_south_common::{HEALTHY_WITHIN, TIMEOUT, client_addr, ip_of, lab_logs, node_addr};

/// Requests per connection (and datagrams per UDP flow): all but the first packets of each
/// are an established flow's.
const REQUESTS: usize = 10;

struct Setup {
    lab: MultiNodeLab,
    family: Family,
    a1: Pod,
    b1: Pod,
    _servers: Vec<Backend>,
    lbs: Vec<Lbproxy>,
}

impl Setup {
    /// `web` (eTP=Cluster) over a1 on nodeA and b1 on nodeB, dual-stack for IPv6; lbproxy
    /// on both nodes with `extra`.
    fn new(family: Family, extra: &[&str]) -> Setup {
        let lab = MultiNodeLab::new();
        lab.enable_xdp_tx();
        let a1 = lab.add_pod(NodeId::A, "a1");
        let b1 = lab.add_pod(NodeId::B, "b1");
        let servers = vec![
            a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
            b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        ];
        let text = match family {
            Family::V4 => {
                let eps: Vec<(Ipv4Addr, Option<&str>)> = [&a1, &b1]
                    .iter()
                    .map(|p| (p.ip, Some(lab.node_of(&p.name).name())))
                    .collect();
                web_manifest(&eps, "Cluster", "")
            }
            Family::V6 => dual_stack_web_manifest(&lab, &[&a1, &b1], "Cluster", ""),
        };
        lab.write_manifest_text(&text);
        let lbs = lab.start_lbproxy_on_both(extra, HEALTHY_WITHIN);
        Setup {
            lab,
            family,
            a1,
            b1,
            _servers: servers,
            lbs,
        }
    }

    fn node_a(&self) -> IpAddr {
        node_addr(&self.lab, NodeId::A, self.family)
    }

    /// A client's address in the setup's family.
    fn client_ip(&self, c: &lbproxy_tests::lab::multinode::Client) -> IpAddr {
        client_addr(c, self.family)
    }

    fn logs(&self) -> String {
        lab_logs(
            &self.lab,
            &self.lbs,
            &["status", "delivery", "flows", "drops"],
        )
    }

    /// nodeA's XDP delivery counters.
    fn xdp_counts(&self) -> BTreeMap<String, u64> {
        self.lab
            .node(NodeId::A)
            .inspect_delivery()
            .packets
            .into_iter()
            .filter(|(k, _)| k.starts_with("xdp_"))
            .collect()
    }

    /// TCP: connections through nodeA's NodePort until both backends answered one; on
    /// each, [`REQUESTS`] requests. Returns backend -> the client address it saw.
    fn tcp_through_node_a(&self, client: &str) -> BTreeMap<String, String> {
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for i in 0..40 {
            if seen.len() == 2 {
                break;
            }
            let mut c = TcpConn::connect(client, self.node_a(), NODE_PORT_TCP, TIMEOUT)
                .unwrap_or_else(|e| panic!("TCP connection #{i}: {e}\n{}", self.logs()));
            assert_eq!(
                c.peer.ip(),
                self.node_a(),
                "the client's socket sees the NodePort"
            );
            let mut backend = None;
            for j in 0..REQUESTS {
                let r = c.request().unwrap_or_else(|e| {
                    panic!("TCP connection #{i}, request #{j}: {e}\n{}", self.logs())
                });
                if let Some(b) = &backend {
                    assert_eq!(b, &r.backend, "one connection, one backend");
                }
                backend = Some(r.backend.clone());
                seen.insert(r.backend, ip_of(&r.client_seen));
            }
        }
        seen
    }

    /// UDP: flows from fixed source ports through nodeA's NodePort until both backends
    /// answered one; each flow [`REQUESTS`] datagrams from its port. Returns backend -> the
    /// client address it saw.
    fn udp_through_node_a(&self, client: &str) -> BTreeMap<String, String> {
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for port in 41_000..41_040u16 {
            if seen.len() == 2 {
                break;
            }
            for j in 0..REQUESTS {
                let (r, from) =
                    udp_request(client, self.node_a(), NODE_PORT_UDP, TIMEOUT, Some(port))
                        .unwrap_or_else(|e| {
                            panic!("UDP from port {port}, datagram #{j}: {e}\n{}", self.logs())
                        });
                assert_eq!(
                    from.ip(),
                    self.node_a(),
                    "the answer comes from the NodePort"
                );
                seen.insert(r.backend, ip_of(&r.client_seen));
            }
        }
        seen
    }
}

/// The XDP program on `ifname` of `node`, as the kernel lists it: `Some("xdp")` in driver
/// mode, `Some("xdpgeneric")` in generic mode, `None` without one.
fn kernel_xdp(lab: &MultiNodeLab, node: NodeId, ifname: &str) -> Option<String> {
    let out = lab
        .node_run(node, &["ip", "-d", "link", "show", "dev", ifname])
        .unwrap_or_else(|e| panic!("ip link show {ifname} on {node}: {e}"));
    // "... mtu 1500 xdp qdisc ..." on the first line, and "prog/xdp id N" below.
    let first = out.lines().next().unwrap_or_default();
    let mode = first
        .split_whitespace()
        .find(|w| w.starts_with("xdp"))
        .map(str::to_string);
    assert_eq!(
        mode.is_some(),
        out.contains("prog/xdp"),
        "ip link's two signs of XDP disagree:\n{out}"
    );
    mode
}

/// `inspect status --json`'s `xdp` for interface `ifname` of `node`.
fn inspect_xdp(lab: &MultiNodeLab, node: NodeId, ifname: &str) -> String {
    let st = lab.node(node).inspect_json("status");
    st["interfaces"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["name"] == ifname))
        .and_then(|i| i["xdp"].as_str())
        .unwrap_or_else(|| panic!("{node}: no interface {ifname} in inspect status: {st:#}"))
        .to_string()
}

fn native_serves(family: Family) {
    let s = Setup::new(family, &["--xdp-acceleration", "native"]);
    for node in NodeId::ALL {
        assert_eq!(
            kernel_xdp(&s.lab, node, "eth0").as_deref(),
            Some("xdp"),
            "{node}: lb_xdp in driver mode on eth0\n{}",
            s.logs()
        );
        assert_eq!(inspect_xdp(&s.lab, node, "eth0"), "native");
    }
    let client = s.lab.add_client("ext");
    let me = s.client_ip(&client).to_string();
    let node_a = s.node_a().to_string();
    let before = s.xdp_counts();
    if let Ok(secs) = std::env::var("XDP_DEBUG_SLEEP") {
        eprintln!("DEBUG lab {} client {}", s.lab.id(), client.netns);
        std::thread::sleep(std::time::Duration::from_secs(secs.parse().unwrap()));
    }
    let want: BTreeMap<String, String> = [
        (s.a1.name.clone(), me.clone()),
        (s.b1.name.clone(), node_a.clone()),
    ]
    .into_iter()
    .collect();
    let tcp = s.tcp_through_node_a(&client.netns);
    assert_eq!(
        tcp,
        want,
        "TCP: a1 sees the client, b1 nodeA (SNAT)\n{}",
        s.logs()
    );
    let udp = s.udp_through_node_a(&client.netns);
    assert_eq!(
        udp,
        want,
        "UDP: a1 sees the client, b1 nodeA (SNAT)\n{}",
        s.logs()
    );
    let after = s.xdp_counts();
    // Each connection's requests after the handshake and each flow's datagrams after the
    // first: at least REQUESTS - 1 each way per backend and protocol.
    let grew = |k: &str| after.get(k).unwrap_or(&0) - before.get(k).unwrap_or(&0);
    let min = 2 * (REQUESTS as u64 - 1);
    for k in ["xdp_to_backend", "xdp_to_client", "xdp_to_local_backend"] {
        assert!(
            grew(k) >= min,
            "{k}: {} packets at XDP (want >= {min}); before {before:?}, after {after:?}\n{}",
            grew(k),
            s.logs()
        );
    }
}

#[test]
fn native_serves_node_ports_at_xdp() {
    native_serves(Family::V4);
}

#[test]
fn native_serves_node_ports_at_xdp_ipv6() {
    native_serves(Family::V6);
}

#[test]
fn disabled_attaches_nothing_and_cleanup_detaches() {
    let mut s = Setup::new(Family::V4, &["--xdp-acceleration", "disabled"]);
    for node in NodeId::ALL {
        assert_eq!(kernel_xdp(&s.lab, node, "eth0"), None, "{node}: disabled");
        assert_eq!(inspect_xdp(&s.lab, node, "eth0"), "none");
    }
    let client = s.lab.add_client("ext");
    let tcp = s.tcp_through_node_a(&client.netns);
    assert_eq!(tcp.len(), 2, "both backends answer: {tcp:?}\n{}", s.logs());
    let counts = s.xdp_counts();
    assert!(
        counts.values().all(|n| *n == 0),
        "nothing at XDP while disabled: {counts:?}"
    );

    // nodeA restarted with native: attached; restarted with disabled: detached.
    for (value, want) in [("native", Some("xdp")), ("disabled", None)] {
        s.lbs[0].kill();
        s.lbs[0] = s
            .lab
            .start_lbproxy(NodeId::A, &["--xdp-acceleration", value]);
        s.lbs[0].expect_healthy(HEALTHY_WITHIN);
        assert_eq!(
            kernel_xdp(&s.lab, NodeId::A, "eth0").as_deref(),
            want,
            "nodeA restarted with {value}\n{}",
            s.logs()
        );
        let tcp = s.tcp_through_node_a(&client.netns);
        assert_eq!(tcp.len(), 2, "{value}: both backends answer: {tcp:?}");
    }

    // native again, then cleanup: no XDP program is left.
    s.lbs[0].kill();
    s.lbs[0] = s
        .lab
        .start_lbproxy(NodeId::A, &["--xdp-acceleration", "native"]);
    s.lbs[0].expect_healthy(HEALTHY_WITHIN);
    assert_eq!(
        kernel_xdp(&s.lab, NodeId::A, "eth0").as_deref(),
        Some("xdp")
    );
    s.lbs[0].kill();
    let node = s.lab.node(NodeId::A);
    let dir = node.bpffs_dir.display().to_string();
    let out = node.lbproxy_cmd(&["cleanup", "--bpffs-dir", &dir]);
    assert!(
        out.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        kernel_xdp(&s.lab, NodeId::A, "eth0"),
        None,
        "cleanup detached lb_xdp"
    );
}

#[test]
fn an_interface_without_xdp() {
    let lab = MultiNodeLab::new();
    lab.enable_xdp_tx();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest_text(&web_manifest(&[(a1.ip, Some("nodeA"))], "Cluster", ""));
    // A node interface whose driver has no native XDP: an ifb (the kernel here has no dummy) with an address.
    for argv in [
        &["ip", "link", "add", "dummy0", "type", "ifb"][..],
        &["ip", "addr", "add", "198.18.90.1/32", "dev", "dummy0"],
        &["ip", "link", "set", "dummy0", "up"],
    ] {
        lab.node_run(NodeId::A, argv).unwrap();
    }

    let mut native = lab.start_lbproxy(NodeId::A, &["--xdp-acceleration", "native"]);
    let status = native.wait_exit(HEALTHY_WITHIN);
    let log = native.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "native with an interface without XDP: still running or exited 0 ({status:?})\n{log}"
    );
    assert!(
        log.contains("xdpAcceleration native") && log.contains("dummy0"),
        "the error names the setting and the interface:\n{log}"
    );

    let mut lb = lab.start_lbproxy(NodeId::A, &["--xdp-acceleration", "best-effort"]);
    lb.expect_healthy(HEALTHY_WITHIN);
    assert_eq!(kernel_xdp(&lab, NodeId::A, "eth0").as_deref(), Some("xdp"));
    assert_eq!(kernel_xdp(&lab, NodeId::A, "dummy0"), None);
    assert_eq!(inspect_xdp(&lab, NodeId::A, "eth0"), "native");
    assert_eq!(inspect_xdp(&lab, NodeId::A, "dummy0"), "none");
    let log = lb.log();
    assert!(
        log.contains("XDP refused") && log.contains("dummy0"),
        "best-effort says which interface keeps TC alone:\n{log}"
    );
    // Served all the same, through the uplink.
    let client = lab.add_client("ext");
    let (r, _) = lbproxy_tests::lab::tcp_request(
        &client.netns,
        lab.node(NodeId::A).ip,
        NODE_PORT_TCP,
        TIMEOUT,
    )
    .unwrap_or_else(|e| panic!("NodePort with best-effort: {e}\n{}", lb.log()));
    assert_eq!(r.backend, "a1");
}
