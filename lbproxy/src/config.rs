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
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

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

/// What lbproxy does with a field of kube-proxy's `KubeProxyConfiguration` v1alpha1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Applied (see the README's configuration table).
    Applied,
    /// Read and validated; it needs nothing from lbproxy (the reason says why).
    NoEffect(&'static str),
    /// Not used; a value other than the empty one is warned about.
    Ignored(&'static str),
    /// A block whose fields are listed on their own.
    Block,
    /// A free-form map (its keys are not checked).
    Map(&'static str),
}

/// Every field of kube-proxy's `KubeProxyConfiguration` v1alpha1 (Kubernetes 1.34), dotted.
pub const KUBE_PROXY_FIELDS: &[(&str, Use)] = &[
    ("apiVersion", Use::Applied),
    ("kind", Use::Applied),
    (
        "featureGates",
        Use::Map("kube-proxy's feature gates do not apply to lbproxy"),
    ),
    ("clientConnection", Use::Block),
    ("clientConnection.kubeconfig", Use::Applied),
    ("clientConnection.qps", Use::Applied),
    ("clientConnection.burst", Use::Applied),
    ("clientConnection.contentType", Use::Applied),
    ("clientConnection.acceptContentTypes", Use::Applied),
    ("logging", Use::Block),
    ("logging.format", Use::Applied),
    ("logging.verbosity", Use::Applied),
    (
        "logging.flushFrequency",
        Use::NoEffect("lbproxy writes every log line at once"),
    ),
    (
        "logging.vmodule",
        Use::Ignored("per-file verbosity is klog's; use RUST_LOG"),
    ),
    ("logging.options", Use::Map("klog's buffering options")),
    ("hostnameOverride", Use::Applied),
    ("bindAddress", Use::Applied),
    ("healthzBindAddress", Use::Applied),
    ("metricsBindAddress", Use::Applied),
    (
        "bindAddressHardFail",
        Use::NoEffect("lbproxy always exits when it cannot bind its addresses"),
    ),
    (
        "enableProfiling",
        Use::Ignored("lbproxy serves no pprof endpoints"),
    ),
    (
        "showHiddenMetricsForVersion",
        Use::Ignored("lbproxy hides no metrics"),
    ),
    ("mode", Use::Applied),
    ("iptables", Use::Block),
    (
        "iptables.masqueradeBit",
        Use::Ignored("lbproxy marks no packets for masquerade"),
    ),
    (
        "iptables.masqueradeAll",
        Use::Ignored("lbproxy source-NATs only what must come back through the node"),
    ),
    (
        "iptables.localhostNodePorts",
        Use::Ignored("lbproxy does not serve NodePorts on localhost"),
    ),
    ("iptables.syncPeriod", Use::Applied),
    ("iptables.minSyncPeriod", Use::Applied),
    ("ipvs", Use::Block),
    ("ipvs.syncPeriod", Use::Ignored("the ipvs mode's")),
    ("ipvs.minSyncPeriod", Use::Ignored("the ipvs mode's")),
    (
        "ipvs.scheduler",
        Use::Ignored("lbproxy selects backends by consistent hashing"),
    ),
    ("ipvs.excludeCIDRs", Use::Ignored("the ipvs mode's")),
    ("ipvs.strictARP", Use::Ignored("the ipvs mode's")),
    (
        "ipvs.tcpTimeout",
        Use::Ignored("the ipvs mode's; lbproxy's flow timeouts are conntrack.*"),
    ),
    (
        "ipvs.tcpFinTimeout",
        Use::Ignored("the ipvs mode's; lbproxy's flow timeouts are conntrack.*"),
    ),
    (
        "ipvs.udpTimeout",
        Use::Ignored("the ipvs mode's; lbproxy's flow timeouts are conntrack.*"),
    ),
    ("nftables", Use::Block),
    (
        "nftables.masqueradeBit",
        Use::Ignored("lbproxy marks no packets for masquerade"),
    ),
    (
        "nftables.masqueradeAll",
        Use::Ignored("lbproxy source-NATs only what must come back through the node"),
    ),
    ("nftables.syncPeriod", Use::Applied),
    ("nftables.minSyncPeriod", Use::Applied),
    ("winkernel", Use::Block),
    ("winkernel.networkName", Use::Ignored("Windows only")),
    ("winkernel.sourceVip", Use::Ignored("Windows only")),
    ("winkernel.enableDSR", Use::Ignored("Windows only")),
    (
        "winkernel.rootHnsEndpointName",
        Use::Ignored("Windows only"),
    ),
    (
        "winkernel.forwardHealthCheckVip",
        Use::Ignored("Windows only"),
    ),
    ("windowsRunAsService", Use::Ignored("Windows only")),
    ("detectLocalMode", Use::Applied),
    ("detectLocal", Use::Block),
    (
        "detectLocal.bridgeInterface",
        Use::Ignored(
            "lbproxy attaches to the pods' own interfaces (podInterfaces), not to a bridge",
        ),
    ),
    ("detectLocal.interfaceNamePrefix", Use::Applied),
    (
        "clusterCIDR",
        Use::NoEffect(
            "lbproxy tells pod traffic by the interface it arrives on, not by its source address",
        ),
    ),
    ("nodePortAddresses", Use::Applied),
    ("oomScoreAdj", Use::Applied),
    ("conntrack", Use::Block),
    (
        "conntrack.maxPerCore",
        Use::Ignored("lbproxy's flow table is sized by flowMapSize, in LbproxyConfiguration"),
    ),
    (
        "conntrack.min",
        Use::Ignored("lbproxy's flow table is sized by flowMapSize, in LbproxyConfiguration"),
    ),
    ("conntrack.tcpEstablishedTimeout", Use::Applied),
    ("conntrack.tcpCloseWaitTimeout", Use::Applied),
    (
        "conntrack.tcpBeLiberal",
        Use::Ignored("lbproxy's flow table does not track TCP windows"),
    ),
    ("conntrack.udpTimeout", Use::Applied),
    (
        "conntrack.udpStreamTimeout",
        Use::Ignored("lbproxy has one UDP timeout, conntrack.udpTimeout"),
    ),
    (
        "configSyncPeriod",
        Use::NoEffect("lbproxy's watches need no informer resync; syncPeriod repairs the maps"),
    ),
    (
        "portRange",
        Use::Ignored("the userspace proxy's, removed from kube-proxy"),
    ),
    // Short forms lbproxy has always read (and kube-proxy's v1alpha2 moved here).
    ("syncPeriod", Use::Applied),
    ("minSyncPeriod", Use::Applied),
];

/// lbproxy's own fields, which belong in the `LbproxyConfiguration` document.
const LBPROXY_FIELDS: &[&str] = &[
    "podInterfaces",
    "bpffsDir",
    "flowMapSize",
    "stackBypass",
    "manifests",
    "snatPortRange",
    "cgroupRoot",
    "socketLb",
    "tcpSynSentTimeout",
];

/// lbproxy's own document. Unknown fields are refused.
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LbproxyDoc {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub pod_interfaces: Option<Vec<String>>,
    pub bpffs_dir: Option<String>,
    pub flow_map_size: Option<u64>,
    pub stack_bypass: Option<bool>,
    pub manifests: Option<String>,
    pub snat_port_range: Option<String>,
    pub cgroup_root: Option<String>,
    pub socket_lb: Option<String>,
    /// How long an unanswered SYN keeps its flow (kube-proxy has no such field).
    pub tcp_syn_sent_timeout: Option<String>,
}

/// The fields of kube-proxy's document that lbproxy applies, as written (empty values are
/// `None`: kube-proxy's "use the default").
#[derive(Debug, Default, Clone)]
pub struct KubeProxyDoc {
    pub kubeconfig: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub config_sync_period: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub cluster_cidr: Option<String>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub udp_timeout: Option<String>,
    pub logging_format: Option<String>,
    pub verbosity: Option<i64>,
    pub detect_local_mode: Option<String>,
    pub interface_name_prefix: Option<String>,
    pub oom_score_adj: Option<i64>,
}

/// A config file, read: its two documents and what was ignored in it.
#[derive(Debug, Default, Clone)]
pub struct FileConfig {
    pub kube: KubeProxyDoc,
    pub own: LbproxyDoc,
    /// One line per ignored field or value, naming it and why.
    pub warnings: Vec<String>,
}

/// Values given on the command line; `None` means "not given".
#[derive(Debug, Default)]
pub struct Flags {
    pub kubeconfig: Option<String>,
    pub hostname_override: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub pod_interfaces: Option<String>,
    pub bpffs_dir: Option<PathBuf>,
    pub flow_map_size: Option<u64>,
    pub stack_bypass: Option<bool>,
    pub manifests: Option<PathBuf>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub udp_timeout: Option<String>,
    pub tcp_syn_sent_timeout: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub snat_port_range: Option<String>,
    pub cgroup_root: Option<PathBuf>,
    pub socket_lb: Option<String>,
    pub logging_format: Option<String>,
    pub verbosity: Option<u32>,
    pub kube_api_qps: Option<f64>,
    pub kube_api_burst: Option<u32>,
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
    /// the node's routes (`bpf::ifaces::Link::primary_v4` and `primary_v6`: the preferred
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
    pub manifests: Option<PathBuf>,
    pub flow_timeouts: crate::bpf::flow_gc::Timeouts,
    pub node_port_addresses: NodePortAddresses,
    /// Ports of source-NATed flows, inclusive.
    pub snat_port_range: (u16, u16),
    pub cgroup_root: CgroupRoot,
    pub socket_lb: SocketLb,
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

/// `--nodeport-addresses`: comma-separated CIDRs, or `primary`; empty means all.
fn parse_node_port_addresses(
    origin: &str,
    items: &[String],
) -> Result<NodePortAddresses, ConfigError> {
    let field = "nodePortAddresses";
    let items: Vec<&str> = items
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Ok(NodePortAddresses::All);
    }
    if items == ["primary"] {
        return Ok(NodePortAddresses::Primary);
    }
    if items.contains(&"primary") {
        return Err(err(
            origin,
            field,
            format!("can't use both \"primary\" and CIDRs (got {items:?})"),
        ));
    }
    let mut cidrs = Vec::new();
    for it in items {
        let net: ipnet::IpNet = it.parse().map_err(|_| {
            err(
                origin,
                field,
                format!("{it:?} is neither a CIDR (e.g. 192.0.2.0/24) nor \"primary\""),
            )
        })?;
        cidrs.push(net);
    }
    Ok(NodePortAddresses::Cidrs(cidrs))
}

/// `--snat-port-range`: `MIN-MAX`, 1024 <= MIN <= MAX <= 65535.
fn parse_port_range(origin: &str, text: &str) -> Result<(u16, u16), ConfigError> {
    let field = "snatPortRange";
    let bad = || {
        err(
            origin,
            field,
            format!("{text:?} is not MIN-MAX with 1024 <= MIN <= MAX <= 65535"),
        )
    };
    let (a, b) = text.split_once('-').ok_or_else(bad)?;
    let a: u16 = a.trim().parse().map_err(|_| bad())?;
    let b: u16 = b.trim().parse().map_err(|_| bad())?;
    if a < 1024 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// A refused setting: where it came from, which field, and why.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {origin}: {field}: {reason}")]
pub struct ConfigError {
    pub origin: String,
    pub field: String,
    pub reason: String,
}

fn err(origin: &str, field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        origin: origin.to_string(),
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Reads the values of kube-proxy's document, naming the dotted field in every error.
struct Doc<'a> {
    origin: &'a str,
    root: &'a Value,
}

impl Doc<'_> {
    fn at(&self, path: &str) -> Option<&Value> {
        path.split('.').try_fold(self.root, |v, k| v.get(k))
    }

    /// A string; `null` and `""` are "not set".
    fn string(&self, path: &str) -> Result<Option<String>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
            Some(other) => Err(err(self.origin, path, format!("{other} is not a string"))),
        }
    }

    /// A duration as a string; `0s` (and `0`) is "not set", as in kube-proxy.
    fn duration(&self, path: &str) -> Result<Option<String>, ConfigError> {
        Ok(self
            .string(path)?
            .filter(|s| parse_go_duration(s) != Some(Duration::ZERO)))
    }

    /// A number; `null` is "not set" (0 is returned as 0: the caller knows what it means).
    fn number(&self, path: &str) -> Result<Option<f64>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(err(self.origin, path, format!("{other} is not a number"))),
        }
    }

    fn integer(&self, path: &str) -> Result<Option<i64>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_i64().is_some() => Ok(n.as_i64()),
            Some(other) => Err(err(self.origin, path, format!("{other} is not an integer"))),
        }
    }

    /// A list of strings; `null` and `[]` are "not set".
    fn strings(&self, path: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => {
                let mut out = Vec::new();
                for it in items {
                    match it {
                        Value::String(s) => out.push(s.clone()),
                        other => {
                            return Err(err(self.origin, path, format!("{other} is not a string")));
                        }
                    }
                }
                Ok(Some(out).filter(|v| !v.is_empty()))
            }
            Some(other) => Err(err(
                self.origin,
                path,
                format!("{other} is not a list of strings"),
            )),
        }
    }
}

