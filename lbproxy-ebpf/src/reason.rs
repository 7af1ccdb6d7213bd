//! Verdicts and the per-reason drop counters.

use aya_ebpf::btf_maps::PerCpuArray;
use aya_ebpf::macros::btf_map;
use lbproxy_common::DropReason;

/// tcx: hand the packet to the next program (or the stack, when this is the last one).
pub const TC_ACT_UNSPEC: i32 = -1;
/// Drop the packet.
pub const TC_ACT_SHOT: i32 = 2;

/// What a stage decided instead of letting the packet continue.
#[derive(Clone, Copy)]
pub enum Verdict {
    /// Drop and count under this reason.
    Drop(DropReason),
}

#[btf_map(name = "LB_DROPS_V1")]
static LB_DROPS_V1: PerCpuArray<u64, { DropReason::COUNT as usize }> = PerCpuArray::new();

/// Counts the reason and returns the TC action for it.
#[inline(always)]
pub fn count_and_act(verdict: Verdict) -> i32 {
    match verdict {
        Verdict::Drop(reason) => {
            if let Some(counter) = LB_DROPS_V1.get_ptr_mut(reason as u32) {
                // Per-CPU slot: no other writer.
                unsafe { *counter += 1 };
            }
            TC_ACT_SHOT
        }
    }
}
