//! A Service as the proxy sees it: every field kube-proxy reads, validated once.
//!
//! Fields are kept as given, whatever the type: what applies to which frontend (for
//! example `externalTrafficPolicy`, which kube-proxy honours only for NodePort and
//! LoadBalancer services) is decided in [`crate::desired`].

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service as K8sService;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    DEFAULT_AFFINITY_TIMEOUT_S, Family, InvalidObject, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
    NamespacedName, Normalized, Protocol, identify, parse_ip, port_u16,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// May be empty for a single-port service.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: TargetPort,
    /// `nodePort`, absent or 0 as `None`. Kept whatever the service's type, as kube-proxy
    /// does (it serves any non-zero nodePort; the API server allows none on a ClusterIP
    /// service).
    pub node_port: Option<u16>,
}

/// `spec.type`, ExternalName aside (never proxied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

/// `spec.ipFamilyPolicy`. kube-proxy does not read it (it serves the families of the
/// clusterIPs); it is kept for `inspect`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[expect(
    clippy::enum_variant_names,
    reason = "the Kubernetes values, SingleStack, PreferDualStack, RequireDualStack"
)]
pub enum IpFamilyPolicy {
    SingleStack,
    PreferDualStack,
    RequireDualStack,
}

/// `status.loadBalancer.ingress[].ipMode` (KEP-1860).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpMode {
    /// The load balancer delivers packets with the ingress IP as destination: the node
    /// must serve that IP (the default).
    Vip,
    /// The load balancer proxies to the node's addresses: the ingress IP is not programmed.
    Proxy,
}

/// One `status.loadBalancer.ingress[]` entry that has an `ip` (hostname-only entries are
/// not kept: kube-proxy ignores them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadBalancerIngress {
    pub ip: IpAddr,
    pub ip_mode: IpMode,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub id: NamespacedName,
    /// `metadata.creationTimestamp`, absent in most manifests. When two services claim the
    /// same frontend, the older one gets it (see `controller::sync`).
    pub created: Option<jiff::Timestamp>,
    /// `spec.type` (ClusterIP when absent).
    pub service_type: ServiceType,
    /// ClusterIPs, IPv4 and IPv6 (dual-stack). Empty for headless services. The families
    /// of these are the families the service is served in, as kube-proxy does.
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.ipFamilies` as given (may be empty); each matches the clusterIP at its index.
    pub ip_families: Vec<Family>,
    /// `spec.ipFamilyPolicy` (SingleStack when absent).
    pub ip_family_policy: IpFamilyPolicy,
    pub ports: Vec<ServicePort>,
    /// `spec.externalIPs`, both families, in the order given.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[]` entries with an IP, in the order given.
    pub load_balancer_ingress: Vec<LoadBalancerIngress>,
    /// `spec.loadBalancerSourceRanges`, both families, as networks (host bits cleared).
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// `externalTrafficPolicy: Local` as given; only NodePort and LoadBalancer services
    /// honour it (see `desired::local_only`).
    pub external_local: bool,
    /// `internalTrafficPolicy: Local`: in-cluster traffic only goes to endpoints on this node.
    pub internal_local: bool,
    /// `spec.healthCheckNodePort`, absent or 0 as `None`.
    pub health_check_node_port: Option<u16>,
    /// `sessionAffinity: ClientIP`'s timeout in seconds; 0 without affinity.
    pub affinity_timeout_s: u32,
}

