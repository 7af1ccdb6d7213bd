//! A two-node lab: nodes "nodeA" and "nodeB" on one L2 fabric, routed (Calico-like) pods on
//! each, and external clients on the fabric. Everything is created by the lab and removed on
//! drop, even when the test panics.
//!
//! ```text
//!   pod ns "lbt-<id>-pod-<name>"     node ns "lbt-<id>-nodeA"        fabric ns "lbt-<id>-fab"
//!   eth0 198.18.1.<2+i>/32 ── veth ── lxc<i>   eth0 198.18.80.1/24 ── veth ── nA ─┐
//!                                                                                 ├ fab0 (bridge)
//!   pod ns                            node ns "lbt-<id>-nodeB"                    │
//!   eth0 198.18.2.<2+i>/32 ── veth ── lxc<i>   eth0 198.18.80.2/24 ── veth ── nB ─┤
//!                                                                                 │
//!   client ns "lbt-<id>-client-<name>"  eth0 198.18.80.<100+i>/24 ── veth ── c<i> ┘
//! ```
//!
//! * All addresses are in 198.18.0.0/15: node A's pods in 198.18.1.0/24, node B's in
//!   198.18.2.0/24, the fabric in 198.18.80.0/24 ([`NODEPORT_ADDRESSES`]), service VIPs,
//!   ExternalIPs and LB IPs in 198.19.0.0/16 ([`super::vip`]). Nothing in the root namespace
//!   is touched.
//! * Pods are exactly [`super::Shape::Routed`] pods: a /32 on eth0, default via 169.254.1.1
//!   (answered by proxy ARP with `proxy_delay=0` on the host side), a /32 route in the node
//!   namespace. Host-side interfaces are `lxc<index>` (per node), so [`POD_IF_GLOB`] (`lxc*`)
//!   matches exactly them; the node's `eth0` never matches it.
//! * Each node has `lo` up, `ip_forward=1`, `send_redirects=0` (all, default and eth0),
//!   `rp_filter=0` (all, default and eth0), `default dev eth0` (proxy ARP needs a default
//!   route) and a route to the other node's pod CIDR via the other node's fabric address.
//! * Everything is dual-stack: node A's pods also get `fd00:c612:1::<2+i>/128` (node B's
//!   `fd00:c612:2::`), routed as the single-node routed shape's (default via `fe80::1` on
//!   the host side, a /128 route in the node namespace); the fabric is `fd00:c612:80::/64`
//!   (nodes `::1` and `::2`, clients `::<100+i>`), each node routes the other's pod /64 via
//!   the other's fabric address, and duplicate address detection is off everywhere.
//! * Clients have only the fabric's /24 (and /64): give them routes with [`Client::route_via`] (e.g.
//!   `198.19.0.0/16` through a node, for ExternalIPs and LB IPs) or [`Client::route_to_pods`].
//!
//! Typical use:
//! ```no_run
//! use std::time::Duration;
//! use lbproxy_tests::lab::{vip, manifest::*};
//! use lbproxy_tests::lab::multinode::{MultiNodeLab, NodeId};
//! let lab = MultiNodeLab::new();
//! let b1 = lab.add_pod(NodeId::A, "b1");
//! let client = lab.add_pod(NodeId::B, "client");
//! let _srv = b1.serve(&[8080]);
//! lab.write_manifest(
//!     &Manifest::new()
//!         .with(Service::cluster_ip("web", vip(10)).port("http", 80, Protocol::Tcp, 8080))
//!         .with(EndpointSlice::new("web-1", "web").port("http", 8080, Protocol::Tcp)
//!             .endpoint(lab.endpoint(&b1))),
//! );
//! let mut lb_a = lab.start_lbproxy(NodeId::A, &[]);
//! let mut lb_b = lab.start_lbproxy(NodeId::B, &[]);
//! lb_a.expect_healthy(Duration::from_secs(10));
//! lb_b.expect_healthy(Duration::from_secs(10));
//! let (reply, _peer) = client.tcp_request(vip(10), 80, Duration::from_secs(1)).unwrap();
//! assert_eq!(reply.backend, "b1");
//! ```
//!
//! Drop order: drop [`super::Backend`]s and [`Lbproxy`] handles before the lab (declare the
//! lab first). Dropping the lab SIGKILLs every lbproxy it started that is still running
//! (through a pidfd, so never another process), runs `lbproxy cleanup --bpffs-dir DIR` in
//! each node where lbproxy was started, removes the bpffs dirs, deletes every interface and
//! namespace, and removes the work dir (kept, and its path printed, if the thread panics).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::cgroup::{CgroupGroup, HostClient, Requests};
use super::inspect::Inspect;
use super::lbproxy::{
    HEALTHZ_ADDR, Lbproxy, METRICS_ADDR, lbproxy_bin_if_present, run_lbproxy_cmd,
};
use super::manifest::{Endpoint, Manifest, write_atomic};
use super::ns::{ns_command, ns_run, run_in_ns};
use super::{
    COUNTER, Pod, ROUTED_GATEWAY, ROUTED_GATEWAY6, SWEEP, ip_batch, netns_add, netns_del,
    netns_del_quiet, quiet_ip, sweep_stale, sysctl, take_lock, wait_lower_up,
};

/// The bridge in the fabric namespace that every node and client is plugged into.
pub const FABRIC_BRIDGE: &str = "fab0";
/// The fabric subnet, passed to lbproxy as `--nodeport-addresses`.
pub const NODEPORT_ADDRESSES: &str = "198.18.80.0/24";
/// Prefix length of every fabric address.
pub const FABRIC_PREFIX_LEN: u8 = 24;
/// The `--pod-interfaces` glob: host-side pod interfaces are `lxc<index>`.
pub const POD_IF_GLOB: &str = "lxc*";
/// The node's interface on the fabric (inside the node namespace).
pub const NODE_IF: &str = "eth0";
/// The first client's fabric address; client `i` gets 198.18.80.`100+i`.
pub const FIRST_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 80, 100);

