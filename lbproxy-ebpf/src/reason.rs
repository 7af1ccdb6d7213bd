//! The per-reason drop counters, and the counters of the datapath's events that are not
//! drops.

use aya_ebpf::{btf_maps::PerCpuArray, programs::TcContext};
use lbproxy_common::{DropReason, VERDICT_DROP};

use crate::{
    maps::{LB_DPEVENTS_V1, LB_DROPS_V2},
    monitor,
    stage::TC_ACT_SHOT,
};

/// Counts one packet under `reason`. A deprecated reason that is not a drop is counted as
/// its `DatapathEvent` too, for the one release both series are kept ([`count_event`]).
/// Every such call site passes a constant, so the choice folds away.
#[inline(always)]
pub fn count(reason: DropReason) {
    match reason.event() {
        None => bump(&LB_DROPS_V2, reason as u32),
        Some(event) => count_event(reason as u32, event as u32),
    }
}

/// A deprecated drop reason and its event, counted in both maps: one call, out of line, so
/// that its sites (rare paths, inlined into every program and family) carry no lookups.
#[inline(never)]
fn count_event(reason: u32, event: u32) {
    bump(&LB_DROPS_V2, reason);
    bump(&LB_DPEVENTS_V1, event);
}

#[inline(always)]
fn bump<const M: usize, const F: usize>(map: &PerCpuArray<u64, M, F>, index: u32) {
    if let Some(counter) = map.get_ptr_mut(index) {
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
