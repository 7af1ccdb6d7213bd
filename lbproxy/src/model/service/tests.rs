//! Unit tests of Service normalization: every field kube-proxy reads, and the error for each bad value.

use super::*;

fn parse(yaml: &str) -> Result<Normalized<Service>, InvalidObject> {
    service_from_k8s(&crate::yaml::from_str(yaml).unwrap())
}

fn proxied(yaml: &str) -> Service {
    match parse(yaml).unwrap() {
        Normalized::Proxied(s) => s,
        Normalized::Skipped(why) => panic!("unexpectedly skipped: {why}\n{yaml}"),
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const LB: &str = r"
metadata: {name: lb, namespace: shop, creationTimestamp: '2024-01-02T03:04:05Z'}
spec:
  type: LoadBalancer
  clusterIPs: [198.19.0.10, 'fd00::10']
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: sig, port: 99, protocol: SCTP, nodePort: 30099}
  externalIPs: [203.0.113.7, '2001:db8::7']
  loadBalancerSourceRanges: [' 10.1.2.3/8 ', '2001:db8::/32']
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
status:
  loadBalancer:
    ingress:
    - {ip: 192.0.2.1}
    - {ip: 192.0.2.2, ipMode: VIP}
    - {ip: 192.0.2.3, ipMode: Proxy}
    - {hostname: lb.example}
    - {ip: '2001:db8::1', hostname: lb6.example}
";

#[test]
fn every_service_field_is_parsed() {
    let s = proxied(LB);
    let want = Service {
        id: NamespacedName {
            namespace: "shop".into(),
            name: "lb".into(),
        },
        created: Some("2024-01-02T03:04:05Z".parse().unwrap()),
        service_type: ServiceType::LoadBalancer,
        cluster_ips: vec![ip("198.19.0.10"), ip("fd00::10")],
        ip_families: vec![Family::V4, Family::V6],
        ip_family_policy: IpFamilyPolicy::RequireDualStack,
        ports: vec![
            ServicePort {
                name: "http".into(),
                port: 80,
                protocol: Protocol::Tcp,
                target_port: TargetPort::Number(8080),
                node_port: Some(30080),
            },
            ServicePort {
                name: "sig".into(),
                port: 99,
                protocol: Protocol::Sctp,
                target_port: TargetPort::Number(99),
                node_port: Some(30099),
            },
        ],
        external_ips: vec![ip("203.0.113.7"), ip("2001:db8::7")],
        load_balancer_ingress: vec![
            LoadBalancerIngress {
                ip: ip("192.0.2.1"),
                ip_mode: IpMode::Vip,
            },
            LoadBalancerIngress {
                ip: ip("192.0.2.2"),
                ip_mode: IpMode::Vip,
            },
            LoadBalancerIngress {
                ip: ip("192.0.2.3"),
                ip_mode: IpMode::Proxy,
            },
            // The hostname-only entry is not kept; one with an IP is, by its IP.
            LoadBalancerIngress {
                ip: ip("2001:db8::1"),
                ip_mode: IpMode::Vip,
            },
        ],
        // Trimmed, as kube-proxy does, and host bits cleared.
        load_balancer_source_ranges: vec![
            "10.0.0.0/8".parse().unwrap(),
            "2001:db8::/32".parse().unwrap(),
        ],
        external_local: true,
        internal_local: true,
        health_check_node_port: Some(32000),
        affinity_timeout_s: DEFAULT_AFFINITY_TIMEOUT_S as u32,
    };
    assert_eq!(s, want);
}

#[test]
fn absent_fields_take_kubernetes_defaults() {
    let s = proxied(
        "metadata: {name: a}\nspec: {clusterIP: 198.19.0.1, ports: [{port: 80, nodePort: 0}], healthCheckNodePort: 0}",
    );
    assert_eq!(s.service_type, ServiceType::ClusterIp);
    assert!(s.ip_families.is_empty());
    assert_eq!(s.ip_family_policy, IpFamilyPolicy::SingleStack);
    assert_eq!(s.ports[0].node_port, None);
    assert!(s.external_ips.is_empty());
    assert!(s.load_balancer_ingress.is_empty());
    assert!(s.load_balancer_source_ranges.is_empty());
    assert!(!s.external_local && !s.internal_local);
    assert_eq!(s.health_check_node_port, None);
    for (ty, want) in [
        ("ClusterIP", ServiceType::ClusterIp),
        ("NodePort", ServiceType::NodePort),
        ("LoadBalancer", ServiceType::LoadBalancer),
    ] {
        let s = proxied(&format!(
            "metadata: {{name: a}}\nspec: {{type: {ty}, clusterIP: 198.19.0.1}}"
        ));
        assert_eq!(s.service_type, want, "{ty}");
    }
    for (policy, want) in [
        ("SingleStack", IpFamilyPolicy::SingleStack),
        ("PreferDualStack", IpFamilyPolicy::PreferDualStack),
        ("RequireDualStack", IpFamilyPolicy::RequireDualStack),
    ] {
        let s = proxied(&format!(
            "metadata: {{name: a}}\nspec: {{ipFamilyPolicy: {policy}, clusterIP: 198.19.0.1}}"
        ));
        assert_eq!(s.ip_family_policy, want, "{policy}");
    }
}

#[test]
fn node_port_on_a_cluster_ip_service_is_kept_as_kube_proxy_does() {
    let s = proxied(
        "metadata: {name: a}\nspec: {clusterIP: 198.19.0.1, ports: [{port: 80, nodePort: 30080}]}",
    );
    assert_eq!(s.service_type, ServiceType::ClusterIp);
    assert_eq!(s.ports[0].node_port, Some(30080));
}

#[test]
fn headless_label_with_any_value_is_skipped() {
    for value in ["''", "'true'", "anything"] {
        let y = format!(
            "metadata: {{name: a, labels: {{service.kubernetes.io/headless: {value}}}}}\nspec: {{clusterIP: 198.19.0.1}}"
        );
        match parse(&y).unwrap() {
            Normalized::Skipped(why) => assert_eq!(why, "labelled headless"),
            Normalized::Proxied(s) => panic!("proxied {s:?}"),
        }
    }
}

#[test]
fn each_bad_field_names_the_object_and_field() {
    let base = "metadata: {name: a, namespace: n}\nspec: {clusterIP: 198.19.0.3";
    for (extra, want) in [
        (
            "type: Internal",
            "spec.type \"Internal\" is not one of ClusterIP, NodePort, LoadBalancer, ExternalName",
        ),
        (
            "ipFamilies: [IPv5]",
            "spec.ipFamilies[0] \"IPv5\" is not one of IPv4, IPv6",
        ),
        (
            "ipFamilies: [IPv4, IPv4]",
            "spec.ipFamilies[1] \"IPv4\" is listed twice",
        ),
        (
            "ipFamilies: [IPv6]",
            "spec.clusterIPs[0] \"198.19.0.3\" does not match spec.ipFamilies[0] IPv6",
        ),
        (
            "ipFamilyPolicy: DualStack",
            "spec.ipFamilyPolicy \"DualStack\" is not one of SingleStack, PreferDualStack, RequireDualStack",
        ),
        (
            "ports: [{port: 80}, {port: 81, nodePort: 70000}]",
            "spec.ports[1].nodePort 70000 is out of range 1-65535",
        ),
        (
            "ports: [{port: 80, nodePort: -1}]",
            "spec.ports[0].nodePort -1 is out of range 1-65535",
        ),
        (
            "externalIPs: [203.0.113.1, 203.0.113.300]",
            "spec.externalIPs[1] \"203.0.113.300\" is not a valid IP address",
        ),
        (
            "loadBalancerSourceRanges: [10.0.0.0/8, 10.0.0.0/33]",
            "spec.loadBalancerSourceRanges[1] \"10.0.0.0/33\" is not a valid CIDR",
        ),
        (
            "loadBalancerSourceRanges: [10.0.0.1]",
            "spec.loadBalancerSourceRanges[0] \"10.0.0.1\" is not a valid CIDR",
        ),
        (
            "externalTrafficPolicy: OnlyLocal",
            "spec.externalTrafficPolicy \"OnlyLocal\" is not one of Cluster, Local",
        ),
        (
            "internalTrafficPolicy: Node",
            "spec.internalTrafficPolicy \"Node\" is not one of Cluster, Local",
        ),
        (
            "healthCheckNodePort: 65536",
            "spec.healthCheckNodePort 65536 is out of range 1-65535",
        ),
        (
            "sessionAffinity: Cookie",
            "spec.sessionAffinity \"Cookie\" is not one of None, ClientIP",
        ),
    ] {
        let e = parse(&format!("{base}, {extra}}}")).unwrap_err();
        assert_eq!(e.to_string(), format!("Service n/a: {want}"), "{extra}");
    }
    let e = parse(
            "metadata: {name: a, namespace: n}\nspec: {clusterIPs: [198.19.0.3, 'fd00::3'], ipFamilies: [IPv4, IPv4]}",
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: spec.ipFamilies[1] \"IPv4\" is listed twice"
    );
    let e = parse(
            "metadata: {name: a, namespace: n}\nspec: {clusterIPs: [198.19.0.3, 198.19.0.4], ipFamilies: [IPv4, IPv6]}",
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: spec.clusterIPs[1] \"198.19.0.4\" does not match spec.ipFamilies[1] IPv6"
    );
}

#[test]
fn bad_load_balancer_ingress_names_the_status_field() {
    let status = |ingress: &str| {
        format!(
            "metadata: {{name: a, namespace: n}}\nspec: {{type: LoadBalancer, clusterIP: 198.19.0.3}}\nstatus: {{loadBalancer: {{ingress: {ingress}}}}}"
        )
    };
    let e = parse(&status("[{ip: 192.0.2.1}, {ip: 192.0.2.300}]")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: status.loadBalancer.ingress[1].ip \"192.0.2.300\" is not a valid IP address"
    );
    let e = parse(&status("[{ip: 192.0.2.1, ipMode: Tunnel}]")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: status.loadBalancer.ingress[0].ipMode \"Tunnel\" is not one of VIP, Proxy"
    );
    // A hostname-only entry is ignored whole, as kube-proxy does, its ipMode included.
    let s = proxied(&status("[{hostname: lb.example, ipMode: Tunnel}]"));
    assert!(s.load_balancer_ingress.is_empty());
}
