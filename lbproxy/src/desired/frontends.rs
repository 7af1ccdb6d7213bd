//! Desired state, part one: the frontends a service asks for, and what each should do.
//!
//! A service asks for frontends of four kinds ([`FrontendKind`]), in the families of its
//! clusterIPs ([`Family`]), one per service port and address:
//! - ClusterIP: each clusterIP x port;
//! - NodePort: each port with a nodePort, on every node address (`addr: None`), once per
//!   family;
//! - ExternalIP: each externalIP x port;
//! - LoadBalancerIP: each `status.loadBalancer.ingress[].ip` with ipMode VIP x port. An
//!   ingress with ipMode Proxy asks for nothing (KEP-1860: the load balancer sends to the
//!   node's addresses, which the NodePorts serve).
//!
//! As kube-proxy, a service is served only in the families of its clusterIPs: an
//! externalIP or load-balancer IP of another family asks for nothing.
//!
//! The datapath serves some of them ([`ServiceFrontends::served`], each a VIP:port/proto
//! with its spec: the backends for new flows and the ones kept only for flows already using
//! them, see [`super::endpoints`]); the rest are listed with the reason they are not served
//! yet ([`Unserved`]).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use super::Topology;
use super::endpoints::{EndpointSet, Scope, endpoint_set_in, local_only};
pub use crate::model::Family;
use crate::model::{EndpointAddr, IpMode, Model, Protocol, Service, ServicePort};

/// The kinds of frontend a service asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    ExternalIp,
    LoadBalancerIp,
}

impl FrontendKind {
    pub const ALL: [FrontendKind; 4] = [
        FrontendKind::ClusterIp,
        FrontendKind::NodePort,
        FrontendKind::ExternalIp,
        FrontendKind::LoadBalancerIp,
    ];

    /// The metric label value.
    pub fn label(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "cluster_ip",
            FrontendKind::NodePort => "node_port",
            FrontendKind::ExternalIp => "external_ip",
            FrontendKind::LoadBalancerIp => "load_balancer_ip",
        }
    }

    /// The name shown to people (`inspect`).
    pub fn display(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::ExternalIp => "ExternalIP",
            FrontendKind::LoadBalancerIp => "LoadBalancerIP",
        }
    }

    /// Where this kind's traffic comes from, which picks its traffic policy.
    pub fn scope(self) -> Scope {
        match self {
            FrontendKind::ClusterIp => Scope::Internal,
            FrontendKind::NodePort | FrontendKind::ExternalIp | FrontendKind::LoadBalancerIp => {
                Scope::External
            }
        }
    }
}

/// A frontend the model asks for that the datapath does not serve yet.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unserved {
    pub kind: FrontendKind,
    pub family: Family,
    /// None for a NodePort (every node address).
    pub addr: Option<IpAddr>,
    /// The frontend's port: the service port, or the nodePort for a NodePort.
    pub port: u16,
    pub proto: Protocol,
    /// `namespace/name:port-name` as [`FrontendSpec::label`].
    pub label: String,
    /// Why, e.g. "NodePort is not served yet", "IPv6 is not served yet", "SCTP is not
    /// served yet".
    pub reason: &'static str,
}

/// Every frontend one service asks for: the ones the datapath serves, and the others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceFrontends {
    /// In service-port order, then clusterIP order (what [`desired_for`] returned before
    /// there were other kinds).
    pub served: Vec<(Frontend, FrontendSpec)>,
    /// Sorted (kind, family, address, port, protocol), without duplicates.
    pub unserved: Vec<Unserved>,
}

/// A frontend the datapath serves: VIP:port/proto.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
    /// The entry this node's pods get instead of the default one (`SCOPE_INTERNAL`): an
    /// external frontend of an `externalTrafficPolicy: Local` service, which pods reach with
    /// the internal traffic policy's endpoints (kube-proxy's short-circuit), while the
    /// default entry, flagged `SVC_F_SPLIT_SCOPE`, keeps the local ones for outside traffic.
    pub pods_only: bool,
}

