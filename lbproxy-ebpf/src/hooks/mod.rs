//! One module per TC program, each one pipeline written once for both families: `run::<A>`
//! goes through the named stages (parse -> frontend -> source check -> flow -> select ->
//! translate -> deliver, or reject), and `main`'s entry points pick the family from the
//! EtherType, as Katran's `balancer_ingress` calls one `process_packet`.
//!
//! Each stage is declared with [`stage!`]: written once, it is inlined into `run` for IPv4
//! and a BPF function of its own for IPv6 (`Family::STAGES_APART`). The verifier allows 512
//! bytes of stack along a call chain: an IPv6 packet's stages inlined together need more,
//! so they run one after the other and hand the packet on in this CPU's [`StagedPacket`];
//! IPv4's fit in one frame, and inlined they cost no call and no scratch lookup per
//! packet. Either way a stage says what it did with a typed outcome ([`Parsed`],
//! [`Forwarded`]), a scalar in a register: no stage returns a `Result` through the
//! caller's stack (LLVM may leave that stack pointer in r0, which the verifier refuses).
//! docs/design.md ("The hooks' stages") says why BPF-to-BPF calls, not tail calls.

/// Declares stage `$name` of a hook's pipeline, generic over the family `A`: its body is
/// inlined where `A::STAGES_APART` is false (IPv4), and called as a BPF function of its
/// own where it is true (IPv6), its frame then apart from the other stages'. The choice is
/// a constant of the family, so each build of the pipeline has only one of the two.
macro_rules! stage {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident<A: Datapath>($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty
        $body:block
    ) => {
        $(#[$attr])*
        #[inline(always)]
        $vis fn $name<A: Datapath>($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body<A: Datapath>($($arg: $ty),*) -> $ret $body
            #[inline(never)]
            fn apart<A: Datapath>($($arg: $ty),*) -> $ret {
                body::<A>($($arg),*)
            }
            if A::STAGES_APART {
                apart::<A>($($arg),*)
            } else {
                body::<A>($($arg),*)
            }
        }
    };
}

pub mod from_node;
pub mod from_pod;
pub mod to_node;
pub mod to_pod;

use core::mem::MaybeUninit;

use aya_ebpf::programs::TcContext;
use aya_log_ebpf::debug;
use lbproxy_common::{DropReason, ServiceValue};

use crate::{
    dsr,
    family::Family,
    flow, icmp, lb, maps,
    packet::Packet,
    reason::{count, count_and_drop},
    reject, source,
    stage::{NatTarget, Parsed, Source, StagedPacket, TC_ACT_UNSPEC, Verdict},
    svc_stats,
};

/// What a hook's pipeline needs of a family: its header and maps ([`Family`]), its ICMP
/// error formats ([`icmp::Errors`]) and its answers to a rejected packet
/// ([`reject::Answer`]).
pub trait Datapath: Family + icmp::Errors + reject::Answer + dsr::Dispatch {}

impl<A: Family + icmp::Errors + reject::Answer + dsr::Dispatch> Datapath for A {}

/// Where a hook's stages keep the [`StagedPacket`]: for a family whose stages are apart
/// (`A::STAGES_APART`), this CPU's scratch entry; otherwise `local`, on the caller's stack,
/// which LLVM keeps in registers once the stages are inlined (no scratch lookup, nothing
/// zeroed). `None` only if the scratch entry were missing.
#[inline(always)]
fn staged<A: Datapath>(
    local: &mut MaybeUninit<StagedPacket<A>>,
) -> Option<&mut MaybeUninit<StagedPacket<A>>> {
    if A::STAGES_APART {
        let s: *mut StagedPacket<A> = A::staged()?;
        // SAFETY: `MaybeUninit<T>` has `T`'s layout.
        Some(unsafe { &mut *s.cast() })
    } else {
        Some(local)
    }
}

stage! {
    /// Stage 0 of a load-balancing hook (`hook`, a `HOOK_*`): parses the packet into
    /// `staged`. Not TCP or UDP, or not understood: passed; malformed: dropped and counted.
    /// On [`Parsed::Packet`], `staged` is initialised (see [`parsed`]).
    fn parse_into<A: Datapath>(
        ctx: &TcContext,
        staged: &mut MaybeUninit<StagedPacket<A>>,
        hook: u8,
    ) -> Parsed {
        match A::parse(ctx) {
            Ok(Some(p)) => {
                let s = staged.as_mut_ptr();
                // SAFETY: field writes through a pointer to `staged`, nothing read.
                unsafe {
                    (&raw mut (*s).pkt).write(p);
                    (&raw mut (*s).reason).write(DropReason::Malformed);
                }
                Parsed::Packet
            }
            Ok(None) => Parsed::Pass,
            Err(v) => {
                count_and_drop(ctx, hook, v.reason());
                Parsed::Dropped
            }
        }
    }
}

/// The source and flow stages of a load-balancing hook, for `pkt` addressed to frontend
/// `svc`: its `loadBalancerSourceRanges`, then `flow::forward` with the hook's check of a
/// new flow's source (`verify`) and where a new flow comes from (`source`). Inlined into the
/// hook's forward stage, which records the answer ([`Forwarded::record`]).
#[inline(always)]
fn source_and_flow<A: Datapath>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    svc: &ServiceValue,
    verify: impl Fn() -> Result<(), DropReason>,
    source: impl Fn(A, u16) -> Result<Source<A>, DropReason>,
) -> Result<NatTarget<A>, Verdict> {
    let r = lb::service::source_allowed(svc, pkt)
        .map_err(Verdict::Drop)
        .and_then(|()| {
            flow::forward(
                pkt,
                svc,
                maps::config().hash_seed(),
                source::ingress(ctx),
                verify,
                source,
            )
        });
    if let Err(v) = &r {
        // A packet to this frontend rejected or dropped, counted for its service.
        svc_stats::refused(svc.svc_id, v);
    }
    r
}

/// The staged packet once [`parse_into`] answered [`Parsed::Packet`].
#[inline(always)]
fn parsed<A: Datapath>(staged: &mut MaybeUninit<StagedPacket<A>>) -> &mut StagedPacket<A> {
    // SAFETY: `parse_into` wrote `pkt` and `reason`. `to` holds only integers and byte
    // arrays, and is written before it is read (`Forwarded::record`).
    unsafe { staged.assume_init_mut() }
}

stage! {
    /// The answer to a packet a stage rejected for `reason` ([`reject::Answer`]), after the
    /// flow stage returned.
    fn reject<A: Datapath>(ctx: &TcContext, pkt: &Packet<A>, reason: DropReason, hook: u8) -> i32 {
        match A::answer(ctx, pkt, reason, hook) {
            Ok(action) => action,
            Err(v) => count_and_drop(ctx, hook, v.reason()),
        }
    }
}

stage! {
    /// Drops the packet a hook's pipeline gave up on (`hook`, a `HOOK_*`), counted, with a
    /// debug line. Called from `run` only; apart, aya-log's record takes room in this
    /// frame, not in `run`'s, which every stage's call chain includes.
    fn drop_logged<A: Datapath>(ctx: &TcContext, hook: u8, reason: DropReason) -> i32 {
        debug!(ctx, "hook {}: drop, reason {}", hook, reason as u32);
        count_and_drop(ctx, hook, reason)
    }
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
