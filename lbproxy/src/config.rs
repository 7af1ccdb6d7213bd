//! Configuration: a `--config` file whose field names follow kube-proxy's
//! `KubeProxyConfiguration` where such a field exists, overridden by flags.
//!
//! ```yaml
//! apiVersion: kubeproxy.config.k8s.io/v1alpha1
//! kind: KubeProxyConfiguration
//! clientConnection: {kubeconfig: ""}
//! hostnameOverride: ""
//! healthzBindAddress: 0.0.0.0:10256
//! metricsBindAddress: 127.0.0.1:10249
//! syncPeriod: 30s
//! minSyncPeriod: 0s
//! mode: ebpf
//! # lbproxy's own:
//! podInterfaces: ["lxc*", "veth*", "cali*"]
//! bpffsDir: /sys/fs/bpf/lbproxy
//! flowMapSize: 262144
//! stackBypass: false            # redirect service traffic between local pods past the node's stack
//! manifests: ""
//! nodePortAddresses: [192.0.2.0/24]  # kube-proxy's field: CIDRs; default every IPv4 address
//! snatPortRange: 1024-29999     # lbproxy's own: ports for source-NATed north-south flows
//! conntrack:                    # kube-proxy's block; sets lbproxy's flow table timeouts
//!   tcpEstablishedTimeout: 24h
//!   tcpCloseWaitTimeout: 1h      # half-closed flows: one FIN seen, the other side may still send
//!   udpTimeout: 30s
//!   tcpSynSentTimeout: 30s       # lbproxy's own: an unanswered SYN
//! ```
//!
//! Every value is validated at start; an invalid one is refused naming the field.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/lbproxy";
pub const DEFAULT_POD_INTERFACES: &str = "lxc*,veth*,cali*";
pub const DEFAULT_HEALTHZ: &str = "0.0.0.0:10256";
pub const DEFAULT_METRICS: &str = "127.0.0.1:10249";
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// 0: every change is written as soon as the loop is free. A diff costs microseconds per
/// changed endpoint, and changes that arrive while a sync runs are coalesced into the next
/// one, so a floor only adds latency. Raise it to bound map writes on a churning cluster.
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::ZERO;

/// The file, as written. Strings stay strings here so errors can quote them.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub client_connection: Option<ClientConnection>,
    pub hostname_override: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub mode: Option<String>,
    pub pod_interfaces: Option<Vec<String>>,
    pub bpffs_dir: Option<String>,
    pub flow_map_size: Option<u64>,
    pub stack_bypass: Option<bool>,
    pub manifests: Option<String>,
    pub conntrack: Option<ConntrackConfig>,
    pub node_port_addresses: Option<Vec<String>>,
    pub snat_port_range: Option<String>,
    pub cgroup_root: Option<String>,
    pub socket_lb: Option<String>,
}

/// kube-proxy's `conntrack` block; here it sets lbproxy's own flow table timeouts.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConntrackConfig {
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub udp_timeout: Option<String>,
    /// lbproxy's own: how long an unanswered SYN keeps its flow.
    pub tcp_syn_sent_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
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
    /// Every IPv4 address on the node's interfaces that are not pod interfaces, except
    /// loopback (kube-proxy's default when the field is empty).
    All,
    /// The addresses within these CIDRs.
    Cidrs(Vec<ipnet::IpNet>),
    /// `primary`: the node's primary IPv4 address only. lbproxy reads it from the node's
    /// routes (`bpf::ifaces::Link::primary_v4`: the preferred source of the main table's
    /// default route, else the first address of the interface it leaves by), which is the
    /// address kubelet takes as the node IP when `--node-ip` is not given; kube-proxy reads
    /// it from the Node object. It follows route changes.
    Primary,
}

impl NodePortAddresses {
    /// Whether NodePorts are served on `addr`, one of the node's own addresses, when the
    /// node's primary address is `primary` (see [`NodePortAddresses::Primary`]).
    pub fn contains(&self, addr: std::net::IpAddr, primary: Option<std::net::IpAddr>) -> bool {
        match self {
            NodePortAddresses::All => true,
            NodePortAddresses::Cidrs(c) => c.iter().any(|n| n.contains(&addr)),
            NodePortAddresses::Primary => primary == Some(addr),
        }
    }
}