/// Whether a value is other than kube-proxy's empty one (`null`, `""`, `0`, `0s`, `false`,
/// `[]`, or a mapping of only such values).
fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => {
            let s = s.trim();
            !s.is_empty() && parse_go_duration(s) != Some(Duration::ZERO)
        }
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => m.values().any(is_set),
    }
}

/// Checks the keys of kube-proxy's document against [`KUBE_PROXY_FIELDS`]: lbproxy's own
/// fields are refused (they belong in the other document); fields lbproxy ignores that carry
/// a value go to `ignored`; fields v1alpha1 does not have go to `unknown`.
fn check_kube_fields(
    origin: &str,
    map: &serde_json::Map<String, Value>,
    prefix: &str,
    ignored: &mut Vec<String>,
    unknown: &mut Vec<String>,
) -> Result<(), ConfigError> {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let known = KUBE_PROXY_FIELDS
            .iter()
            .find(|(p, _)| *p == path)
            .map(|(_, u)| *u);
        match known {
            None if (prefix.is_empty() && LBPROXY_FIELDS.contains(&k.as_str()))
                || path == "conntrack.tcpSynSentTimeout" =>
            {
                return Err(err(
                    origin,
                    &path,
                    format!(
                        "is lbproxy's own field, not kube-proxy's: move it to the \
                         {LBPROXY_KIND} document (apiVersion: {LBPROXY_API_VERSION}){}",
                        if path.contains('.') {
                            format!(" as {k}")
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
            None => unknown.push(path),
            Some(Use::Block) => match v {
                Value::Object(m) => check_kube_fields(origin, m, &path, ignored, unknown)?,
                Value::Null => {}
                other => return Err(err(origin, &path, format!("{other} is not a mapping"))),
            },
            Some(Use::Ignored(why) | Use::Map(why)) => {
                if is_set(v) {
                    ignored.push(format!("{path} ({why})"));
                }
            }
            Some(Use::Applied | Use::NoEffect(_)) => {}
        }
    }
    Ok(())
}

/// Reads kube-proxy's document.
fn kube_doc(
    origin: &str,
    root: &Value,
    warnings: &mut Vec<String>,
) -> Result<KubeProxyDoc, ConfigError> {
    let Value::Object(map) = root else {
        return Err(err(origin, "(document)", "is not a mapping"));
    };
    let (mut ignored, mut unknown) = (Vec::new(), Vec::new());
    check_kube_fields(origin, map, "", &mut ignored, &mut unknown)?;
    let d = Doc { origin, root };
    let mode = d.string("mode")?;
    if let Some(m) = mode.as_deref().filter(|m| *m != "ebpf") {
        ignored.insert(
            0,
            format!("mode: {m:?} (lbproxy is an eBPF proxy: it writes no iptables, ipvs or nftables rules)"),
        );
    }
    for path in [
        "clientConnection.contentType",
        "clientConnection.acceptContentTypes",
    ] {
        if let Some(ct) = d.string(path)?
            && ct.split(',').any(|t| t.trim() != "application/json")
        {
            ignored.push(format!(
                "{path}: {ct:?} (lbproxy's client speaks application/json only)"
            ));
        }
    }
    if !ignored.is_empty() {
        warnings.push(format!(
            "{origin}: ignoring KubeProxyConfiguration fields lbproxy has no use for: {}",
            ignored.join("; ")
        ));
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "{origin}: ignoring fields KubeProxyConfiguration v1alpha1 does not have (as kube-proxy's lenient decoding does): {}",
            unknown.join(", ")
        ));
    }
    // The sync periods: the short form, else the block of the configured mode, else the
    // iptables block, else the nftables one.
    let mode_block = match mode.as_deref() {
        Some("nftables") => "nftables",
        _ => "iptables",
    };
    let other_block = if mode_block == "iptables" {
        "nftables"
    } else {
        "iptables"
    };
    let period = |field: &str| -> Result<Option<String>, ConfigError> {
        for path in [
            field.to_string(),
            format!("{mode_block}.{field}"),
            format!("{other_block}.{field}"),
        ] {
            if let Some(v) = d.duration(&path)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    };
    Ok(KubeProxyDoc {
        kubeconfig: d.string("clientConnection.kubeconfig")?,
        qps: d.number("clientConnection.qps")?.filter(|q| *q != 0.0),
        burst: d.integer("clientConnection.burst")?.filter(|b| *b != 0),
        hostname_override: d.string("hostnameOverride")?,
        bind_address: d.string("bindAddress")?,
        healthz_bind_address: d.string("healthzBindAddress")?,
        metrics_bind_address: d.string("metricsBindAddress")?,
        sync_period: period("syncPeriod")?,
        min_sync_period: period("minSyncPeriod")?,
        config_sync_period: d.duration("configSyncPeriod")?,
        node_port_addresses: d.strings("nodePortAddresses")?,
        cluster_cidr: d.string("clusterCIDR")?,
        tcp_established_timeout: d.duration("conntrack.tcpEstablishedTimeout")?,
        tcp_close_wait_timeout: d.duration("conntrack.tcpCloseWaitTimeout")?,
        udp_timeout: d.duration("conntrack.udpTimeout")?,
        logging_format: d.string("logging.format")?,
        verbosity: d.integer("logging.verbosity")?,
        detect_local_mode: d.string("detectLocalMode")?,
        interface_name_prefix: d.string("detectLocal.interfaceNamePrefix")?,
        oom_score_adj: d.integer("oomScoreAdj")?,
    })
}

/// Parses a config file's text: kube-proxy's document, lbproxy's, or both (YAML documents
/// separated by `---`). A document with neither `apiVersion` nor `kind` is kube-proxy's.
pub fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    let origin = path.display().to_string();
    // YAML 1.2 booleans only: `hostnameOverride: n` is the name "n", not false.
    let docs: Vec<Value> = crate::yaml::documents(text)
        .map_err(|e| err(&origin, "(file)", format!("not valid YAML: {e}")))?;
    let mut out = FileConfig::default();
    let (mut kube_seen, mut own_seen) = (false, false);
    for (i, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let which = format!("document {}", i + 1);
        let Value::Object(map) = &doc else {
            return Err(err(&origin, &which, "is not a mapping"));
        };
        let text_of = |k: &str| map.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let (api, kind) = (text_of("apiVersion"), text_of("kind"));
        if kind == LBPROXY_KIND || api == LBPROXY_API_VERSION {
            if api != LBPROXY_API_VERSION {
                return Err(err(
                    &origin,
                    "apiVersion",
                    format!("{api:?} is not {LBPROXY_API_VERSION} (kind {LBPROXY_KIND})"),
                ));
            }
            if kind != LBPROXY_KIND {
                return Err(err(
                    &origin,
                    "kind",
                    format!("{kind:?} is not {LBPROXY_KIND} (apiVersion {LBPROXY_API_VERSION})"),
                ));
            }
            if std::mem::replace(&mut own_seen, true) {
                return Err(err(
                    &origin,
                    &which,
                    format!("a second {LBPROXY_KIND} document"),
                ));
            }
            out.own = serde_json::from_value(doc).map_err(|e| {
                // serde names the unknown or mistyped field in its message.
                let msg = e.to_string();
                let field = msg
                    .split('`')
                    .nth(1)
                    .filter(|_| msg.starts_with("unknown field"))
                    .unwrap_or(LBPROXY_KIND)
                    .to_string();
                err(&origin, &field, msg)
            })?;
        } else if kind == KUBE_PROXY_KIND
            || api.starts_with("kubeproxy.config.k8s.io/")
            || (kind.is_empty() && api.is_empty())
        {
            if !api.is_empty() && api != KUBE_PROXY_API_VERSION {
                return Err(err(
                    &origin,
                    "apiVersion",
                    format!("{api:?} is not {KUBE_PROXY_API_VERSION}"),
                ));
            }
            if !kind.is_empty() && kind != KUBE_PROXY_KIND {
                return Err(err(
                    &origin,
                    "kind",
                    format!("{kind:?} is not {KUBE_PROXY_KIND}"),
                ));
            }
            if std::mem::replace(&mut kube_seen, true) {
                return Err(err(
                    &origin,
                    &which,
                    format!("a second {KUBE_PROXY_KIND} document"),
                ));
            }
            out.kube = kube_doc(&origin, &doc, &mut out.warnings)?;
        } else {
            return Err(err(
                &origin,
                "kind",
                format!(
                    "{kind:?} (apiVersion {api:?}) is neither {KUBE_PROXY_KIND} ({KUBE_PROXY_API_VERSION}) nor {LBPROXY_KIND} ({LBPROXY_API_VERSION})"
                ),
            ));
        }
    }
    Ok(out)
}

/// A Go (`metav1.Duration`) duration: `1h2m3.5s`, `500ms`, `24h0m0s`, `0`.
pub fn parse_go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    if s.is_empty() {
        return None;
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    Duration::try_from_secs_f64(total).ok()
}

/// A duration as Go prints it (`24h0m0s`, `1m30s`, `500ms`), which kube-proxy reads back.
pub fn go_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d < Duration::from_secs(1) {
        let ms = d.as_secs_f64() * 1e3;
        return if ms.fract() == 0.0 {
            format!("{ms}ms")
        } else {
            format!("{}us", d.as_micros())
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let frac = d.subsec_nanos();
    let s = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{:09}", frac);
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => s,
        (0, m) => format!("{m}m{s}"),
        (h, m) => format!("{h}h{m}m{s}"),
    }
}

/// A duration field: Go's form first (kube-proxy's), then humantime's (`1 day`, `2m 30s`).
pub fn parse_duration(origin: &str, field: &str, s: &str) -> Result<Duration, ConfigError> {
    parse_go_duration(s)
        .or_else(|| humantime::parse_duration(s.trim()).ok())
        .ok_or_else(|| {
            err(
                origin,
                field,
                format!("{s:?} is not a duration (for example 30s, 1m, 500ms, 24h0m0s)"),
            )
        })
}

/// `IP:port`, or an IP alone (then `default_port`), as kube-proxy's bind addresses.
fn parse_addr(
    origin: &str,
    field: &str,
    s: &str,
    default_port: u16,
) -> Result<SocketAddr, ConfigError> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    Err(err(
        origin,
        field,
        format!("{s:?} is not an IP:port address (for example 0.0.0.0:{default_port})"),
    ))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_lowercase())
        .unwrap_or_default()
}