/// One of the two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeId {
    A,
    B,
}

impl NodeId {
    pub const ALL: [NodeId; 2] = [NodeId::A, NodeId::B];

    /// `nodeA` or `nodeB`: the node's Kubernetes name (`--hostname-override`, `nodeName`).
    pub fn name(self) -> &'static str {
        match self {
            NodeId::A => "nodeA",
            NodeId::B => "nodeB",
        }
    }

    /// The other node.
    pub fn other(self) -> NodeId {
        match self {
            NodeId::A => NodeId::B,
            NodeId::B => NodeId::A,
        }
    }

    /// The node's eth0 address on the fabric: 198.18.80.1 (A) or .2 (B).
    pub fn fabric_ip(self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 80, self.octet())
    }

    /// The node's eth0 IPv6 address on the fabric: `fd00:c612:80::1` (A) or `::2` (B).
    pub fn fabric_ip6(self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, u16::from(self.octet()))
    }

    /// The node's IPv6 pod CIDR: `fd00:c612:1::/64` (A) or `fd00:c612:2::/64` (B).
    pub fn pod_cidr6(self) -> String {
        format!("fd00:c612:{}::/64", self.octet())
    }

    /// The IPv6 address pod `index` of this node gets: `fd00:c612:1::<2+index>` (A),
    /// `fd00:c612:2::<2+index>` (B).
    pub fn pod_ip6(self, index: u32) -> Ipv6Addr {
        Ipv6Addr::new(
            0xfd00,
            0xc612,
            u16::from(self.octet()),
            0,
            0,
            0,
            0,
            2 + index as u16,
        )
    }

    /// The node's pod CIDR: `198.18.1.0/24` (A) or `198.18.2.0/24` (B).
    pub fn pod_cidr(self) -> String {
        format!("198.18.{}.0/24", self.octet())
    }

    /// The address pod `index` of this node gets: 198.18.1.`2+index` (A), 198.18.2.`2+index`
    /// (B).
    pub fn pod_ip(self, index: u32) -> Ipv4Addr {
        assert!(index <= 252, "multinode lab: too many pods (index {index})");
        Ipv4Addr::new(198, 18, self.octet(), 2 + index as u8)
    }

    fn octet(self) -> u8 {
        match self {
            NodeId::A => 1,
            NodeId::B => 2,
        }
    }

    /// `a` or `b`, for per-node file and dir names.
    fn suffix(self) -> &'static str {
        match self {
            NodeId::A => "a",
            NodeId::B => "b",
        }
    }

    /// The node's port on the fabric bridge (in the fabric namespace).
    fn fabric_port(self) -> &'static str {
        match self {
            NodeId::A => "nA",
            NodeId::B => "nB",
        }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A node: a network namespace with `eth0` on the fabric and its pods' host sides.
#[derive(Clone, Debug)]
pub struct Node {
    pub id: NodeId,
    /// `nodeA` or `nodeB`.
    pub name: &'static str,
    /// Network namespace name (under /run/netns).
    pub netns: String,
    /// eth0's fabric address.
    pub ip: Ipv4Addr,
    /// eth0's IPv6 fabric address.
    pub ip6: Ipv6Addr,
    /// The node's pod CIDR (`198.18.1.0/24` or `198.18.2.0/24`).
    pub pod_cidr: String,
    /// This node's lbproxy bpffs dir, `/sys/fs/bpf/lbproxy-test-<id>-<a|b>` (not created by
    /// the lab).
    pub bpffs_dir: PathBuf,
}

impl Inspect for Node {
    fn lbproxy_cmd(&self, args: &[&str]) -> std::process::Output {
        run_lbproxy_cmd(&self.netns, args)
    }

    fn bpffs_dir(&self) -> &Path {
        &self.bpffs_dir
    }
}

/// An external client: a namespace whose `eth0` (a /24 on the fabric) is plugged into
/// [`FABRIC_BRIDGE`]. It has no routes beyond the fabric until given some.
#[derive(Clone, Debug)]
pub struct Client {
    /// Name given to [`MultiNodeLab::add_client`].
    pub name: String,
    /// Network namespace name (under /run/netns).
    pub netns: String,
    /// 198.18.80.`100+index`.
    pub ip: Ipv4Addr,
    /// `fd00:c612:80::<100+index>`.
    pub ip6: Ipv6Addr,
    /// Index among the lab's clients (its fabric port is `c<index>`).
    pub index: u32,
}

impl Client {
    /// Routes `cidr` (e.g. `198.19.0.0/16`, or one address) through `node`'s fabric address
    /// (`ip route replace`, so calling it again moves the route to another node). Panics on
    /// failure.
    pub fn route_via(&self, cidr: &str, node: &Node) {
        ip_batch(
            &self.netns,
            &[format!("route replace {cidr} via {} dev eth0", node.ip)],
        );
    }

    /// [`Client::route_via`] for an IPv6 `cidr`, through `node`'s IPv6 fabric address.
    pub fn route_via6(&self, cidr: &str, node: &Node) {
        ip_batch(
            &self.netns,
            &[format!("route replace {cidr} via {} dev eth0", node.ip6)],
        );
    }

    /// Routes `node`'s pod CIDR through `node`, so this client reaches its pods directly.
    pub fn route_to_pods(&self, node: &Node) {
        self.route_via(&node.pod_cidr, node);
    }

