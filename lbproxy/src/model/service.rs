//! A Service as the proxy sees it: every field kube-proxy reads, validated once.

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service as K8sService;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    DEFAULT_AFFINITY_TIMEOUT_S, InvalidObject, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub id: NamespacedName,
    /// ClusterIPs, IPv4 and IPv6 (dual-stack). Empty for headless services.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `internalTrafficPolicy: Local`: in-cluster traffic only goes to endpoints on this node.
    pub internal_local: bool,
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
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(Normalized::Skipped("type ExternalName"));
    }
    let mut ips: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if ips.is_empty()
        && let Some(ip) = &spec.cluster_ip
    {
        ips.push(ip.clone());
    }
    if ips.iter().any(|ip| ip == "None") {
        return Ok(Normalized::Skipped("headless (clusterIP None)"));
    }
    let mut cluster_ips = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        if ip.is_empty() {
            continue;
        }
        cluster_ips.push(parse_ip(&format!("spec.clusterIPs[{i}]"), ip).map_err(invalid)?);
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
        ports.push(ServicePort {
            name,
            port,
            protocol,
            target_port,
        });
    }
    let internal_local = match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            return Err(invalid(format!(
                "spec.internalTrafficPolicy {other:?} is not one of Cluster, Local"
            )));
        }
    };
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
        cluster_ips,
        ports,
        internal_local,
        affinity_timeout_s,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<Normalized<Service>, InvalidObject> {
        service_from_k8s(&serde_yaml::from_str(yaml).unwrap())
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
}
