//! The per-reason drop counters.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, VERDICT_DROP};

use crate::{maps::LB_DROPS_V2, monitor, stage::TC_ACT_SHOT};

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
