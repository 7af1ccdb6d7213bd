//! The resolve step's unit tests: flag over file over default for every setting, each kind
//! of document, and the whole message of each refusal.

use std::path::Path;

use super::*;

fn parse(text: &str) -> Result<FileConfig, ConfigError> {
    parse_file(Path::new("c.yaml"), text)
}

fn with(text: &str, flags: Flags) -> Result<Settings, ConfigError> {
    resolve(Some((Path::new("c.yaml"), parse(text)?)), flags)
}

fn named() -> Flags {
    Flags {
        hostname_override: Some("n".into()),
        ..Default::default()
    }
}

/// lbproxy's own document's header, after kube-proxy's.
const OWN: &str = "---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\n";

/// Sets one flag.
type SetFlag = fn(&mut Flags);

/// One setting: how a flag sets it, what the file says (kube-proxy's document, then
/// lbproxy's), and the setting as each of the flag, the file and the default leaves it.
struct Precedence {
    flag: SetFlag,
    kube: &'static str,
    own: &'static str,
    get: fn(&Settings) -> String,
    /// From the flag, from the file, the default.
    want: [&'static str; 3],
}

fn s(v: &str) -> Option<String> {
    Some(v.into())
}

#[rustfmt::skip]
const PRECEDENCE: &[Precedence] = &[
    Precedence { flag: |f| f.sync_period = s("10s"), kube: "syncPeriod: 1m\n", own: "", get: |s| format!("{:?}", s.sync_period), want: ["10s", "60s", "30s"] },
    Precedence { flag: |f| f.min_sync_period = s("1s"), kube: "minSyncPeriod: 2s\n", own: "", get: |s| format!("{:?}", s.min_sync_period), want: ["1s", "2s", "0ns"] },
    Precedence { flag: |f| f.healthz_bind_address = s("127.0.0.1:1"), kube: "healthzBindAddress: 127.0.0.2\n", own: "", get: |s| s.healthz_bind_address.to_string(), want: ["127.0.0.1:1", "127.0.0.2:10256", "0.0.0.0:10256"] },
    Precedence { flag: |f| f.metrics_bind_address = s("127.0.0.1:1"), kube: "metricsBindAddress: 0.0.0.0:2\n", own: "", get: |s| s.metrics_bind_address.to_string(), want: ["127.0.0.1:1", "0.0.0.0:2", "127.0.0.1:10249"] },
    Precedence { flag: |f| f.kubeconfig = s("/f"), kube: "clientConnection: {kubeconfig: /k}\n", own: "", get: |s| format!("{:?}", s.kubeconfig), want: ["Some(\"/f\")", "Some(\"/k\")", "None"] },
    Precedence { flag: |f| f.kube_api_qps = Some(-1.0), kube: "clientConnection: {qps: 7}\n", own: "", get: |s| s.qps.to_string(), want: ["-1", "7", "5"] },
    Precedence { flag: |f| f.kube_api_burst = Some(3), kube: "clientConnection: {burst: 4}\n", own: "", get: |s| s.burst.to_string(), want: ["3", "4", "10"] },
    Precedence { flag: |f| f.hostname_override = s("Flag"), kube: "hostnameOverride: File\n", own: "", get: |s| s.hostname.clone(), want: ["flag", "file", "n"] },
    Precedence { flag: |f| f.conntrack_tcp_timeout_established = s("1h"), kube: "conntrack: {tcpEstablishedTimeout: 2h}\n", own: "", get: |s| format!("{:?}", s.flow_timeouts.tcp_established), want: ["3600s", "7200s", "86400s"] },
    Precedence { flag: |f| f.conntrack_tcp_timeout_close_wait = s("1m"), kube: "conntrack: {tcpCloseWaitTimeout: 2m}\n", own: "", get: |s| format!("{:?}", s.flow_timeouts.tcp_half_closed), want: ["60s", "120s", "3600s"] },
    Precedence { flag: |f| f.conntrack_udp_timeout = s("1s"), kube: "conntrack: {udpTimeout: 2s}\n", own: "", get: |s| format!("{:?}", s.flow_timeouts.udp), want: ["1s", "2s", "30s"] },
    Precedence { flag: |f| f.flow_tcp_timeout_syn_sent = s("1s"), kube: "", own: "tcpSynSentTimeout: 2s\n", get: |s| format!("{:?}", s.flow_timeouts.tcp_syn_sent), want: ["1s", "2s", "30s"] },
    Precedence { flag: |f| f.nodeport_addresses = Some(vec!["primary".into()]), kube: "nodePortAddresses: [192.0.2.0/24]\n", own: "", get: |s| format!("{:?}", s.node_port_addresses), want: ["Primary", "Cidrs([192.0.2.0/24])", "All"] },
    Precedence { flag: |f| f.logging_format = s("text"), kube: "logging: {format: json}\n", own: "", get: |s| s.log_format.as_str().into(), want: ["text", "json", "text"] },
    Precedence { flag: |f| f.verbosity = Some(1), kube: "logging: {verbosity: 2}\n", own: "", get: |s| s.verbosity.to_string(), want: ["1", "2", "0"] },
    Precedence { flag: |f| f.pod_interfaces = s("a*,b*"), kube: "", own: "podInterfaces: [c*]\n", get: |s| s.pod_interfaces.join(","), want: ["a*,b*", "c*", "lxc*,veth*,cali*"] },
    Precedence { flag: |f| f.bpffs_dir = Some("/f".into()), kube: "", own: "bpffsDir: /o\n", get: |s| s.bpffs_dir.display().to_string(), want: ["/f", "/o", "/sys/fs/bpf/lbproxy"] },
    Precedence { flag: |f| f.flow_map_size = Some(4096), kube: "", own: "flowMapSize: 8192\n", get: |s| s.flow_map_size.to_string(), want: ["4096", "8192", "262144"] },
    Precedence { flag: |f| f.stack_bypass = Some(false), kube: "", own: "stackBypass: true\n", get: |s| s.stack_bypass.to_string(), want: ["false", "true", "false"] },
    Precedence { flag: |f| f.manifests = Some("/f".into()), kube: "", own: "manifests: /o\n", get: |s| format!("{:?}", s.manifests), want: ["Some(\"/f\")", "Some(\"/o\")", "None"] },
    Precedence { flag: |f| f.snat_port_range = s("2000-3000"), kube: "", own: "snatPortRange: 4000-5000\n", get: |s| format!("{:?}", s.snat_port_range), want: ["(2000, 3000)", "(4000, 5000)", "(1024, 29999)"] },
    Precedence { flag: |f| f.cgroup_root = Some("/f".into()), kube: "", own: "cgroupRoot: /o\n", get: |s| format!("{:?}", s.cgroup_root), want: ["Path(\"/f\")", "Path(\"/o\")", "Default"] },
    Precedence { flag: |f| f.socket_lb = s("off"), kube: "", own: "socketLb: pods\n", get: |s| s.socket_lb.as_str().into(), want: ["off", "pods", "host"] },
    Precedence { flag: |f| f.lb_algorithm = s("jump"), kube: "", own: "lbAlgorithm: maglev\n", get: |s| s.lb_algorithm.as_str().into(), want: ["jump", "maglev", "jump"] },
    Precedence { flag: |f| f.load_balancer_mode = s("dsr"), kube: "", own: "loadBalancerMode: hybrid\n", get: |s| s.load_balancer_mode.as_str().into(), want: ["dsr", "hybrid", "snat"] },
    Precedence { flag: |f| f.per_service_metrics = Some(false), kube: "", own: "perServiceMetrics: false\n", get: |s| s.per_service_metrics.to_string(), want: ["false", "false", "true"] },
    Precedence { flag: |f| f.xdp_acceleration = s("native"), kube: "", own: "xdpAcceleration: best-effort\n", get: |s| s.xdp_acceleration.as_str().into(), want: ["native", "best-effort", "disabled"] },
    Precedence { flag: |f| f.maglev_table_size = Some(251), kube: "", own: "maglevTableSize: 65521\n", get: |s| s.maglev_table_size.to_string(), want: ["251", "65521", "16381"] },
    Precedence { flag: |f| f.hash_seed_file = Some("/f".into()), kube: "", own: "hashSeedFile: /o\n", get: |s| format!("{:?}", s.hash_seed_file), want: ["Some(\"/f\")", "Some(\"/o\")", "None"] },
];

/// Every setting: the flag wins over the file, the file over the default.
#[test]
fn flag_over_file_over_default() {
    for (i, p) in PRECEDENCE.iter().enumerate() {
        // The node's name from the file too (the hostname case's own, or "n").
        let name = if p.kube.contains("hostnameOverride") {
            ""
        } else {
            "hostnameOverride: n\n"
        };
        let text = format!("{name}{}{OWN}{}", p.kube, p.own);
        let mut flags = named();
        (p.flag)(&mut flags);
        let got = [
            (p.get)(&with(&text, flags).unwrap()),
            (p.get)(&with(&text, Flags::default()).unwrap()),
            (p.get)(&resolve(None, named()).unwrap()),
        ];
        assert_eq!(got, p.want.map(String::from), "case {i}: {text:?}");
    }
}

/// Which document is which: by `apiVersion` and `kind`, in either order, either one alone,
/// empty documents skipped; a second document of a kind, or a kind of neither, refused.
#[test]
fn each_document_kind() {
    let kube = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nsyncPeriod: 1m\n";
    let own = "apiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nflowMapSize: 2048\n";
    for (text, sync, size) in [
        (format!("{kube}---\n{own}"), 60, 2048),
        (format!("{own}---\n{kube}"), 60, 2048),
        (format!("---\n---\n{own}"), 30, 2048),
        (kube.to_string(), 60, 262_144),
        ("syncPeriod: 1m\n".into(), 60, 262_144),
        (
            "kind: KubeProxyConfiguration\nsyncPeriod: 1m\n".into(),
            60,
            262_144,
        ),
        (String::new(), 30, 262_144),
    ] {
        let s = with(&text, named()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(
            (s.sync_period.as_secs(), s.flow_map_size),
            (sync, size),
            "{text:?}"
        );
    }
    for (text, want) in [
        (
            format!("{kube}---\n{kube}"),
            "document 2: a second KubeProxyConfiguration document",
        ),
        (
            format!("{own}---\n{own}"),
            "document 2: a second LbproxyConfiguration document",
        ),
        (
            "kind: LbproxyConfiguration\n".into(),
            "apiVersion: \"\" is not lbproxy.io/v1alpha1 (kind LbproxyConfiguration)",
        ),
        (
            "apiVersion: v1\nkind: ConfigMap\n".into(),
            "kind: \"ConfigMap\" (apiVersion \"v1\") is neither KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1) nor LbproxyConfiguration (lbproxy.io/v1alpha1)",
        ),
        ("[1, 2]\n".into(), "document 1: is not a mapping"),
    ] {
        let e = parse(&text).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("invalid configuration: c.yaml: {want}"),
            "{text:?}"
        );
    }
}

/// The sync periods: the short form, else the configured mode's block, else iptables',
/// else nftables'; a block after the first set value is not read at all.
#[test]
fn sync_period_blocks() {
    for (text, want) in [
        ("syncPeriod: 5s\niptables: {syncPeriod: 6s}\n", 5),
        (
            "iptables: {syncPeriod: 6s}\nnftables: {syncPeriod: 7s}\n",
            6,
        ),
        (
            "mode: nftables\niptables: {syncPeriod: 6s}\nnftables: {syncPeriod: 7s}\n",
            7,
        ),
        (
            "iptables: {syncPeriod: 0s}\nnftables: {syncPeriod: 7s}\n",
            7,
        ),
        ("syncPeriod: 5s\niptables: {syncPeriod: 5}\n", 5),
        (
            "mode: nftables\nnftables: {syncPeriod: 7s}\niptables: {syncPeriod: [x]}\n",
            7,
        ),
    ] {
        let s = with(text, named()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(s.sync_period.as_secs(), want, "{text:?}");
    }
    let e = with("iptables: {syncPeriod: 5}\n", named()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid configuration: c.yaml: iptables.syncPeriod: 5 is not a string"
    );
}

/// A flag's value is parsed instead of the file's, so a bad file value under a flag is
/// not refused; a field of the wrong type is refused whatever the flags say.
#[test]
fn flags_hide_file_values_but_not_wrong_types() {
    let mut flags = named();
    flags.sync_period = s("10s");
    flags.socket_lb = s("off");
    let text = format!("syncPeriod: thirty\n{OWN}socketLb: sideways\n");
    let s = with(&text, flags).unwrap();
    assert_eq!((s.sync_period.as_secs(), s.socket_lb), (10, SocketLb::Off));
    let mut flags = named();
    flags.kubeconfig = Some("/k".into());
    let e = with("clientConnection: {kubeconfig: 5}\n", flags).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid configuration: c.yaml: clientConnection.kubeconfig: 5 is not a string"
    );
}

/// Each refusal of kube-proxy's document, whole: origin, field and reason; with several
/// bad values, the first in resolve's order.
#[test]
fn kube_proxy_refusals_name_field_and_reason() {
    let file_cases = [
        (
            "clientConnection: {burst: 1.5}\n",
            "clientConnection.burst: 1.5 is not an integer",
        ),
        (
            "clientConnection: {burst: -1}\n",
            "clientConnection.burst: -1 is not in 0..=4294967295",
        ),
        (
            "logging: {verbosity: -1}\n",
            "logging.verbosity: -1 is not in 0..=4294967295",
        ),
        ("logging: 5\n", "logging: 5 is not a mapping"),
        (
            "nodePortAddresses: x\n",
            "nodePortAddresses: \"x\" is not a list of strings",
        ),
        (
            "nodePortAddresses: [1]\n",
            "nodePortAddresses: 1 is not a string",
        ),
        (
            "bindAddress: x\n",
            "bindAddress: \"x\" is not an IP address",
        ),
        (
            "configSyncPeriod: x\n",
            "configSyncPeriod: \"x\" is not a duration (for example 30s, 1m, 500ms, 24h0m0s)",
        ),
        ("syncPeriod: 500ms\n", "syncPeriod: must be at least 1s"),
        (
            "detectLocalMode: Bogus\n",
            "detectLocalMode: \"Bogus\" is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix",
        ),
        ("mode: 5\n", "mode: 5 is not a string"),
        (
            "conntrack: {udpTimeout: 5}\n",
            "conntrack.udpTimeout: 5 is not a string",
        ),
        (
            "metricsBindAddress: 127.0.0.1:http\n",
            "metricsBindAddress: \"127.0.0.1:http\" is not an IP:port address (for example 0.0.0.0:10249)",
        ),
        (
            "hostnameOverride: 5\nclientConnection: {kubeconfig: 6}\n",
            "clientConnection.kubeconfig: 6 is not a string",
        ),
        (
            "healthzBindAddress: x\nsyncPeriod: thirty\n",
            "healthzBindAddress: \"x\" is not an IP:port address (for example 0.0.0.0:10256)",
        ),
        ("iptables: 5\n", "iptables: 5 is not a mapping"),
    ];
    for (text, want) in file_cases {
        let e = with(text, named()).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("invalid configuration: c.yaml: {want}"),
            "{text:?}"
        );
    }
}

