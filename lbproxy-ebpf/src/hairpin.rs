//! Hairpin: a pod's flow to itself through a frontend (`lbproxy_common::hairpin`).
//!
//! - A new flow whose selected backend is the client's own address is source-NATed to
//!   `HAIRPIN_ADDR` ([`source_for`]), keeping the client's port unless another of the pod's
//!   hairpin flows to that backend port holds it (then it is moved as a clashing tuple's).
//! - Its packets, translated, are sent straight back into the pod ([`send_back`]).
//! - The pod's replies, addressed to that address, are translated back to come from the
//!   frontend, addressed to the client's own port, and sent back the same way ([`reply`]).
//!
//! Session affinity and the flow lifecycle (a backend that leaves, a SYN retried) are the
//! flow table's, as for every other flow.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{Delivery, DropReason};

use crate::{
    deliver::{self, Peer},
    family::Family,
    flow, nat,
    packet::Packet,
    source,
    stage::{NatTarget, Source, TC_ACT_UNSPEC, Verdict},
};

/// How a new flow from a pod to the backend at `backend` leaves: source-NATed to
/// `HAIRPIN_ADDR` (`HAIRPIN_ADDR6`) when the backend is the client itself, else with the
/// client's address.
#[inline(always)]
pub fn source_for<A: Family>(pkt: &Packet<A>, backend: &A) -> Source<A> {
    if *backend != pkt.src_addr {
        return Source::CLIENT;
    }
    Source {
        addr: A::HAIRPIN,
        ..Source::CLIENT
    }
}

/// Whether the flow translated to `to` is a hairpin flow.
#[inline(always)]
pub fn is_hairpin<A: Family>(to: &NatTarget<A>) -> bool {
    to.peer_addr == A::HAIRPIN
}

/// A client's packet of a hairpin flow (`to` from `flow::forward`): translated to
/// `HAIRPIN_ADDR -> backend` and sent back into the pod.
#[inline(always)]
pub fn forward<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    to: NatTarget<A>,
) -> Result<i32, Verdict> {
    nat::dnat_l4(ctx, pkt, to)?;
    send_back(ctx, (&to.peer_addr, &to.addr))
}

/// A packet from a pod to `HAIRPIN_ADDR`: the reply of one of its hairpin flows, translated
/// to `frontend -> client` and sent back into the pod. Its source must pass the source
/// check, so a pod cannot touch another pod's hairpin flow by forging its address. A packet
/// of no hairpin flow passes untouched.
#[inline(always)]
pub fn reply<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Result<i32, DropReason> {
    source::check(ctx, pkt)?;
    let Some(to) = flow::reply(pkt, false) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat_l4(ctx, pkt, to).map_err(|v| v.reason())?;
    send_back(ctx, (&to.addr, &to.peer_addr)).map_err(|v| v.reason())
}

/// Writes `addrs` (source, destination) and the hop's MACs and TTL, and redirects the
/// packet back into the pod it came from.
#[inline(always)]
fn send_back<A: Family>(ctx: &TcContext, addrs: (&A, &A)) -> Result<i32, Verdict> {
    let peer = Peer::sender(ctx).ok_or(Verdict::Drop(DropReason::NatFailed))?;
    deliver::redirect(ctx, peer, addrs, Delivery::RedirectHairpin)
}
