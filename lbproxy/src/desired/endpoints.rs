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

use crate::model::{Endpoint, EndpointAddr, Model, Service, ServicePort};

/// The endpoints of one service port, as one frontend uses them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointSet {
    /// Endpoints that get new connections.
    pub serving: Vec<EndpointAddr>,
    /// Endpoints still listed that get no new connections but keep their flows.
    pub draining: Vec<EndpointAddr>,
}

/// The endpoints of `port` for a frontend whose traffic policy is `local_only` (only
/// endpoints on `node`). With `local_only` and no local endpoint, `serving` is empty: the
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
