//! Stage 1: extract the service key from a packet and look the frontend up.

use lbproxy_common::{
    DropReason, SCOPE_DEFAULT, SCOPE_INTERNAL, SVC_F_SOURCE_RANGES, SVC_F_SPLIT_SCOPE,
    ServiceKeyOf, ServiceValue,
};

use crate::{family::Family, packet::Packet};

/// `loadBalancerSourceRanges`: a frontend with `SVC_F_SOURCE_RANGES` takes only packets
/// whose source is in one of its ranges (a longest-prefix lookup of its service id and the
/// source in `LB_SRCRANGES_V1`); `SourceRangeDenied` otherwise. One flag test for every
/// other frontend.
#[inline(always)]
pub fn source_allowed<A: Family>(svc: &ServiceValue, pkt: &Packet<A>) -> Result<(), DropReason> {
    if svc.flags & SVC_F_SOURCE_RANGES == 0 || A::in_source_ranges(svc.svc_id, pkt.src_addr) {
        return Ok(());
    }
    Err(DropReason::SourceRangeDenied)
}

/// The frontend a packet is addressed to, if any. `None` means "not a service": the packet
/// is not ours and passes untouched.
///
/// An exact frontend (a ClusterIP, externalIP or load-balancer IP) is looked up first. A
/// packet to one of the node's NodePort addresses (`LB_NODEADDRS_V1`) without one is
/// looked up again as a NodePort: the entry at address 0.0.0.0 and the packet's port. Only
/// a packet that misses the first lookup pays for the others.
///
/// The key's scope is `SCOPE_DEFAULT`, the entry every frontend has; this node's pods use
/// [`lookup_from_pod`].
#[inline(always)]
pub fn lookup<A: Family>(pkt: &Packet<A>) -> Option<ServiceValue> {
    lookup_keyed(pkt.dst_addr, pkt.dst_port_be, pkt.proto).map(|(_, svc)| svc)
}

/// [`lookup`] for a packet from one of this node's pods. An entry flagged
/// `SVC_F_SPLIT_SCOPE` (an external frontend of an `externalTrafficPolicy: Local` service)
/// has a second entry under `SCOPE_INTERNAL` for them, with the internal traffic policy's
/// endpoints: kube-proxy's short-circuit, which lets pods reach a `Local` service's
/// NodePort or LB IP on a node without a local endpoint. Only a split entry costs the
/// second lookup; should it be missing (the controller writes it beside the default one),
/// the default entry serves.
#[inline(always)]
pub fn lookup_from_pod<A: Family>(pkt: &Packet<A>) -> Option<ServiceValue> {
    lookup_local(pkt.dst_addr, pkt.dst_port_be, pkt.proto)
}

/// The frontend `(addr, port_be, proto)` names for a client on this node: one of its pods,
/// or (socket-level load balancing) one of its own processes, which kube-proxy also sends to
/// all of an `externalTrafficPolicy: Local` service's endpoints. See [`lookup_from_pod`].
#[inline(always)]
pub fn lookup_local<A: Family>(addr: A, port_be: u16, proto: u8) -> Option<ServiceValue> {
    let (key, svc) = lookup_keyed(addr, port_be, proto)?;
    if svc.flags & SVC_F_SPLIT_SCOPE == 0 {
        return Some(svc);
    }
    let key = ServiceKeyOf {
        scope: SCOPE_INTERNAL,
        ..key
    };
    Some(A::service(&key).unwrap_or(svc))
}

/// The frontend a packet dispatched by another node with direct server return was addressed
/// to (`dsr`): an exact frontend (an externalIP, LB IP), or a NodePort at any address (the
/// receiving node's). `None`: not a frontend this node serves.
#[inline(always)]
pub fn lookup_dispatched<A: Family>(addr: A, port_be: u16, proto: u8) -> Option<ServiceValue> {
    let key = ServiceKeyOf {
        addr,
        port_be,
        proto,
        scope: SCOPE_DEFAULT,
    };
    A::service(&key).or_else(|| {
        A::service(&ServiceKeyOf {
            addr: A::ZERO,
            ..key
        })
    })
}

/// The frontend entry `(addr, port_be, proto)` names and the key it was found under.
#[inline(always)]
fn lookup_keyed<A: Family>(
    addr: A,
    port_be: u16,
    proto: u8,
) -> Option<(ServiceKeyOf<A>, ServiceValue)> {
    let key = ServiceKeyOf {
        addr,
        port_be,
        proto,
        scope: SCOPE_DEFAULT,
    };
    if let Some(svc) = A::service(&key) {
        return Some((key, svc));
    }
    if !A::nodeport_addr(addr) {
        return None;
    }
    let key = ServiceKeyOf {
        addr: A::ZERO,
        ..key
    };
    A::service(&key).map(|svc| (key, svc))
}