    super::client::netns_client!("client");
}

#[derive(Default)]
struct State {
    /// Pods by name (names are unique across both nodes), with the node each is on.
    pods: BTreeMap<String, (NodeId, Pod)>,
    next_pod_index: BTreeMap<NodeId, u32>,
    clients: BTreeMap<String, Client>,
    next_client_index: u32,
    lbproxy_starts: u32,
    /// Nodes where lbproxy was ever started.
    lbproxy_used: BTreeSet<NodeId>,
    /// pidfds of every lbproxy started, to kill them on drop without risking a reused pid.
    lbproxy_pidfds: Vec<OwnedFd>,
    /// Links of the XDP pass programs on the fabric ports ([`MultiNodeLab::enable_xdp_tx`]).
    xdp_links: Vec<OwnedFd>,
}

/// See the [module docs](self).
pub struct MultiNodeLab {
    id: String,
    fabric: String,
    nodes: [Node; 2],
    workdir: PathBuf,
    state: Mutex<State>,
    /// The cgroup2 group the nodes' lbproxies attach to (`--cgroup-root`) and host clients
    /// run in; made at the end of setup.
    cgroup: std::sync::OnceLock<CgroupGroup>,
}

impl Default for MultiNodeLab {
    fn default() -> Self {
        MultiNodeLab::new()
    }
}

impl MultiNodeLab {
    /// Builds the fabric and both nodes (no pods, no clients). Panics with the reason if it
    /// cannot, e.g. without root; whatever was created by then is removed.
    pub fn new() -> MultiNodeLab {
        SWEEP.call_once(|| {
            sweep_stale();
            take_lock();
        });
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let id = format!("{}-{n}", std::process::id());
        let node = |nid: NodeId| Node {
            id: nid,
            name: nid.name(),
            netns: format!("lbt-{id}-{}", nid.name()),
            ip: nid.fabric_ip(),
            ip6: nid.fabric_ip6(),
            pod_cidr: nid.pod_cidr(),
            bpffs_dir: PathBuf::from(format!("/sys/fs/bpf/lbproxy-test-{id}-{}", nid.suffix())),
        };
        let lab = MultiNodeLab {
            fabric: format!("lbt-{id}-fab"),
            nodes: [node(NodeId::A), node(NodeId::B)],
            workdir: std::env::temp_dir().join(format!("lbt-{id}")),
            state: Mutex::new(State::default()),
            cgroup: std::sync::OnceLock::new(),
            id,
        };
        // From here on a panic drops `lab`, which removes whatever was created.
        lab.setup();
        lab
    }

    fn setup(&self) {
        let _ = std::fs::remove_dir_all(&self.workdir);
        for d in ["manifests", "tmp", "logs"] {
            std::fs::create_dir_all(self.workdir.join(d)).unwrap_or_else(|e| {
                panic!("multinode lab: create {}: {e}", self.workdir.display())
            });
        }
        let fab = &self.fabric;
        netns_add(fab);
        ip_batch(
            fab,
            &[
                "link set lo up".into(),
                // No STP: ports forward as soon as they have carrier.
                format!("link add {FABRIC_BRIDGE} type bridge stp_state 0"),
                format!("link set {FABRIC_BRIDGE} up"),
            ],
        );
        // A plain L2 switch: keep bridged frames out of the fabric's netfilter (the key
        // exists only when br_netfilter is loaded).
        let key = "net/bridge/bridge-nf-call-iptables";
        if run_in_ns(fab, || Path::new("/proc/sys").join(key).exists()) {
            sysctl(fab, key, "0");
        }
        for node in &self.nodes {
            let ns = &node.netns;
            netns_add(ns);
            ip_batch(ns, &["link set lo up".into()]);
            sysctl(ns, "net/ipv4/ip_forward", "1");
            sysctl(ns, "net/ipv6/conf/default/accept_dad", "0");
            sysctl(ns, "net/ipv6/conf/all/accept_dad", "0");
            sysctl(ns, "net/ipv6/conf/all/forwarding", "1");
            // `default` first, so interfaces created later (eth0, lxc*) inherit it.
            // send_redirects is ORed (all || dev) and rp_filter is max(all, dev): set both.
            for conf in ["default", "all"] {
                sysctl(ns, &format!("net/ipv4/conf/{conf}/send_redirects"), "0");
                sysctl(ns, &format!("net/ipv4/conf/{conf}/rp_filter"), "0");
            }
            let port = node.id.fabric_port();
            ip_batch(
                ns,
                &[format!(
                    "link add {NODE_IF} type veth peer name {port} netns {fab}"
                )],
            );
            sysctl(ns, &format!("net/ipv4/conf/{NODE_IF}/send_redirects"), "0");
            sysctl(ns, &format!("net/ipv4/conf/{NODE_IF}/rp_filter"), "0");
            let other = node.id.other();
            ip_batch(
                ns,
                &[
                    format!("addr add {}/{FABRIC_PREFIX_LEN} dev {NODE_IF}", node.ip),
                    format!("link set {NODE_IF} up"),
                    // Proxy ARP for the pods' gateway needs a route to it off the pod's link.
                    format!("route add default dev {NODE_IF}"),
                    format!(
                        "route add {} via {} dev {NODE_IF}",
                        other.pod_cidr(),
                        other.fabric_ip()
                    ),
                    format!("addr add {}/64 dev {NODE_IF} nodad", node.ip6),
                    format!(
                        "route add {} via {} dev {NODE_IF}",
                        other.pod_cidr6(),
                        other.fabric_ip6()
                    ),
                ],
            );
            ip_batch(fab, &[format!("link set {port} master {FABRIC_BRIDGE} up")]);
        }
        for node in &self.nodes {
            wait_lower_up(&node.netns, NODE_IF);
            wait_lower_up(fab, node.id.fabric_port());
        }
        let _ = self.cgroup.set(CgroupGroup::new(&self.id));
    }

