//! Configuration: a `--config` file that holds kube-proxy's own `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`, as kubeadm and kind write it into the kube-proxy
//! ConfigMap's `config.conf`) and, in a second YAML document, lbproxy's own settings
//! (`lbproxy.io/v1alpha1` `LbproxyConfiguration`). Either document may be left out. Flags
//! override the file.
//!
//! ```yaml
//! apiVersion: kubeproxy.config.k8s.io/v1alpha1
//! kind: KubeProxyConfiguration
//! clientConnection: {kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 5, burst: 10}
//! hostnameOverride: ""
//! healthzBindAddress: 0.0.0.0:10256
//! metricsBindAddress: 127.0.0.1:10249
//! iptables: {syncPeriod: 30s, minSyncPeriod: 0s}   # or nftables.*, or top-level syncPeriod
//! nodePortAddresses: [192.0.2.0/24]                 # CIDRs or [primary]; default every IPv4 address
//! conntrack: {tcpEstablishedTimeout: 24h, tcpCloseWaitTimeout: 1h, udpTimeout: 30s}
//! logging: {format: json, verbosity: 2}
//! mode: ""                                          # anything but "" or ebpf: warned, ignored
//! ---
//! apiVersion: lbproxy.io/v1alpha1
//! kind: LbproxyConfiguration
//! podInterfaces: ["lxc*", "veth*", "cali*"]
//! bpffsDir: /sys/fs/bpf/lbproxy
//! flowMapSize: 262144
//! stackBypass: false
//! socketLb: host
//! cgroupRoot: ""
//! snatPortRange: 1024-29999
//! tcpSynSentTimeout: 30s
//! manifests: ""
//! ```
//!
//! kube-proxy's rules hold for its document: an empty value (`""`, `0`, `0s`, `null`) means
//! the default. Every field of v1alpha1 is read ([`KUBE_PROXY_FIELDS`] says what each one
//! does here). A field lbproxy has no use for (`ipvs`, `winkernel`, `mode: iptables`, ...) is
//! ignored with one warning that names each one; a field v1alpha1 does not have is warned
//! about and ignored, as kube-proxy's lenient decoding does. lbproxy's own document refuses
//! unknown fields. Every value is validated at start; an invalid one is refused naming the
//! file and the field.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

mod documents;
mod durations;
mod errors;
mod fields;
mod flags;
mod kube_proxy;
mod resolve;
#[cfg(test)]
mod resolve_tests;
#[cfg(test)]
mod tests;
mod values;

pub use documents::*;
pub use durations::*;
pub use errors::*;
pub use fields::*;
pub use flags::{Flags, RunArgs};
pub use kube_proxy::*;
pub use resolve::*;
pub(crate) use values::*;

pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/lbproxy";
pub const DEFAULT_POD_INTERFACES: &str = "lxc*,veth*,cali*";
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
pub const DEFAULT_METRICS_PORT: u16 = 10249;
pub const DEFAULT_HEALTHZ: &str = "0.0.0.0:10256";
pub const DEFAULT_METRICS: &str = "127.0.0.1:10249";
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// 0: every change is written as soon as the loop is free. A diff costs microseconds per
/// changed endpoint, and changes that arrive while a sync runs are coalesced into the next
/// one, so a floor only adds latency. Raise it to bound map writes on a churning cluster.
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::ZERO;
/// kube-proxy's `configSyncPeriod` default.
pub const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);
/// client-go's defaults, which kube-proxy keeps (`clientConnection.qps`, `.burst`).
pub const DEFAULT_QPS: f32 = 5.0;
pub const DEFAULT_BURST: u32 = 10;

pub const KUBE_PROXY_API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KUBE_PROXY_KIND: &str = "KubeProxyConfiguration";
pub const LBPROXY_API_VERSION: &str = "lbproxy.io/v1alpha1";
pub const LBPROXY_KIND: &str = "LbproxyConfiguration";

