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
    /// Answer the client at once (TCP RST or ICMP unreachable), counted under this reason.
    Reject(DropReason),
}

#[btf_map(name = "LB_DROPS_V2")]
static LB_DROPS_V2: PerCpuArray<u64, { DropReason::SLOTS as usize }> = PerCpuArray::new();

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

/// Counts a drop and returns the TC action for it.
#[inline(always)]
pub fn count_and_drop(reason: DropReason) -> i32 {
    count(reason);
    TC_ACT_SHOT
}
