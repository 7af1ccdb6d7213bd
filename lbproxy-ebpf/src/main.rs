//! lbproxy's datapath: TC programs on the host side of pod interfaces.
//!
//! - `lb_from_pod` (tcx ingress: packets leaving a pod) DNATs packets addressed to a service
//!   frontend to a backend, keeping every packet of a flow on one backend.
//! - `lb_to_pod` (tcx egress: packets entering a pod) reverse-NATs the backend's replies so
//!   the client sees the VIP:port it connected to.
//!
//! Translating the forward direction before the node's stack and the reply direction after
//! it means netfilter and conntrack on the node only ever see consistent pod-to-pod tuples,
//! so a `--ctstate INVALID -j DROP` rule never sees a half-translated flow.
//!
//! Stages, one module each: `parse` -> `lb::service` (frontend lookup) -> `flow` (flow
//! table, calling `lb::select` or `lb::affinity` for new flows) -> `nat` (translate) ->
//! `deliver` (to the stack, or with the stack bypass straight into the destination pod), or
//! `reject` (answer the client at once) when there is no usable backend. A pod's flow to
//! itself (`hairpin`) is source-NATed to a link-local address and sent straight back into
//! the pod, both ways. Drops and rejects are counted per reason in `reason`. Every map is
//! declared in `maps`, from `lbproxy_common`'s specs.
//!
//! With the stack bypass, `lb_from_pod` also handles the reply direction: a backend's reply
//! is reverse-NATed at its own interface and redirected into the client's pod, so neither
//! direction of a flow between two local pods passes the node's stack or `lb_to_pod`. When a
//! packet cannot be redirected (see `deliver`), both directions fall back to the split above.
//!
//! Socket level (`sock`): `lb_connect4`, `lb_sendmsg4`, `lb_recvmsg4` and
//! `lb_getpeername4` (cgroup programs on `--cgroup-root`) translate the node's own
//! processes' sockets, which no interface program sees before the stack routes them; their
//! `*6` twins do the same for dual-stack IPv6 sockets addressing IPv4 (mapped) frontends.
//!
//! North-south (`north`): `lb_from_node` (tcx ingress on the node's own interfaces) serves
//! NodePorts, externalIPs and load-balancer IPs to traffic from outside the node, and takes
//! back the replies of source-NATed flows; `lb_to_node` (tcx egress there) reverse-NATs the
//! replies of backends on this node to clients outside it.
#![no_std]
#![no_main]

mod deliver;
mod family;
mod flow;
mod hairpin;
mod icmp;
mod lb;
mod maps;
mod monitor;
mod nat;
mod north;
mod parse;
mod reason;
mod reject;
mod sock;
mod source;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use aya_log_ebpf::debug;

use lbproxy_common::{
    DatapathConfig, Delivery, DropReason, HAIRPIN_ADDR, HAIRPIN_ADDR6, HOOK_FROM_NODE,
    HOOK_FROM_POD, HOOK_TO_NODE, HOOK_TO_POD, IPPROTO_UDP, SVC_KIND_CLUSTER_IP, SockEvent,
};

use crate::{
    parse::L4,
    reason::{TC_ACT_UNSPEC, Verdict, count, count_and_drop},
};

#[classifier]
pub fn lb_from_pod(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        if parse::is_icmp6(&ctx) {
            // An ICMPv6 error about a reply from an IPv6 frontend is translated.
            icmp::from_client6(ctx);
            return TC_ACT_UNSPEC;
        }
        from_pod6(ctx)
    } else {
        from_pod4(ctx)
    }
}

// Each family's path is its own BPF function, so that the two do not add up in one stack
// frame: the verifier allows 512 bytes along a call chain, and each path alone is close.
#[inline(never)]
fn from_pod4(ctx: TcContext) -> i32 {
    match try_from_pod(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            debug!(&ctx, "lb_from_pod: drop, reason {}", reason as u32);
            count_and_drop(&ctx, HOOK_FROM_POD, reason)
        }
    }
}

#[inline(never)]
fn from_pod6(ctx: TcContext) -> i32 {
    from_pod_action(&ctx, try_from_pod6(&ctx))
}

