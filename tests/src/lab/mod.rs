//! A network-namespace lab: one "node" namespace with pods attached to it, all created by the
//! lab itself and removed on drop.
//!
//! ```text
//!   pod ns "lbt-<pid>-<n>-pod-<name>"          node ns "lbt-<pid>-<n>-node"      uplink ns
//!   eth0 198.18.0.<2+i> ── veth ── <prefix><i> (host side)   uplink0 ── veth ── eth0
//!                                    Routed: /32 route + proxy_arp   198.18.255.1/30  .2/30
//!                                    Bridge: enslaved to lbcni0 (198.18.0.1/24)
//! ```
//!
//! * Nothing in the root namespace is touched. All addresses are in 198.18.0.0/15: pods in
//!   198.18.0.0/24, the uplink in 198.18.255.0/30, service VIPs in 198.19.0.0/16 ([`vip`]).
//!   Different labs may use the same addresses: they never share a namespace.
//! * Host-side pod interfaces are named `<prefix><index>` ([`Lab::pod_glob`] matches exactly
//!   them); the uplink (`uplink0`) and bridge (`lbcni0`) never match it.
//! * [`Shape::Routed`] is Calico-like (pod /32, gateway 169.254.1.1 answered by proxy ARP with
//!   `proxy_delay=0`), [`Shape::Bridge`] is cni0-like (pods /24 on a bridge holding the gateway
//!   198.18.0.1, with a fixed MAC [`BRIDGE_MAC`] so it does not change as ports come and go).
//! * The node namespace has `lo` up, `ip_forward=1`, a default route via the uplink, and in
//!   bridge mode `net.bridge.bridge-nf-call-iptables=1` (br_netfilter is loaded on these hosts).
//!   Duplicate address detection is off in the node and uplink namespaces (and in pods).
//!
//! Typical use:
//! ```no_run
//! use std::time::Duration;
//! use lbproxy_tests::lab::{Lab, Shape, vip, manifest::*};
//! let lab = Lab::new(Shape::Routed);
//! let client = lab.add_pod("client");
//! let b1 = lab.add_pod("b1");
//! let _srv = b1.serve(&[8080]);
//! lab.write_manifest(
//!     &Manifest::new()
//!         .with(Service::cluster_ip("web", vip(10)).port("http", 80, Protocol::Tcp, 8080))
//!         .with(EndpointSlice::new("web-1", "web").port("http", 8080, Protocol::Tcp)
//!             .endpoint(Endpoint::ready(b1.ip))),
//! );
//! let mut lb = lab.start_lbproxy();
//! lb.expect_healthy(Duration::from_secs(10));
//! let (reply, peer) = client.tcp_request(vip(10), 80, Duration::from_secs(1)).unwrap();
//! assert_eq!(reply.backend, "b1");
//! ```
//!
//! Main entry points: [`Lab`] (namespaces, pods, manifests, lbproxy), [`Pod`] (servers and
//! clients in one pod), [`Backend`], [`TcpConn`], [`tally`] / [`Tally`], [`Lbproxy`],
//! [`manifest`] (Service/EndpointSlice YAML), [`ns`] (`run_in_ns`, `ns_command`, `http_get`),
//! [`bpf`] (which programs are tcx-attached where), [`kube_proxy`] (kube-proxy's iptables and
//! nftables rules for a few Services, rendered and installed). To run lbproxy against the
//! Kubernetes API instead of manifests, start a [`crate::apiserver::ApiServer`] in
//! [`Lab::node_ns`] and pass [`Lab::lbproxy_base_args`] plus `--kubeconfig` to
//! [`Lab::start_lbproxy_argv`].
//!
//! Drop order matters: drop [`Backend`]s and the [`Lbproxy`] before the [`Lab`] (declare the
//! lab first). Dropping the lab runs `lbproxy cleanup` for its bpffs dir (if lbproxy was
//! started), removes that dir, deletes every interface and namespace, and removes its work
//! dir (kept, and its path printed, if the thread is panicking).

pub mod bpf;
pub mod cgroup;
mod client;
pub mod connect;
pub mod inspect;
pub mod kube_proxy;
pub mod lbproxy;
pub mod manifest;
pub mod multinode;
pub mod net;
pub mod ns;
pub mod paced;
pub mod takeover_load;

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