/// Normalizes a v1 Service, the way kube-proxy reads it.
pub fn service_from_k8s(svc: &K8sService) -> Result<Normalized<Service>, InvalidObject> {
    let (namespace, name, invalid) = identify("Service", &svc.metadata)?;
    let invalid = &invalid;
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME)) {
        return Ok(Normalized::Skipped("labelled for another proxy"));
    }
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Ok(Normalized::Skipped("labelled headless"));
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Err(invalid("spec is missing".into()));
    };
    let service_type = match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIp,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some("ExternalName") => return Ok(Normalized::Skipped("type ExternalName")),
        Some(other) => {
            return Err(invalid(format!(
                "spec.type {other:?} is not one of ClusterIP, NodePort, LoadBalancer, ExternalName"
            )));
        }
    };
    let mut ips: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if ips.is_empty()
        && let Some(ip) = &spec.cluster_ip
    {
        ips.push(ip.clone());
    }
    if ips.iter().any(|ip| ip == "None") {
        return Ok(Normalized::Skipped("headless (clusterIP None)"));
    }
    let mut ip_families = Vec::new();
    for (i, f) in spec.ip_families.iter().flatten().enumerate() {
        let family = Family::parse(f).map_err(|e| invalid(format!("spec.ipFamilies[{i}] {e}")))?;
        if ip_families.contains(&family) {
            return Err(invalid(format!(
                "spec.ipFamilies[{i}] {f:?} is listed twice"
            )));
        }
        ip_families.push(family);
    }
    let ip_family_policy = match spec.ip_family_policy.as_deref() {
        None | Some("SingleStack") => IpFamilyPolicy::SingleStack,
        Some("PreferDualStack") => IpFamilyPolicy::PreferDualStack,
        Some("RequireDualStack") => IpFamilyPolicy::RequireDualStack,
        Some(other) => {
            return Err(invalid(format!(
                "spec.ipFamilyPolicy {other:?} is not one of SingleStack, PreferDualStack, RequireDualStack"
            )));
        }
    };
    let mut cluster_ips = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        if ip.is_empty() {
            continue;
        }
        let addr = parse_ip(&format!("spec.clusterIPs[{i}]"), ip).map_err(invalid)?;
        if let Some(&family) = ip_families.get(i)
            && family != Family::of(&addr)
        {
            return Err(invalid(format!(
                "spec.clusterIPs[{i}] {ip:?} does not match spec.ipFamilies[{i}] {}",
                family.as_str()
            )));
        }
        cluster_ips.push(addr);
    }
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = format!("spec.ports[{i}]");
        let port = port_u16(&format!("{field}.port"), p.port).map_err(invalid)?;
        let protocol =
            Protocol::parse(p.protocol.as_deref()).map_err(|e| invalid(format!("{field}: {e}")))?;
        let name = p.name.clone().unwrap_or_default();
        if !seen.insert((port, protocol)) {
            return Err(invalid(format!(
                "{field}: port {port}/{} is listed twice",
                protocol.as_str()
            )));
        }
        let target_port = match &p.target_port {
            None => TargetPort::Number(port),
            Some(IntOrString::Int(n)) => {
                TargetPort::Number(port_u16(&format!("{field}.targetPort"), *n).map_err(invalid)?)
            }
            Some(IntOrString::String(s)) => match s.parse::<i32>() {
                Ok(n) => TargetPort::Number(
                    port_u16(&format!("{field}.targetPort"), n).map_err(invalid)?,
                ),
                Err(_) if s.is_empty() => TargetPort::Number(port),
                Err(_) => TargetPort::Name(s.clone()),
            },
        };
        let node_port =
            optional_port(&format!("{field}.nodePort"), p.node_port).map_err(invalid)?;
        ports.push(ServicePort {
            name,
            port,
            protocol,
            target_port,
            node_port,
        });
    }
    let mut external_ips = Vec::new();
    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        external_ips.push(parse_ip(&format!("spec.externalIPs[{i}]"), ip).map_err(invalid)?);
    }
    let mut load_balancer_ingress = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, ing) in ingress.into_iter().flatten().enumerate() {
        let field = format!("status.loadBalancer.ingress[{i}]");
        // Hostname-only entries: kube-proxy programs nothing for them.
        let Some(ip) = ing.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        let ip = parse_ip(&format!("{field}.ip"), ip).map_err(invalid)?;
        let ip_mode = match ing.ip_mode.as_deref() {
            None | Some("VIP") => IpMode::Vip,
            Some("Proxy") => IpMode::Proxy,
            Some(other) => {
                return Err(invalid(format!(
                    "{field}.ipMode {other:?} is not one of VIP, Proxy"
                )));
            }
        };
        load_balancer_ingress.push(LoadBalancerIngress { ip, ip_mode });
    }
    let mut load_balancer_source_ranges = Vec::new();
    for (i, cidr) in spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
    {
        // kube-proxy trims: API validation lets whitespace padding through.
        let net = cidr.trim().parse::<IpNet>().map_err(|_| {
            invalid(format!(
                "spec.loadBalancerSourceRanges[{i}] {cidr:?} is not a valid CIDR"
            ))
        })?;
        load_balancer_source_ranges.push(net.trunc());
    }
    let external_local = match spec.external_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            return Err(invalid(format!(
                "spec.externalTrafficPolicy {other:?} is not one of Cluster, Local"
            )));
        }
    };
    let internal_local = match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            return Err(invalid(format!(
                "spec.internalTrafficPolicy {other:?} is not one of Cluster, Local"
            )));
        }
    };
    let health_check_node_port =
        optional_port("spec.healthCheckNodePort", spec.health_check_node_port).map_err(invalid)?;
    let affinity_timeout_s = match spec.session_affinity.as_deref() {
        None | Some("None") => 0,
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S);
            match u32::try_from(t) {
                Ok(t) if (1..=86_400).contains(&t) => t,
                _ => {
                    return Err(invalid(format!(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-86400"
                    )));
                }
            }
        }
        Some(other) => {
            return Err(invalid(format!(
                "spec.sessionAffinity {other:?} is not one of None, ClientIP"
            )));
        }
    };
    Ok(Normalized::Proxied(Service {
        id: NamespacedName { namespace, name },
        created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
        service_type,
        cluster_ips,
        ip_families,
        ip_family_policy,
        ports,
        external_ips,
        load_balancer_ingress,
        load_balancer_source_ranges,
        external_local,
        internal_local,
        health_check_node_port,
        affinity_timeout_s,
    }))
}

/// A port that the API leaves 0 (or absent) when unset, such as `nodePort`.
fn optional_port(field: &str, p: Option<i32>) -> Result<Option<u16>, String> {
    match p {
        None | Some(0) => Ok(None),
        Some(p) => port_u16(field, p).map(Some),
    }
}

#[cfg(test)]
mod tests {
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
}