// Inlined, as `try_from_node` is: as a BPF subprogram returning its `Result` through the
// caller's stack, LLVM may leave that stack pointer in r0, which the verifier refuses.
#[inline(always)]
fn try_from_pod(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match parse::parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => {
            // Not TCP or UDP: an ICMP error about a reply from a VIP is translated.
            icmp::from_client(ctx);
            return Ok(TC_ACT_UNSPEC);
        }
        Err(v) => return Err(v.reason()),
    };
    // One lookup of the settings per packet: the bypass flag and the flow-hash seed.
    let config = maps::config();
    let Some(svc) = lb::service::lookup_from_pod(&pkt) else {
        if pkt.l4 == L4::Bad {
            return Ok(pass_bad_l4());
        }
        if pkt.dst_addr == HAIRPIN_ADDR {
            return hairpin::reply(ctx, &pkt);
        }
        if pkt.l4 == L4::Header {
            flow::direct(&pkt);
        }
        return reply_from_pod(ctx, &pkt, &config);
    };
    if pkt.l4 == L4::Bad {
        // Addressed to a frontend, but there is no header to translate.
        return Err(DropReason::Malformed);
    }
    lb::service::source_allowed(&svc, &pkt)?;
    let to = match flow::forward(
        &pkt,
        &svc,
        config.hash_seed(),
        source::ingress(ctx),
        || source::check(ctx, &pkt),
        |backend, _| Ok(hairpin::source_for(&pkt, &backend)),
    ) {
        Ok(to) => to,
        Err(Verdict::Drop(reason)) => return Err(reason),
        Err(Verdict::Reject(reason)) => {
            return reject::answer(ctx, &pkt, reason, HOOK_FROM_POD).map_err(|v| v.reason());
        }
    };
    if hairpin::is_hairpin(&to) {
        return hairpin::forward(ctx, &pkt, to).map_err(|v| v.reason());
    }
    let peer = if deliver::enabled(&config) {
        deliver::route(ctx, &pkt, &to.addr, to.port_be)
    } else {
        None
    };
    match peer {
        Some(peer) => {
            nat::dnat_l4(ctx, &pkt, to).map_err(|v| v.reason())?;
            deliver::redirect(
                ctx,
                peer,
                (&to.peer_addr, &to.addr),
                Delivery::RedirectToBackend,
            )
            .map_err(|v| v.reason())
        }
        None => {
            nat::dnat(ctx, &pkt, to).map_err(|v| v.reason())?;
            Ok(TC_ACT_UNSPEC)
        }
    }
}

/// An IPv6 packet leaving a pod: a packet to an IPv6 frontend is DNATed to a backend
/// through the same stages as IPv4 (`parse6`, then the family-generic `lb::service`,
/// `source`, `flow`, `hairpin`, `nat` and `deliver`). The parsed packet and the flow's
/// working state live in per-CPU map memory (`LB_PACKET6`, `LB_SCRATCH6_V1`): IPv6
/// addresses on the stack would not fit the verifier's 512 bytes.
#[inline(always)]
fn try_from_pod6(ctx: &TcContext) -> Result<i32, DropReason> {
    let Some(slot) = maps::LB_PACKET6.get_ptr_mut(0) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let slot = unsafe { &mut *slot };
    let parsed = parse6_into(ctx, &mut slot.pkt, HOOK_FROM_POD);
    if parsed != PARSED6 {
        return Ok(parsed);
    }
    match forward6(ctx, slot) {
        FORWARD6_OK => Ok(translate6(ctx, &slot.pkt, &slot.to)),
        FORWARD6_REJECT => Ok(reject6(ctx, &slot.pkt, slot.reason, HOOK_FROM_POD)),
        FORWARD6_DROP => Err(slot.reason),
        _ => {
            let pkt = &slot.pkt;
            if pkt.l4 == L4::Bad {
                return Ok(pass_bad_l4());
            }
            if pkt.l4 == L4::Header && pkt.dst_addr != HAIRPIN_ADDR6 {
                flow::direct(pkt);
            }
            Ok(reply6(ctx, pkt))
        }
    }
}

/// [`parse6_into`]'s answer when it parsed a packet (never a TC action).
const PARSED6: i32 = i32::MIN;