pub use self::inspect::{DATAPATH_EVENTS, Inspect};
pub use self::lbproxy::{
    HEALTHZ_ADDR, Lbproxy, METRICS_ADDR, lbproxy_bin, lbproxy_bin_if_present, run_lbproxy_cmd,
};
pub use self::manifest::{
    Conditions, Endpoint, EndpointSlice, Manifest, Node as NodeObject, Object, Protocol, Service,
    TargetPort, write_atomic,
};
pub use self::net::{
    Backend, Proto, Reply, Tally, TcpConn, answer_after_close, set_rcvtimeo, socket2_udp, tally,
    tcp_request, tcp_request_here, udp_request, udp_request_here, wait_for, wait_udp_port_released,
};
pub use self::ns::{http_get, http_get_full, netns_path, ns_command, ns_run, run_in_ns};

/// An IP family, for a test written once for both (see [`crate::both_families`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Pod-network shape of a lab.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Calico-like: pod /32 on eth0, default via 169.254.1.1 (answered by proxy ARP on the
    /// host side), a /32 route per pod in the node namespace.
    Routed,
    /// cni0-like: host sides enslaved to a bridge holding 198.18.0.1/24; pods /24.
    Bridge,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::Routed, Shape::Bridge];
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Shape::Routed => "routed",
            Shape::Bridge => "bridge",
        })
    }
}

/// The gateway address pods use in [`Shape::Bridge`] (on the bridge `lbcni0`).
pub const BRIDGE_GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The gateway address pods use in [`Shape::Routed`].
pub const ROUTED_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// Name of the bridge in [`Shape::Bridge`].
pub const BRIDGE_IF: &str = "lbcni0";
/// The bridge's fixed MAC address (locally administered).
pub const BRIDGE_MAC: &str = "02:00:c6:12:00:01";
/// Name of the node side of the uplink veth.
pub const UPLINK_IF: &str = "uplink0";
/// Node-side uplink address (/30).
pub const UPLINK_NODE_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 1);
/// Uplink-namespace address (/30).
pub const UPLINK_PEER_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 2);

/// Service VIP number `n`: 198.19.0.`n`.
pub fn vip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 0, n)
}

/// The IPv6 pod network of the single-node lab (a ULA, inside the lab only):
/// `fd00:c612::/64` (`c612` is 198.18 in hex).
pub const POD_NET6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, 0);
/// The bridge's IPv6 address (the pods' gateway in the bridge shape).
pub const BRIDGE_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, 1);
/// The routed shape's IPv6 gateway: a link-local address every host-side veth carries, as
/// Calico's `fe80::ecee:eeff:feee:eeee`.
pub const ROUTED_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The IPv6 address pod index `i` gets: `fd00:c612::` + `2+i`, beside its IPv4
/// [`pod_ip`] (a /128 routed, a /64 on the bridge).
pub fn pod_ip6(index: u32) -> Ipv6Addr {
    let v4 = pod_ip(index).octets();
    Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, u16::from(v4[3]))
}

/// The address pod index `i` gets: 198.18.0.`2+i`.
pub fn pod_ip(index: u32) -> Ipv4Addr {
    assert!(index <= 252, "lab: too many pods (index {index})");
    Ipv4Addr::new(198, 18, 0, 2 + index as u8)
}

/// Lab options.
#[derive(Clone, Debug)]
pub struct LabConfig {
    pub shape: Shape,
    /// Prefix of host-side pod interface names (at most 11 characters). Default
    /// `lbt<counter>a`, unique within the process.
    pub if_prefix: Option<String>,
}

impl LabConfig {
    pub fn new(shape: Shape) -> LabConfig {
        LabConfig {
            shape,
            if_prefix: None,
        }
    }
}

/// A pod: a network namespace with `eth0`, connected to the node by a veth.
#[derive(Clone, Debug)]
pub struct Pod {
    /// Name given to [`Lab::add_pod`]; also the identity its [`Backend`]s answer with.
    pub name: String,
    /// Network namespace name (under /run/netns).
    pub netns: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address: every pod of the single-node lab is dual-stack ([`pod_ip6`]); the
    /// multinode lab's pods are IPv4 only (`None`).
    pub ip6: Option<Ipv6Addr>,
    /// Host-side interface name in the node namespace.
    pub host_if: String,
    /// Index within the lab (interfaces are `<prefix><index>`, ip 198.18.0.`2+index`).
    pub index: u32,
}

impl Pod {
    /// Starts TCP and UDP servers on `ports` answering with this pod's name.
    pub fn serve(&self, ports: &[u16]) -> Backend {
        Backend::start(&self.netns, &self.name, ports)
    }

    client::netns_client!("pod");

