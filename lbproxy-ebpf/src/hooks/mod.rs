//! One module per TC program, each one pipeline written once for both families: `run::<A>`
//! goes through the named stages (parse -> frontend -> source check -> flow -> select ->
//! translate -> deliver, or reject), and `main`'s entry points pick the family from the
//! EtherType, as Katran's `balancer_ingress` calls one `process_packet`.
//!
//! The stages that load-balance a packet (`from_pod`, `from_node`) are BPF functions of
//! their own, called one after the other by `run`: the verifier allows 512 bytes of stack
//! along a call chain, and an IPv6 packet's stages inlined together need more. They hand the
//! packet on in this CPU's [`StagedPacket`] and say what they did with a typed outcome
//! ([`Parsed`], [`Forwarded`]), a scalar in a register: no stage returns a `Result` through
//! the caller's stack (LLVM may leave that stack pointer in r0, which the verifier refuses).
//! docs/design.md ("The hooks' stages") says why BPF-to-BPF calls, not tail calls.

pub mod from_node;
pub mod from_pod;
pub mod to_node;
pub mod to_pod;

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use aya_log_ebpf::debug;
use lbproxy_common::DropReason;

use crate::{
    family::Family,
    icmp,
    packet::Packet,
    reason::{count, count_and_drop},
    reject,
    stage::{Parsed, TC_ACT_UNSPEC},
};

/// What a hook's pipeline needs of a family: its header and maps ([`Family`]), its ICMP
/// error formats ([`icmp::Errors`]) and its answers to a rejected packet
/// ([`reject::Answer`]).
pub trait Datapath: Family + icmp::Errors + reject::Answer {}

impl<A: Family + icmp::Errors + reject::Answer> Datapath for A {}

/// Stage 0 of a load-balancing hook (`hook`, a `HOOK_*`): parses the packet into `pkt`. Not
/// TCP or UDP, or not understood: passed; malformed: dropped and counted.
#[inline(never)]
fn parse_into<A: Datapath>(ctx: &TcContext, pkt: &mut MaybeUninit<Packet<A>>, hook: u8) -> Parsed {
    match A::parse(ctx) {
        Ok(Some(p)) => {
            pkt.write(p);
            Parsed::Packet
        }
        Ok(None) => Parsed::Pass,
        Err(v) => {
            count_and_drop(ctx, hook, v.reason());
            Parsed::Dropped
        }
    }
}

/// The answer to a packet a stage rejected for `reason` ([`reject::Answer`]), as a BPF
/// function of its own, called after the flow stage returned.
#[inline(never)]
fn reject<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>, reason: DropReason, hook: u8) -> i32 {
    match A::answer(ctx, pkt, reason, hook) {
        Ok(action) => action,
        Err(v) => count_and_drop(ctx, hook, v.reason()),
    }
}

/// Drops the packet a hook's pipeline gave up on (`hook`, a `HOOK_*`), counted, with a
/// debug line. A BPF function of its own, called from `run` only: aya-log's record takes
/// room in this frame, not in `run`'s, which every stage's call chain includes.
#[inline(never)]
fn drop_logged(ctx: &TcContext, hook: u8, reason: DropReason) -> i32 {
    debug!(ctx, "hook {}: drop, reason {}", hook, reason as u32);
    count_and_drop(ctx, hook, reason)
}

/// The TC action of a stage's result: an error is counted and dropped (`hook`).
#[inline(always)]
fn action(ctx: &TcContext, hook: u8, r: Result<i32, DropReason>) -> i32 {
    match r {
        Ok(action) => action,
        Err(reason) => count_and_drop(ctx, hook, reason),
    }
}

/// A TCP or UDP header cut short (or a TCP data offset below 5) that is not addressed to a
/// frontend: not lbproxy's to judge, so it passes (the receiving stack drops it), counted.
#[inline(always)]
fn pass_bad_l4() -> i32 {
    count(DropReason::L4HeaderBadPassed);
    TC_ACT_UNSPEC
}
