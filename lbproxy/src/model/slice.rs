//! An EndpointSlice as the proxy sees it: its ports and endpoints with their conditions.

use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;

use super::{
    InvalidObject, LABEL_SERVICE_NAME, NamespacedName, Normalized, Protocol, ServicePort,
    TargetPort, identify, parse_ip, port_u16,
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addresses: Vec<IpAddr>,
    /// `ready` (absent means true).
    pub ready: bool,
    /// `serving` (absent means the value of `ready`).
    pub serving: bool,
    /// `terminating` (absent means false).
    pub terminating: bool,
    pub node_name: Option<String>,
    /// `hints`: where the EndpointSlice controller asks proxies to use this endpoint
    /// (`trafficDistribution`), see `desired::endpoints::topology`.
    pub hints: Hints,
}

/// An endpoint's `hints.forZones` and `hints.forNodes`, as names, sorted and de-duplicated.
/// Empty means no hint of that kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    pub for_zones: Vec<String>,
    pub for_nodes: Vec<String>,
}

impl Hints {
    pub fn is_empty(&self) -> bool {
        self.for_zones.is_empty() && self.for_nodes.is_empty()
    }

    /// Whether `hints.forZones` names `zone`.
    pub fn for_zone(&self, zone: &str) -> bool {
        self.for_zones.iter().any(|z| z == zone)
    }

    /// Whether `hints.forNodes` names `node` (compared as [`Endpoint::on_node`] does).
    pub fn for_node(&self, node: &str) -> bool {
        self.for_nodes.iter().any(|n| n.eq_ignore_ascii_case(node))
    }
}

impl Endpoint {
    /// Whether this endpoint is on node `node` (this node's name, which lbproxy lowercases as
    /// kube-proxy does with `--hostname-override`). Compared without regard to case, so a
    /// slice written with `nodeName: nodeA` matches `--hostname-override nodeA`.
    pub fn on_node(&self, node: &str) -> bool {
        self.node_name
            .as_deref()
            .is_some_and(|n| n.eq_ignore_ascii_case(node))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSlice {
    pub id: NamespacedName,
    /// The service this slice belongs to (label `kubernetes.io/service-name`).
    pub service: NamespacedName,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

/// A backend address for one service port, after port resolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointAddr {
    pub ip: IpAddr,
    pub port: u16,
}

/// Normalizes a discovery.k8s.io/v1 EndpointSlice.
pub fn slice_from_k8s(
    slice: &K8sEndpointSlice,
) -> Result<Normalized<EndpointSlice>, InvalidObject> {
    let (namespace, name, invalid) = identify("EndpointSlice", &slice.metadata)?;
    let invalid = &invalid;
    let Some(service_name) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SERVICE_NAME))
        .cloned()
    else {
        return Ok(Normalized::Skipped("no kubernetes.io/service-name label"));
    };
    let family_ok = |ip: &IpAddr| match slice.address_type.as_str() {
        "IPv4" => ip.is_ipv4(),
        "IPv6" => ip.is_ipv6(),
        _ => false,
    };
    if slice.address_type == "FQDN" {
        return Ok(Normalized::Skipped("addressType FQDN"));
    }
    if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
        return Err(invalid(format!(
            "addressType {:?} is not one of IPv4, IPv6, FQDN",
            slice.address_type
        )));
    }
    let mut ports = Vec::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let field = format!("ports[{i}]");
        let Some(port) = p.port else {
            // An absent port means "all ports"; kube-proxy ignores such ports.
            continue;
        };
        ports.push(SlicePort {
            name: p.name.clone().unwrap_or_default(),
            port: port_u16(&format!("{field}.port"), port).map_err(invalid)?,
            protocol: Protocol::parse(p.protocol.as_deref())
                .map_err(|e| invalid(format!("{field}: {e}")))?,
        });
    }
    let mut endpoints = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let mut addresses = Vec::new();
        for (j, a) in ep.addresses.iter().enumerate() {
            let ip = parse_ip(&format!("endpoints[{i}].addresses[{j}]"), a).map_err(invalid)?;
            if !family_ok(&ip) {
                return Err(invalid(format!(
                    "endpoints[{i}].addresses[{j}] {a:?} does not match addressType {}",
                    slice.address_type
                )));
            }
            addresses.push(ip);
        }
        let cond = ep.conditions.as_ref();
        let ready = cond.and_then(|c| c.ready).unwrap_or(true);
        endpoints.push(Endpoint {
            addresses,
            ready,
            serving: cond.and_then(|c| c.serving).unwrap_or(ready),
            terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
            node_name: ep.node_name.clone(),
            hints: hints_of(ep.hints.as_ref()),
        });
    }
    Ok(Normalized::Proxied(EndpointSlice {
        id: NamespacedName {
            namespace: namespace.clone(),
            name,
        },
        service: NamespacedName {
            namespace,
            name: service_name,
        },
        ports,
        endpoints,
    }))
}

/// An endpoint's hints, as names; an empty name is no hint.
fn hints_of(h: Option<&k8s_openapi::api::discovery::v1::EndpointHints>) -> Hints {
    let names = |v: Vec<String>| {
        let mut v: Vec<String> = v.into_iter().filter(|n| !n.is_empty()).collect();
        v.sort();
        v.dedup();
        v
    };
    let Some(h) = h else {
        return Hints::default();
    };
    Hints {
        for_zones: names(
            h.for_zones
                .iter()
                .flatten()
                .map(|z| z.name.clone())
                .collect(),
        ),
        for_nodes: names(
            h.for_nodes
                .iter()
                .flatten()
                .map(|n| n.name.clone())
                .collect(),
        ),
    }
}

/// The number a slice gives a service port, if any. See [`Model::ready_endpoints`].
pub fn resolve_slice_port(slice: &EndpointSlice, port: &ServicePort) -> Option<u16> {
    let by_name = |name: &str| {
        slice
            .ports
            .iter()
            .find(|p| p.name == name && p.protocol == port.protocol)
            .map(|p| p.port)
    };
    by_name(&port.name).or_else(|| match &port.target_port {
        TargetPort::Name(target) => by_name(target),
        TargetPort::Number(_) => None,
    })
}