    /// Drops inbound TCP to `port` in the pod's own INPUT chain: SYNs reach the pod and
    /// vanish, as with a hung or overloaded process. The error names the pod.
    pub fn freeze_tcp(&self, port: u16) -> Result<(), String> {
        ns_run(
            &self.netns,
            &[
                "iptables",
                "-A",
                "INPUT",
                "-p",
                "tcp",
                "--dport",
                &port.to_string(),
                "-j",
                "DROP",
            ],
        )
        .map(drop)
        .map_err(|e| format!("freezing {} (iptables DROP inside the pod): {e}", self.name))
    }
}

struct LabState {
    pods: BTreeMap<String, Pod>,
    next_index: u32,
    lbproxy_starts: u32,
}

/// See the [module docs](self).
pub struct Lab {
    id: String,
    shape: Shape,
    node: String,
    uplink: String,
    if_prefix: String,
    workdir: PathBuf,
    bpffs_dir: PathBuf,
    state: Mutex<LabState>,
    lbproxy_used: AtomicBool,
    /// The cgroup2 group lbproxy's socket-level programs attach to (`--cgroup-root` in
    /// [`Lab::lbproxy_base_args`]), so they never see a process outside the lab.
    cgroup: std::sync::OnceLock<cgroup::CgroupGroup>,
}

pub(crate) static COUNTER: AtomicU32 = AtomicU32::new(0);
pub(crate) static SWEEP: std::sync::Once = std::sync::Once::new();

impl Lab {
    /// A lab with default options. Panics (with the reason) if it cannot be built, e.g.
    /// without root.
    pub fn new(shape: Shape) -> Lab {
        Lab::with_config(LabConfig::new(shape))
    }

    pub fn with_config(cfg: LabConfig) -> Lab {
        SWEEP.call_once(|| {
            sweep_stale();
            take_lock();
        });
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let id = format!("{}-{n}", std::process::id());
        let if_prefix = cfg.if_prefix.unwrap_or_else(|| format!("lbt{n}a"));
        assert!(
            !if_prefix.is_empty()
                && if_prefix.len() <= 11
                && if_prefix
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "lab: bad interface prefix {if_prefix:?} (1-11 chars of [A-Za-z0-9_-])"
        );
        assert!(
            !glob_prefix_matches(&if_prefix, UPLINK_IF)
                && !glob_prefix_matches(&if_prefix, BRIDGE_IF),
            "lab: interface prefix {if_prefix:?} would match {UPLINK_IF} or {BRIDGE_IF}"
        );
        let workdir = std::env::temp_dir().join(format!("lbt-{id}"));
        let lab = Lab {
            shape: cfg.shape,
            node: format!("lbt-{id}-node"),
            uplink: format!("lbt-{id}-up"),
            if_prefix,
            bpffs_dir: PathBuf::from(format!("/sys/fs/bpf/lbproxy-test-{id}")),
            workdir,
            id,
            state: Mutex::new(LabState {
                pods: BTreeMap::new(),
                next_index: 0,
                lbproxy_starts: 0,
            }),
            lbproxy_used: AtomicBool::new(false),
            cgroup: std::sync::OnceLock::new(),
        };
        // From here on a panic drops `lab`, which removes whatever was created.
        lab.setup();
        lab
    }

