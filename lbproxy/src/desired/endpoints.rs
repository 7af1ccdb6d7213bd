//! Desired state, part two: which endpoints a frontend sends traffic to.
//!
//! kube-proxy's rules, in order:
//! 1. the traffic policy of the frontend's scope narrows the candidates: `Local` keeps only
//!    this node's endpoints (`internalTrafficPolicy` for in-cluster sources,
//!    `externalTrafficPolicy` for traffic from outside);
//! 2. new connections go to the candidates that are `ready`;
//! 3. when none is ready, to the candidates that are `serving` and `terminating` (KEP-1669);
//! 4. every endpoint still listed in a slice, whatever its conditions, keeps the flows it
//!    already has ("draining"): only an endpoint gone from every slice loses its flows.
//!
//! Between 1 and 2, a `Cluster` policy follows the endpoints' topology hints, as kube-proxy
//! 1.35's `CategorizeEndpoints` (`pkg/proxy/topology.go`): see [`topology`].

use std::collections::{BTreeSet, HashSet};

use super::topology::{HintsIgnored, Topology, available, topology};
use crate::model::{Endpoint, EndpointAddr, Model, Service, ServicePort, ServiceType};

/// Where a frontend's traffic comes from, which picks the traffic policy that applies
/// (Cilium's `LB_LOOKUP_SCOPE_INT`/`_EXT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// In-cluster traffic to a ClusterIP: `internalTrafficPolicy`.
    Internal,
    /// Traffic to a NodePort, an externalIP or a load-balancer IP: `externalTrafficPolicy`.
    External,
}

/// Whether a frontend of `scope` only uses this node's endpoints.
///
/// As kube-proxy (`ExternalPolicyLocal`): `externalTrafficPolicy: Local` only counts for
/// NodePort and LoadBalancer services; the externalIPs of a ClusterIP service always use
/// every endpoint. `internalTrafficPolicy: Local` counts for every type.
///
/// kube-proxy also lets traffic from this node's pods to an external frontend of a `Local`
/// service use every endpoint ("short-circuiting"): that depends on the packet's source, so
/// it is for the datapath to do once external frontends are served.
pub fn local_only(svc: &Service, scope: Scope) -> bool {
    match scope {
        Scope::Internal => svc.internal_local,
        Scope::External => {
            svc.external_local
                && matches!(
                    svc.service_type,
                    ServiceType::NodePort | ServiceType::LoadBalancer
                )
        }
    }
}

/// The endpoints of one service port, as one frontend uses them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSet {
    /// Endpoints that get new connections.
    pub serving: Vec<EndpointAddr>,
    /// Endpoints still listed that get no new connections but keep their flows.
    pub draining: Vec<EndpointAddr>,
    /// `serving` holds terminating endpoints, because none is ready (KEP-1669).
    pub fallback: bool,
    /// The topology hints' effect on `serving`.
    pub topology: Topology,
}

/// The endpoints of `port` for a frontend whose traffic policy is `local_only` (only
/// endpoints on `node`; see [`local_only`]). With `local_only` and no local endpoint, `serving` is empty: the
/// traffic is rejected, as kube-proxy does.
#[cfg(test)]
pub fn endpoint_set(
    model: &Model,
    svc: &Service,
    port: &ServicePort,
    node: &str,
    local_only: bool,
) -> EndpointSet {
    endpoint_set_where(model, svc, port, node, local_only, |_| true)
}

/// [`endpoint_set`] of one family's endpoints: what that family's frontends serve, as
/// kube-proxy runs one proxier per family (the terminating fallback included: IPv6
/// frontends fall back to terminating IPv6 endpoints when no IPv6 one is ready, whatever
/// the IPv4 ones are).
pub fn endpoint_set_in(
    model: &Model,
    svc: &Service,
    port: &ServicePort,
    node: &str,
    local_only: bool,
    family: crate::model::Family,
) -> EndpointSet {
    endpoint_set_where(model, svc, port, node, local_only, |ep| {
        crate::model::Family::of(&ep.ip) == family
    })
}