    /// Makes the fabric's side of both nodes' uplinks behave as a wire does under XDP
    /// (lbproxy's `--xdp-acceleration`): an XDP pass program on it, so that it takes the
    /// frames a node sends back out with `XDP_TX` ([`super::net::attach_xdp_pass`], kept
    /// while the lab lives), and checksum offload off, so that every frame a node receives
    /// carries a complete checksum ([`super::net::tx_checksum_off`]).
    pub fn enable_xdp_tx(&self) {
        for node in NodeId::ALL {
            let port = node.fabric_port();
            super::net::tx_checksum_off(&self.fabric, port)
                .unwrap_or_else(|e| panic!("lab: the fabric port of {node}: {e}"));
            let link = super::net::attach_xdp_pass(&self.fabric, port)
                .unwrap_or_else(|e| panic!("lab: the fabric port of {node}: {e}"));
            self.state.lock().unwrap().xdp_links.push(link);
        }
    }

    /// The cgroup2 group given to every lbproxy of the lab as `--cgroup-root`.
    pub fn cgroup(&self) -> &Path {
        self.cgroup.get().expect("set up with the lab").path()
    }

    /// A client process of `node`'s own network namespace, in the lab's cgroup (so lbproxy's
    /// socket-level programs see it), making `req`.
    pub fn host_client(&self, node: NodeId, req: &Requests) -> HostClient {
        HostClient::spawn(&self.node(node).netns, Some(self.cgroup()), req)
    }

    /// `<pid>-<counter>`, unique per lab on this machine.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The fabric namespace's name (holds [`FABRIC_BRIDGE`]).
    pub fn fabric_ns(&self) -> &str {
        &self.fabric
    }

    /// Node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Both nodes, A first.
    pub fn nodes(&self) -> &[Node; 2] {
        &self.nodes
    }

    /// Node `id`'s namespace name.
    pub fn node_ns(&self, id: NodeId) -> &str {
        &self.node(id).netns
    }

    /// The lab's work dir (manifests, logs), under the system temp dir.
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// The manifest file both nodes' lbproxy read, `<workdir>/manifests/cluster.yaml`.
    pub fn manifest_path(&self) -> PathBuf {
        self.workdir.join("manifests").join("cluster.yaml")
    }

    /// Atomically (re)writes [`Self::manifest_path`] with `m`.
    pub fn write_manifest(&self, m: &Manifest) {
        self.write_manifest_text(&m.to_yaml());
    }

    /// Atomically (re)writes [`Self::manifest_path`] with raw text.
    pub fn write_manifest_text(&self, text: &str) {
        let path = self.manifest_path();
        write_atomic(&path, text, Some(&self.workdir.join("tmp")))
            .unwrap_or_else(|e| panic!("multinode lab: write {}: {e}", path.display()));
    }

    /// Adds a routed pod named `name` (`[a-z0-9-]`, unique across both nodes) on `node`; it
    /// is reachable as soon as this returns. Its host side is `lxc<index>` in the node
    /// namespace, its address [`NodeId::pod_ip`]`(index)`, `index` counting per node.
    pub fn add_pod(&self, node: NodeId, name: &str) -> Pod {
        assert!(
            !name.is_empty()
                && name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "multinode lab: bad pod name {name:?}"
        );
        let pod = {
            let mut st = self.state.lock().unwrap();
            assert!(
                !st.pods.contains_key(name) && !st.clients.contains_key(name),
                "multinode lab: pod or client {name} already exists"
            );
            let next = st.next_pod_index.entry(node).or_insert(0);
            let index = *next;
            *next += 1;
            let pod = Pod {
                name: name.to_owned(),
                netns: format!("lbt-{}-pod-{name}", self.id),
                ip: node.pod_ip(index),
                ip6: Some(node.pod_ip6(index)),
                host_if: format!("lxc{index}"),
                index,
            };
            // Registered before it exists, so a panic below still removes it on drop.
            st.pods.insert(name.to_owned(), (node, pod.clone()));
            pod
        };
        let (ns, host, ip) = (&self.node(node).netns, &pod.host_if, pod.ip);
        let ip6 = node.pod_ip6(pod.index);
        netns_add(&pod.netns);
        sysctl(&pod.netns, "net/ipv6/conf/default/accept_dad", "0");
        sysctl(&pod.netns, "net/ipv6/conf/all/accept_dad", "0");
        ip_batch(
            ns,
            &[format!(
                "link add {host} type veth peer name eth0 netns {}",
                pod.netns
            )],
        );
        ip_batch(
            &pod.netns,
            &[
                "link set lo up".into(),
                format!("addr add {ip}/32 dev eth0"),
                format!("addr add {ip6}/128 dev eth0 nodad"),
                "link set eth0 up".into(),
                format!("route add {ROUTED_GATEWAY} dev eth0 scope link"),
                format!("route add default via {ROUTED_GATEWAY} dev eth0"),
                format!("route add ::/0 via {ROUTED_GATEWAY6} dev eth0"),
            ],
        );
        sysctl(ns, &format!("net/ipv4/conf/{host}/proxy_arp"), "1");
        // Answer proxy ARP at once rather than after up to 0.8 s (as Calico does).
        sysctl(ns, &format!("net/ipv4/neigh/{host}/proxy_delay"), "0");
        ip_batch(
            ns,
            &[
                format!("addr add {ROUTED_GATEWAY6}/64 dev {host} nodad"),
                format!("link set {host} up"),
                format!("route add {ip}/32 dev {host}"),
                format!("route add {ip6}/128 dev {host}"),
            ],
        );
        // A packet sent before both ends have carrier is lost (and a lost SYN is retried
        // only after 1 s): wait, so the pod really is reachable when this returns.
        wait_lower_up(ns, host);
        wait_lower_up(&pod.netns, "eth0");
        pod
    }

