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
}

/// The endpoints of `port` for a frontend whose traffic policy is `local_only` (only
/// endpoints on `node`; see [`local_only`]). With `local_only` and no local endpoint, `serving` is empty: the
/// traffic is rejected, as kube-proxy does.
pub fn endpoint_set(
    model: &Model,
    svc: &Service,
    port: &ServicePort,
    node: &str,
    local_only: bool,
) -> EndpointSet {
    let eligible = |e: &Endpoint| !local_only || e.node_name.as_deref() == Some(node);
    let mut serving = model.endpoints_where(svc, port, |e| e.ready && eligible(e));
    if serving.is_empty() {
        serving = model.endpoints_where(svc, port, |e| e.serving && e.terminating && eligible(e));
    }
    let draining = model
        .present_endpoints(svc, port)
        .into_iter()
        .filter(|ep| !serving.contains(ep))
        .collect();
    EndpointSet { serving, draining }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Normalized, service_from_k8s};

    fn service(spec: &str) -> Service {
        let k8s = serde_yaml::from_str(&format!(
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
}