fn endpoint_set_where(
    model: &Model,
    svc: &Service,
    port: &ServicePort,
    node: &str,
    local_only: bool,
    keep: impl Fn(&EndpointAddr) -> bool,
) -> EndpointSet {
    // One pass over the slices: each endpoint with the number its slice gives the port.
    let mut all: Vec<(&Endpoint, u16)> = Vec::new();
    model.for_each_endpoint(svc, port, |e, n| all.push((e, n)));
    let eligible = |e: &Endpoint| !local_only || e.on_node(node);
    // An endpoint's addresses of this family, at its port number.
    let addrs = |e: &Endpoint, n: u16| {
        e.addresses
            .iter()
            .map(move |ip| EndpointAddr { ip: *ip, port: n })
            .filter(|a| keep(a))
            .collect::<Vec<_>>()
    };
    let ready: Vec<&Endpoint> = all
        .iter()
        .filter(|(e, n)| e.ready && eligible(e) && !addrs(e, *n).is_empty())
        .map(|(e, _)| *e)
        .collect();
    let zone = model.node_zone.as_deref();
    // Local endpoints ignore hints (and say so when they have some).
    let topology = match local_only {
        true if ready.iter().any(|e| !e.hints.is_empty()) => {
            Topology::Ignored(HintsIgnored::LocalPolicy)
        }
        true => Topology::None,
        false => topology(ready.iter().copied(), node, zone),
    };
    let mode = if local_only { Topology::None } else { topology };
    // Merged over the slices and de-duplicated, in address order.
    let pick = |f: &dyn Fn(&Endpoint) -> bool| -> Vec<EndpointAddr> {
        let set: BTreeSet<EndpointAddr> = all
            .iter()
            .filter(|(e, _)| f(e))
            .flat_map(|(e, n)| addrs(e, *n))
            .collect();
        set.into_iter().collect()
    };
    let mut serving = pick(&|e| e.ready && eligible(e) && available(e, mode, node, zone));
    let mut fallback = false;
    if serving.is_empty() {
        serving = pick(&|e| e.serving && e.terminating && eligible(e));
        fallback = !serving.is_empty();
    }
    // A set, not `serving.contains`: a slice of 100,000 endpoints would otherwise cost
    // 10^10 comparisons on every sync of its service.
    let serving_set: HashSet<&EndpointAddr> = serving.iter().collect();
    let draining = pick(&|_| true)
        .into_iter()
        .filter(|ep| !serving_set.contains(ep))
        .collect();
    EndpointSet {
        serving,
        draining,
        fallback,
        topology,
    }
}