/// A config file, read: its two documents and what was ignored in it.
#[derive(Debug, Default, Clone)]
pub struct FileConfig {
    pub kube: KubeProxyDoc,
    pub own: LbproxyDoc,
    /// One line per ignored field or value, naming it and why.
    pub warnings: Vec<String>,
}

/// How log lines are written (`--logging-format`, `logging.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

/// How a new flow picks its backend (`--lb-algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LbAlgorithm {
    /// Jump consistent hashing over the frontend's slots, with the node's seed.
    Jump,
    /// A Maglev table per frontend, built from the backends' addresses and the seed.
    Maglev,
}

impl LbAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Jump => "jump",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

/// How north-south flows reach a backend on another node (`--load-balancer-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadBalancerMode {
    /// Source-NATed to the receiving node's address; replies come back through it.
    Snat,
    /// Direct server return for TCP and UDP: the backend sees the client's address and its
    /// node answers the client itself, from the frontend.
    Dsr,
    /// Direct server return for TCP, SNAT for UDP.
    Hybrid,
}

impl LoadBalancerMode {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadBalancerMode::Snat => "snat",
            LoadBalancerMode::Dsr => "dsr",
            LoadBalancerMode::Hybrid => "hybrid",
        }
    }

    /// The `DatapathConfig` flags of the mode (`CONFIG_F_DSR_TCP`, `CONFIG_F_DSR_UDP`).
    pub fn config_flags(self) -> u32 {
        match self {
            LoadBalancerMode::Snat => 0,
            LoadBalancerMode::Dsr => {
                lbproxy_common::CONFIG_F_DSR_TCP | lbproxy_common::CONFIG_F_DSR_UDP
            }
            LoadBalancerMode::Hybrid => lbproxy_common::CONFIG_F_DSR_TCP,
        }
    }
}

/// Where north-south translation runs at XDP (`--xdp-acceleration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpAcceleration {
    /// `lb_xdp` in native (driver) mode on every node interface; an interface that refuses
    /// it is an error, and lbproxy does not start.
    Native,
    /// Native where the driver takes it; an interface that refuses it keeps the TC programs
    /// alone, said once per interface.
    BestEffort,
    /// No XDP program: the TC programs alone (the default). Any XDP program an earlier run
    /// attached is detached.
    Disabled,
}

impl XdpAcceleration {
    pub fn as_str(self) -> &'static str {
        match self {
            XdpAcceleration::Native => "native",
            XdpAcceleration::BestEffort => "best-effort",
            XdpAcceleration::Disabled => "disabled",
        }
    }
}

/// Where socket-level load balancing applies (`--socket-lb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketLb {
    /// No cgroup programs: the node's own processes are not load-balanced.
    Off,
    /// The node's own processes (its network namespace): the default.
    Host,
    /// The node's processes and pods' alike (every network namespace under the cgroup).
    Pods,
}

impl SocketLb {
    pub fn as_str(self) -> &'static str {
        match self {
            SocketLb::Off => "off",
            SocketLb::Host => "host",
            SocketLb::Pods => "pods",
        }
    }
}

/// Where the cgroup programs attach (`--cgroup-root`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupRoot {
    /// Not given: `/sys/fs/cgroup` when that is cgroup v2, else lbproxy's own cgroup2
    /// mount at `/run/lbproxy/cgroupv2` (see `bpf::sock::resolve_cgroup_root`).
    Default,
    /// This directory, which must be a cgroup v2 directory.
    Path(PathBuf),
}

/// Which of the node's addresses serve NodePorts (kube-proxy's `nodePortAddresses`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every address (IPv4, and global IPv6) on the node's interfaces that are not pod
    /// interfaces, except loopback (kube-proxy's default when the field is empty).
    All,
    /// The addresses within these CIDRs; for a family none of them is of, every address of
    /// that family (as kube-proxy, which reads the list per family).
    Cidrs(Vec<ipnet::IpNet>),
    /// `primary`: the node's primary address of each family only. lbproxy reads it from
    /// the node's routes (`bpf::ifaces::Link`'s `v4.primary` and `v6.primary`: the preferred
    /// source of the main table's default route, else the first address of the interface
    /// it leaves by), which is the address kubelet takes as the node IP when `--node-ip` is
    /// not given; kube-proxy reads it from the Node object. It follows route changes.
    Primary,
}

