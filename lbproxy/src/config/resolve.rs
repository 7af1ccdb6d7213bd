//! The one resolve step: flags over the file over the defaults, each value validated.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

/// `--nodeport-addresses`: comma-separated CIDRs, or `primary`; empty means all.
pub(crate) fn parse_node_port_addresses(
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
pub(crate) fn parse_port_range(origin: &str, text: &str) -> Result<(u16, u16), ConfigError> {
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

/// `IP:port`, or an IP alone (then `default_port`), as kube-proxy's bind addresses.
pub(crate) fn parse_addr(
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

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_lowercase())
        .unwrap_or_default()
}

/// Merges file and flags (flags win) and validates every value.
// Over 120 lines: one setting after another, in `Settings`' order, each with the same rule
// (the flag, else the file, else the default; an invalid value refused naming its origin
// and field). Kept as one list so each setting's precedence and error read in one place;
// typed serde documents (issue 27) are to shorten it.
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