/// `addr:port`, with an IPv6 address in brackets.
pub fn host_port(addr: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(addr, port).to_string()
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}",
            host_port(self.addr, self.port),
            self.proto.as_str()
        )?;
        if self.pods_only {
            f.write_str(" (pods)")?;
        }
        Ok(())
    }
}

/// A backend address as the datapath sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: Protocol,
}

impl BackendAddr {
    pub fn family(&self) -> Family {
        Family::of(&self.addr)
    }
}

impl std::fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&host_port(self.addr, self.port))
    }
}

/// How a frontend treats traffic beyond picking a backend, in Kubernetes terms (the maps
/// hold it as the entry's flags, see `program::encode::flags`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// This node's pods use the frontend's `pods_only` twin instead: an external frontend of
    /// an `externalTrafficPolicy: Local` service whose internal policy is `Cluster`.
    pub split_for_pods: bool,
    /// Only this node's endpoints may serve it and all of them are on other nodes: traffic
    /// is dropped, not rejected (a load balancer's health check steers it elsewhere).
    pub local_only_elsewhere: bool,
    /// Only sources in `src_ranges` may use it (`loadBalancerSourceRanges`).
    pub source_ranges: bool,
    /// Its backends are serving but terminating endpoints, none being ready (KEP-1669).
    pub terminating_fallback: bool,
    /// What the endpoints' topology hints did to its backends (for `inspect`; the
    /// controller chose the backends, the datapath does nothing per packet).
    pub topology: Topology,
}

/// What one frontend should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendSpec {
    /// `namespace/name:port-name`, stored for `lbproxy inspect`.
    pub label: String,
    /// Backends for new flows, in a stable order.
    pub backends: Vec<BackendAddr>,
    /// Backends still listed but not eligible for new flows (not ready, terminating). They
    /// stay in the backend map so flows already using them keep working.
    pub draining: Vec<BackendAddr>,
    /// Session affinity timeout in seconds, 0 for none.
    pub affinity_timeout_s: u32,
    /// Its kind (`ServiceValue::kind`): the datapath serves ClusterIPs to pods only.
    pub kind: FrontendKind,
    /// How it treats traffic beyond picking a backend.
    pub policy: Policy,
    /// A load-balancer IP's `loadBalancerSourceRanges` of its own family (sorted, without
    /// duplicates); empty for every other frontend and for a `/0` range of its family.
    pub src_ranges: Vec<ipnet::IpNet>,
}

pub type Desired = BTreeMap<Frontend, FrontendSpec>;

/// The frontends of the whole model (the controller builds the same per service, with
/// [`desired_for`]).
#[cfg(test)]
pub fn desired(model: &Model, node: &str) -> Desired {
    let mut out = Desired::new();
    for svc in model.services.values() {
        out.extend(desired_for(model, svc, node));
    }
    out
}

/// The frontends of one service that the datapath serves: [`frontends_for`]'s `served`.
#[cfg(test)]
pub fn desired_for(model: &Model, svc: &Service, node: &str) -> Vec<(Frontend, FrontendSpec)> {
    frontends_for(model, svc, node).served
}

/// The address the datapath serves a frontend on, or why it does not serve it yet. Served
/// today: ClusterIPs, NodePorts (at 0.0.0.0 or ::, any node address of the family),
/// externalIPs and load-balancer IPs of both families, TCP, UDP and SCTP (docs/sctp.md);
/// an IPv6 load-balancer IP only without `loadBalancerSourceRanges` (`filtered`), which
/// are enforced over IPv4 only so far.
fn servable(
    kind: FrontendKind,
    family: Family,
    addr: Option<IpAddr>,
) -> Result<IpAddr, &'static str> {
    match (kind, addr) {
        (_, Some(addr)) => Ok(addr),
        // Every node address of the family: the datapath's NodePort entry (see
        // `Frontend::key`).
        (FrontendKind::NodePort, None) => Ok(match family {
            Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        }),
        // Not reached: the other kinds have an address.
        _ => Err("no address"),
    }
}

