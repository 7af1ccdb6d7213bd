//! `lb_from_node` (tcx ingress on the node's own interfaces: traffic arriving from outside
//! the node): a frontend other than a ClusterIP (those are served to pods) is
//! load-balanced, to a backend on this node up the stack, to one on another node source-NATed
//! and redirected out towards it; a reply of a source-NATed flow is translated back and
//! sent to its client; an ICMP error about either is translated; anything else passes.

use core::{ffi::c_void, mem::MaybeUninit};

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    Delivery, DropReason, FLOW_ADOPTED_CONNTRACK, FLOW_ADOPTED_HANDOVER, FLOW_DISPATCH_DSR,
    HOOK_FROM_NODE, SVC_KIND_CLUSTER_IP,
};

use super::{Datapath, action, drop_logged, parse_into, pass_bad_l4, reject};
use crate::{
    deliver, dsr, flow, lb, maps, nat, north,
    packet::{L4, Packet},
    reason::count,
    stage::{Forwarded, Parsed, Source, StagedPacket, TC_ACT_SHOT, TC_ACT_UNSPEC},
    untrack,
};

/// The pipeline: ICMP errors to [`icmp`]; else parse -> frontend -> flow (select for a new
/// one, source-NATed when its backend is on another node) -> translate -> deliver, or
/// reject; a packet to no frontend may be a source-NATed flow's reply.
///
/// Inlined into the entry point, so that [`icmp`] and [`balance`] are called from there one
/// after the other, their frames never on the stack together. The context crosses the calls
/// as its raw pointer, in a register: a reference to it would put it on the caller's stack,
/// and that frame counts towards every call chain below.
#[inline(always)]
pub fn run<A: Datapath>(raw: *mut c_void) -> i32 {
    if A::is_icmp(&TcContext::new(raw.cast())) {
        return icmp::<A>(raw);
    }
    balance::<A>(raw)
}

/// A TCP or UDP packet (or one not understood) through the stages. Each family's a BPF
/// function of its own, so that the two do not add up in one frame.
#[inline(never)]
fn balance<A: Datapath>(raw: *mut c_void) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    let mut local = MaybeUninit::uninit();
    let Some(slot) = super::staged::<A>(&mut local) else {
        return TC_ACT_UNSPEC;
    };
    match parse_into(ctx, slot, HOOK_FROM_NODE) {
        Parsed::Packet => {}
        Parsed::Pass => return TC_ACT_UNSPEC,
        Parsed::Dropped => return TC_ACT_SHOT,
    }
    let staged = super::parsed(slot);
    match forward(ctx, staged) {
        Forwarded::Translate if to_conntrack(staged) => TC_ACT_UNSPEC,
        Forwarded::Translate => translate(ctx, staged),
        Forwarded::Reject => reject(ctx, &staged.pkt, staged.reason, HOOK_FROM_NODE),
        Forwarded::Drop => drop_logged::<A>(ctx, HOOK_FROM_NODE, staged.reason),
        Forwarded::NoFrontend => {
            if staged.pkt.l4 == L4::Bad {
                return pass_bad_l4();
            }
            if dsr::receiving(&maps::config()) {
                dispatched(ctx, &staged.pkt);
            }
            reply(ctx, &staged.pkt)
        }
    }
}

stage! {
    /// The frontend and flow stages for a packet from outside the node: only frontends other
    /// than ClusterIPs, new flows source-NATed when their backend is on another node
    /// (`north::source_for`). Apart (IPv6), as `from_pod`'s.
    fn forward<A: Datapath>(ctx: &TcContext, staged: &mut StagedPacket<A>) -> Forwarded {
        let pkt = &staged.pkt;
        let svc = match lb::service::lookup(pkt) {
            Some(svc) if svc.kind != SVC_KIND_CLUSTER_IP => svc,
            _ => return Forwarded::NoFrontend,
        };
        if pkt.l4 == L4::Bad {
            return Forwarded::NoFrontend;
        }
        let r = super::source_and_flow(ctx, pkt, &svc, || Ok(()), |addr, port_be| {
            north::source_for(ctx, pkt, &addr, port_be).map(|s| {
                // A backend on another node: source-NATed, or dispatched with direct server
                // return where that is on for the protocol.
                if s.snat && dsr::enabled_for(&maps::config(), pkt.proto) {
                    Source::DSR
                } else {
                    s
                }
            })
        });
        Forwarded::record(staged, r)
    }
}

/// Whether a packet of a flow adopted from conntrack passes untranslated, to the entry that
/// still exists (`lbproxy_common::FlowAdopted`): always while the entry translates the flow,
/// and during a handover unless the flow is source-NATed (redirected out, past netfilter,
/// as any source-NATed flow's) or the datapath marks packets for the untrack rule
/// (`untrack`). A BPF function of its own: inlined, LLVM spilled a register
/// it had not set on the new-flow path, which the verifier refuses.
#[inline(never)]
fn to_conntrack<A: Datapath>(staged: &StagedPacket<A>) -> bool {
    let a = staged.to.adopted;
    a == FLOW_ADOPTED_CONNTRACK
        || (a == FLOW_ADOPTED_HANDOVER
            && staged.to.peer_addr == staged.pkt.src_addr
            && !untrack::enabled(&maps::config()))
}

