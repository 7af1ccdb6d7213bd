//! The one desired-state model: services, their ports, and endpoints with their conditions.
//!
//! Every source (the API server, or manifests) produces Kubernetes objects; they are
//! normalized here, once, into these types ([`service`], [`slice`]). What comes after (the
//! desired state, the programmer) only ever sees this model.

mod node;
mod service;
mod service_cidr;
mod slice;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

pub use node::{NodeInfo, TO_BE_DELETED_TAINT, node_from_k8s, not_eligible, zone_of};
pub use service::{IpMode, Service, ServicePort, ServiceType, TargetPort, service_from_k8s};
pub use service_cidr::{ServiceCidr, service_cidr_from_k8s};
#[cfg(test)]
pub use slice::SlicePort;
pub use slice::{Endpoint, EndpointAddr, EndpointSlice, Hints, resolve_slice_port, slice_from_k8s};
/// `sessionAffinityConfig.clientIP.timeoutSeconds` when absent (3 hours, as Kubernetes).
pub const DEFAULT_AFFINITY_TIMEOUT_S: i32 = 10_800;

/// The label linking an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// A service with this label belongs to another proxy and is skipped.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// A service with this label (any value) is headless for proxies and is skipped, as
/// kube-proxy's informer selects `!service.kubernetes.io/headless`.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    /// The name of a Kubernetes object; an absent namespace is `default`, as the API server
    /// would have filled it in.
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        Self {
            namespace: meta
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_string()),
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

