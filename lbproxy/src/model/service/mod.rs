//! A Service as the proxy sees it: every field kube-proxy reads, validated once.
//!
//! Fields are kept as given, whatever the type: what applies to which frontend (for
//! example `externalTrafficPolicy`, which kube-proxy honours only for NodePort and
//! LoadBalancer services) is decided in [`crate::desired`].

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service as K8sService, ServiceSpec};
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

/// Normalizes a v1 Service, the way kube-proxy reads it. Each part of the spec is read by
/// one function below, which names the field in its error.
pub fn service_from_k8s(svc: &K8sService) -> Result<Normalized<Service>, InvalidObject> {
    let (namespace, name, invalid) = identify("Service", &svc.metadata)?;
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
    let Some(service_type) = service_type(spec).map_err(&invalid)? else {
        return Ok(Normalized::Skipped("type ExternalName"));
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
    let ip_families = ip_families(spec).map_err(&invalid)?;
    Ok(Normalized::Proxied(Service {
        id: NamespacedName { namespace, name },
        created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
        service_type,
        ip_family_policy: ip_family_policy(spec).map_err(&invalid)?,
        cluster_ips: cluster_ips(&ips, &ip_families).map_err(&invalid)?,
        ip_families,
        ports: service_ports(spec).map_err(&invalid)?,
        external_ips: external_ips(spec).map_err(&invalid)?,
        load_balancer_ingress: load_balancer_ingress(svc).map_err(&invalid)?,
        load_balancer_source_ranges: source_ranges(spec).map_err(&invalid)?,
        external_local: local_policy(
            "spec.externalTrafficPolicy",
            spec.external_traffic_policy.as_deref(),
        )
        .map_err(&invalid)?,
        internal_local: local_policy(
            "spec.internalTrafficPolicy",
            spec.internal_traffic_policy.as_deref(),
        )
        .map_err(&invalid)?,
        health_check_node_port: optional_port(
            "spec.healthCheckNodePort",
            spec.health_check_node_port,
        )
        .map_err(&invalid)?,
        affinity_timeout_s: affinity_timeout(spec).map_err(&invalid)?,
    }))
}

/// `spec.type`; `None` for ExternalName, which is not proxied.
fn service_type(spec: &ServiceSpec) -> Result<Option<ServiceType>, String> {
    Ok(Some(match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIp,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some("ExternalName") => return Ok(None),
        Some(other) => {
            return Err(format!(
                "spec.type {other:?} is not one of ClusterIP, NodePort, LoadBalancer, ExternalName"
            ));
        }
    }))
}

/// `spec.ipFamilies`, each family once.
fn ip_families(spec: &ServiceSpec) -> Result<Vec<Family>, String> {
    let mut ip_families = Vec::new();
    for (i, f) in spec.ip_families.iter().flatten().enumerate() {
        let family = Family::parse(f).map_err(|e| format!("spec.ipFamilies[{i}] {e}"))?;
        if ip_families.contains(&family) {
            return Err(format!("spec.ipFamilies[{i}] {f:?} is listed twice"));
        }
        ip_families.push(family);
    }
    Ok(ip_families)
}

/// `spec.ipFamilyPolicy`.
fn ip_family_policy(spec: &ServiceSpec) -> Result<IpFamilyPolicy, String> {
    match spec.ip_family_policy.as_deref() {
        None | Some("SingleStack") => Ok(IpFamilyPolicy::SingleStack),
        Some("PreferDualStack") => Ok(IpFamilyPolicy::PreferDualStack),
        Some("RequireDualStack") => Ok(IpFamilyPolicy::RequireDualStack),
        Some(other) => Err(format!(
            "spec.ipFamilyPolicy {other:?} is not one of SingleStack, PreferDualStack, RequireDualStack"
        )),
    }
}

/// `spec.clusterIPs` (or `spec.clusterIP`), each of the family `spec.ipFamilies` gives it.
fn cluster_ips(ips: &[String], ip_families: &[Family]) -> Result<Vec<IpAddr>, String> {
    let mut cluster_ips = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        if ip.is_empty() {
            continue;
        }
        let addr = parse_ip(&format!("spec.clusterIPs[{i}]"), ip)?;
        if let Some(&family) = ip_families.get(i)
            && family != Family::of(&addr)
        {
            return Err(format!(
                "spec.clusterIPs[{i}] {ip:?} does not match spec.ipFamilies[{i}] {}",
                family.as_str()
            ));
        }
        cluster_ips.push(addr);
    }
    Ok(cluster_ips)
}

