//! The one resolve step: flags over the file over the defaults, each value validated.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

/// Merges file and flags (flags win) and validates every value. The settings are resolved
/// in this order, which is the order of their checks: with several invalid values, the
/// first one here is the one refused.
pub fn resolve(file: Option<(&Path, FileConfig)>, flags: Flags) -> Result<Settings, ConfigError> {
    let (origin, f) = match file {
        Some((p, f)) => (p.display().to_string(), f),
        None => (String::new(), FileConfig::default()),
    };
    let src = Sources {
        file: &origin,
        kube: &f.kube,
        own: &f.own,
    };
    let (k, own) = (src.kube, src.own);
    let bind_address = src.bind_address()?;
    let healthz_bind_address = src.listen(
        flags.healthz_bind_address,
        &k.healthz_bind_address,
        ("healthzBindAddress", DEFAULT_HEALTHZ, DEFAULT_HEALTHZ_PORT),
    )?;
    let metrics_bind_address = src.listen(
        flags.metrics_bind_address,
        &k.metrics_bind_address,
        ("metricsBindAddress", DEFAULT_METRICS, DEFAULT_METRICS_PORT),
    )?;
    let (sync_period, min_sync_period) =
        src.sync_periods(flags.sync_period, flags.min_sync_period)?;
    let (config_sync_period, _) = src.duration(
        None,
        k.config_sync_period.as_ref(),
        "configSyncPeriod",
        DEFAULT_CONFIG_SYNC_PERIOD,
    )?;
    let (detect_local_mode, interface_name_prefix) = src.detect_local()?;
    let cluster_cidrs = src.cluster_cidrs()?;
    let pod_interfaces = src.pod_interfaces(
        flags.pod_interfaces,
        &detect_local_mode,
        interface_name_prefix.as_deref(),
    )?;
    let bpffs_dir = src.bpffs_dir(flags.bpffs_dir)?;
    let flow_map_size = src.flow_map_size(flags.flow_map_size)?;
    let stack_bypass = flags.stack_bypass.or(own.stack_bypass).unwrap_or(false);
    let takeover = flags.takeover.or(own.takeover).unwrap_or(false);
    let per_service_metrics = flags
        .per_service_metrics
        .or(own.per_service_metrics)
        .unwrap_or(true);
    let manifests = flags.manifests.or_else(|| non_empty_path(&own.manifests));
    let kubeconfig = flags
        .kubeconfig
        .or_else(|| k.kubeconfig.clone())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let (qps, burst) = src.client_rate(flags.kube_api_qps, flags.kube_api_burst)?;
    let hostname = node_name(flags.hostname_override, k.hostname_override.clone())?;
    let flow_timeouts = src.flow_timeouts([
        flags.conntrack_tcp_timeout_established,
        flags.conntrack_tcp_timeout_close_wait,
        flags.conntrack_udp_timeout,
        flags.flow_tcp_timeout_syn_sent,
    ])?;
    let (addrs, o) = src.pick(flags.nodeport_addresses, k.node_port_addresses.clone());
    let node_port_addresses = parse_node_port_addresses(o, addrs.as_deref().unwrap_or(&[]))?;
    let snat_port_range = src.snat_port_range(flags.snat_port_range)?;
    let cgroup_root = src.cgroup_root(flags.cgroup_root)?;
    let socket_lb = src.one_of(
        flags.socket_lb,
        own.socket_lb.clone(),
        ("socketLb", SocketLb::Host),
        SOCKET_LB,
    )?;
    let lb_algorithm = src.one_of(
        flags.lb_algorithm,
        own.lb_algorithm.clone(),
        ("lbAlgorithm", LbAlgorithm::Jump),
        LB_ALGORITHMS,
    )?;
    let maglev_table_size = src.maglev_table_size(flags.maglev_table_size)?;
    let load_balancer_mode = src.one_of(
        flags.load_balancer_mode,
        own.load_balancer_mode.clone(),
        ("loadBalancerMode", LoadBalancerMode::Snat),
        LOAD_BALANCER_MODES,
    )?;
    let xdp_acceleration = src.one_of(
        flags.xdp_acceleration,
        own.xdp_acceleration.clone(),
        ("xdpAcceleration", XdpAcceleration::Disabled),
        XDP_ACCELERATIONS,
    )?;
    let hash_seed_file = src.hash_seed_file(flags.hash_seed_file);
    let log_format = src.one_of(
        flags.logging_format,
        k.logging_format.clone(),
        ("logging.format", LogFormat::Text),
        LOG_FORMATS,
    )?;
    let verbosity = match flags.verbosity {
        Some(v) => v,
        None => src.file_u32(k.verbosity, "logging.verbosity")?.unwrap_or(0),
    };
    let oom_score_adj = src.oom_score_adj()?;
    Ok(Settings {
        cgroup_root,
        socket_lb,
        lb_algorithm,
        maglev_table_size,
        hash_seed_file,
        xdp_acceleration,
        load_balancer_mode,
        per_service_metrics,
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
        takeover,
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

/// The origin an error about a flag's value names.
const FLAG: &str = "flag";

/// `socketLb`'s values and `logging.format`'s, in the order their errors list them.
const SOCKET_LB: &[(&str, SocketLb)] = &[
    ("off", SocketLb::Off),
    ("host", SocketLb::Host),
    ("pods", SocketLb::Pods),
];
const LB_ALGORITHMS: &[(&str, LbAlgorithm)] =
    &[("jump", LbAlgorithm::Jump), ("maglev", LbAlgorithm::Maglev)];
const LOAD_BALANCER_MODES: &[(&str, LoadBalancerMode)] = &[
    ("snat", LoadBalancerMode::Snat),
    ("dsr", LoadBalancerMode::Dsr),
    ("hybrid", LoadBalancerMode::Hybrid),
];
const XDP_ACCELERATIONS: &[(&str, XdpAcceleration)] = &[
    ("native", XdpAcceleration::Native),
    ("best-effort", XdpAcceleration::BestEffort),
    ("disabled", XdpAcceleration::Disabled),
];
const LOG_FORMATS: &[(&str, LogFormat)] = &[("text", LogFormat::Text), ("json", LogFormat::Json)];

/// The file's side of [`resolve`]: its two documents, and its name (the origin its errors
/// name; "" without a file).
struct Sources<'a> {
    file: &'a str,
    kube: &'a KubeProxyDoc,
    own: &'a LbproxyDoc,
}

impl<'a> Sources<'a> {
    /// The flag if given, else the file's value; and the origin an error about it names.
    fn pick<T>(&self, flag: Option<T>, file: Option<T>) -> (Option<T>, &'a str) {
        match flag {
            Some(v) => (Some(v), FLAG),
            None => (file, self.file),
        }
    }

    /// A duration: the flag's, else the file's, else `default`; and where it came from.
    fn duration(
        &self,
        flag: Option<String>,
        file: Option<&String>,
        field: &str,
        default: Duration,
    ) -> Result<(Duration, &'a str), ConfigError> {
        let (v, o) = self.pick(flag, file.cloned());
        let d = match v {
            Some(s) => parse_duration(o, field, &s)?,
            None => default,
        };
        Ok((d, o))
    }

    /// A whole number from the file, as a `u32`.
    fn file_u32(&self, v: Option<i64>, field: &str) -> Result<Option<u32>, ConfigError> {
        v.map(|v| {
            u32::try_from(v)
                .map_err(|_| err(self.file, field, format!("{v} is not in 0..=4294967295")))
        })
        .transpose()
    }

    /// kube-proxy's `bindAddress`: an IP address, when given.
    fn bind_address(&self) -> Result<Option<IpAddr>, ConfigError> {
        let Some(s) = &self.kube.bind_address else {
            return Ok(None);
        };
        let ip = s.parse().map_err(|_| {
            err(
                self.file,
                "bindAddress",
                format!("{s:?} is not an IP address"),
            )
        })?;
        Ok(Some(ip))
    }

    /// A bind address (`healthzBindAddress`, `metricsBindAddress`); empty is the default.
    fn listen(
        &self,
        flag: Option<String>,
        file: &Option<String>,
        (field, default, port): (&str, &str, u16),
    ) -> Result<SocketAddr, ConfigError> {
        let (v, o) = self.pick(flag, file.clone());
        let addr = v.as_deref().filter(|s| !s.is_empty()).unwrap_or(default);
        parse_addr(o, field, addr, port)
    }

    /// `syncPeriod` (at least 1s) and `minSyncPeriod` (no longer than it).
    fn sync_periods(
        &self,
        sync: Option<String>,
        min: Option<String>,
    ) -> Result<(Duration, Duration), ConfigError> {
        let k = self.kube;
        let (sync_period, o) = self.duration(
            sync,
            k.sync_period.as_ref(),
            "syncPeriod",
            DEFAULT_SYNC_PERIOD,
        )?;
        if sync_period < Duration::from_secs(1) {
            return Err(err(o, "syncPeriod", "must be at least 1s"));
        }
        let (min_sync_period, o) = self.duration(
            min,
            k.min_sync_period.as_ref(),
            "minSyncPeriod",
            DEFAULT_MIN_SYNC_PERIOD,
        )?;
        if min_sync_period > sync_period {
            return Err(err(
                o,
                "minSyncPeriod",
                format!(
                    "{} is longer than syncPeriod {}",
                    humantime::format_duration(min_sync_period),
                    humantime::format_duration(sync_period)
                ),
            ));
        }
        Ok((sync_period, min_sync_period))
    }

    /// kube-proxy's `detectLocalMode` ("" for the default) and, which that mode needs,
    /// `detectLocal.interfaceNamePrefix`.
    fn detect_local(&self) -> Result<(String, Option<String>), ConfigError> {
        let mode = self.kube.detect_local_mode.clone().unwrap_or_default();
        let modes = [
            "",
            "ClusterCIDR",
            "NodeCIDR",
            "BridgeInterface",
            "InterfaceNamePrefix",
        ];
        if !modes.contains(&mode.as_str()) {
            return Err(err(
                self.file,
                "detectLocalMode",
                format!(
                    "{mode:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"
                ),
            ));
        }
        let prefix = self.kube.interface_name_prefix.clone();
        if mode == "InterfaceNamePrefix" && prefix.is_none() {
            return Err(err(
                self.file,
                "detectLocal.interfaceNamePrefix",
                "must be set when detectLocalMode is InterfaceNamePrefix",
            ));
        }
        Ok((mode, prefix))
    }

    /// kube-proxy's `clusterCIDR`: comma-separated CIDRs.
    fn cluster_cidrs(&self) -> Result<Vec<ipnet::IpNet>, ConfigError> {
        self.kube
            .cluster_cidr
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|c| {
                c.parse().map_err(|_| {
                    err(
                        self.file,
                        "clusterCIDR",
                        format!("{c:?} is not a CIDR (for example 10.244.0.0/16)"),
                    )
                })
            })
            .collect()
    }

    /// Pod interfaces: the flag, lbproxy's document, kube-proxy's interface name prefix
    /// (detectLocalMode InterfaceNamePrefix), else the default globs.
    fn pod_interfaces(
        &self,
        flag: Option<String>,
        detect_local_mode: &str,
        prefix: Option<&str>,
    ) -> Result<Vec<String>, ConfigError> {
        let from_prefix = prefix
            .filter(|_| detect_local_mode == "InterfaceNamePrefix")
            .map(|p| format!("{p}*"));
        let own = self.own.pod_interfaces.as_ref().map(|l| l.join(","));
        let (v, o) = self.pick(flag, own.or(from_prefix));
        let globs: Vec<String> = v
            .as_deref()
            .unwrap_or(DEFAULT_POD_INTERFACES)
            .split(',')
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .map(String::from)
            .collect();
        if globs.is_empty() {
            return Err(err(o, "podInterfaces", "no interface globs given"));
        }
        for g in &globs {
            globset::Glob::new(g)
                .map_err(|e| err(o, "podInterfaces", format!("bad glob {g:?}: {e}")))?;
        }
        Ok(globs)
    }

    /// `bpffsDir`, absolute: the flag's, else the file's, else the default. A relative one is
    /// refused naming where it came from.
    fn bpffs_dir(&self, flag: Option<PathBuf>) -> Result<PathBuf, ConfigError> {
        let (dir, o) = self.pick(flag, non_empty_path(&self.own.bpffs_dir));
        absolute(
            o,
            "bpffsDir",
            dir.unwrap_or_else(|| PathBuf::from(DEFAULT_BPFFS_DIR)),
        )
    }

    fn flow_map_size(&self, flag: Option<u64>) -> Result<u32, ConfigError> {
        let (size, o) = self.pick(flag, self.own.flow_map_size);
        let size = size.unwrap_or(u64::from(lbproxy_common::DEFAULT_FLOW_MAP_SIZE));
        u32::try_from(size)
            .ok()
            .filter(|n| *n >= 1024)
            .ok_or_else(|| {
                err(
                    o,
                    "flowMapSize",
                    format!("{size} is not in 1024..=4294967295"),
                )
            })
    }

    /// The Maglev tables' size: a prime in the range `program::maglev` accepts.
    fn maglev_table_size(&self, flag: Option<u32>) -> Result<u32, ConfigError> {
        let (size, o) = self.pick(flag, self.own.maglev_table_size);
        crate::program::maglev::check_size(size.unwrap_or(crate::program::maglev::DEFAULT_M))
            .map_err(|e| err(o, "maglevTableSize", e.to_string()))
    }

    /// The seed file's path (the file itself is read at start, by `bpf::seed_from_file`).
    fn hash_seed_file(&self, flag: Option<PathBuf>) -> Option<PathBuf> {
        self.pick(flag, non_empty_path(&self.own.hash_seed_file)).0
    }

    /// The API client's rate limit and burst; 0 for either is the default.
    fn client_rate(&self, qps: Option<f64>, burst: Option<u32>) -> Result<(f32, u32), ConfigError> {
        let qps = qps.or(self.kube.qps).map_or(DEFAULT_QPS, |q| q as f32);
        let burst = match burst {
            Some(b) => b,
            None => self
                .file_u32(self.kube.burst, "clientConnection.burst")?
                .unwrap_or(DEFAULT_BURST),
        };
        Ok((
            if qps == 0.0 { DEFAULT_QPS } else { qps },
            if burst == 0 { DEFAULT_BURST } else { burst },
        ))
    }

    /// The flow table's idle timeouts (`conntrack.*`, `tcpSynSentTimeout`), each longer
    /// than 0s, from their flags: established, close-wait, UDP, SYN-sent.
    fn flow_timeouts(
        &self,
        [established, close_wait, udp, syn_sent]: [Option<String>; 4],
    ) -> Result<crate::bpf::flow_gc::Timeouts, ConfigError> {
        let (k, defaults) = (self.kube, crate::bpf::flow_gc::Timeouts::default());
        let timeout = |flag, file, field, default| {
            let (d, o) = self.duration(flag, file, field, default)?;
            if d.is_zero() {
                return Err(err(o, field, "must be longer than 0s"));
            }
            Ok(d)
        };
        Ok(crate::bpf::flow_gc::Timeouts {
            tcp_established: timeout(
                established,
                k.tcp_established_timeout.as_ref(),
                "conntrack.tcpEstablishedTimeout",
                defaults.tcp_established,
            )?,
            tcp_half_closed: timeout(
                close_wait,
                k.tcp_close_wait_timeout.as_ref(),
                "conntrack.tcpCloseWaitTimeout",
                defaults.tcp_half_closed,
            )?,
            tcp_closing: defaults.tcp_closing,
            sctp: defaults.sctp,
            udp: timeout(
                udp,
                k.udp_timeout.as_ref(),
                "conntrack.udpTimeout",
                defaults.udp,
            )?,
            tcp_syn_sent: timeout(
                syn_sent,
                self.own
                    .tcp_syn_sent_timeout
                    .as_ref()
                    .filter(|s| !s.is_empty()),
                "tcpSynSentTimeout",
                defaults.tcp_syn_sent,
            )?,
        })
    }

    /// `snatPortRange`; empty is the default.
    fn snat_port_range(&self, flag: Option<String>) -> Result<(u16, u16), ConfigError> {
        let (range, o) = self.pick(flag, self.own.snat_port_range.clone());
        match range.filter(|s| !s.is_empty()) {
            Some(r) => parse_port_range(o, &r),
            None => Ok((
                lbproxy_common::DEFAULT_SNAT_PORT_MIN,
                lbproxy_common::DEFAULT_SNAT_PORT_MAX,
            )),
        }
    }

    /// `cgroupRoot`: an absolute directory, or the default when not given.
    fn cgroup_root(&self, flag: Option<PathBuf>) -> Result<CgroupRoot, ConfigError> {
        let (root, o) = self.pick(flag, non_empty_path(&self.own.cgroup_root));
        match root {
            Some(p) => Ok(CgroupRoot::Path(absolute(o, "cgroupRoot", p)?)),
            None => Ok(CgroupRoot::Default),
        }
    }

    /// One of `choices` by its name (trimmed); empty is the default.
    fn one_of<T: Copy>(
        &self,
        flag: Option<String>,
        file: Option<String>,
        (field, default): (&str, T),
        choices: &[(&str, T)],
    ) -> Result<T, ConfigError> {
        let (v, o) = self.pick(flag, file);
        let v = v.as_deref().map_or("", str::trim);
        if v.is_empty() {
            return Ok(default);
        }
        let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
        choices
            .iter()
            .find(|(n, _)| *n == v)
            .map(|(_, c)| *c)
            .ok_or_else(|| {
                err(
                    o,
                    field,
                    format!("{v:?} is not one of {}", names.join(", ")),
                )
            })
    }

    /// kube-proxy's `oomScoreAdj`, in -1000..=1000.
    fn oom_score_adj(&self) -> Result<Option<i32>, ConfigError> {
        match self.kube.oom_score_adj {
            Some(v) if (-1000..=1000).contains(&v) => Ok(Some(v as i32)),
            Some(v) => Err(err(
                self.file,
                "oomScoreAdj",
                format!("{v} is not in -1000..=1000"),
            )),
            None => Ok(None),
        }
    }
}

/// The node's name: the flag's, else the file's, else the hostname; lowercase.
fn node_name(flag: Option<String>, file: Option<String>) -> Result<String, ConfigError> {
    let name = flag
        .or(file)
        .filter(|s| !s.is_empty())
        .map_or_else(hostname, |h| h.trim().to_lowercase());
    if name.is_empty() {
        return Err(err(
            FLAG,
            "hostnameOverride",
            "the hostname is empty and no --hostname-override was given",
        ));
    }
    Ok(name)
}

/// A path given in lbproxy's document; "" is "not given".
fn non_empty_path(s: &Option<String>) -> Option<PathBuf> {
    s.as_deref().filter(|s| !s.is_empty()).map(PathBuf::from)
}

/// `p`, refused when it is not absolute.
fn absolute(origin: &str, field: &str, p: PathBuf) -> Result<PathBuf, ConfigError> {
    if !p.is_absolute() {
        return Err(err(
            origin,
            field,
            format!("{} is not an absolute path", p.display()),
        ));
    }
    Ok(p)
}