impl fmt::Display for NamespacedName {
    /// `namespace/name`; a cluster-scoped object's (empty namespace) is its name alone.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            // A cluster-scoped object (a Node, a ServiceCIDR).
            return f.write_str(&self.name);
        }
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    fn parse(s: Option<&str>) -> Result<Self, String> {
        match s.unwrap_or("TCP") {
            "TCP" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            "SCTP" => Ok(Protocol::Sctp),
            other => Err(format!("protocol {other:?} is not one of TCP, UDP, SCTP")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// An IP family (`spec.ipFamilies`, a slice's `addressType`, or an address's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    fn parse(s: &str) -> Result<Self, String> {
        match s {
            "IPv4" => Ok(Family::V4),
            "IPv6" => Ok(Family::V6),
            other => Err(format!("{other:?} is not one of IPv4, IPv6")),
        }
    }

    /// The Kubernetes spelling, `IPv4` or `IPv6`.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// The metric label value, `ipv4` or `ipv6`.
    #[cfg(test)]
    pub fn label(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// The desired state. Slices are kept whole and joined to services when asked, so a slice
/// may arrive before its service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    pub services: BTreeMap<NamespacedName, Service>,
    slices: BTreeMap<NamespacedName, EndpointSlice>,
    /// Slice names by the service they belong to, so one service's endpoints are found
    /// without scanning every slice. Each list is sorted: most services have one slice, and
    /// a `BTreeSet` would allocate room for eleven (17 MiB more at 50,000 services).
    by_service: BTreeMap<NamespacedName, Vec<NamespacedName>>,
    /// This node's own addresses, IPv4 and IPv6 (those of its non-pod interfaces, from the
    /// interface watcher), sorted. `loadBalancerSourceRanges` that contain one of them also
    /// admit the load-balancer IPs of that family as sources (`desired::frontends`).
    pub node_ips: Vec<std::net::IpAddr>,
    /// This node's zone: the `topology.kubernetes.io/zone` label of its Node object, `None`
    /// without the label or the object. Zone hints apply only with one.
    pub node_zone: Option<String>,
    /// The cluster's ServiceCIDRs, by name (`desired::service_cidrs`).
    pub service_cidrs: BTreeMap<NamespacedName, ServiceCidr>,
}

/// The Node label naming its zone.
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";

/// Why an object was rejected, naming the field.
#[derive(Debug, thiserror::Error)]
#[error("{kind} {object}: {reason}")]
pub struct InvalidObject {
    pub kind: &'static str,
    pub object: String,
    pub reason: String,
}

/// What normalizing a Service produced: a service to proxy, or a reason it is not proxied.
#[derive(Debug)]
pub enum Normalized<T> {
    Proxied(T),
    /// Valid, but not for us (headless, ExternalName, another proxy's).
    Skipped(&'static str),
}

fn parse_ip(field: &str, s: &str) -> Result<IpAddr, String> {
    s.parse::<IpAddr>()
        .map_err(|_| format!("{field} {s:?} is not a valid IP address"))
}

fn port_u16(field: &str, p: i32) -> Result<u16, String> {
    match u16::try_from(p) {
        Ok(v) if v != 0 => Ok(v),
        _ => Err(format!("{field} {p} is out of range 1-65535")),
    }
}

/// An object's namespace (default `default`) and name, and a constructor of errors naming
/// it. Fails when the name is missing.
fn identify(
    kind: &'static str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<(String, String, impl Fn(String) -> InvalidObject), InvalidObject> {
    let NamespacedName { namespace, name } = NamespacedName::of(meta);
    let object = format!("{namespace}/{name}");
    let invalid = move |reason: String| InvalidObject {
        kind,
        object: object.clone(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("metadata.name is missing".into()));
    }
    Ok((namespace, name, invalid))
}

impl Model {
    /// Sets [`Model::node_ips`]; returns the services the change concerns (those with
    /// `loadBalancerSourceRanges`), none when the addresses are the same.
    pub fn set_node_ips(&mut self, mut ips: Vec<std::net::IpAddr>) -> Vec<NamespacedName> {
        ips.sort();
        ips.dedup();
        if ips == self.node_ips {
            return Vec::new();
        }
        self.node_ips = ips;
        self.services
            .iter()
            .filter(|(_, s)| !s.load_balancer_source_ranges.is_empty())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Sets [`Model::node_zone`]; returns the services the change concerns (those with an
    /// endpoint that has hints), none when the zone is the same.
    pub fn set_node_zone(&mut self, zone: Option<String>) -> Vec<NamespacedName> {
        let zone = zone.filter(|z| !z.is_empty());
        if zone == self.node_zone {
            return Vec::new();
        }
        self.node_zone = zone;
        self.by_service
            .iter()
            .filter(|(_, slices)| {
                slices
                    .iter()
                    .filter_map(|n| self.slices.get(n))
                    .any(|s| s.endpoints.iter().any(|e| !e.hints.is_empty()))
            })
            .map(|(svc, _)| svc.clone())
            .collect()
    }

    /// The slices of a service, in name order.
    pub fn slices_of<'a>(
        &'a self,
        service: &'a NamespacedName,
    ) -> impl Iterator<Item = &'a EndpointSlice> + 'a {
        self.by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|name| self.slices.get(name))
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// Defines (`Some`) or removes (`None`) a service. Returns whether that changed it.
    pub fn set_service(&mut self, id: &NamespacedName, new: Option<Service>) -> bool {
        match new {
            Some(s) if self.services.get(id) != Some(&s) => {
                self.services.insert(id.clone(), s);
                true
            }
            Some(_) => false,
            None => self.services.remove(id).is_some(),
        }
    }

    /// Defines (`Some`) or removes (`None`) a ServiceCIDR. Returns whether that changed it.
    pub fn set_service_cidr(&mut self, id: &NamespacedName, new: Option<ServiceCidr>) -> bool {
        match new {
            Some(c) if self.service_cidrs.get(id) != Some(&c) => {
                self.service_cidrs.insert(id.clone(), c);
                true
            }
            Some(_) => false,
            None => self.service_cidrs.remove(id).is_some(),
        }
    }

    /// Defines (`Some`) or removes (`None`) a slice. Returns the services whose endpoints
    /// may have changed (see [`Model::upsert_slice`]): none when the slice is as it was.
    pub fn set_slice(
        &mut self,
        id: &NamespacedName,
        new: Option<EndpointSlice>,
    ) -> Vec<NamespacedName> {
        match new {
            Some(s) if self.slices.get(id) == Some(&s) => Vec::new(),
            Some(s) => self.upsert_slice(s),
            None => self.remove_slice(id).into_iter().collect(),
        }
    }

    /// Inserts or replaces a slice. Returns the services whose endpoints may have changed
    /// (the slice's service, and its former service if the label moved).
    pub fn upsert_slice(&mut self, slice: EndpointSlice) -> Vec<NamespacedName> {
        let mut touched = vec![slice.service.clone()];
        if let Some(old) = self.remove_slice(&slice.id)
            && old != slice.service
        {
            touched.push(old);
        }
        let names = self.by_service.entry(slice.service.clone()).or_default();
        if let Err(at) = names.binary_search(&slice.id) {
            names.insert(at, slice.id.clone());
        }
        self.slices.insert(slice.id.clone(), slice);
        touched
    }

    /// Removes a slice; returns the service it belonged to.
    pub fn remove_slice(&mut self, id: &NamespacedName) -> Option<NamespacedName> {
        let old = self.slices.remove(id)?;
        if let Some(set) = self.by_service.get_mut(&old.service) {
            if let Ok(at) = set.binary_search(id) {
                set.remove(at);
            }
            if set.is_empty() {
                self.by_service.remove(&old.service);
            }
        }
        Some(old.service)
    }

    /// The services whose definition or endpoint slices differ between `self` and `other`:
    /// what a sync from `self` to `other` has to reprogram. (Manifest reloads get this from
    /// the documents that changed instead; tests check them against it.)
    #[cfg(test)]
    pub fn changed_services(&self, other: &Model) -> BTreeSet<NamespacedName> {
        let names: BTreeSet<&NamespacedName> = self
            .services
            .keys()
            .chain(other.services.keys())
            .chain(self.by_service.keys())
            .chain(other.by_service.keys())
            .collect();
        names
            .into_iter()
            .filter(|n| {
                self.services.get(*n) != other.services.get(*n)
                    || !self.slices_of(n).eq(other.slices_of(n))
            })
            .cloned()
            .collect()
    }

    /// The slice names currently held, for replacing a whole set after a re-list.
    pub fn slice_ids(&self) -> Vec<NamespacedName> {
        self.slices.keys().cloned().collect()
    }

    /// The endpoints that get new connections for one service port, merged over all slices
    /// and de-duplicated.
    ///
    /// Port resolution follows kube-proxy: in each slice, the port with the service port's
    /// name (and protocol) gives the number; the slice's number is the already-resolved
    /// targetPort, so a named targetPort can resolve to different numbers per slice. For
    /// hand-written manifests that name the slice port after the targetPort instead, a slice
    /// port with the targetPort's name is used when no port has the service port's name.
    ///
    /// Only endpoints whose `ready` condition is true (absent means true) are returned.
    #[cfg(test)]
    pub fn ready_endpoints(&self, svc: &Service, port: &ServicePort) -> Vec<EndpointAddr> {
        self.endpoints_where(svc, port, |e| e.ready)
    }

    /// Every endpoint still listed for a service port, whatever its conditions. Flows that
    /// already use one of these keep it; only endpoints gone from every slice lose their flows.
    pub fn present_endpoints(&self, svc: &Service, port: &ServicePort) -> Vec<EndpointAddr> {
        self.endpoints_where(svc, port, |_| true)
    }

    /// Calls `f` with each endpoint listed for a service port and the port number its slice
    /// resolves the service port to, slice by slice (an endpoint in two slices comes twice).
    pub fn for_each_endpoint<'a>(
        &'a self,
        svc: &Service,
        port: &ServicePort,
        mut f: impl FnMut(&'a Endpoint, u16),
    ) {
        let names = self.by_service.get(&svc.id).into_iter().flatten();
        for slice in names.filter_map(|n| self.slices.get(n)) {
            let Some(number) = resolve_slice_port(slice, port) else {
                continue;
            };
            for ep in &slice.endpoints {
                f(ep, number);
            }
        }
    }

    /// The endpoints of a service port that pass `keep`, merged and de-duplicated.
    pub fn endpoints_where(
        &self,
        svc: &Service,
        port: &ServicePort,
        keep: impl Fn(&Endpoint) -> bool,
    ) -> Vec<EndpointAddr> {
        let mut out = BTreeSet::new();
        self.for_each_endpoint(svc, port, |ep, number| {
            if keep(ep) {
                out.extend(ep.addresses.iter().map(|ip| EndpointAddr {
                    ip: *ip,
                    port: number,
                }));
            }
        });
        out.into_iter().collect()
    }
}

#[cfg(test)]
mod tests;