/// The effective, validated settings.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Parses a config file's text.
pub fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    let origin = path.display().to_string();
    let cfg: FileConfig = serde_yaml::from_str(text).map_err(|e| {
        // serde names the unknown or mistyped field in its message.
        let msg = e.to_string();
        let field = msg
            .split('`')
            .nth(1)
            .filter(|_| msg.starts_with("unknown field"))
            .unwrap_or("(file)")
            .to_string();
        err(&origin, &field, msg)
    })?;
    if let Some(api) = &cfg.api_version
        && api != "kubeproxy.config.k8s.io/v1alpha1"
    {
        return Err(err(
            &origin,
            "apiVersion",
            format!("{api:?} is not kubeproxy.config.k8s.io/v1alpha1"),
        ));
    }
    if let Some(kind) = &cfg.kind
        && kind != "KubeProxyConfiguration"
    {
        return Err(err(
            &origin,
            "kind",
            format!("{kind:?} is not KubeProxyConfiguration"),
        ));
    }
    if let Some(mode) = &cfg.mode
        && !mode.is_empty()
        && mode != "ebpf"
    {
        return Err(err(
            &origin,
            "mode",
            format!("{mode:?} is not supported: lbproxy only runs in mode \"ebpf\""),
        ));
    }
    Ok(cfg)
}

pub fn parse_duration(origin: &str, field: &str, s: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.trim()).map_err(|_| {
        err(
            origin,
            field,
            format!("{s:?} is not a duration (for example 30s, 1m, 500ms)"),
        )
    })
}