/// Parses an IPv6 packet from a pod into `pkt` and returns [`PARSED6`], or returns the TC
/// action of a packet that is not parsed (not TCP or UDP: passed; malformed: dropped and
/// counted). A BPF function of its own, as [`translate6`]: the parsed packet crosses the
/// call in map memory, not on the stack.
#[inline(never)]
fn parse6_into(ctx: &TcContext, pkt: &mut parse::Packet<[u8; 16]>, hook: u8) -> i32 {
    match parse::parse6(ctx) {
        Ok(Some(p)) => {
            *pkt = p;
            PARSED6
        }
        Ok(None) => TC_ACT_UNSPEC,
        Err(v) => count_and_drop(ctx, hook, v.reason()),
    }
}

/// The TC action of a stage's result: an error is counted and dropped (`HOOK_FROM_POD`).
#[inline(always)]
fn from_pod_action(ctx: &TcContext, r: Result<i32, DropReason>) -> i32 {
    match r {
        Ok(action) => action,
        Err(reason) => count_and_drop(ctx, HOOK_FROM_POD, reason),
    }
}

/// An IPv6 packet from a pod translated to `to` (from [`forward6`]): a hairpin flow's is
/// sent back into the pod; with the stack bypass, one routed to a pod of this node is
/// redirected into it; anything else goes to the stack. A BPF function of its own, called
/// after `forward6` returned, so that the two frames are never on the stack together.
#[inline(never)]
fn translate6(
    ctx: &TcContext,
    pkt: &parse::Packet<[u8; 16]>,
    to: &flow::NatTarget<[u8; 16]>,
) -> i32 {
    let to = *to;
    if hairpin::is_hairpin(&to) {
        return from_pod_action(ctx, hairpin::forward(ctx, pkt, to).map_err(|v| v.reason()));
    }
    let peer = if deliver::enabled(&maps::config()) {
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
        None => nat::dnat(ctx, pkt, to).map(|()| TC_ACT_UNSPEC),
    };
    from_pod_action(ctx, r.map_err(|v| v.reason()))
}

/// The reject of an IPv6 packet from a pod (`reject::answer6`), as a BPF function of its
/// own, as [`translate6`].
#[inline(never)]
fn reject6(ctx: &TcContext, pkt: &parse::Packet<[u8; 16]>, reason: DropReason, hook: u8) -> i32 {
    match reject::answer6(ctx, pkt, reason, hook) {
        Ok(action) => action,
        Err(v) => count_and_drop(ctx, hook, v.reason()),
    }
}

/// An IPv6 packet from a pod to no frontend: the reply of a hairpin flow (to
/// `HAIRPIN_ADDR6`), or with the stack bypass a backend's reply (see [`reply_from_pod`]).
/// Anything else passes untouched. A BPF function of its own, as [`translate6`].
#[inline(never)]
fn reply6(ctx: &TcContext, pkt: &parse::Packet<[u8; 16]>) -> i32 {
    let r = if pkt.dst_addr == HAIRPIN_ADDR6 {
        hairpin::reply(ctx, pkt)
    } else {
        reply_from_pod(ctx, pkt, &maps::config())
    };
    from_pod_action(ctx, r)
}

const FORWARD6_OK: u32 = 0;
const FORWARD6_DROP: u32 = 1;
const FORWARD6_REJECT: u32 = 2;
const FORWARD6_NO_FRONTEND: u32 = 3;

/// The frontend stages for an IPv6 packet from a pod (`slot.pkt`): the frontend's lookup,
/// its source ranges, then `flow::forward` with the source check and hairpin. As a BPF
/// function of its own: its stack frame is not added to the rest of `from_pod6`'s, and its
/// code is laid out on its own (inlined, LLVM merged a drop counter's index with a flow
/// pointer in one register, which the verifier refuses). The answer goes to `slot.to` or
/// `slot.reason`; the return value says which (`FORWARD6_*`; `FORWARD6_NO_FRONTEND` when
/// the packet is addressed to no frontend): only scalars cross the call.
#[inline(never)]
fn forward6(ctx: &TcContext, slot: &mut maps::FromPod6) -> u32 {
    let pkt = &slot.pkt;
    let Some(svc) = lb::service::lookup_from_pod(pkt) else {
        return FORWARD6_NO_FRONTEND;
    };
    let r = if pkt.l4 == L4::Bad {
        // Addressed to a frontend, but there is no header to translate.
        Err(Verdict::Drop(DropReason::Malformed))
    } else {
        lb::service::source_allowed(&svc, pkt)
            .map_err(Verdict::Drop)
            .and_then(|()| {
                flow::forward(
                    pkt,
                    &svc,
                    maps::config().hash_seed(),
                    source::ingress(ctx),
                    || source::check(ctx, pkt),
                    |backend, _| Ok(hairpin::source_for(pkt, &backend)),
                )
            })
    };
    forward6_answer(slot, r)
}