/// Service ports with a `Local` traffic policy and no endpoint on `node` for new
/// connections, as (internal, external): kube-proxy's
/// `sync_proxy_rules_no_local_endpoints_total`. Traffic to them is rejected here.
///
/// Counted per family, as kube-proxy's proxier of each family counts: a service port is
/// counted for each family of its clusterIPs that has no local endpoint.
pub fn no_local_endpoints(
    model: &Model,
    node: &str,
    family: crate::model::Family,
) -> (usize, usize) {
    let (mut internal, mut external) = (0, 0);
    for svc in model.services.values() {
        if !svc
            .cluster_ips
            .iter()
            .any(|ip| crate::model::Family::of(ip) == family)
        {
            continue;
        }
        for (scope, n) in [
            (Scope::Internal, &mut internal),
            (Scope::External, &mut external),
        ] {
            if local_only(svc, scope) {
                *n += svc
                    .ports
                    .iter()
                    .filter(|p| {
                        endpoint_set_in(model, svc, p, node, true, family)
                            .serving
                            .is_empty()
                    })
                    .count();
            }
        }
    }
    (internal, external)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Normalized, service_from_k8s};

    fn service(spec: &str) -> Service {
        let k8s = crate::yaml::from_str(&format!(
            "metadata: {{name: a, namespace: n}}\nspec: {{clusterIP: 198.19.0.1, {spec}}}"
        ))
        .unwrap();
        match service_from_k8s(&k8s).unwrap() {
            Normalized::Proxied(s) => s,
            Normalized::Skipped(why) => panic!("skipped: {why}"),
        }
    }

    #[test]
    fn internal_scope_follows_internal_traffic_policy_for_every_type() {
        for ty in ["ClusterIP", "NodePort", "LoadBalancer"] {
            let local = service(&format!("type: {ty}, internalTrafficPolicy: Local"));
            assert!(local_only(&local, Scope::Internal), "{ty}");
            let cluster = service(&format!("type: {ty}, externalTrafficPolicy: Local"));
            assert!(!local_only(&cluster, Scope::Internal), "{ty}");
        }
    }

    #[test]
    fn external_scope_follows_external_traffic_policy_for_node_port_and_load_balancer_only() {
        for (ty, want) in [
            ("ClusterIP", false),
            ("NodePort", true),
            ("LoadBalancer", true),
        ] {
            let s = service(&format!(
                "type: {ty}, externalTrafficPolicy: Local, externalIPs: [203.0.113.1]"
            ));
            assert_eq!(local_only(&s, Scope::External), want, "{ty}");
            let s = service(&format!("type: {ty}, internalTrafficPolicy: Local"));
            assert!(!local_only(&s, Scope::External), "{ty}");
        }
    }

    /// One slice of 100,000 endpoints: every third not ready (draining), the rest serving.
    /// Asserts the counts and that the two sets are disjoint; the set lookup keeps this
    /// linear (with `Vec::contains` it took minutes).
    #[test]
    fn a_slice_of_100_000_endpoints_splits_into_serving_and_draining() {
        use crate::model::{EndpointSlice, NamespacedName, Protocol, SlicePort};
        const N: u32 = 100_000;
        let s = service("ports: [{name: http, port: 80}]");
        let mut model = Model::default();
        model.services.insert(s.id.clone(), s.clone());
        let endpoints = (0..N)
            .map(|i| {
                let ready = i % 3 != 0;
                Endpoint {
                    addresses: vec![std::net::IpAddr::V4(std::net::Ipv4Addr::from(
                        0x0a00_0000 + i,
                    ))],
                    ready,
                    serving: ready,
                    terminating: false,
                    node_name: None,
                    hints: Default::default(),
                }
            })
            .collect();
        model.upsert_slice(EndpointSlice {
            id: NamespacedName {
                namespace: "n".into(),
                name: "a-big".into(),
            },
            service: s.id.clone(),
            ports: vec![SlicePort {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            }],
            endpoints,
        });
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        let not_ready = (0..N).filter(|i| i % 3 == 0).count();
        assert_eq!(
            (set.serving.len(), set.draining.len()),
            (N as usize - not_ready, not_ready)
        );
        let serving: HashSet<&EndpointAddr> = set.serving.iter().collect();
        assert!(set.draining.iter().all(|e| !serving.contains(e)));
        assert!(set.draining.iter().all(|e| e.port == 8080));
    }

    /// A service `n/a` (port 80 `http`, clusterIP 198.19.0.1, `spec` added) with one slice
    /// `eps` (a YAML list of endpoints), in a model whose node is in `zone`.
    fn hinted(spec: &str, eps: &str, zone: Option<&str>) -> (Model, Service) {
        let s = service(&format!("ports: [{{name: http, port: 80}}]{spec}"));
        let mut model = Model::default();
        model.services.insert(s.id.clone(), s.clone());
        let k8s = crate::yaml::from_str(&format!(
            "metadata: {{name: a-1, namespace: n, labels: {{kubernetes.io/service-name: a}}}}\n\
             addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: {eps}"
        ))
        .unwrap();
        let Normalized::Proxied(slice) = crate::model::slice_from_k8s(&k8s).unwrap() else {
            panic!("slice skipped")
        };
        model.upsert_slice(slice);
        model.set_node_zone(zone.map(str::to_string));
        (model, s)
    }

    fn ips(v: &[EndpointAddr]) -> Vec<String> {
        v.iter().map(|e| e.ip.to_string()).collect()
    }

    const ZONED: &str = "[{addresses: [10.0.0.1], nodeName: node-a, hints: {forZones: [{name: zone-a}]}}, \
        {addresses: [10.0.0.2], nodeName: node-b, hints: {forZones: [{name: zone-b}]}}, \
        {addresses: [10.0.0.3], nodeName: node-c, hints: {forZones: [{name: zone-a}]}}]";

    #[test]
    fn zone_hints_keep_the_zones_endpoints_and_the_others_drain() {
        let (model, s) = hinted("", ZONED, Some("zone-a"));
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        assert_eq!(set.topology, Topology::SameZone);
        assert_eq!(ips(&set.serving), ["10.0.0.1", "10.0.0.3"]);
        assert_eq!(ips(&set.draining), ["10.0.0.2"], "keeps its flows");
        let (model, s) = hinted("", ZONED, Some("zone-z"));
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        assert_eq!(set.topology, Topology::Ignored(HintsIgnored::NotForZone));
        assert_eq!(ips(&set.serving), ["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    }

    #[test]
    fn a_zone_label_change_concerns_the_hinted_services_only() {
        let (mut model, s) = hinted("", ZONED, None);
        let plain = service("ports: [{name: http, port: 80}]");
        let plain = Service {
            id: crate::model::NamespacedName {
                namespace: "n".into(),
                name: "plain".into(),
            },
            ..plain
        };
        model.services.insert(plain.id.clone(), plain);
        assert_eq!(
            model.set_node_zone(Some("zone-b".into())),
            vec![s.id.clone()]
        );
        assert_eq!(model.set_node_zone(Some("zone-b".into())), Vec::new());
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        assert_eq!(ips(&set.serving), ["10.0.0.2"]);
        assert_eq!(model.set_node_zone(None), vec![s.id.clone()]);
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        assert_eq!(set.topology, Topology::Ignored(HintsIgnored::NoZoneLabel));
    }

    #[test]
    fn without_ready_endpoints_terminating_ones_serve_whatever_their_hints() {
        let eps = "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-b}]}, \
            conditions: {ready: false, serving: true, terminating: true}}, \
            {addresses: [10.0.0.2], hints: {forZones: [{name: zone-a}]}, \
            conditions: {ready: false, serving: true, terminating: true}}]";
        let (model, s) = hinted("", eps, Some("zone-a"));
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", false);
        assert!(set.fallback);
        assert_eq!(set.topology, Topology::None);
        assert_eq!(ips(&set.serving), ["10.0.0.1", "10.0.0.2"]);
    }

    #[test]
    fn a_local_policy_ignores_hints() {
        let (model, s) = hinted(", internalTrafficPolicy: Local", ZONED, Some("zone-b"));
        let set = endpoint_set(&model, &s, &s.ports[0], "node-a", true);
        assert_eq!(set.topology, Topology::Ignored(HintsIgnored::LocalPolicy));
        assert_eq!(ips(&set.serving), ["10.0.0.1"], "this node's, not zone-b's");
    }
}