    /// Removes pod `name` (its veth, at once, and its namespace). Panics if there is none.
    pub fn remove_pod(&self, name: &str) {
        let (node, pod) = self
            .state
            .lock()
            .unwrap()
            .pods
            .remove(name)
            .unwrap_or_else(|| panic!("multinode lab: no pod {name}"));
        ip_batch(
            &self.node(node).netns,
            &[format!("link del {}", pod.host_if)],
        );
        netns_del(&pod.netns);
    }

    /// The pod named `name`. Panics if there is none.
    pub fn pod(&self, name: &str) -> Pod {
        self.state
            .lock()
            .unwrap()
            .pods
            .get(name)
            .map(|(_, p)| p.clone())
            .unwrap_or_else(|| panic!("multinode lab: no pod {name}"))
    }

    /// The node pod `name` is on. Panics if there is no such pod.
    pub fn node_of(&self, pod: &str) -> NodeId {
        self.state
            .lock()
            .unwrap()
            .pods
            .get(pod)
            .map(|(n, _)| *n)
            .unwrap_or_else(|| panic!("multinode lab: no pod {pod}"))
    }

    /// The pods on `node`, by name.
    pub fn pods(&self, node: NodeId) -> Vec<Pod> {
        self.state
            .lock()
            .unwrap()
            .pods
            .values()
            .filter(|(n, _)| *n == node)
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// A ready endpoint for `pod`: its address, `nodeName` the node it is on, and a
    /// `targetRef` to it.
    pub fn endpoint(&self, pod: &Pod) -> Endpoint {
        let node = self.node_of(&pod.name);
        Endpoint::ready(pod.ip)
            .node(Some(node.name()))
            .pod(&pod.name)
    }

    /// Adds an external client named `name` (`[a-z0-9-]`, unique in the lab) on the fabric,
    /// at 198.18.80.`100+index`; reachable from the nodes as soon as this returns. It has no
    /// routes beyond the fabric: see [`Client::route_via`].
    pub fn add_client(&self, name: &str) -> Client {
        assert!(
            !name.is_empty()
                && name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "multinode lab: bad client name {name:?}"
        );
        let client = {
            let mut st = self.state.lock().unwrap();
            assert!(
                !st.pods.contains_key(name) && !st.clients.contains_key(name),
                "multinode lab: pod or client {name} already exists"
            );
            let index = st.next_client_index;
            assert!(index < 150, "multinode lab: too many clients");
            st.next_client_index += 1;
            let [a, b, c, d] = FIRST_CLIENT_IP.octets();
            let client = Client {
                name: name.to_owned(),
                netns: format!("lbt-{}-client-{name}", self.id),
                ip: Ipv4Addr::new(a, b, c, d + index as u8),
                ip6: Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, 100 + index as u16),
                index,
            };
            st.clients.insert(name.to_owned(), client.clone());
            client
        };
        let port = format!("c{}", client.index);
        netns_add(&client.netns);
        sysctl(&client.netns, "net/ipv6/conf/default/accept_dad", "0");
        sysctl(&client.netns, "net/ipv6/conf/all/accept_dad", "0");
        ip_batch(
            &client.netns,
            &[format!(
                "link add eth0 type veth peer name {port} netns {}",
                self.fabric
            )],
        );
        ip_batch(
            &client.netns,
            &[
                "link set lo up".into(),
                format!("addr add {}/{FABRIC_PREFIX_LEN} dev eth0", client.ip),
                format!("addr add {}/64 dev eth0 nodad", client.ip6),
                "link set eth0 up".into(),
            ],
        );
        ip_batch(
            &self.fabric,
            &[format!("link set {port} master {FABRIC_BRIDGE} up")],
        );
        wait_lower_up(&client.netns, "eth0");
        wait_lower_up(&self.fabric, &port);
        client
    }

    /// The client named `name`. Panics if there is none.
    pub fn client(&self, name: &str) -> Client {
        self.state
            .lock()
            .unwrap()
            .clients
            .get(name)
            .cloned()
            .unwrap_or_else(|| panic!("multinode lab: no client {name}"))
    }

