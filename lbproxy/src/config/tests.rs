//! The configuration's unit tests: every accepted file and every error message.

use std::path::Path;

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
            nodeport_addresses: Some(vec!["198.18.80.0/24,198.18.90.0/24".into()]),
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
        include_str!("../../../tests/fixtures/kubeadm-kube-proxy.conf"),
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