    fn setup(&self) {
        let _ = std::fs::remove_dir_all(&self.workdir);
        for d in ["manifests", "tmp", "logs"] {
            std::fs::create_dir_all(self.workdir.join(d))
                .unwrap_or_else(|e| panic!("lab: create {}: {e}", self.workdir.display()));
        }
        netns_add(&self.node);
        netns_add(&self.uplink);
        let node = &self.node;
        ip_batch(node, &["link set lo up".into()]);
        sysctl(node, "net/ipv4/ip_forward", "1");
        // Dual-stack pods: the node forwards IPv6 too, and skips DAD on the lab's links.
        sysctl(node, "net/ipv6/conf/default/accept_dad", "0");
        sysctl(node, "net/ipv6/conf/all/accept_dad", "0");
        sysctl(node, "net/ipv6/conf/all/forwarding", "1");
        // The uplink namespace too, before its eth0 exists: with DAD its link-local address
        // stays tentative for 1-3 s after the link comes up, and meanwhile the kernel sends
        // no neighbour solicitation for an answer whose source is not on eth0 (an address
        // on its `lo`, as tests give it): the first TCP SYN-ACK and its retry were lost.
        sysctl(&self.uplink, "net/ipv6/conf/default/accept_dad", "0");
        sysctl(&self.uplink, "net/ipv6/conf/all/accept_dad", "0");
        // Uplink: gives the node a default route (proxy ARP needs one) that leads nowhere.
        ip_batch(
            node,
            &[
                format!(
                    "link add {UPLINK_IF} type veth peer name eth0 netns {}",
                    self.uplink
                ),
                format!("addr add {UPLINK_NODE_ADDR}/30 dev {UPLINK_IF}"),
                format!("link set {UPLINK_IF} up"),
                format!("route add default dev {UPLINK_IF}"),
            ],
        );
        ip_batch(
            &self.uplink,
            &[
                "link set lo up".into(),
                format!("addr add {UPLINK_PEER_ADDR}/30 dev eth0"),
                "link set eth0 up".into(),
            ],
        );
        if self.shape == Shape::Bridge {
            ip_batch(
                node,
                &[
                    // A fixed MAC: otherwise the bridge takes its lowest port MAC, which changes as
                    // pods come and go and leaves pods with a stale gateway neighbour entry.
                    format!("link add {BRIDGE_IF} address {BRIDGE_MAC} type bridge"),
                    format!("addr add {BRIDGE_GATEWAY}/24 dev {BRIDGE_IF}"),
                    format!("addr add {BRIDGE_GATEWAY6}/64 dev {BRIDGE_IF} nodad"),
                    format!("link set {BRIDGE_IF} up"),
                ],
            );
            // Per-netns since Linux 5.3; present only when br_netfilter is loaded.
            let key = "net/bridge/bridge-nf-call-iptables";
            if run_in_ns(node, || Path::new("/proc/sys").join(key).exists()) {
                sysctl(node, key, "1");
            }
        }
        let _ = self.cgroup.set(cgroup::CgroupGroup::new(&self.id));
    }

