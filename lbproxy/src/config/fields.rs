//! The fields of both documents and what lbproxy does with each.

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
pub(crate) const LBPROXY_FIELDS: &[&str] = &[
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