/// Each refusal of lbproxy's document, whole.
#[test]
fn lbproxy_refusals_name_field_and_reason() {
    let own_cases = [
        (
            "podInterfaces: []\n",
            "podInterfaces: no interface globs given",
        ),
        (
            "tcpSynSentTimeout: 0s\n",
            "tcpSynSentTimeout: must be longer than 0s",
        ),
        ("bpffsDir: rel\n", "bpffsDir: rel is not an absolute path"),
        (
            "cgroupRoot: rel\n",
            "cgroupRoot: rel is not an absolute path",
        ),
        (
            "socketLb: x\n",
            "socketLb: \"x\" is not one of off, host, pods",
        ),
        (
            "lbAlgorithm: random\n",
            "lbAlgorithm: \"random\" is not one of jump, maglev",
        ),
        (
            "loadBalancerMode: direct\n",
            "loadBalancerMode: \"direct\" is not one of snat, dsr, hybrid",
        ),
        (
            "xdpAcceleration: generic\n",
            "xdpAcceleration: \"generic\" is not one of native, best-effort, disabled",
        ),
        (
            "maglevTableSize: 16383\n",
            "maglevTableSize: the Maglev table size must be a prime (each backend's permutation must reach every entry), and 16383 is not; 16381, 32749 and 65521 are",
        ),
        (
            "maglevTableSize: 100\n",
            "maglevTableSize: the Maglev table size must be between 251 and 131071, not 100",
        ),
        (
            "snatPortRange: 80-90\nsocketLb: x\n",
            "snatPortRange: \"80-90\" is not MIN-MAX with 1024 <= MIN <= MAX <= 65535",
        ),
        (
            "flowMapSize: lots\n",
            "LbproxyConfiguration: invalid type: string \"lots\", expected u64",
        ),
    ];
    for (text, want) in own_cases {
        let e = with(&format!("{OWN}{text}"), named())
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!("invalid configuration: c.yaml: {want}"),
            "{text:?}"
        );
    }
}

