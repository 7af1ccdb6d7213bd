//! `lb_from_pod` (tcx ingress on a pod's interface: packets leaving the pod): a packet to a
//! service frontend is DNATed to a backend, every packet of a flow to the same one.
//!
//! Translating the forward direction before the node's stack and the reply direction after
//! it (`to_pod`) means netfilter and conntrack on the node only ever see consistent
//! pod-to-pod tuples, so a `--ctstate INVALID -j DROP` rule never sees a half-translated
//! flow. A pod's flow to itself (`hairpin`) is source-NATed to a link-local address and sent
//! straight back into the pod, both ways. With the stack bypass, a backend's reply is
//! reverse-NATed here and redirected into the client's pod (`deliver`), so neither
//! direction of a flow between two local pods passes the node's stack or `lb_to_pod`; when
//! a packet cannot be redirected, both directions fall back to the split above.

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    DatapathConfig, Delivery, DropReason, FLOW_ADOPTED_HANDOVER, FLOW_ADOPTED_OWN, HOOK_FROM_POD,
};

use super::{Datapath, action, drop_logged, parse_into, pass_bad_l4, reject};
use crate::{
    deliver, flow, hairpin, lb, maps, nat,
    packet::{L4, Packet},
    source,
    stage::{Forwarded, NatTarget, Parsed, StagedPacket, TC_ACT_SHOT, TC_ACT_UNSPEC, Verdict},
    untrack,
};

/// The pipeline: ICMP errors to `icmp`; else parse -> frontend -> source check -> flow
/// (select for a new one) -> translate -> deliver, or reject; a packet to no frontend may be
/// a hairpin flow's or (with the stack bypass) a backend's reply.
///
/// Inlined into the entry point, so that the ICMP stage (a BPF function of its own) and
/// [`balance`] are called from there one after the other, their frames never on the stack
/// together.
#[inline(always)]
pub fn run<A: Datapath>(ctx: TcContext) -> i32 {
    if A::is_icmp(&ctx) {
        // An ICMP error about a reply from a frontend is translated.
        A::from_client(&ctx);
        return TC_ACT_UNSPEC;
    }
    balance::<A>(ctx)
}

/// A TCP or UDP packet (or one not understood) through the stages, after `run` took the
/// ICMP errors aside. Each family's a BPF function of its own, so that the two do not add
/// up in one frame.
#[inline(never)]
fn balance<A: Datapath>(ctx: TcContext) -> i32 {
    let ctx = &ctx;
    let mut local = MaybeUninit::uninit();
    let Some(slot) = super::staged::<A>(&mut local) else {
        return TC_ACT_UNSPEC;
    };
    match parse_into(ctx, slot, HOOK_FROM_POD) {
        Parsed::Packet => {}
        Parsed::Pass => return TC_ACT_UNSPEC,
        Parsed::Dropped => return TC_ACT_SHOT,
    }
    let staged = super::parsed(slot);
    match forward(ctx, staged) {
        Forwarded::Translate => translate(ctx, &staged.pkt, &staged.to),
        Forwarded::Reject => reject(ctx, &staged.pkt, staged.reason, HOOK_FROM_POD),
        Forwarded::Drop => drop_logged::<A>(ctx, HOOK_FROM_POD, staged.reason),
        Forwarded::NoFrontend => no_frontend(ctx, &staged.pkt),
    }
}

stage! {
    /// The frontend, source and flow stages for `staged.pkt`: the frontend it is addressed to
    /// ([`Forwarded::NoFrontend`] if none), its source ranges, then `flow::forward` with the
    /// source check and hairpin. Apart (IPv6), its stack frame (the frontend's lookup keys
    /// included) is not added to the other stages', and its code is laid out on its own
    /// (inlined into IPv6's `balance`, LLVM merged a drop counter's index with a flow pointer in
    /// one register, which the verifier refuses). The answer goes to `staged.to` or
    /// `staged.reason` ([`Forwarded::record`]).
    fn forward<A: Datapath>(ctx: &TcContext, staged: &mut StagedPacket<A>) -> Forwarded {
        let pkt = &staged.pkt;
        let Some(svc) = lb::service::lookup_from_pod(pkt) else {
            // Inside a ServiceCIDR: an allocated ClusterIP's undefined port is rejected, an
            // unallocated address dropped (`lb::cidr`). A header cut short passes as before.
            if pkt.l4 != L4::Bad
                && lb::cidr::enabled()
                && let Some(v) = lb::cidr::verdict(&pkt.dst_addr, pkt.proto)
            {
                return Forwarded::record(staged, Err(v));
            }
            return Forwarded::NoFrontend;
        };
        if pkt.l4 == L4::Bad {
            // Addressed to a frontend, but there is no header to translate.
            return Forwarded::record(staged, Err(Verdict::Drop(DropReason::Malformed)));
        }
        let r = super::source_and_flow(
            ctx,
            pkt,
            &svc,
            || source::check(ctx, pkt),
            |backend, _| Ok(hairpin::source_for(pkt, &backend)),
        );
        Forwarded::record(staged, r)
    }
}

