//! `LB_SNATTRIES_V1`: per-CPU counts of the tries each SNAT port allocation took, the
//! histogram of issue 11's "observable exhaustion".
//!
//! A try is one insert of the reply half with `BPF_NOEXIST`: the client's own port first
//! (when it is in the SNAT range), then random ports, then a linear scan. Slot `n`
//! (1..=[`MAX_SNAT_TRIES`]) counts allocations that found a free port on try `n`; slot 0
//! counts allocations that found none (also counted as the drop reason `snat_no_port`).
//! Rising counts in the higher slots mean the per-destination port space is filling up,
//! before anything is dropped.

use crate::spec::{MapKind, MapSpec};

/// The most tries one allocation makes: the client's own port, then 16 more.
pub const MAX_SNAT_TRIES: u32 = 17;

/// Slot 0 (failed) and one slot per try count.
pub const SLOTS: u32 = MAX_SNAT_TRIES + 1;

/// A per-CPU `u64` per slot.
pub const SPEC: MapSpec =
    MapSpec::of::<u32, u64>("LB_SNATTRIES_V1", "snat_tries", MapKind::PerCpuArray, SLOTS);
