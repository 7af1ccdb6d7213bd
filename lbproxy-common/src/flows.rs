//! `LB_FLOWS_V2`: the datapath's own flow table (an LRU hash), not the kernel's conntrack.
//!
//! A flow is two entries, its two halves: a forward entry keyed by the client's packet
//! (client -> VIP) and a reply entry keyed by the backend's packet (backend -> client). Each
//! half names the other (see [`FlowValue`]), so either can find and, when the LRU or the
//! collector removed it alone, recreate its partner. Both halves are expired together.
//!
//! `LB_FLOWS_V1` (32-byte values, without the client port a tuple clash rewrites, nor the
//! per-direction FIN/RST flags) is migrated into V2 at start ([`crate::MIGRATED`]).

use crate::spec::{MapKind, MapSpec};

/// The flow map's default capacity; `--flow-map-size` sets it at load time.
pub const DEFAULT_FLOW_MAP_SIZE: u32 = 262_144;

/// Flow states. UDP flows stay `NONE`. A TCP flow is `SYN_SENT` until the backend answers.
/// Closing is not a state: each half records the FIN and RST of its own direction in
/// [`FlowValue::flags`], so a half-close (one FIN) is told apart from a closed flow.
pub const FLOW_STATE_NONE: u8 = 0;
pub const FLOW_STATE_SYN_SENT: u8 = 1;
pub const FLOW_STATE_ESTABLISHED: u8 = 2;
/// `LB_FLOWS_V1` only: a FIN or RST was seen in either direction. Never written to V2; the
/// migration turns it into [`FLOW_F_FIN`] on both halves.
pub const FLOW_STATE_CLOSING_V1: u8 = 3;

/// [`FlowValue::flags`]: this half's direction sent a FIN.
pub const FLOW_F_FIN: u8 = 0x01;
/// [`FlowValue::flags`]: this half's direction sent a RST.
pub const FLOW_F_RST: u8 = 0x02;

/// Which way a flow entry translates.
pub const FLOW_DIR_FORWARD: u8 = 0;
pub const FLOW_DIR_REPLY: u8 = 1;

/// Key of `LB_FLOWS_V2` (and V1).
///
/// A forward entry is keyed by the packet as the client sent it (client -> VIP). A reply
/// entry is keyed by the packet as the backend sends it (backend -> client), with the
/// client's port as the backend sees it (rewritten when the flow's tuple clashed).
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

impl FlowKey {
    /// The key of the other half of the flow whose entry is `self` -> `v`: the reply key of a
    /// forward entry, the forward key of a reply entry.
    #[inline(always)]
    pub const fn partner(&self, v: &FlowValue) -> FlowKey {
        if self.dir == FLOW_DIR_FORWARD {
            FlowKey {
                src_addr: v.nat_addr,
                dst_addr: self.src_addr,
                src_port_be: v.nat_port_be,
                dst_port_be: v.peer_port_be,
                proto: self.proto,
                dir: FLOW_DIR_REPLY,
                _pad: [0; 2],
            }
        } else {
            FlowKey {
                src_addr: self.dst_addr,
                dst_addr: v.nat_addr,
                src_port_be: v.peer_port_be,
                dst_port_be: v.nat_port_be,
                proto: self.proto,
                dir: FLOW_DIR_FORWARD,
                _pad: [0; 2],
            }
        }
    }
}

/// Value of `LB_FLOWS_V2`.
///
/// - Forward entry: the destination becomes `nat_addr:nat_port_be` (the backend) and the
///   source port becomes `peer_port_be`: the client's own port, or another one when the
///   client's tuple towards this backend was already taken by a flow through another VIP
///   (a tuple clash, resolved as netfilter does).
/// - Reply entry: the source becomes `nat_addr:nat_port_be` (the VIP) and the destination
///   port becomes `peer_port_be` (the client's own port again).
///
/// The partner of a forward entry is the reply key (nat, client:peer_port); the partner of a
/// reply entry is the forward key (client:peer_port -> nat). Each half writes only its own
/// `flags`; `state` is written single-byte in both halves. Whole entries are only ever
/// replaced through a map update, never written in place, so no CPU reads a torn entry.
///
/// Times are `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC at tick resolution).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValue {
    pub nat_addr: [u8; 4],
    pub nat_port_be: u16,
    pub peer_port_be: u16,
    /// `FLOW_STATE_*`.
    pub state: u8,
    /// `FLOW_F_*` seen in this half's direction.
    pub flags: u8,
    pub _pad: [u8; 2],
    pub svc_id: u32,
    pub backend_id: u32,
    /// Forward half: the interface the client's packets of this flow arrive on, whose source
    /// check they passed; a packet of the flow that arrives on it again is not checked again.
    /// 0 when unknown (a forward half recreated from its reply half, or migrated from V1).
    /// Reply half: 0.
    pub ifindex: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FlowValue>() == 40);

impl FlowValue {
    /// Whether this flow is over as far as this half can tell: a RST either way, or (with
    /// the partner's flags) a FIN both ways.
    #[inline(always)]
    pub const fn closed_with(&self, partner_flags: u8) -> bool {
        (self.flags | partner_flags) & FLOW_F_RST != 0
            || (self.flags & partner_flags & FLOW_F_FIN) != 0
    }
}

/// Value of `LB_FLOWS_V1`, read once at start to migrate it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValueV1 {
    pub nat_addr: [u8; 4],
    pub nat_port_be: u16,
    pub state: u8,
    pub _pad: u8,
    pub svc_id: u32,
    pub backend_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FlowValueV1>() == 32);

/// `max_entries` is the default; the loader overrides it with `--flow-map-size`.
pub const SPEC: MapSpec = MapSpec::of::<FlowKey, FlowValue>(
    "LB_FLOWS_V2",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);

/// The layout before tuple-clash ports and per-direction flags; migrated into V2 at start.
pub const SPEC_V1: MapSpec = MapSpec::of::<FlowKey, FlowValueV1>(
    "LB_FLOWS_V1",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);