/// Merges file and flags (flags win) and validates every value.
pub fn resolve(file: Option<(&Path, FileConfig)>, flags: Flags) -> Result<Settings, ConfigError> {
    let (forigin, f) = match file {
        Some((p, f)) => (p.display().to_string(), f),
        None => (String::new(), FileConfig::default()),
    };
    let (k, own) = (&f.kube, &f.own);
    // Pick the flag if given, else the file's value; remember where it came from.
    let pick = |flag: Option<String>, file: Option<String>| -> (Option<String>, String) {
        match flag {
            Some(v) => (Some(v), "flag".to_string()),
            None => (file, forigin.clone()),
        }
    };
    let bind_address = match &k.bind_address {
        Some(s) => Some(s.parse::<IpAddr>().map_err(|_| {
            err(
                &forigin,
                "bindAddress",
                format!("{s:?} is not an IP address"),
            )
        })?),
        None => None,
    };
    let (v, o) = pick(flags.healthz_bind_address, k.healthz_bind_address.clone());
    let healthz_bind_address = parse_addr(
        &o,
        "healthzBindAddress",
        v.as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_HEALTHZ),
        DEFAULT_HEALTHZ_PORT,
    )?;
    let (v, o) = pick(flags.metrics_bind_address, k.metrics_bind_address.clone());
    let metrics_bind_address = parse_addr(
        &o,
        "metricsBindAddress",
        v.as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_METRICS),
        DEFAULT_METRICS_PORT,
    )?;
    let (v, o) = pick(flags.sync_period, k.sync_period.clone());
    let sync_period = match v {
        Some(s) => parse_duration(&o, "syncPeriod", &s)?,
        None => DEFAULT_SYNC_PERIOD,
    };
    if sync_period < Duration::from_secs(1) {
        return Err(err(&o, "syncPeriod", "must be at least 1s"));
    }
    let (v, o) = pick(flags.min_sync_period, k.min_sync_period.clone());
    let min_sync_period = match v {
        Some(s) => parse_duration(&o, "minSyncPeriod", &s)?,
        None => DEFAULT_MIN_SYNC_PERIOD,
    };
    if min_sync_period > sync_period {
        return Err(err(
            &o,
            "minSyncPeriod",
            format!(
                "{} is longer than syncPeriod {}",
                humantime::format_duration(min_sync_period),
                humantime::format_duration(sync_period)
            ),
        ));
    }
    let config_sync_period = match &k.config_sync_period {
        Some(s) => parse_duration(&forigin, "configSyncPeriod", s)?,
        None => DEFAULT_CONFIG_SYNC_PERIOD,
    };
    let detect_local_mode = k.detect_local_mode.clone().unwrap_or_default();
    if ![
        "",
        "ClusterCIDR",
        "NodeCIDR",
        "BridgeInterface",
        "InterfaceNamePrefix",
    ]
    .contains(&detect_local_mode.as_str())
    {
        return Err(err(
            &forigin,
            "detectLocalMode",
            format!(
                "{detect_local_mode:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"
            ),
        ));
    }
    let interface_name_prefix = k.interface_name_prefix.clone();
    if detect_local_mode == "InterfaceNamePrefix" && interface_name_prefix.is_none() {
        return Err(err(
            &forigin,
            "detectLocal.interfaceNamePrefix",
            "must be set when detectLocalMode is InterfaceNamePrefix",
        ));
    }
    let mut cluster_cidrs = Vec::new();
    for c in k
        .cluster_cidr
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        cluster_cidrs.push(c.parse::<ipnet::IpNet>().map_err(|_| {
            err(
                &forigin,
                "clusterCIDR",
                format!("{c:?} is not a CIDR (for example 10.244.0.0/16)"),
            )
        })?);
    }
    // Pod interfaces: the flag, lbproxy's document, kube-proxy's interface name prefix
    // (detectLocalMode InterfaceNamePrefix), else the default globs.
    let from_prefix = interface_name_prefix
        .as_ref()
        .filter(|_| detect_local_mode == "InterfaceNamePrefix")
        .map(|p| format!("{p}*"));
    let (v, o) = pick(
        flags.pod_interfaces,
        own.pod_interfaces
            .as_ref()
            .map(|l| l.join(","))
            .or(from_prefix),
    );
    let pod_interfaces: Vec<String> = v
        .as_deref()
        .unwrap_or(DEFAULT_POD_INTERFACES)
        .split(',')
        .map(str::trim)
        .filter(|g| !g.is_empty())
        .map(String::from)
        .collect();
    if pod_interfaces.is_empty() {
        return Err(err(&o, "podInterfaces", "no interface globs given"));
    }
    for g in &pod_interfaces {
        globset::Glob::new(g)
            .map_err(|e| err(&o, "podInterfaces", format!("bad glob {g:?}: {e}")))?;
    }
    let bpffs_dir = flags
        .bpffs_dir
        .or_else(|| {
            own.bpffs_dir
                .clone()
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BPFFS_DIR));
    if !bpffs_dir.is_absolute() {
        return Err(err(
            &forigin,
            "bpffsDir",
            format!("{} is not an absolute path", bpffs_dir.display()),
        ));
    }
    let (size, o) = match flags.flow_map_size {
        Some(n) => (n, "flag".to_string()),
        None => (
            own.flow_map_size
                .unwrap_or(u64::from(lbproxy_common::DEFAULT_FLOW_MAP_SIZE)),
            forigin.clone(),
        ),
    };
    let flow_map_size = u32::try_from(size)
        .ok()
        .filter(|n| *n >= 1024)
        .ok_or_else(|| {
            err(
                &o,
                "flowMapSize",
                format!("{size} is not in 1024..=4294967295"),
            )
        })?;
    let stack_bypass = flags.stack_bypass.or(own.stack_bypass).unwrap_or(false);
    let manifests = flags.manifests.or_else(|| {
        own.manifests
            .clone()
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    });
    let kubeconfig = flags
        .kubeconfig
        .or_else(|| k.kubeconfig.clone())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let qps = match (flags.kube_api_qps, k.qps) {
        (Some(q), _) | (None, Some(q)) => q as f32,
        (None, None) => DEFAULT_QPS,
    };
    let qps = if qps == 0.0 { DEFAULT_QPS } else { qps };
    let burst = match (flags.kube_api_burst, k.burst) {
        (Some(b), _) => b,
        (None, Some(b)) => u32::try_from(b).map_err(|_| {
            err(
                &forigin,
                "clientConnection.burst",
                format!("{b} is not in 0..=4294967295"),
            )
        })?,
        (None, None) => DEFAULT_BURST,
    };
    let burst = if burst == 0 { DEFAULT_BURST } else { burst };
    let hostname = flags
        .hostname_override
        .or(k.hostname_override.clone())
        .filter(|s| !s.is_empty())
        .map_or_else(hostname, |h| h.trim().to_lowercase());
    if hostname.is_empty() {
        return Err(err(
            "flag",
            "hostnameOverride",
            "the hostname is empty and no --hostname-override was given",
        ));
    }
    let defaults = crate::bpf::flow_gc::Timeouts::default();
    let timeout = |flag: Option<String>,
                   file: Option<&String>,
                   field: &str,
                   default: Duration|
     -> Result<Duration, ConfigError> {
        let (v, o) = pick(flag, file.cloned());
        let d = match v {
            Some(s) => parse_duration(&o, field, &s)?,
            None => default,
        };
        if d.is_zero() {
            return Err(err(&o, field, "must be longer than 0s"));
        }
        Ok(d)
    };
    let flow_timeouts = crate::bpf::flow_gc::Timeouts {
        tcp_established: timeout(
            flags.tcp_established_timeout,
            k.tcp_established_timeout.as_ref(),
            "conntrack.tcpEstablishedTimeout",
            defaults.tcp_established,
        )?,
        tcp_half_closed: timeout(
            flags.tcp_close_wait_timeout,
            k.tcp_close_wait_timeout.as_ref(),
            "conntrack.tcpCloseWaitTimeout",
            defaults.tcp_half_closed,
        )?,
        tcp_closing: defaults.tcp_closing,
        udp: timeout(
            flags.udp_timeout,
            k.udp_timeout.as_ref(),
            "conntrack.udpTimeout",
            defaults.udp,
        )?,
        tcp_syn_sent: timeout(
            flags.tcp_syn_sent_timeout,
            own.tcp_syn_sent_timeout.as_ref().filter(|s| !s.is_empty()),
            "tcpSynSentTimeout",
            defaults.tcp_syn_sent,
        )?,
    };
    let node_port_addresses = match flags.node_port_addresses {
        Some(v) => parse_node_port_addresses("flag", &v)?,
        None => {
            parse_node_port_addresses(&forigin, k.node_port_addresses.as_deref().unwrap_or(&[]))?
        }
    };
    let (range, o) = pick(flags.snat_port_range, own.snat_port_range.clone());
    let snat_port_range = match range.filter(|s| !s.is_empty()) {
        Some(r) => parse_port_range(&o, &r)?,
        None => (
            lbproxy_common::DEFAULT_SNAT_PORT_MIN,
            lbproxy_common::DEFAULT_SNAT_PORT_MAX,
        ),
    };
    let (root, o) = match flags.cgroup_root {
        Some(p) => (Some(p), "flag".to_string()),
        None => (
            own.cgroup_root
                .clone()
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            forigin.clone(),
        ),
    };
    let cgroup_root = match root {
        Some(p) if !p.is_absolute() => {
            return Err(err(
                &o,
                "cgroupRoot",
                format!("{} is not an absolute path", p.display()),
            ));
        }
        Some(p) => CgroupRoot::Path(p),
        None => CgroupRoot::Default,
    };
    let (mode, o) = pick(flags.socket_lb, own.socket_lb.clone());
    let socket_lb = match mode.as_deref().map(str::trim) {
        None | Some("") | Some("host") => SocketLb::Host,
        Some("off") => SocketLb::Off,
        Some("pods") => SocketLb::Pods,
        Some(other) => {
            return Err(err(
                &o,
                "socketLb",
                format!("{other:?} is not one of off, host, pods"),
            ));
        }
    };
    let (fmt, o) = pick(flags.logging_format, k.logging_format.clone());
    let log_format = match fmt.as_deref().map(str::trim) {
        None | Some("") | Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => {
            return Err(err(
                &o,
                "logging.format",
                format!("{other:?} is not one of text, json"),
            ));
        }
    };
    let verbosity = match (flags.verbosity, k.verbosity) {
        (Some(v), _) => v,
        (None, Some(v)) => u32::try_from(v).map_err(|_| {
            err(
                &forigin,
                "logging.verbosity",
                format!("{v} is not in 0..=4294967295"),
            )
        })?,
        (None, None) => 0,
    };
    let oom_score_adj = match k.oom_score_adj {
        Some(v) if (-1000..=1000).contains(&v) => Some(v as i32),
        Some(v) => {
            return Err(err(
                &forigin,
                "oomScoreAdj",
                format!("{v} is not in -1000..=1000"),
            ));
        }
        None => None,
    };
    Ok(Settings {
        cgroup_root,
        socket_lb,
        node_port_addresses,
        snat_port_range,
        flow_timeouts,
        kubeconfig,
        hostname,
        healthz_bind_address,
        metrics_bind_address,
        sync_period,
        min_sync_period,
        pod_interfaces,
        bpffs_dir,
        flow_map_size,
        stack_bypass,
        manifests,
        bind_address,
        qps,
        burst,
        log_format,
        verbosity,
        config_sync_period,
        cluster_cidrs,
        detect_local_mode,
        interface_name_prefix,
        oom_score_adj,
    })
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
            "manifests": self.manifests.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            "snatPortRange": format!("{}-{}", self.snat_port_range.0, self.snat_port_range.1),
            "cgroupRoot": match &self.cgroup_root {
                CgroupRoot::Default => String::new(),
                CgroupRoot::Path(p) => p.display().to_string(),
            },
            "socketLb": self.socket_lb.as_str(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<Settings, ConfigError> {
        let p = Path::new("c.yaml");
        let f = parse_file(p, text)?;
        resolve(Some((p, f)), Flags::default())
    }

    /// lbproxy's own document's header, after kube-proxy's.
    const OWN: &str = "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\n";

    /// `nodePortAddresses` (CIDRs, empty for all, `primary` alone but not beside CIDRs)
    /// and `snatPortRange` (MIN-MAX, at least 1024), from the file and from flags, each
    /// refused with the field's name.
    #[test]
    fn node_port_addresses_and_snat_port_range() {
        let s = file(&format!("nodePortAddresses: ['198.18.80.0/24', 192.0.2.7/32]\nhostnameOverride: n\n{OWN}snatPortRange: 20000-20003\n")).unwrap();
        assert_eq!(
            s.node_port_addresses,
            NodePortAddresses::Cidrs(vec![
                "198.18.80.0/24".parse().unwrap(),
                "192.0.2.7/32".parse().unwrap()
            ])
        );
        assert!(
            s.node_port_addresses
                .contains("198.18.80.9".parse().unwrap(), None)
        );
        assert!(
            !s.node_port_addresses
                .contains("198.18.81.1".parse().unwrap(), None)
        );
        let p = file("nodePortAddresses: [primary]\nhostnameOverride: n\n").unwrap();
        assert_eq!(p.node_port_addresses, NodePortAddresses::Primary);
        let primary = Some("198.18.80.9".parse().unwrap());
        assert!(
            p.node_port_addresses
                .contains("198.18.80.9".parse().unwrap(), primary)
                && !p
                    .node_port_addresses
                    .contains("198.18.80.10".parse().unwrap(), primary)
                && !p
                    .node_port_addresses
                    .contains("198.18.80.9".parse().unwrap(), None),
            "primary: that one address only, and none while it is not known"
        );
        assert_eq!(s.snat_port_range, (20000, 20003));
        let d = file("hostnameOverride: n\n").unwrap();
        assert_eq!(d.node_port_addresses, NodePortAddresses::All);
        assert_eq!(d.snat_port_range, (1024, 29_999));
        let flags = resolve(
            None,
            Flags {
                hostname_override: Some("n".into()),
                node_port_addresses: Some(vec!["198.18.80.0/24,198.18.90.0/24".into()]),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            flags.node_port_addresses,
            NodePortAddresses::Cidrs(vec![
                "198.18.80.0/24".parse().unwrap(),
                "198.18.90.0/24".parse().unwrap()
            ])
        );
        for (text, field) in [
            (
                "nodePortAddresses: [primary, 192.0.2.0/24]\n",
                "nodePortAddresses",
            ),
            ("nodePortAddresses: [eth0]\n", "nodePortAddresses"),
            (
                "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nsnatPortRange: 80-90\n",
                "snatPortRange",
            ),
            (
                "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nsnatPortRange: 3000-2000\n",
                "snatPortRange",
            ),
            (
                "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nsnatPortRange: lots\n",
                "snatPortRange",
            ),
        ] {
            let e = file(&format!("hostnameOverride: n\n{text}")).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
        }
    }

    #[test]
    fn defaults_and_full_file() {
        let s = resolve(
            None,
            Flags {
                hostname_override: Some("n1".into()),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.sync_period, Duration::from_secs(30));
        assert_eq!(s.min_sync_period, Duration::ZERO);
        assert_eq!(s.pod_interfaces, vec!["lxc*", "veth*", "cali*"]);
        assert!(!s.stack_bypass, "the stack bypass is off unless asked for");
        let s = file(
            &format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclientConnection: {{kubeconfig: /k}}\nhostnameOverride: Node-A\nhealthzBindAddress: 127.0.0.1:1\nmetricsBindAddress: 127.0.0.1:2\nsyncPeriod: 1m\nminSyncPeriod: 500ms\nmode: ebpf\n{OWN}podInterfaces: [eth*]\nbpffsDir: /sys/fs/bpf/x\nflowMapSize: 2048\nstackBypass: true\n"),
        )
        .unwrap();
        assert!(s.stack_bypass);
        assert_eq!(s.hostname, "node-a");
        assert_eq!(s.kubeconfig, Some(PathBuf::from("/k")));
        assert_eq!(s.sync_period, Duration::from_secs(60));
        assert_eq!(s.min_sync_period, Duration::from_millis(500));
        assert_eq!(s.flow_map_size, 2048);
    }

    /// kubeadm's kube-proxy `config.conf`, unchanged: every value is kube-proxy's empty
    /// one, so every setting is the default, and nothing is warned about.
    #[test]
    fn kubeadm_config_conf_reads_unchanged() {
        let p = Path::new("config.conf");
        let f = parse_file(
            p,
            include_str!("../../tests/fixtures/kubeadm-kube-proxy.conf"),
        )
        .unwrap();
        assert!(f.warnings.is_empty(), "{:?}", f.warnings);
        let s = resolve(
            Some((p, f)),
            Flags {
                hostname_override: Some("n".into()),
                ..Default::default()
            },
        )
        .unwrap();
        let d = resolve(
            None,
            Flags {
                hostname_override: Some("n".into()),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            s.kubeconfig,
            Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(
            s.cluster_cidrs,
            vec!["10.244.0.0/16".parse::<ipnet::IpNet>().unwrap()]
        );
        assert_eq!(s.bind_address, Some("0.0.0.0".parse().unwrap()));
        assert_eq!(
            Settings {
                kubeconfig: None,
                cluster_cidrs: Vec::new(),
                bind_address: None,
                ..s
            },
            d
        );
    }

    /// kube-proxy's fields are applied (the mode's sync block, conntrack, logging, client
    /// QPS, detect-local prefix, oomScoreAdj) and the ones lbproxy has no use for are named
    /// in one warning; a field v1alpha1 lacks gets its own warning.
    #[test]
    fn kube_proxy_fields_applied_and_ignored() {
        let p = Path::new("c.conf");
        let f = parse_file(
            p,
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             mode: nftables\niptables: {syncPeriod: 1m, masqueradeBit: 14}\n\
             nftables: {syncPeriod: 45s, minSyncPeriod: 2s}\n\
             conntrack: {tcpEstablishedTimeout: 2h0m0s, udpTimeout: 1m30s, maxPerCore: 32768}\n\
             clientConnection: {qps: 20, burst: 40, contentType: application/vnd.kubernetes.protobuf}\n\
             logging: {format: json, verbosity: 4}\nhealthzBindAddress: 127.0.0.1\n\
             detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: cali}\n\
             oomScoreAdj: -999\nipvs: {scheduler: rr}\nhostnameOverride: n\nfutureField: 1\n",
        )
        .unwrap();
        assert_eq!(f.warnings.len(), 2, "{:?}", f.warnings);
        for named in [
            "mode: \"nftables\"",
            "iptables.masqueradeBit",
            "conntrack.maxPerCore",
            "clientConnection.contentType",
            "ipvs.scheduler",
        ] {
            assert!(
                f.warnings[0].contains(named),
                "{named} not in {:?}",
                f.warnings[0]
            );
        }
        assert!(f.warnings[1].contains("futureField"), "{:?}", f.warnings[1]);
        let s = resolve(Some((p, f)), Flags::default()).unwrap();
        assert_eq!(
            s.sync_period,
            Duration::from_secs(45),
            "nftables mode: its block"
        );
        assert_eq!(s.min_sync_period, Duration::from_secs(2));
        assert_eq!(s.flow_timeouts.tcp_established, Duration::from_secs(7200));
        assert_eq!(s.flow_timeouts.udp, Duration::from_secs(90));
        assert_eq!((s.qps, s.burst), (20.0, 40));
        assert_eq!((s.log_format, s.verbosity), (LogFormat::Json, 4));
        assert_eq!(s.healthz_bind_address, "127.0.0.1:10256".parse().unwrap());
        assert_eq!(s.pod_interfaces, vec!["cali*"]);
        assert_eq!(s.oom_score_adj, Some(-999));
    }

    /// What `--write-config-to` writes reads back as the same settings.
    #[test]
    fn written_config_reads_back_the_same() {
        let p = Path::new("c.conf");
        let f = parse_file(
            p,
            &format!(
                "clientConnection: {{kubeconfig: /k, qps: -1}}\nhostnameOverride: n\n\
                 nodePortAddresses: [192.0.2.0/24]\nminSyncPeriod: 250ms\nclusterCIDR: 10.0.0.0/8\n\
                 logging: {{format: json, verbosity: 3}}\noomScoreAdj: 0\n\
                 {OWN}podInterfaces: [lxc*]\ncgroupRoot: /run/x\nsocketLb: pods\n\
                 tcpSynSentTimeout: 5s\nmanifests: /m.yaml\n"
            ),
        )
        .unwrap();
        let s = resolve(Some((p, f)), Flags::default()).unwrap();
        let text = s.to_yaml();
        let again = resolve(Some((p, parse_file(p, &text).unwrap())), Flags::default())
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(again, s, "{text}");
        let z = s.configz();
        assert_eq!(z["kubeproxy.config.k8s.io"]["minSyncPeriod"], "250ms");
        assert_eq!(z["lbproxy.io"]["socketLb"], "pods");
    }

    #[test]
    fn go_durations() {
        for (text, secs) in [
            ("24h0m0s", 86400.0),
            ("1m30s", 90.0),
            ("500ms", 0.5),
            ("0", 0.0),
            ("1.5h", 5400.0),
        ] {
            assert_eq!(
                parse_go_duration(text),
                Some(Duration::from_secs_f64(secs)),
                "{text}"
            );
        }
        for d in [
            Duration::from_secs(86400),
            Duration::from_millis(1500),
            Duration::from_millis(250),
            Duration::from_secs(61),
        ] {
            assert_eq!(
                parse_go_duration(&go_duration(d)),
                Some(d),
                "{}",
                go_duration(d)
            );
        }
        assert_eq!(go_duration(Duration::from_secs(86400)), "24h0m0s");
        assert_eq!(parse_go_duration("thirty"), None);
    }

    #[test]
    fn flags_override_the_file() {
        let p = Path::new("c.yaml");
        let f = parse_file(
            p,
            &format!("syncPeriod: 1m\nhostnameOverride: a\n{OWN}stackBypass: true\n"),
        )
        .unwrap();
        let s = resolve(
            Some((p, f)),
            Flags {
                sync_period: Some("10s".into()),
                stack_bypass: Some(false),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s.sync_period, Duration::from_secs(10));
        assert!(!s.stack_bypass, "--stack-bypass=false overrides the file");
        assert_eq!(s.hostname, "a");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let cases = [
            (
                "syncPeriod: thirty\n",
                "c.yaml: syncPeriod: \"thirty\" is not a duration",
            ),
            (
                "healthzBindAddress: localhost\n",
                "c.yaml: healthzBindAddress: \"localhost\" is not an IP:port",
            ),
            (
                "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nhostnmeOverride: x\n",
                "c.yaml: hostnmeOverride: unknown field",
            ),
            (
                "podInterfaces: [eth0]\n",
                "c.yaml: podInterfaces: is lbproxy's own field, not kube-proxy's: move it to the LbproxyConfiguration document",
            ),
            (
                "conntrack: {tcpSynSentTimeout: 5s}\n",
                "c.yaml: conntrack.tcpSynSentTimeout: is lbproxy's own field",
            ),
            (
                "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nflowMapSize: 10\n",
                "c.yaml: flowMapSize: 10 is not in",
            ),
            (
                "apiVersion: kubeproxy.config.k8s.io/v1alpha2\n",
                "c.yaml: apiVersion: \"kubeproxy.config.k8s.io/v1alpha2\" is not",
            ),
            (
                "clientConnection: {qps: fast}\n",
                "c.yaml: clientConnection.qps: \"fast\" is not a number",
            ),
            (
                "logging: {format: xml}\n",
                "c.yaml: logging.format: \"xml\" is not one of text, json",
            ),
            (
                "oomScoreAdj: -2000\n",
                "c.yaml: oomScoreAdj: -2000 is not in",
            ),
            (
                "detectLocalMode: InterfaceNamePrefix\n",
                "c.yaml: detectLocal.interfaceNamePrefix: must be set",
            ),
            (
                "clusterCIDR: 10.0.0.0/33\n",
                "c.yaml: clusterCIDR: \"10.0.0.0/33\" is not a CIDR",
            ),
            (
                "syncPeriod: 10s\nminSyncPeriod: 1m\n",
                "c.yaml: minSyncPeriod: 1m is longer than syncPeriod 10s",
            ),
            (
                "kind: Deployment\n",
                "c.yaml: kind: \"Deployment\" (apiVersion \"\") is neither KubeProxyConfiguration",
            ),
            (
                "conntrack: {tcpEstablishedTimeout: soon}\n",
                "c.yaml: conntrack.tcpEstablishedTimeout: \"soon\" is not a duration",
            ),
        ];
        for (text, want) in cases {
            let e = file(text).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("invalid configuration: {want}")),
                "{text:?} gave {e}"
            );
        }
    }
}