    /// The `lbproxy` arguments [`Self::start_lbproxy`] uses for `node`, `extra` appended:
    ///
    /// `run --manifests FILE --pod-interfaces lxc* --hostname-override nodeA
    /// --nodeport-addresses 198.18.80.0/24 --cgroup-root CGROUP --bpffs-dir DIR --healthz-bind-address
    /// 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 EXTRA...`
    pub fn lbproxy_run_args(&self, node: NodeId, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "run".into(),
            "--manifests".into(),
            self.manifest_path().display().to_string(),
            "--pod-interfaces".into(),
            POD_IF_GLOB.into(),
            "--hostname-override".into(),
            node.name().into(),
            "--nodeport-addresses".into(),
            NODEPORT_ADDRESSES.into(),
            "--cgroup-root".into(),
            self.cgroup().display().to_string(),
            "--bpffs-dir".into(),
            self.node(node).bpffs_dir.display().to_string(),
            "--healthz-bind-address".into(),
            HEALTHZ_ADDR.into(),
            "--metrics-bind-address".into(),
            METRICS_ADDR.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Starts the real `lbproxy` with [`Self::lbproxy_run_args`] inside `node`'s namespace.
    /// Logs go to `<workdir>/logs/lbproxy-<node>-<k>.{stdout,stderr}`. Does not wait for it
    /// to become healthy (see [`Lbproxy::wait_healthy`]).
    pub fn start_lbproxy(&self, node: NodeId, extra: &[&str]) -> Lbproxy {
        self.start_lbproxy_argv(node, self.lbproxy_run_args(node, extra), &[])
    }

    /// [`Self::start_lbproxy`] on both nodes, A first, each waited for until healthy (up to
    /// `healthy_within`).
    pub fn start_lbproxy_on_both(&self, extra: &[&str], healthy_within: Duration) -> Vec<Lbproxy> {
        NodeId::ALL
            .iter()
            .map(|&node| {
                let mut lb = self.start_lbproxy(node, extra);
                lb.expect_healthy(healthy_within);
                lb
            })
            .collect()
    }

    /// Starts `lbproxy ARGS` (exactly `args`) inside `node`'s namespace with extra
    /// environment variables `env`; the lab kills it and cleans up `node`'s bpffs dir on
    /// drop as for [`Self::start_lbproxy`].
    pub fn start_lbproxy_argv(
        &self,
        node: NodeId,
        args: Vec<String>,
        env: &[(&str, &str)],
    ) -> Lbproxy {
        let k = {
            let mut st = self.state.lock().unwrap();
            st.lbproxy_used.insert(node);
            st.lbproxy_starts += 1;
            st.lbproxy_starts
        };
        let lb = Lbproxy::spawn_env(
            &self.node(node).netns,
            args,
            env,
            &self
                .workdir
                .join("logs")
                .join(format!("lbproxy-{}-{k}", node.name())),
        );
        // The child is not reaped before its handle is dropped, so this pid is still ours.
        // SAFETY: plain syscall; a non-negative result is a new fd we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, lb.pid() as libc::pid_t, 0) };
        if fd >= 0 {
            // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            self.state.lock().unwrap().lbproxy_pidfds.push(fd);
        } else {
            eprintln!(
                "multinode lab {}: pidfd_open({}): {}",
                self.id,
                lb.pid(),
                std::io::Error::last_os_error()
            );
        }
        lb
    }

    /// Waits (up to `timeout`) until the lbproxy on `pod`'s node has attached both pod
    /// programs to the pod's host-side interface, as a pod added after lbproxy started needs
    /// before its traffic is served; panics with the attachments seen otherwise.
    pub fn wait_programs_on(&self, pod: &Pod, timeout: Duration) {
        let ns = &self.node(self.node_of(&pod.name)).netns;
        let attached = || {
            let att = super::bpf::tcx_attachments(ns);
            let on = |prog: &str| {
                att.iter()
                    .any(|a| a.ifname == pod.host_if && a.prog_name == prog)
            };
            (on("lb_from_pod") && on("lb_to_pod")).then_some(())
        };
        if super::net::wait_for(timeout, Duration::from_millis(20), attached).is_err() {
            panic!(
                "lbproxy did not attach to {} ({}) within {timeout:?}: {:?}",
                pod.host_if,
                pod.name,
                super::bpf::tcx_attachments(ns)
            );
        }
    }

    /// A command running `program` inside `node`'s namespace (nsenter).
    pub fn node_command(&self, node: NodeId, program: &str) -> Command {
        ns_command(&self.node(node).netns, program)
    }

    /// Runs `argv` inside `node`'s namespace; stdout or an error with stderr.
    pub fn node_run(&self, node: NodeId, argv: &[&str]) -> Result<String, String> {
        ns_run(&self.node(node).netns, argv)
    }

    /// A UDP NodePort Service `closed` (port 55, nodePort 30055 -> port 5555, where nothing
    /// listens) over `backend` alone, single-stack in `backend`'s family (`v6`), with its
    /// EndpointSlice: YAML to append to a manifest, for port-unreachable tests.
    pub fn closed_service(&self, backend: &super::Pod, v6: bool) -> String {
        let (cluster_ip, family, addr) = if v6 {
            (
                "fd00:c612:ffff::12".to_string(),
                "IPv6",
                backend.ip6.expect("dual-stack pod").to_string(),
            )
        } else {
            ("198.19.0.12".to_string(), "IPv4", backend.ip.to_string())
        };
        format!(
            "---
apiVersion: v1
kind: Service
metadata: {{name: closed, namespace: default}}
spec:
  type: NodePort
  clusterIP: \"{cluster_ip}\"
  ipFamilies: [{family}]
  ports:
  - {{name: dns, port: 55, protocol: UDP, targetPort: 5555, nodePort: 30055}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: closed-1
  namespace: default
  labels: {{kubernetes.io/service-name: closed}}
addressType: {family}
ports:
- {{name: dns, port: 5555, protocol: UDP}}
endpoints:
- {{addresses: [\"{addr}\"], nodeName: {}, conditions: {{ready: true}}}}
",
            self.node_of(&backend.name).name()
        )
    }

    /// Whether `node`'s maps serve every frontend of `service` (`namespace/name`) in
    /// `backend`'s family with `backend` alone (and serve at least one).
    #[cfg(feature = "inspect-rows")]
    pub fn serves_only(&self, node: NodeId, service: &str, backend: std::net::IpAddr) -> bool {
        let want = backend.to_string();
        let rows = self.node(node).inspect_services();
        let mine: Vec<_> = rows
            .iter()
            .filter(|e| e.service == service && e.vip.contains(':') == backend.is_ipv6())
            .collect();
        !mine.is_empty()
            && mine
                .iter()
                .all(|e| e.backends.len() == 1 && e.backends[0].addr == want)
    }

    /// A text dump for failure messages: `ip addr` and `ip route` of every namespace, the
    /// nodes' neighbours, the fabric's bridge FDB and, where its maps are pinned, `lbproxy
    /// inspect services` per node. Never panics.
    pub fn diagnostics(&self) -> String {
        let mut out = format!("===== multinode lab {} diagnostics =====\n", self.id);
        let mut section = |title: &str, r: Result<String, String>| {
            out.push_str(&format!("--- {title} ---\n{}\n", r.unwrap_or_else(|e| e)));
        };
        let (pods, clients) = self
            .state
            .lock()
            .map(|s| {
                (
                    s.pods.values().cloned().collect::<Vec<_>>(),
                    s.clients.values().cloned().collect::<Vec<_>>(),
                )
            })
            .unwrap_or_default();
        let mut spaces: Vec<(String, &str)> = vec![("fabric".into(), &self.fabric)];
        for n in &self.nodes {
            spaces.push((n.name.into(), &n.netns));
        }
        for (node, p) in &pods {
            spaces.push((format!("pod {} on {node}", p.name), &p.netns));
        }
        for c in &clients {
            spaces.push((format!("client {}", c.name), &c.netns));
        }
        for (what, ns) in &spaces {
            section(
                &format!("ip addr ({what}, {ns})"),
                ns_run(ns, &["ip", "-br", "addr"]),
            );
            section(
                &format!("ip route ({what}, {ns})"),
                ns_run(ns, &["ip", "route"]),
            );
        }
        for n in &self.nodes {
            section(
                &format!("ip neigh ({})", n.name),
                ns_run(&n.netns, &["ip", "neigh"]),
            );
        }
        section(
            "bridge fdb (fabric)",
            ns_run(
                &self.fabric,
                &["bridge", "fdb", "show", "br", FABRIC_BRIDGE],
            ),
        );
        if let Some(bin) = lbproxy_bin_if_present() {
            for n in &self.nodes {
                if !n.bpffs_dir.exists() {
                    continue;
                }
                let dir = n.bpffs_dir.display().to_string();
                let r = ns_command(&n.netns, &bin)
                    .args(["inspect", "services", "--bpffs-dir", &dir])
                    .output()
                    .map_err(|e| e.to_string())
                    .and_then(|o| super::ns::output_result("inspect", o));
                section(&format!("lbproxy inspect services ({})", n.name), r);
            }
        }
        out.push_str("===== end diagnostics =====");
        out
    }
}

/// SIGKILLs the process behind `pidfd` if it still runs, and waits (up to 5 s) for it to be
/// gone. Signals through a pidfd never reach another process that reused the pid.
fn kill_pidfd(pidfd: &OwnedFd) {
    let fd = pidfd.as_raw_fd();
    // SAFETY: plain syscalls on an fd we own; ESRCH (already exited) is fine.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
        // A pidfd becomes readable once its process has exited.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        libc::poll(&mut pfd, 1, 5000);
    }
}

impl Drop for MultiNodeLab {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        let st = match self.state.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        };
        // 1. lbproxy processes first, so none of them races cleanup.
        for fd in &st.lbproxy_pidfds {
            kill_pidfd(fd);
        }
        // 2. `lbproxy cleanup` per node where it ran (or left maps), then the bpffs dirs.
        for node in &self.nodes {
            let used = st.lbproxy_used.contains(&node.id);
            if (used || node.bpffs_dir.exists())
                && let Some(bin) = lbproxy_bin_if_present()
            {
                let dir = node.bpffs_dir.display().to_string();
                match ns_command(&node.netns, &bin)
                    .args(["cleanup", "--bpffs-dir", &dir])
                    .output()
                {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => eprintln!(
                        "multinode lab {} ({}): lbproxy cleanup failed ({}): {}",
                        self.id,
                        node.name,
                        o.status,
                        String::from_utf8_lossy(&o.stderr)
                    ),
                    Err(e) => eprintln!(
                        "multinode lab {} ({}): cannot run lbproxy cleanup: {e}",
                        self.id, node.name
                    ),
                }
            }
            if node.bpffs_dir.exists() {
                let _ = std::fs::remove_dir_all(&node.bpffs_dir);
            }
        }
        // 3. Interfaces (deleted explicitly, so they are gone when this returns rather than
        //    whenever the kernel gets round to dismantling a namespace), then namespaces.
        for (node, p) in st.pods.values() {
            let _ = quiet_ip(&self.node(*node).netns, &["link", "del", &p.host_if]);
            let _ = netns_del_quiet(&p.netns);
        }
        for c in st.clients.values() {
            let _ = quiet_ip(&c.netns, &["link", "del", "eth0"]);
            let _ = netns_del_quiet(&c.netns);
        }
        // 4. The cgroup group (killing any client left in it), before the namespaces go.
        drop(self.cgroup.take());
        for node in &self.nodes {
            let _ = quiet_ip(&node.netns, &["link", "del", NODE_IF]);
            let _ = netns_del_quiet(&node.netns);
        }
        let _ = quiet_ip(&self.fabric, &["link", "del", FABRIC_BRIDGE]);
        let _ = netns_del_quiet(&self.fabric);
        if panicking {
            eprintln!(
                "multinode lab {}: keeping work dir {} (logs, manifests)",
                self.id,
                self.workdir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.workdir);
        }
    }
}

/// The `web` service's ClusterIP ([`web_manifest`]).
pub const WEB_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// The `web` service's externalIP.
pub const WEB_EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 50);
/// The `web` service's load-balancer IP.
pub const WEB_LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 60);
/// The `web` service's TCP NodePort.
pub const WEB_NODE_PORT_TCP: u16 = 30080;
/// The `web` service's UDP NodePort.
pub const WEB_NODE_PORT_UDP: u16 = 30053;
/// The `web` backends' TCP port.
pub const WEB_BACKEND_TCP: u16 = 8080;
/// The `web` backends' UDP port.
pub const WEB_BACKEND_UDP: u16 = 5353;
/// The IPv6 frontends of the dual-stack `web` ([`dual_stack_web_manifest`]): outside every
/// lab subnet, routed to a node by the client.
pub const WEB_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x10);
pub const WEB_EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x50);
pub const WEB_LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x60);