/// A packet leaving a pod that is not addressed to a service: with the stack bypass, a
/// backend's reply is reverse-NATed here and redirected into the client's pod. Anything else,
/// or a reply that cannot be redirected, goes to the stack untouched (`lb_to_pod` translates
/// such a reply on its way into the client's pod).
#[inline(always)]
fn reply_from_pod<A: family::Family>(
    ctx: &TcContext,
    pkt: &parse::Packet<A>,
    config: &DatapathConfig,
) -> Result<i32, DropReason> {
    if !deliver::enabled(config) {
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(peer) = deliver::route(ctx, pkt, &pkt.dst_addr, pkt.dst_port_be) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat_l4(ctx, pkt, to).map_err(|v| v.reason())?;
    deliver::redirect(
        ctx,
        peer,
        (&to.addr, &to.peer_addr),
        Delivery::RedirectToClient,
    )
    .map_err(|v| v.reason())
}

/// A TCP or UDP header cut short (or a TCP data offset below 5) that is not addressed to a
/// frontend: not lbproxy's to judge, so it passes (the receiving stack drops it), counted.
#[inline(always)]
fn pass_bad_l4() -> i32 {
    count(DropReason::L4HeaderBadPassed);
    TC_ACT_UNSPEC
}

#[classifier]
pub fn lb_to_pod(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        if parse::is_icmp6(&ctx) {
            // An ICMPv6 error about a translated packet is translated.
            icmp::to_client6(ctx);
            return TC_ACT_UNSPEC;
        }
        to_pod6(ctx)
    } else {
        to_pod4(ctx)
    }
}

#[inline(never)]
fn to_pod4(ctx: TcContext) -> i32 {
    match try_to_pod(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            debug!(&ctx, "lb_to_pod: drop, reason {}", reason as u32);
            count_and_drop(&ctx, HOOK_TO_POD, reason)
        }
    }
}

#[inline(never)]
fn to_pod6(ctx: TcContext) -> i32 {
    match try_to_pod6(&ctx) {
        Ok(action) => action,
        Err(reason) => count_and_drop(&ctx, HOOK_TO_POD, reason),
    }
}

fn try_to_pod(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match parse::parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => {
            // Not TCP or UDP: an ICMP error about a translated packet is translated.
            icmp::to_client(ctx);
            return Ok(TC_ACT_UNSPEC);
        }
        Err(v) => return Err(v.reason()),
    };
    if pkt.l4 == L4::Bad {
        return Ok(pass_bad_l4());
    }
    let Some(to) = flow::reply(&pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat(ctx, &pkt, to).map_err(|v| v.reason())?;
    Ok(TC_ACT_UNSPEC)
}

/// An IPv6 packet entering a pod: a backend's reply of an IPv6 flow is reverse-NATed.
fn try_to_pod6(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match parse::parse6(ctx) {
        Ok(Some(pkt)) if pkt.l4 != L4::Bad => pkt,
        Ok(_) => return Ok(TC_ACT_UNSPEC),
        Err(v) => return Err(v.reason()),
    };
    let Some(to) = flow::reply(&pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat(ctx, &pkt, to).map_err(|v| v.reason())?;
    Ok(TC_ACT_UNSPEC)
}

#[classifier]
pub fn lb_from_node(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        return from_node6(ctx);
    }
    // The context crosses these calls as its raw pointer, in a register: a reference to
    // `ctx` would put it on this function's stack, and that frame counts towards every
    // call chain below it.
    let raw = aya_ebpf::EbpfContext::as_ptr(&ctx);
    let action = from_node4(raw);
    if action == NOT_TCP_UDP {
        return icmp_from_node_action(raw);
    }
    action
}

/// `from_node4`'s answer for a packet that is neither TCP nor UDP (never a TC action):
/// `lb_from_node` then calls `icmp_from_node_action`, so that the two frames are never on
/// the stack together.
const NOT_TCP_UDP: i32 = i32::MIN + 1;