/// `spec.ports`, each port and protocol once.
fn service_ports(spec: &ServiceSpec) -> Result<Vec<ServicePort>, String> {
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = format!("spec.ports[{i}]");
        let port = port_u16(&format!("{field}.port"), p.port)?;
        let protocol =
            Protocol::parse(p.protocol.as_deref()).map_err(|e| format!("{field}: {e}"))?;
        let name = p.name.clone().unwrap_or_default();
        if !seen.insert((port, protocol)) {
            return Err(format!(
                "{field}: port {port}/{} is listed twice",
                protocol.as_str()
            ));
        }
        let target_port = match &p.target_port {
            None => TargetPort::Number(port),
            Some(IntOrString::Int(n)) => {
                TargetPort::Number(port_u16(&format!("{field}.targetPort"), *n)?)
            }
            Some(IntOrString::String(s)) => match s.parse::<i32>() {
                Ok(n) => TargetPort::Number(port_u16(&format!("{field}.targetPort"), n)?),
                Err(_) if s.is_empty() => TargetPort::Number(port),
                Err(_) => TargetPort::Name(s.clone()),
            },
        };
        let node_port = optional_port(&format!("{field}.nodePort"), p.node_port)?;
        ports.push(ServicePort {
            name,
            port,
            protocol,
            target_port,
            node_port,
        });
    }
    Ok(ports)
}

/// `spec.externalIPs`.
fn external_ips(spec: &ServiceSpec) -> Result<Vec<IpAddr>, String> {
    spec.external_ips
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, ip)| parse_ip(&format!("spec.externalIPs[{i}]"), ip))
        .collect()
}

/// `status.loadBalancer.ingress`: the entries with an IP (hostname-only entries: kube-proxy
/// programs nothing for them).
fn load_balancer_ingress(svc: &K8sService) -> Result<Vec<LoadBalancerIngress>, String> {
    let mut load_balancer_ingress = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, ing) in ingress.into_iter().flatten().enumerate() {
        let field = format!("status.loadBalancer.ingress[{i}]");
        let Some(ip) = ing.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        let ip = parse_ip(&format!("{field}.ip"), ip)?;
        let ip_mode = match ing.ip_mode.as_deref() {
            None | Some("VIP") => IpMode::Vip,
            Some("Proxy") => IpMode::Proxy,
            Some(other) => {
                return Err(format!("{field}.ipMode {other:?} is not one of VIP, Proxy"));
            }
        };
        load_balancer_ingress.push(LoadBalancerIngress { ip, ip_mode });
    }
    Ok(load_balancer_ingress)
}

/// `spec.loadBalancerSourceRanges`, trimmed as kube-proxy does (API validation lets
/// whitespace padding through).
fn source_ranges(spec: &ServiceSpec) -> Result<Vec<IpNet>, String> {
    spec.load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, cidr)| {
            cidr.trim()
                .parse::<IpNet>()
                .map(|net| net.trunc())
                .map_err(|_| {
                    format!("spec.loadBalancerSourceRanges[{i}] {cidr:?} is not a valid CIDR")
                })
        })
        .collect()
}

/// `spec.externalTrafficPolicy` or `spec.internalTrafficPolicy` (`field`): whether it is
/// `Local`.
fn local_policy(field: &str, value: Option<&str>) -> Result<bool, String> {
    match value {
        None | Some("Cluster") => Ok(false),
        Some("Local") => Ok(true),
        Some(other) => Err(format!("{field} {other:?} is not one of Cluster, Local")),
    }
}

/// `spec.sessionAffinity` and its timeout: 0 without affinity.
fn affinity_timeout(spec: &ServiceSpec) -> Result<u32, String> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => Ok(0),
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S);
            match u32::try_from(t) {
                Ok(t) if (1..=86_400).contains(&t) => Ok(t),
                _ => Err(format!(
                    "spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-86400"
                )),
            }
        }
        Some(other) => Err(format!(
            "spec.sessionAffinity {other:?} is not one of None, ClientIP"
        )),
    }
}

/// A port that the API leaves 0 (or absent) when unset, such as `nodePort`.
fn optional_port(field: &str, p: Option<i32>) -> Result<Option<u16>, String> {
    match p {
        None | Some(0) => Ok(None),
        Some(p) => port_u16(field, p).map(Some),
    }
}

#[cfg(test)]
mod tests;