/// `loadBalancerSourceRanges` of `family`, for the load-balancer IPs only (as kube-proxy):
/// `Some(ranges)` filters that family's LB IPs (empty: the Service lists ranges of the other
/// family only, so no source of this one is admitted), `None` does not (no ranges at all,
/// or a range of length 0 of this family). Sorted, without duplicates.
fn source_ranges(model: &Model, svc: &Service, family: Family) -> Option<Vec<ipnet::IpNet>> {
    if svc.load_balancer_source_ranges.is_empty() {
        return None;
    }
    let mut ranges: Vec<ipnet::IpNet> = svc
        .load_balancer_source_ranges
        .iter()
        .filter(|n| Family::of(&n.addr()) == family)
        .copied()
        .collect();
    if ranges.iter().any(|n| n.prefix_len() == 0) {
        return None;
    }
    // As kube-proxy: when a range holds one of this node's addresses, the service's
    // load-balancer IPs are admitted as sources too (a load balancer that loops traffic back
    // to the node keeps the LB IP as its source).
    if ranges
        .iter()
        .any(|n| model.node_ips.iter().any(|ip| n.contains(ip)))
    {
        for ing in &svc.load_balancer_ingress {
            if ing.ip_mode == IpMode::Vip && Family::of(&ing.ip) == family {
                ranges.push(ipnet::IpNet::from(ing.ip));
            }
        }
    }
    ranges.sort();
    ranges.dedup();
    Some(ranges)
}

/// Every frontend one service asks for (see the module documentation), split into the ones
/// the datapath serves, with their backends, and the ones it does not serve yet. `node` is
/// this node's name, for the `Local` traffic policies (see [`local_only`]).
pub fn frontends_for(model: &Model, svc: &Service, node: &str) -> ServiceFrontends {
    let mut families: Vec<Family> = Vec::new();
    for ip in &svc.cluster_ips {
        if !families.contains(&Family::of(ip)) {
            families.push(Family::of(ip));
        }
    }
    // The same for every port: (IPv4, IPv6).
    let ranges = (
        source_ranges(model, svc, Family::V4),
        source_ranges(model, svc, Family::V6),
    );
    let mut out = ServiceFrontends::default();
    for port in &svc.ports {
        let label = if port.name.is_empty() {
            svc.id.to_string()
        } else {
            format!("{}:{}", svc.id, port.name)
        };
        let asked = asked_by(svc, port, &families);
        // Each family's frontends are served from that family's endpoints only.
        let mut specs: BTreeMap<(Scope, Family), FrontendSpec> = BTreeMap::new();
        for (kind, family, addr, frontend_port) in asked {
            match servable(kind, family, addr) {
                Ok(addr) => {
                    let spec = specs
                        .entry((kind.scope(), family))
                        .or_insert_with(|| {
                            let local = local_only(svc, kind.scope());
                            let set = endpoint_set_in(model, svc, port, node, local, family);
                            // No endpoint here but some elsewhere: dropped, not rejected.
                            let elsewhere = local
                                && set.serving.is_empty()
                                && !endpoint_set_in(model, svc, port, node, false, family)
                                    .serving
                                    .is_empty();
                            let mut spec = spec_of(svc, port, &label, set);
                            spec.policy.local_only_elsewhere = elsewhere;
                            spec
                        })
                        .clone();
                    let filter = match family {
                        Family::V4 => &ranges.0,
                        Family::V6 => &ranges.1,
                    };
                    let mut spec = if kind == FrontendKind::LoadBalancerIp
                        && let Some(filter) = filter
                    {
                        FrontendSpec {
                            kind,
                            policy: Policy {
                                source_ranges: true,
                                ..spec.policy
                            },
                            src_ranges: filter.clone(),
                            ..spec
                        }
                    } else {
                        FrontendSpec { kind, ..spec }
                    };
                    let frontend = Frontend {
                        addr,
                        port: frontend_port,
                        proto: port.protocol,
                        pods_only: false,
                    };
                    // kube-proxy's short-circuit: this node's pods reach an external
                    // frontend of an `externalTrafficPolicy: Local` service with the
                    // internal policy's endpoints, not only the local ones, and keep their
                    // own source (no SNAT: pod flows never get it).
                    let split = kind.scope() == Scope::External
                        && local_only(svc, Scope::External)
                        && !local_only(svc, Scope::Internal);
                    if split {
                        spec.policy.split_for_pods = true;
                        let pods = specs
                            .entry((Scope::Internal, family))
                            .or_insert_with(|| {
                                let set = endpoint_set_in(model, svc, port, node, false, family);
                                spec_of(svc, port, &label, set)
                            })
                            .clone();
                        out.served.push((frontend, spec));
                        out.served.push((
                            Frontend {
                                pods_only: true,
                                ..frontend
                            },
                            FrontendSpec { kind, ..pods },
                        ));
                    } else {
                        out.served.push((frontend, spec));
                    }
                }
                Err(reason) => out.unserved.push(Unserved {
                    kind,
                    family,
                    addr,
                    port: frontend_port,
                    proto: port.protocol,
                    label: label.clone(),
                    reason,
                }),
            }
        }
    }
    out.unserved.sort();
    out.unserved.dedup();
    out
}