/// The IPv4 EndpointSlice `<name>-1` of Service `name`, with the web ports (8080/TCP
/// "http", 5353/UDP "dns") and `eps` (address, nodeName) each ready: the YAML document, with
/// its leading `---`.
pub fn slice_yaml(name: &str, eps: &[(Ipv4Addr, Option<&str>)]) -> String {
    let items: String = eps
        .iter()
        .map(|(ip, node)| {
            let node = node.map_or(String::new(), |n| format!(", nodeName: {n}"));
            format!("- {{addresses: [{ip}]{node}, conditions: {{ready: true}}}}\n")
        })
        .collect();
    format!(
        "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
- {{name: http, port: {WEB_BACKEND_TCP}, protocol: TCP}}
- {{name: dns, port: {WEB_BACKEND_UDP}, protocol: UDP}}
endpoints:{}
{items}",
        if eps.is_empty() { " []" } else { "" }
    )
}

/// A second ClusterIP Service `name` on `cluster_ip` with the web ports (TCP 80 -> 8080,
/// UDP 53 -> 5353) over `eps`: with [`web_manifest`], one pod behind two Services, as a
/// pod behind its app's Service and its metrics Service.
pub fn cluster_ip_manifest(
    name: &str,
    cluster_ip: Ipv4Addr,
    eps: &[(Ipv4Addr, Option<&str>)],
) -> String {
    format!(
        "---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {cluster_ip}
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: {WEB_BACKEND_TCP}}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: {WEB_BACKEND_UDP}}}
{}",
        slice_yaml(name, eps)
    )
}