/// Each refusal of a flag, whole: its origin is `flag`, its field the file's.
#[test]
fn flag_refusals_name_field_and_reason() {
    let flag_cases: [(SetFlag, &str); 8] = [
        (
            |f| f.sync_period = s(""),
            "syncPeriod: \"\" is not a duration (for example 30s, 1m, 500ms, 24h0m0s)",
        ),
        (
            |f| f.conntrack_tcp_timeout_established = s("0s"),
            "conntrack.tcpEstablishedTimeout: must be longer than 0s",
        ),
        (
            |f| f.pod_interfaces = s("["),
            "podInterfaces: bad glob \"[\": error parsing glob '[': unclosed character class; missing ']'",
        ),
        (
            |f| f.flow_map_size = Some(10),
            "flowMapSize: 10 is not in 1024..=4294967295",
        ),
        (
            |f| f.logging_format = s("xml"),
            "logging.format: \"xml\" is not one of text, json",
        ),
        (
            |f| f.nodeport_addresses = Some(vec!["1.2.3.0/24".into(), "primary".into()]),
            "nodePortAddresses: can't use both \"primary\" and CIDRs (got [\"1.2.3.0/24\", \"primary\"])",
        ),
        (
            |f| f.bpffs_dir = Some("rel/dir".into()),
            "bpffsDir: rel/dir is not an absolute path",
        ),
        (
            |f| f.hostname_override = s(" "),
            "hostnameOverride: the hostname is empty and no --hostname-override was given",
        ),
    ];
    for (i, (set, want)) in flag_cases.into_iter().enumerate() {
        let mut flags = named();
        set(&mut flags);
        let e = with("syncPeriod: 1m\n", flags).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("invalid configuration: flag: {want}"),
            "flag case {i}"
        );
    }
}
