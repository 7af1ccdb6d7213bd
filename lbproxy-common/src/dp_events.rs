//! `LB_DPEVENTS_V1`: per-CPU counters of what the datapath did that is worth counting but
//! is not a drop, indexed by [`DatapathEvent`].
//!
//! These events used to be counted only as "not a drop" [`DropReason`]s in `LB_DROPS_V2`.
//! For one release they are counted in both maps (the datapath's `count` adds the event
//! wherever [`DropReason::event`] names one), so `lbproxy_datapath_drops_total{reason}`
//! keeps its series while dashboards move to `lbproxy_datapath_events_total{event}`. The
//! release after drops the six reasons from `LB_DROPS_V2`; their values are never reused.

use crate::DropReason;
use crate::spec::{MapKind, MapSpec};

counter_enum! {
    /// A datapath event that is not a drop: the index into `LB_DPEVENTS_V1` and the `event`
    /// label of `lbproxy_datapath_events_total`. Each label is the one the event had as a
    /// drop reason.
    pub enum DatapathEvent, slots 16 {
        /// A TCP segment other than a SYN reached a service with no flow entry, which is
        /// what a live flow evicted from a full flow table looks like. It is sent to a newly
        /// selected backend.
        MidstreamWithoutFlow = 0 => "tcp_midstream_without_flow",
        /// One half of a flow was missing (evicted alone by the LRU) and was recreated from
        /// the other, or a flow whose reply tuple was taken started over.
        FlowHalfRecreated = 1 => "flow_half_recreated",
        /// A new flow's tuple towards its backend was held by a live flow through another
        /// VIP (same client port), so it got another source port.
        TupleClashPortRewritten = 2 => "tuple_clash_port_rewritten",
        /// The reply half of a finished VIP flow was removed, because a direct connection
        /// (or a new flow) now uses its tuple.
        StaleReplyRemoved = 3 => "stale_reply_removed",
        /// An IPv4 or IPv6 fragment after the first (no L4 header) whose first fragment was
        /// not seen (lost, reordered, or sent before lbproxy ran), so its ports are unknown.
        /// It passes untouched.
        FragmentWithoutFirst = 4 => "fragment_without_first",
        /// A TCP or UDP header cut short (or a TCP data offset below 5) in a packet not
        /// addressed to a frontend. It passes untouched; the receiving stack drops it. The
        /// same packet addressed to a frontend is dropped as [`DropReason::Malformed`].
        L4HeaderBadPassed = 5 => "l4_header_bad_passed",
    }
}

impl DropReason {
    /// The event a deprecated "not a drop" reason also counts as, for the one release both
    /// are counted; `None` for a real drop. A `const fn` on a `#[repr(u32)]` enum: at a
    /// datapath call site with a constant reason it folds to a constant.
    #[inline(always)]
    pub const fn event(self) -> Option<DatapathEvent> {
        match self {
            DropReason::MidstreamWithoutFlow => Some(DatapathEvent::MidstreamWithoutFlow),
            DropReason::FlowHalfRecreated => Some(DatapathEvent::FlowHalfRecreated),
            DropReason::TupleClashPortRewritten => Some(DatapathEvent::TupleClashPortRewritten),
            DropReason::StaleReplyRemoved => Some(DatapathEvent::StaleReplyRemoved),
            DropReason::FragmentWithoutFirst => Some(DatapathEvent::FragmentWithoutFirst),
            DropReason::L4HeaderBadPassed => Some(DatapathEvent::L4HeaderBadPassed),
            _ => None,
        }
    }

    /// Whether the packet was really dropped (or answered instead): every reason but the
    /// deprecated ones that are [`DatapathEvent`]s now.
    pub const fn is_drop(self) -> bool {
        self.event().is_none()
    }
}

/// A per-CPU `u64` per [`DatapathEvent`] slot. A controller upgrading from a version
/// without it creates it empty at load: the events count from then on.
pub const SPEC: MapSpec = MapSpec::of::<u32, u64>(
    "LB_DPEVENTS_V1",
    "datapath_events",
    MapKind::PerCpuArray,
    DatapathEvent::SLOTS,
);