// Each family's path is its own BPF function, as in `lb_from_pod`.
#[inline(never)]
fn from_node4(raw: *mut core::ffi::c_void) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    match try_from_node(ctx) {
        Ok(action) => action,
        Err(reason) => {
            debug!(ctx, "lb_from_node: drop, reason {}", reason as u32);
            count_and_drop(ctx, HOOK_FROM_NODE, reason)
        }
    }
}

/// An IPv6 packet from outside the node: as [`try_from_node`], through the same stages,
/// each a BPF function of its own run one after the other (as `from_pod6`'s), handing on
/// through `LB_PACKET6`.
#[inline(never)]
fn from_node6(ctx: TcContext) -> i32 {
    if parse::is_icmp6(&ctx) {
        return icmp_from_node6(aya_ebpf::EbpfContext::as_ptr(&ctx));
    }
    let ctx = &ctx;
    let Some(slot) = maps::LB_PACKET6.get_ptr_mut(0) else {
        return TC_ACT_UNSPEC;
    };
    // SAFETY: this CPU's entry, used by one program run at a time.
    let slot = unsafe { &mut *slot };
    let parsed = parse6_into(ctx, &mut slot.pkt, HOOK_FROM_NODE);
    if parsed != PARSED6 {
        return parsed;
    }
    match forward_node6(ctx, slot) {
        FORWARD6_OK => translate_node6(ctx, slot),
        FORWARD6_REJECT => reject6(ctx, &slot.pkt, slot.reason, HOOK_FROM_NODE),
        FORWARD6_DROP => count_and_drop(ctx, HOOK_FROM_NODE, slot.reason),
        _ => {
            if slot.pkt.l4 == L4::Bad {
                return pass_bad_l4();
            }
            reply_node(ctx, &slot.pkt)
        }
    }
}

/// [`forward6`] for a packet from outside the node: only frontends other than ClusterIPs,
/// new flows source-NATed when their backend is on another node (`north::source_for`).
#[inline(never)]
fn forward_node6(ctx: &TcContext, slot: &mut maps::FromPod6) -> u32 {
    let pkt = &slot.pkt;
    let svc = match lb::service::lookup(pkt) {
        Some(svc) if svc.kind != SVC_KIND_CLUSTER_IP => svc,
        _ => return FORWARD6_NO_FRONTEND,
    };
    if pkt.l4 == L4::Bad {
        return FORWARD6_NO_FRONTEND;
    }
    let r = lb::service::source_allowed(&svc, pkt)
        .map_err(Verdict::Drop)
        .and_then(|()| {
            flow::forward(
                pkt,
                &svc,
                maps::config().hash_seed(),
                source::ingress(ctx),
                || Ok(()),
                |addr, port_be| north::source_for(ctx, pkt, &addr, port_be),
            )
        });
    forward6_answer(slot, r)
}

/// Writes `flow::forward`'s answer `r` into `slot` and says which kind it is (`FORWARD6_*`).
#[inline(always)]
fn forward6_answer(
    slot: &mut maps::FromPod6,
    r: Result<flow::NatTarget<[u8; 16]>, Verdict>,
) -> u32 {
    match r {
        Ok(t) => {
            slot.to = t;
            FORWARD6_OK
        }
        Err(Verdict::Drop(r)) => {
            slot.reason = r;
            FORWARD6_DROP
        }
        Err(Verdict::Reject(r)) => {
            slot.reason = r;
            FORWARD6_REJECT
        }
    }
}

/// An IPv6 packet from outside translated to `slot.to`: to a backend on this node, up the
/// stack to its pod; to one on another node (source-NATed), redirected out towards it.
#[inline(never)]
fn translate_node6(ctx: &TcContext, slot: &maps::FromPod6) -> i32 {
    let (pkt, to) = (&slot.pkt, slot.to);
    let r = nat::dnat(ctx, pkt, to)
        .map_err(|v| v.reason())
        .and_then(|()| {
            if to.peer_addr == pkt.src_addr {
                return Ok(TC_ACT_UNSPEC);
            }
            let (from, dst) = north::forward_ends(&to);
            north::redirect(ctx, pkt, from, dst)
        });
    match r {
        Ok(action) => action,
        Err(reason) => count_and_drop(ctx, HOOK_FROM_NODE, reason),
    }
}

/// [`reply_from_node`] for IPv6, as a BPF function of its own, called after
/// `forward_node6` returned (IPv4 inlines it: its frame is shared with the forward path's).
#[inline(never)]
fn reply_node<A: family::Family>(ctx: &TcContext, pkt: &parse::Packet<A>) -> i32 {
    match reply_from_node(ctx, pkt) {
        Ok(action) => action,
        Err(reason) => count_and_drop(ctx, HOOK_FROM_NODE, reason),
    }
}