    /// The lab's cgroup2 group (see [`Lab::lbproxy_base_args`]).
    pub fn cgroup(&self) -> &Path {
        self.cgroup.get().expect("set up with the lab").path()
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// `<pid>-<counter>`, unique per lab on this machine.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The node namespace's name.
    pub fn node_ns(&self) -> &str {
        &self.node
    }

    /// The uplink namespace's name.
    pub fn uplink_ns(&self) -> &str {
        &self.uplink
    }

    /// Prefix of host-side pod interface names.
    pub fn if_prefix(&self) -> &str {
        &self.if_prefix
    }

    /// `<prefix>*`: the `--pod-interfaces` glob matching this lab's pod interfaces.
    pub fn pod_glob(&self) -> String {
        format!("{}*", self.if_prefix)
    }

    /// This lab's private bpffs dir, `/sys/fs/bpf/lbproxy-test-<id>` (not created by the lab).
    pub fn bpffs_dir(&self) -> &Path {
        &self.bpffs_dir
    }

    /// The lab's work dir (manifests, logs), under the system temp dir.
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// The manifests directory, `<workdir>/manifests`.
    pub fn manifest_dir(&self) -> PathBuf {
        self.workdir.join("manifests")
    }

    /// The default manifest file, `<workdir>/manifests/cluster.yaml` (what
    /// [`Lab::start_lbproxy`] passes as `--manifests`).
    pub fn manifest_path(&self) -> PathBuf {
        self.manifest_dir().join("cluster.yaml")
    }

    /// Atomically (re)writes [`Lab::manifest_path`] with `m`.
    pub fn write_manifest(&self, m: &Manifest) {
        self.write_manifest_text(&m.to_yaml());
    }

    /// Atomically (re)writes [`Lab::manifest_path`] with raw text (e.g. invalid YAML).
    pub fn write_manifest_text(&self, text: &str) {
        self.write_file_atomic(&self.manifest_path(), text);
    }

    /// Atomically writes any file; the temporary file lives in `<workdir>/tmp`, so a
    /// directory watcher never sees it.
    pub fn write_file_atomic(&self, path: &Path, text: &str) {
        write_atomic(path, text, Some(&self.workdir.join("tmp")))
            .unwrap_or_else(|e| panic!("lab: write {}: {e}", path.display()));
    }

    /// Adds a pod named `name` (`[a-z0-9-]`, unique in the lab); it is reachable as soon as
    /// this returns.
    pub fn add_pod(&self, name: &str) -> Pod {
        assert!(
            !name.is_empty()
                && name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "lab: bad pod name {name:?}"
        );
        let pod = {
            let mut st = self.state.lock().unwrap();
            assert!(
                !st.pods.contains_key(name),
                "lab: pod {name} already exists"
            );
            let index = st.next_index;
            st.next_index += 1;
            let pod = Pod {
                name: name.to_owned(),
                netns: format!("lbt-{}-pod-{name}", self.id),
                ip: pod_ip(index),
                ip6: Some(pod_ip6(index)),
                host_if: format!("{}{index}", self.if_prefix),
                index,
            };
            st.pods.insert(name.to_owned(), pod.clone());
            pod
        };
        let (node, host, ip) = (&self.node, &pod.host_if, pod.ip);
        let ip6 = pod_ip6(pod.index);
        netns_add(&pod.netns);
        // No duplicate address detection: an address in DAD cannot be used for about a
        // second, and the lab's addresses are unique by construction.
        sysctl(&pod.netns, "net/ipv6/conf/default/accept_dad", "0");
        sysctl(&pod.netns, "net/ipv6/conf/all/accept_dad", "0");
        ip_batch(
            node,
            &[format!(
                "link add {host} type veth peer name eth0 netns {}",
                pod.netns
            )],
        );
        match self.shape {
            Shape::Routed => {
                ip_batch(
                    &pod.netns,
                    &[
                        "link set lo up".into(),
                        format!("addr add {ip}/32 dev eth0"),
                        format!("addr add {ip6}/128 dev eth0 nodad"),
                        "link set eth0 up".into(),
                        format!("route add {ROUTED_GATEWAY} dev eth0 scope link"),
                        format!("route add default via {ROUTED_GATEWAY} dev eth0"),
                        format!("route add default via {ROUTED_GATEWAY6} dev eth0"),
                    ],
                );
                sysctl(node, &format!("net/ipv4/conf/{host}/proxy_arp"), "1");
                // Answer proxy ARP at once rather than after up to 0.8 s (as Calico does).
                sysctl(node, &format!("net/ipv4/neigh/{host}/proxy_delay"), "0");
                ip_batch(
                    node,
                    &[
                        format!("addr add {ROUTED_GATEWAY6}/64 dev {host} nodad"),
                        format!("link set {host} up"),
                        format!("route add {ip}/32 dev {host}"),
                        format!("route add {ip6}/128 dev {host}"),
                    ],
                );
            }
            Shape::Bridge => {
                ip_batch(
                    &pod.netns,
                    &[
                        "link set lo up".into(),
                        format!("addr add {ip}/24 dev eth0"),
                        format!("addr add {ip6}/64 dev eth0 nodad"),
                        "link set eth0 up".into(),
                        format!("route add default via {BRIDGE_GATEWAY} dev eth0"),
                        format!("route add default via {BRIDGE_GATEWAY6} dev eth0"),
                    ],
                );
                ip_batch(node, &[format!("link set {host} master {BRIDGE_IF} up")]);
            }
        }
        // A veth forwards only once both ends have carrier; a packet sent before that is
        // lost, and a lost first SYN is retried only after 1 s. Wait, so the pod really is
        // reachable when this returns.
        wait_lower_up(node, &pod.host_if);
        wait_lower_up(&pod.netns, "eth0");
        pod
    }

    /// Removes pod `name`: deletes its veth (both ends, at once, even if sockets in the pod
    /// are still open) and its namespace. Panics if there is no such pod.
    pub fn remove_pod(&self, name: &str) {
        let pod = self
            .state
            .lock()
            .unwrap()
            .pods
            .remove(name)
            .unwrap_or_else(|| panic!("lab: no pod {name}"));
        ip_batch(&self.node, &[format!("link del {}", pod.host_if)]);
        netns_del(&pod.netns);
    }

    /// The pod named `name`. Panics if there is none.
    pub fn pod(&self, name: &str) -> Pod {
        self.state
            .lock()
            .unwrap()
            .pods
            .get(name)
            .cloned()
            .unwrap_or_else(|| panic!("lab: no pod {name}"))
    }

    /// All current pods, by name.
    pub fn pods(&self) -> Vec<Pod> {
        self.state.lock().unwrap().pods.values().cloned().collect()
    }

    /// A command running `program` inside the node namespace (nsenter).
    pub fn node_command(&self, program: &str) -> Command {
        ns_command(&self.node, program)
    }

    /// Runs `argv` inside the node namespace; stdout or an error with stderr.
    pub fn node_run(&self, argv: &[&str]) -> Result<String, String> {
        ns_run(&self.node, argv)
    }

    /// The entries of pinned map `name`, as `bpftool -j map dump` formats them from the
    /// map's BTF: each `{"key": …, "value": …}`. Panics when bpftool fails or prints
    /// something else.
    pub fn map_dump(&self, name: &str) -> Vec<serde_json::Value> {
        let map = self.bpffs_dir.join(name).display().to_string();
        let out = self
            .node_run(&["bpftool", "-j", "map", "dump", "pinned", &map])
            .unwrap_or_else(|e| panic!("bpftool map dump {map}: {e}"));
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("bpftool JSON ({e}): {out}"));
        v.as_array()
            .unwrap_or_else(|| panic!("bpftool map dump {map}: not an array: {out}"))
            .iter()
            .map(|e| e.get("formatted").cloned().unwrap_or_else(|| e.clone()))
            .collect()
    }

