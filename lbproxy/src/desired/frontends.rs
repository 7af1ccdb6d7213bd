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
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lbproxy_common::{
    Backend, Backend6, IpFamily, Scope as KeyScope, ServiceKey, ServiceKey6, ServiceKeyOf,
    SvcFlags, SvcKind, UnservedKey, UnservedValue, nul_padded,
};

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

    /// Its number in the maps (`ServiceValue::kind`).
    pub fn number(self) -> u8 {
        SvcKind::from(self).into()
    }

    /// The kind a map's `kind` number stands for.
    pub fn from_number(n: u8) -> Option<Self> {
        SvcKind::try_from(n).ok().map(Self::from)
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

impl From<FrontendKind> for SvcKind {
    fn from(k: FrontendKind) -> SvcKind {
        match k {
            FrontendKind::ClusterIp => SvcKind::ClusterIp,
            FrontendKind::NodePort => SvcKind::NodePort,
            FrontendKind::ExternalIp => SvcKind::ExternalIp,
            FrontendKind::LoadBalancerIp => SvcKind::LoadBalancer,
        }
    }
}

impl From<SvcKind> for FrontendKind {
    fn from(k: SvcKind) -> FrontendKind {
        match k {
            SvcKind::ClusterIp => FrontendKind::ClusterIp,
            SvcKind::NodePort => FrontendKind::NodePort,
            SvcKind::ExternalIp => FrontendKind::ExternalIp,
            SvcKind::LoadBalancer => FrontendKind::LoadBalancerIp,
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

impl Unserved {
    /// Its entry in `LB_UNSERVED_V1`, the list `lbproxy inspect` reads (as [`Frontend::key`]
    /// is a served frontend's entry in the services map).
    pub fn entry(&self) -> (UnservedKey, UnservedValue) {
        let mut addr = [0u8; 16];
        match self.addr {
            Some(IpAddr::V4(a)) => addr[..4].copy_from_slice(&a.octets()),
            Some(IpAddr::V6(a)) => addr = a.octets(),
            None => {}
        }
        let key = UnservedKey {
            addr,
            port_be: self.port.to_be(),
            proto: self.proto.number(),
            kind: self.kind.number(),
            family: match self.family {
                Family::V4 => IpFamily::V4,
                Family::V6 => IpFamily::V6,
            }
            .into(),
            _pad: [0; 3],
            svc_hash: fnv1a(self.label.as_bytes()),
        };
        let value = UnservedValue {
            label: nul_padded(&self.label),
            reason: nul_padded(self.reason),
        };
        (key, value)
    }
}

/// FNV-1a, 64 bits: tells apart two services asking for the same frontend.
fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| {
        (h ^ u64::from(*c)).wrapping_mul(0x0100_0000_01b3)
    })
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

/// A frontend's key in its family's frontend map: `LB_SERVICES_V2` or `LB_SERVICES6_V1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

/// A backend's value in its family's backend map: `LB_BACKENDS_V1` or `LB_BACKENDS6_V1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackendValue {
    V4(Backend),
    V6(Backend6),
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

impl Frontend {
    /// Its entry's key, in its family's map.
    pub fn key(&self) -> FrontendKey {
        let scope = if self.pods_only {
            KeyScope::Internal
        } else {
            KeyScope::Default
        }
        .into();
        let (port_be, proto) = (self.port.to_be(), self.proto.number());
        match self.addr {
            IpAddr::V4(a) => FrontendKey::V4(ServiceKeyOf {
                addr: a.octets(),
                port_be,
                proto,
                scope,
            }),
            IpAddr::V6(a) => FrontendKey::V6(ServiceKeyOf {
                addr: a.octets(),
                port_be,
                proto,
                scope,
            }),
        }
    }

    pub fn from_key(k: &FrontendKey) -> Option<Self> {
        let (addr, port_be, proto, scope) = match k {
            FrontendKey::V4(k) => (
                IpAddr::from(Ipv4Addr::from(k.addr)),
                k.port_be,
                k.proto,
                k.scope,
            ),
            FrontendKey::V6(k) => (
                IpAddr::from(Ipv6Addr::from(k.addr)),
                k.port_be,
                k.proto,
                k.scope,
            ),
        };
        Some(Self {
            addr,
            port: u16::from_be(port_be),
            proto: Protocol::from_number(proto)?,
            pods_only: KeyScope::try_from(scope) == Ok(KeyScope::Internal),
        })
    }
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
    /// Its value, in its family's map.
    pub fn value(&self) -> BackendValue {
        let (port_be, proto) = (self.port.to_be(), self.proto.number());
        match self.addr {
            IpAddr::V4(a) => BackendValue::V4(Backend {
                addr: a.octets(),
                port_be,
                proto,
                _pad: 0,
            }),
            IpAddr::V6(a) => BackendValue::V6(Backend6 {
                addr: a.octets(),
                port_be,
                proto,
                _pad: 0,
            }),
        }
    }

    pub fn from_value(b: &BackendValue) -> Option<Self> {
        let (addr, port_be, proto) = match b {
            BackendValue::V4(b) => (IpAddr::from(Ipv4Addr::from(b.addr)), b.port_be, b.proto),
            BackendValue::V6(b) => (IpAddr::from(Ipv6Addr::from(b.addr)), b.port_be, b.proto),
        };
        Some(Self {
            addr,
            port: u16::from_be(port_be),
            proto: Protocol::from_number(proto)?,
        })
    }

    pub fn family(&self) -> Family {
        Family::of(&self.addr)
    }
}

impl std::fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&host_port(self.addr, self.port))
    }
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
    /// `SVC_F_*` (`ServiceValue::flags`): `SVC_F_LOCAL_ONLY` when only this node's endpoints
    /// may serve it and all of them are on other nodes; `SVC_F_SOURCE_RANGES` when only
    /// sources in `src_ranges` may use it; `SVC_F_TERMINATING_FALLBACK` when its backends
    /// are terminating ones, none being ready.
    pub flags: SvcFlags,
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

/// The address the datapath serves a frontend on, or why it does not serve it yet. When
/// both reasons apply, the family's is given, then the protocol's. Served today: ClusterIPs,
/// NodePorts (at 0.0.0.0 or ::, any node address of the family), externalIPs and
/// load-balancer IPs of both families, TCP and UDP; an IPv6 load-balancer IP only without
/// `loadBalancerSourceRanges` (`filtered`), which are enforced over IPv4 only so far.
fn servable(
    kind: FrontendKind,
    family: Family,
    addr: Option<IpAddr>,
    proto: Protocol,
) -> Result<IpAddr, &'static str> {
    if proto == Protocol::Sctp {
        return Err("SCTP is not served yet");
    }
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
    let in_families = |ip: &&IpAddr| families.contains(&Family::of(ip));
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
        // (kind, family, address, frontend port) of each frontend this port asks for.
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
            for family in &families {
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
        // Each family's frontends are served from that family's endpoints only.
        let mut specs: BTreeMap<(Scope, Family), FrontendSpec> = BTreeMap::new();
        for (kind, family, addr, frontend_port) in asked {
            match servable(kind, family, addr, port.protocol) {
                Ok(addr) => {
                    let spec = specs
                        .entry((kind.scope(), family))
                        .or_insert_with(|| {
                            let local = local_only(svc, kind.scope());
                            let set = endpoint_set_in(model, svc, port, node, local, family);
                            // No endpoint here but some elsewhere: dropped, not rejected.
                            let flags = if local
                                && set.serving.is_empty()
                                && !endpoint_set_in(model, svc, port, node, false, family)
                                    .serving
                                    .is_empty()
                            {
                                SvcFlags::LOCAL_ONLY
                            } else {
                                SvcFlags::EMPTY
                            } | if set.fallback {
                                SvcFlags::TERMINATING_FALLBACK
                            } else {
                                SvcFlags::EMPTY
                            };
                            FrontendSpec {
                                flags,
                                ..spec_of(svc, port, &label, set)
                            }
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
                            flags: spec.flags | SvcFlags::SOURCE_RANGES,
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
                        spec.flags |= SvcFlags::SPLIT_SCOPE;
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

/// The spec of a frontend of `port` that uses `set` (the endpoints of the frontend's family).
fn spec_of(svc: &Service, port: &ServicePort, label: &str, set: EndpointSet) -> FrontendSpec {
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
        flags: SvcFlags::EMPTY,
        src_ranges: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_of(text: &str) -> Model {
        use crate::source::manifests;
        manifests::parse(std::path::Path::new("x.yaml"), text)
            .unwrap()
            .model
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.10, ports: [{name: http, port: 80}]}\n";

    fn slice_with(endpoints: &str) -> String {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-a, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: {endpoints}\n"
        )
    }

    fn addrs(v: &[BackendAddr]) -> Vec<String> {
        v.iter().map(|b| b.addr.to_string()).collect()
    }

    #[test]
    fn terminating_serving_endpoints_are_the_fallback_when_none_is_ready() {
        let m = model_of(&format!(
            "{SVC}{}",
            slice_with(
                "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.3], conditions: {ready: false, serving: false, terminating: true}}, {addresses: [198.18.0.4], conditions: {ready: false, serving: true, terminating: false}}]"
            )
        ));
        let d = desired(&m, "n");
        let spec = d.values().next().unwrap();
        assert_eq!(addrs(&spec.backends), vec!["198.18.0.2"]);
        assert_eq!(addrs(&spec.draining), vec!["198.18.0.3", "198.18.0.4"]);
        // One ready endpoint: the terminating ones get no new connections.
        let m = model_of(&format!(
            "{SVC}{}",
            slice_with(
                "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.5]}]"
            )
        ));
        let d = desired(&m, "n");
        assert_eq!(
            addrs(&d.values().next().unwrap().backends),
            vec!["198.18.0.5"]
        );
    }

    #[test]
    fn internal_traffic_policy_local_uses_this_nodes_endpoints_only() {
        let svc = SVC.replace(
            "clusterIP: 198.19.0.10,",
            "clusterIP: 198.19.0.10, internalTrafficPolicy: Local,",
        );
        let m = model_of(&format!(
            "{svc}{}",
            slice_with(
                "[{addresses: [198.18.0.2], nodeName: nodeA}, {addresses: [198.18.0.3], nodeName: b}]"
            )
        ));
        // This node's name is lowercased (as kube-proxy does); nodeName matches it whatever
        // its case.
        assert_eq!(
            addrs(&desired(&m, "nodea").values().next().unwrap().backends),
            vec!["198.18.0.2"]
        );
        assert!(
            desired(&m, "c")
                .values()
                .next()
                .unwrap()
                .backends
                .is_empty()
        );
    }

    #[test]
    fn desired_serves_tcp_udp_in_each_family_from_its_own_slices() {
        use crate::source::manifests;
        let text = r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
  - {name: sig, port: 99, protocol: SCTP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [198.18.0.2]}]
";
        let model = manifests::parse(std::path::Path::new("x.yaml"), text)
            .unwrap()
            .model;
        let d = desired(&model, "node-a");
        let keys: Vec<String> = d.keys().map(ToString::to_string).collect();
        assert_eq!(
            keys,
            vec![
                "198.19.0.10:53/UDP",
                "198.19.0.10:80/TCP",
                "[fd00::10]:53/UDP",
                "[fd00::10]:80/TCP"
            ]
        );
        assert_eq!(d.values().next().unwrap().backends[0].port, 5353);
        assert_eq!(d.values().next().unwrap().label, "shop/web:dns");
        // The only slice is IPv4: the IPv6 frontends have no backend (and reject).
        for (fe, spec) in &d {
            let want = usize::from(fe.addr.is_ipv4());
            assert_eq!(spec.backends.len(), want, "{fe}");
        }
    }

    /// One line per unserved frontend: kind, family, address:port/proto, label, reason.
    fn rows(f: &ServiceFrontends) -> Vec<String> {
        f.unserved
            .iter()
            .map(|u| {
                let at = match u.addr {
                    Some(ip) => std::net::SocketAddr::new(ip, u.port).to_string(),
                    None => format!("*:{}", u.port),
                };
                format!(
                    "{} {} {at}/{} {}: {}",
                    u.kind.display(),
                    u.family.label(),
                    u.proto.as_str(),
                    u.label,
                    u.reason
                )
            })
            .collect()
    }

    fn served(f: &ServiceFrontends) -> Vec<String> {
        f.served.iter().map(|(fe, _)| fe.to_string()).collect()
    }

    fn frontends_of(text: &str) -> ServiceFrontends {
        let m = model_of(text);
        let svc = m.services.values().next().unwrap();
        let f = frontends_for(&m, svc, "node-a");
        assert_eq!(f.served, desired_for(&m, svc, "node-a"));
        f
    }

    #[test]
    fn cluster_ip_service_serves_ipv4_tcp_udp_and_lists_the_rest() {
        let f = frontends_of(
            r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80}
  - {name: dns, port: 53, protocol: UDP}
  - {name: sig, port: 99, protocol: SCTP}
  externalIPs: [203.0.113.7]
  externalTrafficPolicy: Local
",
        );
        assert_eq!(
            served(&f),
            vec![
                "198.19.0.10:80/TCP",
                "[fd00::10]:80/TCP",
                "203.0.113.7:80/TCP",
                "198.19.0.10:53/UDP",
                "[fd00::10]:53/UDP",
                "203.0.113.7:53/UDP"
            ]
        );
        assert_eq!(
            rows(&f),
            vec![
                "ClusterIP ipv4 198.19.0.10:99/SCTP shop/web:sig: SCTP is not served yet",
                "ClusterIP ipv6 [fd00::10]:99/SCTP shop/web:sig: SCTP is not served yet",
                "ExternalIP ipv4 203.0.113.7:99/SCTP shop/web:sig: SCTP is not served yet",
            ]
        );
    }

    #[test]
    fn node_port_service_asks_for_one_node_port_per_port_with_a_node_port() {
        let f = frontends_of(
            r"
apiVersion: v1
kind: Service
metadata: {name: np, namespace: shop}
spec:
  type: NodePort
  clusterIP: 198.19.0.11
  ports:
  - {name: http, port: 80, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
  - {name: metrics, port: 9100}
",
        );
        assert_eq!(
            served(&f),
            vec![
                "198.19.0.11:80/TCP",
                "0.0.0.0:30080/TCP",
                "198.19.0.11:53/UDP",
                "0.0.0.0:30053/UDP",
                "198.19.0.11:9100/TCP"
            ]
        );
        assert!(f.unserved.is_empty(), "{:?}", rows(&f));
    }

    const LB: &str = r"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: shop}
spec:
  type: LoadBalancer
  clusterIPs: [198.19.0.12, 'fd00::12']
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: PreferDualStack
  ports:
  - {name: http, port: 80, nodePort: 30080}
  - {name: sig, port: 99, protocol: SCTP, nodePort: 30099}
  externalIPs: [203.0.113.7, '2001:db8::7']
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
status:
  loadBalancer:
    ingress:
    - {ip: 192.0.2.1}
    - {ip: 192.0.2.3, ipMode: Proxy}
    - {hostname: lb.example}
    - {ip: '2001:db8::1', ipMode: VIP}
";

    #[test]
    fn dual_stack_load_balancer_asks_for_every_kind_in_both_families() {
        let f = frontends_of(LB);
        // 192.0.2.3 (ipMode Proxy) and the hostname-only ingress ask for nothing. Each
        // external frontend of this `Local` service has an entry for this node's pods.
        assert_eq!(
            served(&f),
            vec![
                "198.19.0.12:80/TCP",
                "[fd00::12]:80/TCP",
                "0.0.0.0:30080/TCP",
                "0.0.0.0:30080/TCP (pods)",
                "[::]:30080/TCP",
                "[::]:30080/TCP (pods)",
                "203.0.113.7:80/TCP",
                "203.0.113.7:80/TCP (pods)",
                "[2001:db8::7]:80/TCP",
                "[2001:db8::7]:80/TCP (pods)",
                "192.0.2.1:80/TCP",
                "192.0.2.1:80/TCP (pods)",
                "[2001:db8::1]:80/TCP",
                "[2001:db8::1]:80/TCP (pods)"
            ]
        );
        let sctp = "SCTP is not served yet";
        assert_eq!(
            rows(&f),
            vec![
                format!("ClusterIP ipv4 198.19.0.12:99/SCTP shop/lb:sig: {sctp}"),
                format!("ClusterIP ipv6 [fd00::12]:99/SCTP shop/lb:sig: {sctp}"),
                format!("NodePort ipv4 *:30099/SCTP shop/lb:sig: {sctp}"),
                format!("NodePort ipv6 *:30099/SCTP shop/lb:sig: {sctp}"),
                format!("ExternalIP ipv4 203.0.113.7:99/SCTP shop/lb:sig: {sctp}"),
                format!("ExternalIP ipv6 [2001:db8::7]:99/SCTP shop/lb:sig: {sctp}"),
                format!("LoadBalancerIP ipv4 192.0.2.1:99/SCTP shop/lb:sig: {sctp}"),
                format!("LoadBalancerIP ipv6 [2001:db8::1]:99/SCTP shop/lb:sig: {sctp}"),
            ]
        );
    }

    #[test]
    fn ip_mode_proxy_ingress_asks_for_nothing() {
        let f = frontends_of(
            "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIP: 198.19.0.12, ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.3, ipMode: Proxy}, {hostname: lb.example}]}}\n",
        );
        assert_eq!(served(&f), vec!["198.19.0.12:80/TCP", "0.0.0.0:30080/TCP"]);
        assert!(f.unserved.is_empty(), "{:?}", rows(&f));
    }

    #[test]
    fn single_stack_service_asks_for_nothing_in_the_other_family() {
        // As kube-proxy: an IPv4-only service's IPv6 externalIPs and load-balancer IPs are
        // not programmed, and it has no IPv6 NodePort.
        let f = frontends_of(
            &LB.replace("[198.19.0.12, 'fd00::12']", "[198.19.0.12]")
                .replace("ipFamilies: [IPv4, IPv6]", "ipFamilies: [IPv4]"),
        );
        assert!(
            f.unserved.iter().all(|u| u.family == Family::V4),
            "{:#?}",
            rows(&f)
        );
        // SCTP on each of the four kinds.
        assert_eq!(f.unserved.len(), 4, "{:#?}", rows(&f));
    }

    #[test]
    fn the_cluster_ip_ignores_every_other_kind_and_the_external_policy() {
        let slice = "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-a, namespace: shop, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [198.18.0.2], nodeName: node-a}, {addresses: [198.18.0.3], nodeName: node-b}]\n";
        let plain = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {clusterIPs: [198.19.0.12, 'fd00::12'], ports: [{name: http, port: 80}, {name: sig, port: 99, protocol: SCTP}]}\n";
        let base = frontends_of(&format!("{plain}{slice}"));
        let full = frontends_of(&format!("{LB}{slice}"));
        assert_eq!(full.served[0], base.served[0]);
        // externalTrafficPolicy: Local narrows the external frontends to this node's, and
        // flags them split; their entries for this node's pods keep every endpoint (as
        // kube-proxy's short-circuit of pod traffic to the internal policy).
        // (The slice is IPv4: the IPv6 frontends have no endpoints.)
        for (fe, spec) in full.served[1..]
            .iter()
            .filter(|(fe, spec)| spec.kind != FrontendKind::ClusterIp && fe.addr.is_ipv4())
        {
            if fe.pods_only {
                assert_eq!(
                    addrs(&spec.backends),
                    vec!["198.18.0.2", "198.18.0.3"],
                    "{fe}"
                );
                assert_eq!(
                    spec.flags.bits() & lbproxy_common::SVC_F_SPLIT_SCOPE,
                    0,
                    "{fe}"
                );
            } else {
                assert_eq!(addrs(&spec.backends), vec!["198.18.0.2"], "{fe}");
                assert_ne!(
                    spec.flags.bits() & lbproxy_common::SVC_F_SPLIT_SCOPE,
                    0,
                    "{fe}"
                );
            }
        }
        assert_eq!(
            full.served
                .iter()
                .filter(|(fe, _)| fe.pods_only && fe.addr.is_ipv4())
                .count(),
            3
        );
        // externalTrafficPolicy: Local does not narrow the ClusterIP's backends.
        assert_eq!(
            addrs(&full.served[0].1.backends),
            vec!["198.18.0.2", "198.18.0.3"]
        );
        // internalTrafficPolicy: Local does.
        let local = frontends_of(&format!(
            "{}{slice}",
            LB.replace(
                "externalTrafficPolicy: Local",
                "internalTrafficPolicy: Local"
            )
        ));
        assert_eq!(addrs(&local.served[0].1.backends), vec!["198.18.0.2"]);
        // Both policies Local: pods and outside traffic get the same local endpoints, so
        // there is nothing to split.
        let both = frontends_of(&format!(
            "{}{slice}",
            LB.replace(
                "externalTrafficPolicy: Local",
                "externalTrafficPolicy: Local\n  internalTrafficPolicy: Local"
            )
        ));
        assert!(
            both.served
                .iter()
                .all(|(fe, s)| !fe.pods_only
                    && s.flags.bits() & lbproxy_common::SVC_F_SPLIT_SCOPE == 0),
            "{:?}",
            served(&both)
        );
    }

    #[test]
    fn sctp_is_the_one_reason_a_frontend_is_not_served() {
        let v4 = Some(IpAddr::from([198, 19, 0, 1]));
        let v6_addr: IpAddr = "fd00::1".parse().unwrap();
        let v6 = Some(v6_addr);
        use FrontendKind::*;
        use Protocol::*;
        let sctp = "SCTP is not served yet";
        let ok = |a: [u8; 4]| Ok(IpAddr::from(a));
        for (kind, family, addr, proto, want) in [
            (NodePort, Family::V6, None, Sctp, Err(sctp)),
            (NodePort, Family::V6, None, Tcp, Ok(IpAddr::from([0u8; 16]))),
            (NodePort, Family::V4, None, Udp, ok([0, 0, 0, 0])),
            (ExternalIp, Family::V6, v6, Sctp, Err(sctp)),
            (ExternalIp, Family::V6, v6, Tcp, Ok(v6_addr)),
            (LoadBalancerIp, Family::V6, v6, Tcp, Ok(v6_addr)),
            (LoadBalancerIp, Family::V6, v6, Sctp, Err(sctp)),
            (LoadBalancerIp, Family::V4, v4, Tcp, ok([198, 19, 0, 1])),
            (ClusterIp, Family::V6, v6, Sctp, Err(sctp)),
            (ClusterIp, Family::V6, v6, Tcp, Ok(v6_addr)),
            (ClusterIp, Family::V4, v4, Sctp, Err(sctp)),
            (ClusterIp, Family::V4, v4, Udp, ok([198, 19, 0, 1])),
        ] {
            assert_eq!(
                servable(kind, family, addr, proto),
                want,
                "{kind:?} {family:?} {proto:?}"
            );
        }
    }

    /// A dual-stack LoadBalancer: each family's LB IP is filtered by that family's ranges
    /// only; a family with no range of its own admits no source of that family (the
    /// Service asked for a filter); a `/0` of one family opens that family only.
    #[test]
    fn source_ranges_apply_per_family() {
        let lb = |ranges: &str| {
            frontends_of(&format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: shop}}\nspec: {{type: LoadBalancer, clusterIPs: [198.19.0.12, 'fd00:c613::12'], ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack, loadBalancerSourceRanges: {ranges}, ports: [{{port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 192.0.2.1}}, {{ip: '2001:db8::1'}}]}}}}\n"
            ))
        };
        let lb_ranges = |f: &ServiceFrontends| -> Vec<(String, u16, Vec<String>)> {
            f.served
                .iter()
                .filter(|(_, s)| s.kind == FrontendKind::LoadBalancerIp)
                .map(|(fe, s)| {
                    (
                        fe.addr.to_string(),
                        s.flags.bits() & lbproxy_common::SVC_F_SOURCE_RANGES,
                        s.src_ranges.iter().map(ToString::to_string).collect(),
                    )
                })
                .collect()
        };
        let f = lb("[203.0.113.0/24, '2001:db8:1::/48', '2001:db8:1::/48']");
        let flag = lbproxy_common::SVC_F_SOURCE_RANGES;
        assert_eq!(
            lb_ranges(&f),
            vec![
                ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
                ("2001:db8::1".into(), flag, vec!["2001:db8:1::/48".into()]),
            ]
        );
        assert!(f.unserved.is_empty(), "{:?}", f.unserved);
        assert_eq!(
            lb_ranges(&lb("[203.0.113.0/24]")),
            vec![
                ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
                ("2001:db8::1".into(), flag, vec![]),
            ],
            "IPv4 ranges only: the IPv6 LB IP admits no IPv6 source"
        );
        // A range holding one of the node's IPv6 addresses admits the IPv6 LB IP itself as
        // a source (and only that family's LB IP).
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIPs: [198.19.0.12, 'fd00:c613::12'], ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack, loadBalancerSourceRanges: [203.0.113.0/24, '2001:db8:1::/48'], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.1}, {ip: '2001:db8::1'}]}}\n";
        let mut m = model_of(text);
        assert_eq!(
            m.set_node_ips(vec!["2001:db8:1::5".parse().unwrap()]).len(),
            1
        );
        let svc = m.services.values().next().unwrap();
        assert_eq!(
            lb_ranges(&frontends_for(&m, svc, "node-a")),
            vec![
                ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
                (
                    "2001:db8::1".into(),
                    flag,
                    vec!["2001:db8::1/128".into(), "2001:db8:1::/48".into()]
                ),
            ]
        );
        assert_eq!(
            lb_ranges(&lb("[203.0.113.0/24, '::/0']")),
            vec![
                ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
                ("2001:db8::1".into(), 0, vec![]),
            ],
            "::/0 opens IPv6 only"
        );
    }

    /// `loadBalancerSourceRanges` restrict the load-balancer IPs only (as kube-proxy), and
    /// `0.0.0.0/0` restricts nothing.
    #[test]
    fn source_ranges_restrict_load_balancer_ips_only() {
        let lb = |ranges: &str| {
            frontends_of(&format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: shop}}\nspec: {{type: LoadBalancer, clusterIP: 198.19.0.12, loadBalancerSourceRanges: {ranges}, ports: [{{port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 192.0.2.1}}]}}}}\n"
            ))
        };
        let f = lb("[203.0.113.0/24, 198.51.100.7/32, 203.0.113.0/24]");
        assert_eq!(
            served(&f),
            vec![
                "198.19.0.12:80/TCP",
                "0.0.0.0:30080/TCP",
                "192.0.2.1:80/TCP"
            ]
        );
        let by_kind = |f: &ServiceFrontends, k: FrontendKind| {
            f.served
                .iter()
                .find(|(_, s)| s.kind == k)
                .map(|(_, s)| s.clone())
                .unwrap()
        };
        let lbip = by_kind(&f, FrontendKind::LoadBalancerIp);
        assert_eq!(
            lbip.src_ranges
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            vec!["198.51.100.7/32", "203.0.113.0/24"]
        );
        assert_ne!(lbip.flags.bits() & lbproxy_common::SVC_F_SOURCE_RANGES, 0);
        for k in [FrontendKind::ClusterIp, FrontendKind::NodePort] {
            let s = by_kind(&f, k);
            assert!(
                s.src_ranges.is_empty() && s.flags.is_empty(),
                "{k:?}: {s:?}"
            );
        }
        let open = by_kind(
            &lb("[203.0.113.0/24, '0.0.0.0/0']"),
            FrontendKind::LoadBalancerIp,
        );
        assert!(
            open.src_ranges.is_empty() && open.flags.is_empty(),
            "{open:?}"
        );
    }

    /// As kube-proxy: ranges that hold one of this node's addresses admit the service's
    /// load-balancer IPs as sources too; ranges that hold none do not. A change of the
    /// node's addresses names the services it concerns.
    #[test]
    fn source_ranges_holding_a_node_ip_admit_the_lb_ips() {
        let text = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIP: 198.19.0.12, loadBalancerSourceRanges: [10.0.0.0/24], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.1}, {ip: 192.0.2.2}, {ip: 192.0.2.3, ipMode: Proxy}]}}\n";
        let mut m = model_of(text);
        let ranges = |m: &Model| -> Vec<Vec<String>> {
            let svc = m.services.values().next().unwrap();
            frontends_for(m, svc, "node-a")
                .served
                .iter()
                .filter(|(_, s)| s.kind == FrontendKind::LoadBalancerIp)
                .map(|(_, s)| s.src_ranges.iter().map(ToString::to_string).collect())
                .collect()
        };
        assert_eq!(ranges(&m), vec![vec!["10.0.0.0/24"]; 2]);
        let touched = m.set_node_ips(vec!["10.0.1.5".parse().unwrap()]);
        assert_eq!(touched.len(), 1, "the service with ranges is named");
        assert_eq!(
            ranges(&m),
            vec![vec!["10.0.0.0/24"]; 2],
            "no node IP in range"
        );
        m.set_node_ips(vec![
            "10.0.0.5".parse().unwrap(),
            "10.0.1.5".parse().unwrap(),
        ]);
        assert_eq!(
            ranges(&m),
            vec![vec!["10.0.0.0/24", "192.0.2.1/32", "192.0.2.2/32"]; 2],
            "both VIP-mode LB IPs admitted on both LB frontends"
        );
        assert!(
            m.set_node_ips(vec![
                "10.0.1.5".parse().unwrap(),
                "10.0.0.5".parse().unwrap()
            ])
            .is_empty(),
            "the same addresses in another order change nothing"
        );
    }

    #[test]
    fn kinds_and_families_have_stable_labels() {
        let got: Vec<_> = FrontendKind::ALL
            .iter()
            .map(|k| (k.label(), k.display(), k.scope()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("cluster_ip", "ClusterIP", Scope::Internal),
                ("node_port", "NodePort", Scope::External),
                ("external_ip", "ExternalIP", Scope::External),
                ("load_balancer_ip", "LoadBalancerIP", Scope::External),
            ]
        );
        assert_eq!((Family::V4.label(), Family::V6.label()), ("ipv4", "ipv6"));
    }
}