/// Traffic arriving from outside the node: a frontend other than a ClusterIP (those are
/// served to pods) is load-balanced; a reply of a source-NATed flow is translated back and
/// sent to its client; anything else passes.
// Inlined: as a BPF subprogram returning its `Result` through the caller's stack, LLVM may
// leave that stack pointer in r0, which the verifier refuses ("cannot return stack pointer
// to the caller").
#[inline(always)]
fn try_from_node(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match parse::parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => return Ok(NOT_TCP_UDP),
        Err(v) => return Err(v.reason()),
    };
    if pkt.l4 == L4::Bad {
        return Ok(pass_bad_l4());
    }
    let svc = match lb::service::lookup(&pkt) {
        Some(svc) if svc.kind != SVC_KIND_CLUSTER_IP => svc,
        _ => return reply_from_node(ctx, &pkt),
    };
    lb::service::source_allowed(&svc, &pkt)?;
    let config = maps::config();
    let to = match flow::forward(
        &pkt,
        &svc,
        config.hash_seed(),
        source::ingress(ctx),
        || Ok(()),
        |addr, port_be| north::source_for(ctx, &pkt, &addr, port_be),
    ) {
        Ok(to) => to,
        Err(Verdict::Drop(reason)) => return Err(reason),
        Err(Verdict::Reject(reason)) => {
            return reject::answer(ctx, &pkt, reason, HOOK_FROM_NODE).map_err(|v| v.reason());
        }
    };
    nat::dnat(ctx, &pkt, to).map_err(|v| v.reason())?;
    if to.peer_addr == pkt.src_addr {
        // A backend on this node: up the stack to its pod.
        return Ok(TC_ACT_UNSPEC);
    }
    let (from, dst) = north::forward_ends(&to);
    north::redirect(ctx, &pkt, from, dst)
}

/// [`icmp_from_node`] as a BPF function of its own, its frame apart from the forward path's.
#[inline(never)]
fn icmp_from_node_action(raw: *mut core::ffi::c_void) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    match icmp_from_node(ctx) {
        Ok(action) => action,
        Err(reason) => count_and_drop(ctx, HOOK_FROM_NODE, reason),
    }
}

/// Not TCP or UDP, from outside: an ICMP error about a translated flow is translated. One
/// addressed to a SNAT address of this node (about a source-NATed packet to a backend on
/// another node) is then addressed to the client and sent to it; one from a client about a
/// reply it got goes on to the backend through the stack.
#[inline(always)]
fn icmp_from_node(ctx: &TcContext) -> Result<i32, DropReason> {
    let Some(dst) = parse::ipv4_dst(ctx) else {
        return Ok(TC_ACT_UNSPEC);
    };
    // A node address is often both a SNAT address and a NodePort frontend: an error that is
    // not about a source-NATed packet may still be a client's about a reply.
    if north::to_snat_address(&dst)
        && let Some((src, client)) = icmp::to_snat_client(ctx)
    {
        if client == dst {
            return Ok(TC_ACT_UNSPEC);
        }
        return north::redirect_ip(ctx, icmp::IPPROTO_ICMP, (&src, 0), (&client, 0));
    }
    icmp::from_client(ctx);
    Ok(TC_ACT_UNSPEC)
}

/// [`icmp_from_node`] for ICMPv6, a BPF function of its own: an error addressed to one of
/// this node's IPv6 SNAT addresses about a source-NATed packet is translated, addressed to
/// the client and sent to it; any other is tried as a client's error about a reply.
#[inline(never)]
fn icmp_from_node6(raw: *mut core::ffi::c_void) -> i32 {
    let ctx = &TcContext::new(raw.cast());
    let Ok(dst) = ctx.load::<[u8; 16]>(parse::ETH_LEN + 24) else {
        return TC_ACT_UNSPEC;
    };
    if north::to_snat_address(&dst) && icmp::to_snat_client6(TcContext::new(raw.cast())) {
        let (Ok(src), Ok(client)) = (
            ctx.load::<[u8; 16]>(parse::ETH_LEN + 8),
            ctx.load::<[u8; 16]>(parse::ETH_LEN + 24),
        ) else {
            return TC_ACT_UNSPEC;
        };
        if client == dst {
            // Not source-NATed (a client on this node's own address): up the stack.
            return TC_ACT_UNSPEC;
        }
        return match north::redirect_ip(ctx, icmp::IPPROTO_ICMPV6, (&src, 0), (&client, 0)) {
            Ok(action) => action,
            Err(reason) => count_and_drop(ctx, HOOK_FROM_NODE, reason),
        };
    }
    icmp::from_client6(TcContext::new(raw.cast()));
    TC_ACT_UNSPEC
}

