//! `LB_SVCSTATS_V1`: per-CPU traffic counters by Service (issue 31 §2), for
//! `lbproxy_service_new_flows_total`, `lbproxy_service_rejects_total` and
//! `lbproxy_service_drops_total`.
//!
//! Counted only where the datapath decides something for a frontend: a new flow created
//! (per packet, or a node process's socket connected), a packet to a frontend rejected or
//! dropped. A packet of an established flow is never counted here, so it pays nothing. The
//! key is the frontend's service id, what happened and, for rejects and drops, the reason: one
//! entry per (service port, event) that ever happened, created by the first. An LRU map, so a
//! full one forgets the stalest entry rather than refuse a count; the controller reads the
//! per-CPU sums every 2 s and adds what each entry gained to its counters, which therefore
//! never go back (`telemetry::datapath`). `--per-service-metrics=false` sets
//! `CONFIG_F_NO_SERVICE_STATS`, and nothing is counted.

use crate::spec::{MapKind, MapSpec};

/// A new flow for the service's frontend.
pub const SVC_STAT_NEW_FLOW: u8 = 0;
/// A packet to the frontend answered with a RST or an ICMP error; `reason` is the
/// `DropReason`.
pub const SVC_STAT_REJECT: u8 = 1;
/// A packet to the frontend dropped; `reason` is the `DropReason`.
pub const SVC_STAT_DROP: u8 = 2;

/// Key of `LB_SVCSTATS_V1`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcStatKey {
    /// The frontend's service id (`ServiceValue::svc_id`; the label map names it).
    pub svc_id: u32,
    /// `SVC_STAT_*`.
    pub kind: u8,
    /// The `DropReason` of a reject or drop; 0 for a new flow.
    pub reason: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<SvcStatKey>() == 8);

/// Room for 10,000 Service ports with six kinds of event each.
pub const MAX_SVC_STATS: u32 = 65_536;

/// A per-CPU `u64` per key.
pub const SPEC: MapSpec = MapSpec::of::<SvcStatKey, u64>(
    "LB_SVCSTATS_V1",
    "svc_stats",
    MapKind::LruPerCpuHash,
    MAX_SVC_STATS,
);