impl NodePortAddresses {
    /// Whether NodePorts are served on `addr`, one of the node's own addresses, when the
    /// node's primary address of `addr`'s family is `primary` (see
    /// [`NodePortAddresses::Primary`]).
    pub fn contains(&self, addr: std::net::IpAddr, primary: Option<std::net::IpAddr>) -> bool {
        match self {
            NodePortAddresses::All => true,
            // As kube-proxy, per family: no CIDR of the address's family means every
            // address of that family.
            NodePortAddresses::Cidrs(c) => {
                let mut of_family = c
                    .iter()
                    .filter(|n| n.addr().is_ipv4() == addr.is_ipv4())
                    .peekable();
                of_family.peek().is_none() || of_family.any(|n| n.contains(&addr))
            }
            NodePortAddresses::Primary => primary == Some(addr),
        }
    }
}

/// The effective, validated settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub kubeconfig: Option<PathBuf>,
    pub hostname: String,
    pub healthz_bind_address: SocketAddr,
    pub metrics_bind_address: SocketAddr,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub pod_interfaces: Vec<String>,
    pub bpffs_dir: PathBuf,
    pub flow_map_size: u32,
    /// Redirect translated packets between local pods straight into the destination pod,
    /// past the node's routing and netfilter (off by default: see the README).
    pub stack_bypass: bool,
    /// Take the node over from kube-proxy at start (`--takeover`, `takeover: true`).
    pub takeover: bool,
    pub manifests: Option<PathBuf>,
    pub flow_timeouts: crate::bpf::flow_gc::Timeouts,
    pub node_port_addresses: NodePortAddresses,
    /// Ports of source-NATed flows, inclusive.
    pub snat_port_range: (u16, u16),
    pub cgroup_root: CgroupRoot,
    pub socket_lb: SocketLb,
    /// `--lb-algorithm`, and the Maglev tables' size (`--maglev-table-size`, a prime).
    pub lb_algorithm: LbAlgorithm,
    pub maglev_table_size: u32,
    /// `--hash-seed-file`: the flow-hash seed comes from this file's content, not from the
    /// node's own random seed.
    pub hash_seed_file: Option<PathBuf>,
    /// `--load-balancer-mode`: SNAT or direct server return for north-south flows to
    /// backends on other nodes.
    pub load_balancer_mode: LoadBalancerMode,
    /// `--per-service-metrics`: the datapath counts traffic by Service.
    pub per_service_metrics: bool,
    /// `--xdp-acceleration`: whether `lb_xdp` runs on the node's interfaces.
    pub xdp_acceleration: XdpAcceleration,
    /// kube-proxy's `bindAddress`: validated; lbproxy serves IPv4 and needs no node IP hint.
    pub bind_address: Option<IpAddr>,
    /// The API client's request rate limit (`clientConnection.qps`; negative: none) and burst.
    pub qps: f32,
    pub burst: u32,
    pub log_format: LogFormat,
    /// `-v`/`logging.verbosity`: 0-2 info, 3-4 debug, 5 and up trace.
    pub verbosity: u32,
    pub config_sync_period: Duration,
    /// kube-proxy's `clusterCIDR`, validated (no effect: see [`KUBE_PROXY_FIELDS`]).
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// kube-proxy's `detectLocalMode` ("" for the default); `InterfaceNamePrefix` sets the
    /// pod interfaces when `podInterfaces` is not given.
    pub detect_local_mode: String,
    pub interface_name_prefix: Option<String>,
    /// Written to `/proc/self/oom_score_adj` at start when given.
    pub oom_score_adj: Option<i32>,
}