/// A packet from outside that is not for a frontend: the reply of a source-NATed flow (a
/// backend on another node answering this node's address) is translated back to come from
/// the frontend, addressed to the client, and redirected to it.
#[inline(always)]
fn reply_from_node<A: family::Family>(
    ctx: &TcContext,
    pkt: &parse::Packet<A>,
) -> Result<i32, DropReason> {
    if !north::to_snat_address(&pkt.dst_addr) {
        // Not for one of this node's SNAT addresses: not a reply of a source-NATed flow.
        // A pod's flow answered from another node is translated by the pod's interface.
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(pkt) else {
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

#[classifier]
pub fn lb_to_node(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        if parse::is_icmp6(&ctx) {
            // An error of a backend on this node to a client outside, about the client's
            // translated packet, is translated.
            icmp::to_client6(ctx);
            return TC_ACT_UNSPEC;
        }
        return to_node6(ctx);
    }
    to_node4(ctx)
}

#[inline(never)]
fn to_node4(ctx: TcContext) -> i32 {
    match try_to_node(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            debug!(&ctx, "lb_to_node: drop, reason {}", reason as u32);
            count_and_drop(&ctx, HOOK_TO_NODE, reason)
        }
    }
}

/// [`try_to_node`] for an IPv6 packet: a reply of a backend on this node to a client
/// outside it is reverse-NATed.
#[inline(never)]
fn to_node6(ctx: TcContext) -> i32 {
    let r = match parse::parse6(&ctx) {
        Ok(Some(pkt)) if pkt.l4 != L4::Bad => match flow::reply(&pkt) {
            Some(to) if to.peer_addr == pkt.dst_addr => {
                nat::snat(&ctx, &pkt, to).map(|()| TC_ACT_UNSPEC)
            }
            _ => Ok(TC_ACT_UNSPEC),
        },
        Ok(_) => Ok(TC_ACT_UNSPEC),
        Err(v) => Err(v),
    };
    match r {
        Ok(action) => action,
        Err(v) => count_and_drop(&ctx, HOOK_TO_NODE, v.reason()),
    }
}

/// Traffic leaving the node: a reply of a backend on this node to a client outside it is
/// reverse-NATed to come from the frontend the client used.
#[inline(always)]
fn try_to_node(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match parse::parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => {
            // Not TCP or UDP: an error of a backend on this node to a client outside, about
            // the client's translated packet, is translated.
            icmp::to_client(ctx);
            return Ok(TC_ACT_UNSPEC);
        }
        Err(v) => return Err(v.reason()),
    };
    if pkt.l4 == L4::Bad {
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(&pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    if to.peer_addr != pkt.dst_addr {
        // A source-NATed flow's reply arrives on the way in, not out.
        return Ok(TC_ACT_UNSPEC);
    }
    nat::snat(ctx, &pkt, to).map_err(|v| v.reason())?;
    Ok(TC_ACT_UNSPEC)
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        false,
        SockEvent::ConnectTranslated,
        SockEvent::ConnectRefused,
    )
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        false,
        SockEvent::SendmsgTranslated,
        SockEvent::SendmsgRefused,
    )
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, false, IPPROTO_UDP, SockEvent::RecvmsgRestored)
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    let proto = sock::protocol(&ctx);
    sock::reverse(&ctx, false, proto, SockEvent::GetpeernameRestored)
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        true,
        SockEvent::ConnectTranslated,
        SockEvent::ConnectRefused,
    )
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        true,
        SockEvent::SendmsgTranslated,
        SockEvent::SendmsgRefused,
    )
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, true, IPPROTO_UDP, SockEvent::RecvmsgRestored)
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    let proto = sock::protocol(&ctx);
    sock::reverse(&ctx, true, proto, SockEvent::GetpeernameRestored)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
