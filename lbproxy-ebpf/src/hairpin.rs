//! Hairpin: a pod's flow to itself through a frontend (`lbproxy_common::hairpin`).
//!
//! - A new flow whose selected backend is the client's own address is source-NATed to
//!   `HAIRPIN_ADDR` ([`source_for`]), keeping the client's port unless another of the pod's
//!   hairpin flows to that backend port holds it (then it is moved as a clashing tuple's).
//! - Its packets, translated, are sent straight back into the pod ([`send_back`]).
//! - The pod's replies, addressed to `HAIRPIN_ADDR`, are translated back to come from the
//!   frontend, addressed to the client's own port, and sent back the same way ([`reply`]).
//!
//! Session affinity and the flow lifecycle (a backend that leaves, a SYN retried) are the
//! flow table's, as for every other flow.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{Delivery, DropReason, HAIRPIN_ADDR};

use crate::{
    deliver::{self, Peer},
    flow::{self, NatTarget, Source},
    nat,
    parse::Packet,
    reason::{TC_ACT_UNSPEC, Verdict},
    source,
};

/// How a new flow from a pod to the backend at `backend` leaves: source-NATed to
/// `HAIRPIN_ADDR` when the backend is the client itself, else with the client's address.
#[inline(always)]
pub fn source_for(pkt: &Packet, backend: [u8; 4]) -> Source {
    if backend != pkt.src_addr {
        return Source::CLIENT;
    }
    Source {
        addr: HAIRPIN_ADDR,
        ..Source::CLIENT
    }
}

/// Whether the flow translated to `to` is a hairpin flow.
#[inline(always)]
pub fn is_hairpin(to: &NatTarget) -> bool {
    to.peer_addr == HAIRPIN_ADDR
}

/// A client's packet of a hairpin flow (`to` from `flow::forward`): translated to
/// `HAIRPIN_ADDR -> backend` and sent back into the pod.
#[inline(always)]
pub fn forward(ctx: &TcContext, pkt: &Packet, to: NatTarget) -> Result<i32, Verdict> {
    nat::dnat_l4(ctx, pkt, to)?;
    send_back(ctx, [to.peer_addr, to.addr])
}

/// A packet from a pod to `HAIRPIN_ADDR`: the reply of one of its hairpin flows, translated
/// to `frontend -> client` and sent back into the pod. Its source must pass the source
/// check, so a pod cannot touch another pod's hairpin flow by forging its address. A packet
/// of no hairpin flow passes untouched.
#[inline(always)]
pub fn reply(ctx: &TcContext, pkt: &Packet) -> Result<i32, DropReason> {
    source::check(ctx, pkt)?;
    let Some(to) = flow::reply(pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat_l4(ctx, pkt, to).map_err(|v| v.reason())?;
    send_back(ctx, [to.addr, to.peer_addr]).map_err(|v| v.reason())
}

/// Writes `addrs` (source, destination) and the hop's MACs and TTL, and redirects the
/// packet back into the pod it came from.
#[inline(always)]
fn send_back(ctx: &TcContext, addrs: [[u8; 4]; 2]) -> Result<i32, Verdict> {
    let peer = Peer::sender(ctx).ok_or(Verdict::Drop(DropReason::NatFailed))?;
    deliver::redirect(ctx, peer, addrs, Delivery::RedirectHairpin)
}