/// (kind, family, address, frontend port) of each frontend `port` asks for, in the order
/// [`frontends_for`] serves them: clusterIPs, NodePorts (one per family), externalIPs,
/// load-balancer IPs with ipMode VIP, the last two in `families` only.
fn asked_by(
    svc: &Service,
    port: &ServicePort,
    families: &[Family],
) -> Vec<(FrontendKind, Family, Option<IpAddr>, u16)> {
    let in_families = |ip: &&IpAddr| families.contains(&Family::of(ip));
    let mut asked: Vec<(FrontendKind, Family, Option<IpAddr>, u16)> = Vec::new();
    for ip in &svc.cluster_ips {
        asked.push((
            FrontendKind::ClusterIp,
            Family::of(ip),
            Some(*ip),
            port.port,
        ));
    }
    if let Some(node_port) = port.node_port {
        for family in families {
            asked.push((FrontendKind::NodePort, *family, None, node_port));
        }
    }
    for ip in svc.external_ips.iter().filter(in_families) {
        asked.push((
            FrontendKind::ExternalIp,
            Family::of(ip),
            Some(*ip),
            port.port,
        ));
    }
    let lb_vips = svc
        .load_balancer_ingress
        .iter()
        .filter(|ing| ing.ip_mode == IpMode::Vip)
        .map(|ing| &ing.ip);
    for ip in lb_vips.filter(in_families) {
        asked.push((
            FrontendKind::LoadBalancerIp,
            Family::of(ip),
            Some(*ip),
            port.port,
        ));
    }
    asked
}

/// The spec of a frontend of `port` that uses `set` (the endpoints of the frontend's family).
fn spec_of(svc: &Service, port: &ServicePort, label: &str, set: EndpointSet) -> FrontendSpec {
    let (fallback, topology) = (set.fallback, set.topology);
    let addrs = |eps: Vec<EndpointAddr>| -> Vec<BackendAddr> {
        eps.into_iter()
            .map(|ep| BackendAddr {
                addr: ep.ip,
                port: ep.port,
                proto: port.protocol,
            })
            .collect()
    };
    FrontendSpec {
        label: label.to_string(),
        backends: addrs(set.serving),
        draining: addrs(set.draining),
        affinity_timeout_s: svc.affinity_timeout_s,
        kind: FrontendKind::ClusterIp,
        policy: Policy {
            terminating_fallback: fallback,
            topology,
            ..Policy::default()
        },
        src_ranges: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