    /// The standard `lbproxy run` arguments for this lab: [`Lab::lbproxy_base_args`] with the
    /// lab's manifest as the source.
    pub fn lbproxy_run_args(&self) -> Vec<String> {
        let mut args = self.lbproxy_base_args();
        args.extend([
            "--manifests".into(),
            self.manifest_path().display().to_string(),
        ]);
        args
    }

    /// The `lbproxy run` arguments for this lab without a source (no `--manifests`):
    /// `run --pod-interfaces <glob> --bpffs-dir <dir> --healthz-bind-address ...
    /// --metrics-bind-address ...`. Add `--kubeconfig PATH` to use a Kubernetes API server.
    pub fn lbproxy_base_args(&self) -> Vec<String> {
        vec![
            "run".into(),
            "--pod-interfaces".into(),
            self.pod_glob(),
            "--bpffs-dir".into(),
            self.bpffs_dir.display().to_string(),
            "--cgroup-root".into(),
            self.cgroup().display().to_string(),
            "--healthz-bind-address".into(),
            HEALTHZ_ADDR.into(),
            "--metrics-bind-address".into(),
            METRICS_ADDR.into(),
        ]
    }

    /// Starts `lbproxy ARGS` (exactly `args`, e.g. [`Lab::lbproxy_base_args`] plus
    /// `--kubeconfig PATH`) inside the node namespace, with extra environment variables
    /// `env`. Logs go to the lab's work dir as with [`Lab::start_lbproxy`].
    pub fn start_lbproxy_argv(&self, args: Vec<String>, env: &[(&str, &str)]) -> Lbproxy {
        self.lbproxy_used.store(true, Ordering::SeqCst);
        let k = {
            let mut st = self.state.lock().unwrap();
            st.lbproxy_starts += 1;
            st.lbproxy_starts
        };
        Lbproxy::spawn_env(
            &self.node,
            args,
            env,
            &self.workdir.join("logs").join(format!("lbproxy-{k}")),
        )
    }

    /// Starts `lbproxy run` with [`Lab::lbproxy_run_args`] inside the node namespace. Does
    /// not wait for it to become healthy (see [`Lbproxy::wait_healthy`]).
    pub fn start_lbproxy(&self) -> Lbproxy {
        self.start_lbproxy_with(&[])
    }

    /// Like [`Lab::start_lbproxy`] with extra arguments appended.
    pub fn start_lbproxy_with(&self, extra: &[&str]) -> Lbproxy {
        self.start_lbproxy_bin_with(&lbproxy_bin(), extra)
    }

    /// [`Self::start_lbproxy_with`], running the binary `bin` (to compare two builds in one
    /// benchmark run; `lbproxy cleanup` still runs [`lbproxy_bin`]).
    pub fn start_lbproxy_bin_with(&self, bin: &std::path::Path, extra: &[&str]) -> Lbproxy {
        self.lbproxy_used.store(true, Ordering::SeqCst);
        let k = {
            let mut st = self.state.lock().unwrap();
            st.lbproxy_starts += 1;
            st.lbproxy_starts
        };
        let mut args = self.lbproxy_run_args();
        args.extend(extra.iter().map(|s| s.to_string()));
        Lbproxy::spawn_bin(
            bin,
            &self.node,
            args,
            &[],
            &self.workdir.join("logs").join(format!("lbproxy-{k}")),
        )
    }

    /// Runs `lbproxy ARGS` to completion inside the node namespace (no arguments added).
    pub fn lbproxy_cmd(&self, args: &[&str]) -> Output {
        self.lbproxy_used.store(true, Ordering::SeqCst);
        lbproxy::run_lbproxy_cmd(&self.node, args)
    }

    /// [`Inspect::inspect_json`], also callable without the trait in scope (the benchmarks
    /// in xtask call it so).
    pub fn inspect_json(&self, what: &str) -> serde_json::Value {
        Inspect::inspect_json(self, what)
    }

