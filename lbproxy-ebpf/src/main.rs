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
//! Stages, one module each: `packet` (parse) -> `service` (frontend lookup) -> `flow`
//! (flow table, calling `select` for new flows) -> `nat` (translate). Drops are counted per
//! reason in `reason`.
#![no_std]
#![no_main]

mod flow;
mod nat;
mod packet;
mod reason;
mod select;
mod service;

use aya_ebpf::{macros::classifier, programs::TcContext};
use aya_log_ebpf::debug;

use crate::reason::{TC_ACT_UNSPEC, Verdict, count_and_act};

#[classifier]
pub fn lb_from_pod(ctx: TcContext) -> i32 {
    match try_from_pod(&ctx) {
        Ok(action) => action,
        Err(verdict) => {
            let Verdict::Drop(reason) = verdict;
            debug!(&ctx, "lb_from_pod: drop, reason {}", reason as u32);
            count_and_act(verdict)
        }
    }
}

fn try_from_pod(ctx: &TcContext) -> Result<i32, Verdict> {
    let Some(pkt) = packet::parse(ctx)? else {
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(svc) = service::lookup(&pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let to = flow::forward(&pkt, &svc)?;
    nat::dnat(ctx, &pkt, to)?;
    Ok(TC_ACT_UNSPEC)
}

#[classifier]
pub fn lb_to_pod(ctx: TcContext) -> i32 {
    match try_to_pod(&ctx) {
        Ok(action) => action,
        Err(verdict) => {
            let Verdict::Drop(reason) = verdict;
            debug!(&ctx, "lb_to_pod: drop, reason {}", reason as u32);
            count_and_act(verdict)
        }
    }
}

fn try_to_pod(ctx: &TcContext) -> Result<i32, Verdict> {
    let Some(pkt) = packet::parse(ctx)? else {
        return Ok(TC_ACT_UNSPEC);
    };
    let Some(to) = flow::reply(&pkt) else {
        return Ok(TC_ACT_UNSPEC);
    };
    nat::snat(ctx, &pkt, to)?;
    Ok(TC_ACT_UNSPEC)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