fn parse_addr(origin: &str, field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| {
        err(
            origin,
            field,
            format!("{s:?} is not an IP:port address (for example 0.0.0.0:10256)"),
        )
    })
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
    // Pick the flag if given, else the file's value; remember where it came from.
    let pick = |flag: Option<String>, file: Option<String>| -> (Option<String>, String) {
        match flag {
            Some(v) => (Some(v), "flag".to_string()),
            None => (file, forigin.clone()),
        }
    };
    let (v, o) = pick(flags.healthz_bind_address, f.healthz_bind_address.clone());
    let healthz_bind_address = parse_addr(
        &o,
        "healthzBindAddress",
        v.as_deref().unwrap_or(DEFAULT_HEALTHZ),
    )?;
    let (v, o) = pick(flags.metrics_bind_address, f.metrics_bind_address.clone());
    let metrics_bind_address = parse_addr(
        &o,
        "metricsBindAddress",
        v.as_deref().unwrap_or(DEFAULT_METRICS),
    )?;
    let (v, o) = pick(flags.sync_period, f.sync_period.clone());
    let sync_period = match v {
        Some(s) => parse_duration(&o, "syncPeriod", &s)?,
        None => DEFAULT_SYNC_PERIOD,
    };
    if sync_period < Duration::from_secs(1) {
        return Err(err(&o, "syncPeriod", "must be at least 1s"));
    }
    let (v, o) = pick(flags.min_sync_period, f.min_sync_period.clone());
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
    let (v, o) = pick(
        flags.pod_interfaces,
        f.pod_interfaces.as_ref().map(|l| l.join(",")),
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
        .or_else(|| f.bpffs_dir.clone().map(PathBuf::from))
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
            f.flow_map_size
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
    let stack_bypass = flags.stack_bypass.or(f.stack_bypass).unwrap_or(false);
    let manifests = flags.manifests.or_else(|| {
        f.manifests
            .clone()
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    });
    let kubeconfig = flags
        .kubeconfig
        .or_else(|| {
            f.client_connection
                .as_ref()
                .and_then(|c| c.kubeconfig.clone())
        })
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let hostname = flags
        .hostname_override
        .or(f.hostname_override.clone())
        .filter(|s| !s.is_empty())
        .map_or_else(hostname, |h| h.trim().to_lowercase());
    if hostname.is_empty() {
        return Err(err(
            "flag",
            "hostnameOverride",
            "the hostname is empty and no --hostname-override was given",
        ));
    }
    let ct = f.conntrack.as_ref();
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
            ct.and_then(|c| c.tcp_established_timeout.as_ref()),
            "conntrack.tcpEstablishedTimeout",
            defaults.tcp_established,
        )?,
        tcp_half_closed: timeout(
            flags.tcp_close_wait_timeout,
            ct.and_then(|c| c.tcp_close_wait_timeout.as_ref()),
            "conntrack.tcpCloseWaitTimeout",
            defaults.tcp_half_closed,
        )?,
        tcp_closing: defaults.tcp_closing,
        udp: timeout(
            flags.udp_timeout,
            ct.and_then(|c| c.udp_timeout.as_ref()),
            "conntrack.udpTimeout",
            defaults.udp,
        )?,
        tcp_syn_sent: timeout(
            flags.tcp_syn_sent_timeout,
            ct.and_then(|c| c.tcp_syn_sent_timeout.as_ref()),
            "conntrack.tcpSynSentTimeout",
            defaults.tcp_syn_sent,
        )?,
    };
    let node_port_addresses = match flags.node_port_addresses {
        Some(v) => parse_node_port_addresses("flag", &v)?,
        None => {
            parse_node_port_addresses(&forigin, f.node_port_addresses.as_deref().unwrap_or(&[]))?
        }
    };
    let (range, o) = pick(flags.snat_port_range, f.snat_port_range.clone());
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
            f.cgroup_root
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
    let (mode, o) = pick(flags.socket_lb, f.socket_lb.clone());
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
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<Settings, ConfigError> {
        let p = Path::new("c.yaml");
        let f = parse_file(p, text)?;
        resolve(Some((p, f)), Flags::default())
    }

    /// `nodePortAddresses` (CIDRs, empty for all, `primary` alone but not beside CIDRs)
    /// and `snatPortRange` (MIN-MAX, at least 1024), from the file and from flags, each
    /// refused with the field's name.
    #[test]
    fn node_port_addresses_and_snat_port_range() {
        let s = file("nodePortAddresses: ['198.18.80.0/24', 192.0.2.7/32]\nsnatPortRange: 20000-20003\nhostnameOverride: n\n").unwrap();
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
            ("snatPortRange: 80-90\n", "snatPortRange"),
            ("snatPortRange: 3000-2000\n", "snatPortRange"),
            ("snatPortRange: lots\n", "snatPortRange"),
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
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclientConnection: {kubeconfig: /k}\nhostnameOverride: Node-A\nhealthzBindAddress: 127.0.0.1:1\nmetricsBindAddress: 127.0.0.1:2\nsyncPeriod: 1m\nminSyncPeriod: 500ms\nmode: ebpf\npodInterfaces: [eth*]\nbpffsDir: /sys/fs/bpf/x\nflowMapSize: 2048\nstackBypass: true\n",
        )
        .unwrap();
        assert!(s.stack_bypass);
        assert_eq!(s.hostname, "node-a");
        assert_eq!(s.kubeconfig, Some(PathBuf::from("/k")));
        assert_eq!(s.sync_period, Duration::from_secs(60));
        assert_eq!(s.min_sync_period, Duration::from_millis(500));
        assert_eq!(s.flow_map_size, 2048);
    }

    #[test]
    fn flags_override_the_file() {
        let p = Path::new("c.yaml");
        let f = parse_file(
            p,
            "syncPeriod: 1m\nhostnameOverride: a\nstackBypass: true\n",
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
                "mode: iptables\n",
                "c.yaml: mode: \"iptables\" is not supported",
            ),
            (
                "hostnmeOverride: x\n",
                "c.yaml: hostnmeOverride: unknown field",
            ),
            ("flowMapSize: 10\n", "c.yaml: flowMapSize: 10 is not in"),
            (
                "syncPeriod: 10s\nminSyncPeriod: 1m\n",
                "c.yaml: minSyncPeriod: 1m is longer than syncPeriod 10s",
            ),
            (
                "kind: Deployment\n",
                "c.yaml: kind: \"Deployment\" is not KubeProxyConfiguration",
            ),
            (
                "conntrack: {udpTimeout: 0s}\n",
                "c.yaml: conntrack.udpTimeout: must be longer than 0s",
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