    /// Every tcx attachment on the node namespace's interfaces (see [`bpf`]).
    pub fn tcx_attachments(&self) -> Vec<bpf::TcxAttachment> {
        bpf::tcx_attachments(&self.node)
    }

    /// A text dump for failure messages: node routes, neighbours, bridge FDB, conntrack,
    /// iptables counters, tcx attachments and (if its maps are pinned) `lbproxy inspect`.
    /// Never panics.
    pub fn diagnostics(&self) -> String {
        let mut out = format!("===== lab {} ({}) diagnostics =====\n", self.id, self.shape);
        let mut section = |title: &str, r: Result<String, String>| {
            out.push_str(&format!("--- {title} ---\n{}\n", r.unwrap_or_else(|e| e)));
        };
        let node = self.node.as_str();
        section("ip route (node)", ns_run(node, &["ip", "route"]));
        section("ip neigh (node)", ns_run(node, &["ip", "neigh"]));
        if self.shape == Shape::Bridge {
            section(
                "bridge fdb (node)",
                ns_run(node, &["bridge", "fdb", "show", "br", BRIDGE_IF]),
            );
        }
        section("conntrack -L (node)", ns_run(node, &["conntrack", "-L"]));
        section(
            "iptables -L -v -n -x (node)",
            ns_run(node, &["iptables", "-L", "-v", "-n", "-x"]),
        );
        let att = std::panic::catch_unwind(|| bpf::tcx_attachments(node));
        section(
            "tcx attachments (node)",
            att.map(|a| {
                a.iter()
                    .map(|a| {
                        format!(
                            "{} {} {} prog {} link {}",
                            a.ifname, a.direction, a.prog_name, a.prog_id, a.link_id
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .map_err(|_| "query failed".to_owned()),
        );
        if self.bpffs_dir.exists()
            && let Some(bin) = lbproxy_bin_if_present()
        {
            let dir = self.bpffs_dir.display().to_string();
            for what in ["services", "flows"] {
                let r = ns_command(node, &bin)
                    .args(["inspect", what, "--bpffs-dir", &dir])
                    .output()
                    .map_err(|e| e.to_string())
                    .and_then(|o| ns::output_result("inspect", o));
                section(&format!("lbproxy inspect {what}"), r);
            }
        }
        for p in self.pods() {
            section(
                &format!("ip neigh (pod {})", p.name),
                ns_run(&p.netns, &["ip", "neigh"]),
            );
        }
        out.push_str("===== end diagnostics =====");
        out
    }

    /// `lbproxy cleanup --bpffs-dir DIR` inside the node namespace.
    pub fn lbproxy_cleanup(&self) -> Output {
        let dir = self.bpffs_dir.display().to_string();
        self.lbproxy_cmd(&["cleanup", "--bpffs-dir", &dir])
    }
}

impl Inspect for Lab {
    fn lbproxy_cmd(&self, args: &[&str]) -> Output {
        Lab::lbproxy_cmd(self, args)
    }

    fn bpffs_dir(&self) -> &Path {
        &self.bpffs_dir
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if (self.lbproxy_used.load(Ordering::SeqCst) || self.bpffs_dir.exists())
            && let Some(bin) = lbproxy_bin_if_present()
        {
            let dir = self.bpffs_dir.display().to_string();
            match ns_command(&self.node, &bin)
                .args(["cleanup", "--bpffs-dir", &dir])
                .output()
            {
                Ok(o) if o.status.success() => {}
                Ok(o) => eprintln!(
                    "lab {}: lbproxy cleanup failed ({}): {}",
                    self.id,
                    o.status,
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => eprintln!("lab {}: cannot run lbproxy cleanup: {e}", self.id),
            }
        }
        if self.bpffs_dir.exists() {
            let _ = std::fs::remove_dir_all(&self.bpffs_dir);
        }
        let pods: Vec<Pod> = self
            .state
            .lock()
            .map(|s| s.pods.values().cloned().collect())
            .unwrap_or_default();
        for p in &pods {
            let _ = quiet_ip(&self.node, &["link", "del", &p.host_if]);
            let _ = netns_del_quiet(&p.netns);
        }
        drop(self.cgroup.take());
        let _ = quiet_ip(&self.node, &["link", "del", UPLINK_IF]);
        let _ = quiet_ip(&self.node, &["link", "del", BRIDGE_IF]);
        let _ = netns_del_quiet(&self.uplink);
        let _ = netns_del_quiet(&self.node);
        if panicking {
            eprintln!(
                "lab {}: keeping work dir {} (logs, manifests)",
                self.id,
                self.workdir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.workdir);
        }
    }
}

/// True if a glob `<prefix>*` would match `name`.
fn glob_prefix_matches(prefix: &str, name: &str) -> bool {
    name.starts_with(prefix)
}

pub(crate) fn netns_add(ns: &str) {
    let out = Command::new("ip").args(["netns", "add", ns]).output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "lab: cannot create network namespace {ns}: `ip netns add` failed ({}): {}\n\
             The lab needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF); these tests never skip.",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("lab: cannot run `ip netns add {ns}` ({e}); is iproute2 installed?"),
    }
}

pub(crate) fn netns_del(ns: &str) {
    if let Err(e) = netns_del_quiet(ns) {
        panic!("lab: ip netns del {ns}: {e}");
    }
}

pub(crate) fn netns_del_quiet(ns: &str) -> Result<(), String> {
    let o = Command::new("ip")
        .args(["netns", "del", ns])
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

pub(crate) fn quiet_ip(ns: &str, args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .arg("-n")
        .arg(ns)
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// Runs `ip -n NS -batch -` with `cmds`; panics with the commands and stderr on failure.
/// Waits (up to 5 s) until `dev` in `ns` reports LOWER_UP (carrier); panics otherwise.
pub(crate) fn wait_lower_up(ns: &str, dev: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let out = Command::new("ip")
            .args(["-n", ns, "-o", "link", "show", "dev", dev])
            .output()
            .unwrap_or_else(|e| panic!("lab: cannot run ip: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains("LOWER_UP") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "lab: {dev} in {ns} has no carrier after 5 s: {text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

pub(crate) fn ip_batch(ns: &str, cmds: &[String]) {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("lab: cannot run ip: {e}"));
    {
        let mut stdin = child.stdin.take().unwrap();
        for c in cmds {
            writeln!(stdin, "{c}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        panic!(
            "lab: `ip -n {ns} -batch` failed ({}):\n{}\nstderr: {}",
            out.status,
            cmds.join("\n"),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

pub(crate) fn sysctl(ns: &str, key: &str, value: &str) {
    ns::sysctl_write(ns, key, value)
        .unwrap_or_else(|e| panic!("lab: [{ns}] sysctl {key}={value}: {e}"));
}

/// Where each lab process holds an exclusive `flock` for as long as it lives, so another
/// process sweeping stale labs can tell it is alive even when `/proc` does not show it (a
/// process in another PID namespace sharing this filesystem and bpffs).
const LOCK_DIR: &str = "/run/lbproxy-tests";

/// Takes this process's liveness lock (`LOCK_DIR/<pid>.lock`), held until it exits.
pub(crate) fn take_lock() {
    let _ = std::fs::create_dir_all(LOCK_DIR);
    let path = Path::new(LOCK_DIR).join(format!("{}.lock", std::process::id()));
    if let Ok(f) = std::fs::File::create(&path) {
        // SAFETY: flock on an fd we own; the file is leaked so the lock lives as long as us.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX) };
        std::mem::forget(f);
    }
}

/// Whether a live process holds `pid`'s liveness lock.
fn holds_lock(pid: &str) -> bool {
    let path = Path::new(LOCK_DIR).join(format!("{pid}.lock"));
    let Ok(f) = std::fs::File::open(&path) else {
        return false;
    };
    // SAFETY: flock on an fd we own.
    let rc = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    if rc == 0 {
        // Nobody holds it: stale. Our lock goes with `f`.
        let _ = std::fs::remove_file(&path);
        return false;
    }
    true
}

/// Removes namespaces and bpffs dirs left behind by lab processes that no longer exist
/// (e.g. a test binary that was killed). Runs once per process.
///
/// This runs before this process creates its first lab, so names carrying this process's own
/// pid are stale too (left by an earlier process that had the same pid; pids wrap quickly).
pub(crate) fn sweep_stale() {
    let me = std::process::id().to_string();
    let alive = |pid: &str| pid != me && (Path::new("/proc").join(pid).exists() || holds_lock(pid));
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("lbt-").and_then(|r| r.split('-').next())
                && pid.chars().all(|c| c.is_ascii_digit())
                && !alive(pid)
            {
                let _ = netns_del_quiet(&name);
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/fs/bpf") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name
                .strip_prefix("lbproxy-test-")
                .and_then(|r| r.split('-').next())
                && pid.chars().all(|c| c.is_ascii_digit())
                && !alive(pid)
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}