impl Settings {
    /// The effective configuration as the two documents a config file holds; fed back to
    /// `--config`, they give these same settings (`--write-config-to`, `/configz`).
    pub fn documents(&self) -> (Value, Value) {
        let t = &self.flow_timeouts;
        let node_port_addresses: Vec<String> = match &self.node_port_addresses {
            NodePortAddresses::All => Vec::new(),
            NodePortAddresses::Primary => vec!["primary".into()],
            NodePortAddresses::Cidrs(c) => c.iter().map(ToString::to_string).collect(),
        };
        let kube = json!({
            "apiVersion": KUBE_PROXY_API_VERSION,
            "kind": KUBE_PROXY_KIND,
            "mode": "ebpf",
            "bindAddress": self.bind_address.map(|a| a.to_string()).unwrap_or_default(),
            "healthzBindAddress": self.healthz_bind_address.to_string(),
            "metricsBindAddress": self.metrics_bind_address.to_string(),
            "hostnameOverride": self.hostname,
            "clientConnection": {
                "kubeconfig": self.kubeconfig.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                "qps": self.qps,
                "burst": self.burst,
                "contentType": "application/json",
            },
            "clusterCIDR": self.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
            "configSyncPeriod": go_duration(self.config_sync_period),
            "syncPeriod": go_duration(self.sync_period),
            "minSyncPeriod": go_duration(self.min_sync_period),
            "nodePortAddresses": node_port_addresses,
            "conntrack": {
                "tcpEstablishedTimeout": go_duration(t.tcp_established),
                "tcpCloseWaitTimeout": go_duration(t.tcp_half_closed),
                "udpTimeout": go_duration(t.udp),
            },
            "detectLocalMode": self.detect_local_mode,
            "detectLocal": {
                "interfaceNamePrefix": self.interface_name_prefix.clone().unwrap_or_default(),
            },
            "logging": {
                "format": self.log_format.as_str(),
                "verbosity": self.verbosity,
            },
            "oomScoreAdj": self.oom_score_adj,
        });
        let own = json!({
            "apiVersion": LBPROXY_API_VERSION,
            "kind": LBPROXY_KIND,
            "podInterfaces": self.pod_interfaces,
            "bpffsDir": self.bpffs_dir.display().to_string(),
            "flowMapSize": self.flow_map_size,
            "stackBypass": self.stack_bypass,
            "takeover": self.takeover,
            "manifests": self.manifests.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            "snatPortRange": format!("{}-{}", self.snat_port_range.0, self.snat_port_range.1),
            "cgroupRoot": match &self.cgroup_root {
                CgroupRoot::Default => String::new(),
                CgroupRoot::Path(p) => p.display().to_string(),
            },
            "socketLb": self.socket_lb.as_str(),
            "lbAlgorithm": self.lb_algorithm.as_str(),
            "maglevTableSize": self.maglev_table_size,
            "hashSeedFile": self.hash_seed_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            "xdpAcceleration": self.xdp_acceleration.as_str(),
            "loadBalancerMode": self.load_balancer_mode.as_str(),
            "perServiceMetrics": self.per_service_metrics,
            "tcpSynSentTimeout": go_duration(t.tcp_syn_sent),
        });
        (kube, own)
    }

    /// `--write-config-to`: both documents as one YAML file.
    pub fn to_yaml(&self) -> String {
        let (kube, own) = self.documents();
        let mut out = String::from(
            "# The effective configuration of lbproxy, written by --write-config-to.\n",
        );
        for doc in [kube, own] {
            out.push_str("---\n");
            out.push_str(&serde_saphyr::to_string(&doc).unwrap_or_else(|e| format!("# {e}\n")));
        }
        out
    }

    /// `/configz`: the running configuration, keyed by API group as kube-proxy's is.
    pub fn configz(&self) -> Value {
        let (kube, own) = self.documents();
        json!({ "kubeproxy.config.k8s.io": kube, "lbproxy.io": own })
    }
}
