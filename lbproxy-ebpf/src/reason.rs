//! Verdicts and the per-reason drop counters.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, VERDICT_DROP};

use crate::{maps::LB_DROPS_V2, monitor};

/// tcx: hand the packet to the next program (or the stack, when this is the last one).
pub const TC_ACT_UNSPEC: i32 = -1;
/// Drop the packet.
pub const TC_ACT_SHOT: i32 = 2;

/// What a stage decided instead of letting the packet continue.
#[derive(Clone, Copy)]
pub enum Verdict {
    /// Drop and count under this reason.
    Drop(DropReason),
    /// Answer the client at once (TCP RST or ICMP unreachable), counted under this reason.
    Reject(DropReason),
}

impl Verdict {
    #[inline(always)]
    pub fn reason(self) -> DropReason {
        match self {
            Verdict::Drop(r) | Verdict::Reject(r) => r,
        }
    }
}

/// Counts one packet under `reason`.
#[inline(always)]
pub fn count(reason: DropReason) {
    if let Some(counter) = LB_DROPS_V2.get_ptr_mut(reason as u32) {
        // Per-CPU slot: no other writer.
        unsafe { *counter += 1 };
    }
}

/// Drops the packet a program (`hook`, a `HOOK_*`) gave up on: counts it under `reason`,
/// tells a listening `lbproxy monitor`, and returns the TC action.
#[inline(always)]
pub fn count_and_drop(ctx: &TcContext, hook: u8, reason: DropReason) -> i32 {
    monitor::event(ctx, hook, VERDICT_DROP, reason);
    count(reason);
    TC_ACT_SHOT
}