stage! {
    /// A packet from outside translated to `staged.to`: to a backend on this node, up the stack
    /// to its pod; to one on another node (source-NATed), redirected out towards it.
    fn translate<A: Datapath>(ctx: &TcContext, staged: &StagedPacket<A>) -> i32 {
        let (pkt, to) = (&staged.pkt, staged.to);
        if to.dispatch == FLOW_DISPATCH_DSR {
            // Direct server return: to the backend's node with the client's own address.
            return action(ctx, HOOK_FROM_NODE, dsr::forward(ctx, pkt, to));
        }
        let r = nat::dnat(ctx, pkt, to)
            .map_err(|v| v.reason())
            .and_then(|()| {
                if to.peer_addr == pkt.src_addr {
                    // A backend on this node: up the stack to its pod (marked for the
                    // untrack rule while a takeover or hand-back runs).
                    if untrack::marks(&maps::config(), to.adopted) {
                        untrack::mark(ctx);
                    }
                    return Ok(TC_ACT_UNSPEC);
                }
                let (from, dst) = north::forward_ends(&to);
                north::redirect(ctx, pkt, from, dst)
            });
        action(ctx, HOOK_FROM_NODE, r)
    }
}

stage! {
    /// A packet from outside that is not for a frontend, while this node takes direct server
    /// return: one that another node dispatched to a pod here carries the frontend in an
    /// option (`dsr`), and its flow is recorded, to translate the backend's replies as they
    /// leave the node. The frontend must be one this node serves too (a NodePort of any
    /// node's address, or the same externalIP, LB IP). Apart (IPv6), as the other stages.
    fn dispatched<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>) -> u32 {
        let Some((fe, port_be)) = A::frontend_of(ctx) else {
            return 0;
        };
        let Some(svc) = lb::service::lookup_dispatched(fe, port_be, pkt.proto) else {
            count(DropReason::DsrUnknownFrontend);
            return 0;
        };
        match flow::record_dispatched(pkt, (&fe, port_be), svc.svc_id) {
            Ok(()) => deliver::count(Delivery::DsrRecorded),
            // Counted; the packet still goes on to the pod, whose replies then leave
            // untranslated, as when the flow table is full for any new flow.
            Err(reason) => count(reason),
        }
        0
    }
}

stage! {
    /// A packet from outside that is not for a frontend: the reply of a source-NATed flow (a
    /// backend on another node answering this node's address) is translated back to come from
    /// the frontend, addressed to the client, and redirected to it. Apart (IPv6), called after
    /// [`forward`] returned.
    fn reply<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>) -> i32 {
        action(ctx, HOOK_FROM_NODE, snat_reply(ctx, pkt))
    }
}

#[inline(always)]
fn snat_reply<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>) -> Result<i32, DropReason> {
    if !north::to_snat_address(&pkt.dst_addr) {
        // Not for one of this node's SNAT addresses: not a reply of a source-NATed flow.
        // A pod's flow answered from another node is translated by the pod's interface,
        // after the stack: while a takeover or hand-back runs, marked for the untrack rule.
        let config = maps::config();
        if untrack::enabled(&config)
            && let Some(to) = flow::reply(pkt, false)
            && untrack::marks(&config, to.adopted)
        {
            untrack::mark(ctx);
        }
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(pkt, false) else {
        return Ok(TC_ACT_UNSPEC);
    };
    if to.peer_addr == pkt.dst_addr {
        // A flow that is not source-NATed (a client on this node's own address): left to
        // the interface it leaves by.
        return Ok(TC_ACT_UNSPEC);
    }
    nat::snat(ctx, pkt, to).map_err(|v| v.reason())?;
    north::redirect(
        ctx,
        pkt,
        (&to.addr, to.port_be),
        (&to.peer_addr, to.peer_port_be),
    )
}

/// An ICMP or ICMPv6 error from outside, as a BPF function of its own, its frame apart from
/// the other stages'. One addressed to a SNAT address of this node, about a source-NATed
/// packet to a backend on another node, is translated, addressed to the client and sent to
/// it; any other is tried as a client's error about a reply it got, and goes on to the
/// backend through the stack. A node address is often both a SNAT address and a NodePort
/// frontend: an error that is not about a source-NATed packet may still be a client's
/// about a reply.
#[inline(never)]
fn icmp<A: Datapath>(raw: *mut c_void) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    let Some(dst) = A::dst_addr(ctx) else {
        return TC_ACT_UNSPEC;
    };
    if north::to_snat_address(&dst) && A::to_snat_client(ctx) {
        return icmp_to_client::<A>(raw, &dst);
    }
    A::from_client(ctx);
    TC_ACT_UNSPEC
}

/// An ICMP error [`icmp`] translated for a client (it was addressed to `dst`, a SNAT
/// address of this node): sent to the client. A BPF function of its own, so that the FIB
/// lookup's frame is not added to the translation's.
#[inline(never)]
fn icmp_to_client<A: Datapath>(raw: *mut c_void, dst: &A) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    let Some((src, client)) = A::addrs(ctx) else {
        return TC_ACT_UNSPEC;
    };
    if client == *dst {
        // Not source-NATed (a client on this node's own address): up the stack.
        return TC_ACT_UNSPEC;
    }
    action(
        ctx,
        HOOK_FROM_NODE,
        north::redirect_ip(ctx, A::PROTO, (&src, 0), (&client, 0)),
    )
}
