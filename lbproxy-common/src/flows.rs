//! `LB_FLOWS_V1`: the datapath's own flow table (an LRU hash), not the kernel's conntrack.

use crate::spec::{MapKind, MapSpec};

/// The flow map's default capacity; `--flow-map-size` sets it at load time.
pub const DEFAULT_FLOW_MAP_SIZE: u32 = 262_144;

/// Flow states. UDP flows stay `NONE`. A TCP flow is `SYN_SENT` until the backend answers.
pub const FLOW_STATE_NONE: u8 = 0;
pub const FLOW_STATE_SYN_SENT: u8 = 1;
pub const FLOW_STATE_ESTABLISHED: u8 = 2;
/// A FIN or RST was seen in either direction.
pub const FLOW_STATE_CLOSING: u8 = 3;

/// Which way a flow entry translates.
pub const FLOW_DIR_FORWARD: u8 = 0;
pub const FLOW_DIR_REPLY: u8 = 1;

/// Key of `LB_FLOWS_V1`.
///
/// A forward entry is keyed by the packet as the client sent it (client -> VIP). A reply
/// entry is keyed by the packet as the backend sends it (backend -> client).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<FlowKey>() == 16);

/// Value of `LB_FLOWS_V1`.
///
/// Forward entries rewrite the destination to `nat_addr:nat_port_be` (the backend); reply
/// entries rewrite the source to it (the VIP). Times are `bpf_ktime_get_coarse_ns`
/// (CLOCK_MONOTONIC at tick resolution).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValue {
    pub nat_addr: [u8; 4],
    pub nat_port_be: u16,
    /// `FLOW_STATE_*`.
    pub state: u8,
    pub _pad: u8,
    pub svc_id: u32,
    pub backend_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FlowValue>() == 32);

/// `max_entries` is the default; the loader overrides it with `--flow-map-size`.
pub const SPEC: MapSpec = MapSpec::of::<FlowKey, FlowValue>(
    "LB_FLOWS_V1",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);