/// The two-node labs' `web` service: type LoadBalancer with ClusterIP [`WEB_CLUSTER_IP`],
/// externalIP [`WEB_EXTERNAL_IP`], LB IP [`WEB_LB_IP`], TCP port 80 (NodePort
/// [`WEB_NODE_PORT_TCP`], target [`WEB_BACKEND_TCP`]) and UDP port 53 (NodePort
/// [`WEB_NODE_PORT_UDP`], target [`WEB_BACKEND_UDP`]), externalTrafficPolicy `policy`,
/// `extra` added to its spec, over the endpoints `eps` (address, nodeName).
pub fn web_manifest(eps: &[(Ipv4Addr, Option<&str>)], policy: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: LoadBalancer
  clusterIP: {WEB_CLUSTER_IP}
  externalIPs: [{WEB_EXTERNAL_IP}]
  externalTrafficPolicy: {policy}
  {extra}
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: {WEB_BACKEND_TCP}, nodePort: {WEB_NODE_PORT_TCP}}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: {WEB_BACKEND_UDP}, nodePort: {WEB_NODE_PORT_UDP}}}
status:
  loadBalancer:
    ingress: [{{ip: {WEB_LB_IP}}}]
{}",
        slice_yaml("web", eps)
    )
}

/// The dual-stack `web` Service (type LoadBalancer, one clusterIP, externalIP and LB IP per
/// family, TCP 80 and UDP 53 with NodePorts) over `pods`, with one EndpointSlice per family;
/// `policy` is its externalTrafficPolicy, `extra` spec lines (two-space indented).
pub fn dual_stack_web_manifest(
    lab: &MultiNodeLab,
    pods: &[&super::Pod],
    policy: &str,
    extra: &str,
) -> String {
    let slice = |name: &str, family: &str, v6: bool| {
        let eps: String = pods
            .iter()
            .map(|p| {
                let ip = if v6 {
                    p.ip6.unwrap().to_string()
                } else {
                    p.ip.to_string()
                };
                format!(
                    "- {{addresses: [\"{ip}\"], nodeName: {}, conditions: {{ready: true}}}}\n",
                    lab.node_of(&p.name).name()
                )
            })
            .collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {family}\nports: [{{name: http, port: {WEB_BACKEND_TCP}, protocol: TCP}}, {{name: dns, port: {WEB_BACKEND_UDP}, protocol: UDP}}]\nendpoints:\n{eps}"
        )
    };
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: LoadBalancer
  clusterIP: {WEB_CLUSTER_IP}
  clusterIPs: [\"{WEB_CLUSTER_IP}\", \"{WEB_CLUSTER_IP6}\"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  externalIPs: [\"{WEB_EXTERNAL_IP}\", \"{WEB_EXTERNAL_IP6}\"]
  externalTrafficPolicy: {policy}
{extra}  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: {WEB_BACKEND_TCP}, nodePort: {WEB_NODE_PORT_TCP}}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: {WEB_BACKEND_UDP}, nodePort: {WEB_NODE_PORT_UDP}}}
status:
  loadBalancer:
    ingress: [{{ip: \"{WEB_LB_IP}\"}}, {{ip: \"{WEB_LB_IP6}\"}}]
{}{}",
        slice("web-v4", "IPv4", false),
        slice("web-v6", "IPv6", true),
    )
}
