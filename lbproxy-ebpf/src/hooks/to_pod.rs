//! `lb_to_pod` (tcx egress on a pod's interface: packets entering the pod): a backend's
//! reply is reverse-NATed so that the client sees the VIP:port it connected to; an ICMP
//! error about a translated packet is translated.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, HOOK_TO_POD};

use super::{Datapath, drop_logged, pass_bad_l4};
use crate::{flow, nat, packet::L4, stage::TC_ACT_UNSPEC, untrack};

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
        Err(reason) => drop_logged::<A>(ctx, HOOK_TO_POD, reason),
    }
}

#[inline(always)]
fn reverse<A: Datapath>(ctx: &TcContext) -> Result<i32, DropReason> {
    let pkt = match A::parse(ctx) {
        Ok(Some(pkt)) => pkt,
        Ok(None) => return Ok(TC_ACT_UNSPEC),
        Err(v) => return Err(v.reason()),
    };
    if pkt.l4 == L4::Bad {
        // Counted for IPv4 only, as docs/datapath-verdicts.md has it (IPv6 never counted
        // it here): kept as it was.
        if A::AF == AF_INET {
            return Ok(pass_bad_l4());
        }
        return Ok(TC_ACT_UNSPEC);
    }
    let Some(to) = flow::reply(&pkt, untrack::marked(ctx)) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat(ctx, &pkt, to).map_err(|v| v.reason())?;
    Ok(TC_ACT_UNSPEC)
}

/// `Headers::AF` of IPv4.
const AF_INET: u8 = 2;
