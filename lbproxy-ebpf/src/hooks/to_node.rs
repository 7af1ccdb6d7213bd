//! `lb_to_node` (tcx egress on the node's own interfaces: traffic leaving the node): a
//! reply of a backend on this node to a client outside it is reverse-NATed to come from the
//! frontend the client used; an ICMP error of such a backend about the client's translated
//! packet is translated.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{Delivery, DropReason, FLOW_DISPATCH_DSR, HOOK_TO_NODE};

use super::{Datapath, drop_logged};
use crate::{deliver, flow, nat, packet::L4, stage::TC_ACT_UNSPEC, untrack};

/// The pipeline: ICMP errors to `icmp`; else parse -> flow (reply half) -> translate.
/// Inlined into the entry point, so that the ICMP stage (a BPF function of its own) and
/// [`reply`] are called from there one after the other, their frames never on the stack
/// together.
#[inline(always)]
pub fn run<A: Datapath>(ctx: TcContext) -> i32 {
    if A::is_icmp(&ctx) {
        A::to_client(&ctx);
        return TC_ACT_UNSPEC;
    }
    reply::<A>(ctx)
}

/// A TCP or UDP packet (or one not understood): a flow's reply is translated back. Each
/// family's a BPF function of its own, so that the two do not add up in one frame.
#[inline(never)]
fn reply<A: Datapath>(ctx: TcContext) -> i32 {
    let ctx = &ctx;
    match reverse::<A>(ctx) {
        Ok(action) => action,
        Err(reason) => drop_logged::<A>(ctx, HOOK_TO_NODE, reason),
    }
}

#[inline(always)]
fn reverse<A: Datapath>(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match A::parse(ctx) {
        Ok(Some(pkt)) if pkt.l4 != L4::Bad => pkt,
        Ok(_) => return Ok(TC_ACT_UNSPEC),
        Err(v) => return Err(v.reason()),
    };
    let Some(to) = flow::reply(&pkt, untrack::marked(ctx)) else {
        return Ok(TC_ACT_UNSPEC);
    };
    if to.peer_addr != pkt.dst_addr {
        // A source-NATed flow's reply arrives on the way in, not out.
        return Ok(TC_ACT_UNSPEC);
    }
    nat::snat(ctx, &pkt, to).map_err(|v| v.reason())?;
    if to.dispatch == FLOW_DISPATCH_DSR {
        // A flow another node dispatched here (direct server return): straight to the client.
        deliver::count(Delivery::DsrReplyToClient);
    }
    Ok(TC_ACT_UNSPEC)
}