stage! {
    /// The translate and deliver stages for a packet translated to `to`: a hairpin flow's is
    /// sent back into the pod; with the stack bypass, one routed to a pod of this node is
    /// redirected into it; anything else goes to the stack. Apart, called after [`forward`]
    /// returned, so that the two frames are never on the stack together.
    fn translate<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>, to: &NatTarget<A>) -> i32 {
        let to = *to;
        if to.adopted != FLOW_ADOPTED_OWN {
            return adopted(ctx, pkt, &to);
        }
        if hairpin::is_hairpin(&to) {
            return action(
                ctx,
                HOOK_FROM_POD,
                hairpin::forward(ctx, pkt, to).map_err(|v| v.reason()),
            );
        }
        let config = maps::config();
        let peer = if deliver::enabled(&config) {
            deliver::route(ctx, pkt, &to.addr, to.port_be)
        } else {
            None
        };
        let r = match peer {
            Some(peer) => nat::dnat_l4(ctx, pkt, to).and_then(|()| {
                deliver::redirect(
                    ctx,
                    peer,
                    (&to.peer_addr, &to.addr),
                    Delivery::RedirectToBackend,
                )
            }),
            None => to_stack(ctx, pkt, to, &config),
        };
        action(ctx, HOOK_FROM_POD, r.map_err(|v| v.reason()))
    }
}

/// A client packet translated to `to` and sent up the node's stack, marked for the untrack
/// rule while a takeover or hand-back runs (`untrack`).
#[inline(always)]
fn to_stack<A: Datapath>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    to: NatTarget<A>,
    config: &DatapathConfig,
) -> Result<i32, Verdict> {
    nat::dnat(ctx, pkt, to)?;
    if untrack::marks(config, to.adopted) {
        untrack::mark(ctx);
    }
    Ok(TC_ACT_UNSPEC)
}

stage! {
    /// A packet to no frontend: a TCP or UDP header cut short passes, counted; the reply of a
    /// hairpin flow (to `Headers::HAIRPIN`) is sent back into the pod; with the stack bypass a
    /// backend's reply is redirected (see [`bypass_reply`]); anything else passes untouched.
    /// First, a stale VIP flow's reply half on the packet's tuple is forgotten
    /// (`flow::direct`). Apart, as [`translate`]: the flow key `flow::direct` builds takes room
    /// in this frame, not in `run`'s.
    fn no_frontend<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>) -> i32 {
        if pkt.l4 == L4::Bad {
            return pass_bad_l4();
        }
        if pkt.l4 == L4::Header && pkt.dst_addr != A::HAIRPIN {
            flow::direct(pkt);
        }
        let r = if pkt.dst_addr == A::HAIRPIN {
            hairpin::reply(ctx, pkt)
        } else {
            bypass_reply(ctx, pkt, &maps::config())
        };
        action(ctx, HOOK_FROM_POD, r)
    }
}

/// A client packet of a flow adopted from conntrack whose entry still exists
/// (`lbproxy_common::FlowAdopted`). A handed-over flow's packet is translated when it can be
/// redirected into the backend's pod, past netfilter, or, while a takeover marks packets for
/// the untrack rule (`untrack`), into the stack, marked: unmarked, the translated tuple would
/// clash in netfilter with the conntrack entry's reply tuple, and netfilter would move its
/// source port. Any other passes untranslated, to the conntrack entry, which translates it as
/// before lbproxy started.
#[inline(always)]
fn adopted<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>, to: &NatTarget<A>) -> i32 {
    if to.adopted != FLOW_ADOPTED_HANDOVER {
        return TC_ACT_UNSPEC;
    }
    if let Some(peer) = deliver::route(ctx, pkt, &to.addr, to.port_be) {
        let r = nat::dnat_l4(ctx, pkt, *to).and_then(|()| {
            deliver::redirect(
                ctx,
                peer,
                (&to.peer_addr, &to.addr),
                Delivery::RedirectToBackend,
            )
        });
        return action(ctx, HOOK_FROM_POD, r.map_err(|v| v.reason()));
    }
    let config = maps::config();
    if untrack::enabled(&config) {
        let r = to_stack(ctx, pkt, *to, &config);
        return action(ctx, HOOK_FROM_POD, r.map_err(|v| v.reason()));
    }
    TC_ACT_UNSPEC
}

/// With the stack bypass, a backend's reply is reverse-NATed here and redirected into the
/// client's pod. Anything else, or a reply that cannot be redirected, goes to the stack
/// untranslated (`lb_to_pod` translates such a reply on its way into the client's pod),
/// marked for the untrack rule while a takeover or hand-back runs (`untrack`). A flow whose
/// conntrack entry still translates it is not lbproxy's to answer (`flow::reply`).
#[inline(always)]
fn bypass_reply<A: Datapath>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    config: &DatapathConfig,
) -> Result<i32, DropReason> {
    let bypass = deliver::enabled(config);
    if !bypass && !untrack::enabled(config) {
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(pkt, false) else {
        return Ok(TC_ACT_UNSPEC);
    };
    if bypass && let Some(peer) = deliver::route(ctx, pkt, &pkt.dst_addr, pkt.dst_port_be) {
        nat::snat_l4(ctx, pkt, to).map_err(|v| v.reason())?;
        return deliver::redirect(
            ctx,
            peer,
            (&to.addr, &to.peer_addr),
            Delivery::RedirectToClient,
        )
        .map_err(|v| v.reason());
    }
    if untrack::marks(config, to.adopted) {
        untrack::mark(ctx);
    }
    Ok(TC_ACT_UNSPEC)
}
