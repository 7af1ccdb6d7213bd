//! `LB_FLOWS_V3`: the datapath's own flow table (an LRU hash), not the kernel's conntrack.
//!
//! A flow is two entries, its two halves: a forward entry keyed by the client's packet
//! (client -> VIP) and a reply entry keyed by the backend's packet (backend -> client). Each
//! half names the other (see [`FlowValue`]), so either can find and, when the LRU or the
//! collector removed it alone, recreate its partner. Both halves are expired together.
//!
//! Earlier layouts are migrated into V3 at start ([`crate::MIGRATED`]): `LB_FLOWS_V1`
//! (32-byte values, without the client port a tuple clash rewrites, nor the per-direction
//! FIN/RST flags) and `LB_FLOWS_V2` (40-byte values, without the client address a source
//! NAT rewrites).

use crate::family::{Addr, V4, V6};
use crate::spec::{MapKind, MapSpec};

/// The flow map's default capacity; `--flow-map-size` sets it at load time.
pub const DEFAULT_FLOW_MAP_SIZE: u32 = 262_144;
/// The IPv6 flow map's default capacity; `--flow6-map-size` sets it at load time. Smaller
/// than IPv4's: an LRU map takes the memory of its whole capacity when it is created (an
/// entry here is 120 bytes against 64), and most clusters carry far more IPv4 flows.
pub const DEFAULT_FLOW6_MAP_SIZE: u32 = 65_536;

wire_enum! {
    /// `FlowValue::state`. UDP flows stay `None`. A TCP flow is `SynSent` until the backend
    /// answers. Closing is not a state: each half records the FIN and RST of its own
    /// direction in [`FlowValue::flags`], so a half-close (one FIN) is told apart from a
    /// closed flow.
    pub enum FlowState: u8 {
        None = 0,
        SynSent = 1,
        Established = 2,
        /// `LB_FLOWS_V1` only: a FIN or RST was seen in either direction. Never written to
        /// V2; the migration turns it into [`FlowFlags::FIN`] on both halves.
        ClosingV1 = 3,
    }
}

pub const FLOW_STATE_NONE: u8 = FlowState::None as u8;
pub const FLOW_STATE_SYN_SENT: u8 = FlowState::SynSent as u8;
pub const FLOW_STATE_ESTABLISHED: u8 = FlowState::Established as u8;
pub const FLOW_STATE_CLOSING_V1: u8 = FlowState::ClosingV1 as u8;

wire_enum! {
    /// `FlowValue::adopted`: a flow lbproxy adopted from the kernel's conntrack (a flow that
    /// kube-proxy's rules translated before lbproxy started, `lbproxy run --takeover`), and
    /// who translates its client's packets while the conntrack entry still exists.
    pub enum FlowAdopted: u8 {
        /// lbproxy's own flow (or an adopted one whose conntrack entry is gone).
        Own = 0,
        /// netfilter's conntrack entry translates it: the client's packets pass
        /// untranslated. A flow lbproxy would not have made the same way (see
        /// docs/migration.md), or any adopted flow without `--takeover`.
        Conntrack = 1,
        /// Handed over: lbproxy translates the client's packets only when it can send them
        /// past netfilter (redirected into the backend's pod, or out of the node for a
        /// source-NATed flow); any other passes untranslated to the conntrack entry, which
        /// still exists. Its translation goes through netfilter once the controller has
        /// deleted that entry and made the flow `Own`.
        Handover = 2,
    }
}

pub const FLOW_ADOPTED_OWN: u8 = FlowAdopted::Own as u8;
pub const FLOW_ADOPTED_CONNTRACK: u8 = FlowAdopted::Conntrack as u8;
pub const FLOW_ADOPTED_HANDOVER: u8 = FlowAdopted::Handover as u8;

/// `FlowValue::dispatch`: how a north-south flow's packets reach a backend on another node.
/// Source-NATed, the replies come back through this node (0, every flow before DSR).
pub const FLOW_DISPATCH_SNAT: u8 = 0;
/// Direct server return (`--load-balancer-mode dsr|hybrid`): on the receiving node, the
/// forward half of a flow whose packets keep the client's address and carry the frontend to
/// the backend's node (an IPv4 option or IPv6 destination option, `lbproxy_common::dsr`); on
/// the backend's node, both halves of the flow it recorded from that option, whose replies
/// it sends to the client itself.
pub const FLOW_DISPATCH_DSR: u8 = 1;

wire_flags! {
    /// `FlowValue::flags`: what this half's direction sent.
    pub struct FlowFlags: u8 {
        const FIN = 0x01;
        const RST = 0x02;
    }
}

/// [`FlowFlags::FIN`] as the value holds it.
pub const FLOW_F_FIN: u8 = FlowFlags::FIN.bits();
/// [`FlowFlags::RST`] as the value holds it.
pub const FLOW_F_RST: u8 = FlowFlags::RST.bits();

wire_enum! {
    /// `FlowKey::dir`: which way a flow entry translates.
    pub enum FlowDir: u8 {
        Forward = 0,
        Reply = 1,
    }
}

pub const FLOW_DIR_FORWARD: u8 = FlowDir::Forward as u8;
pub const FLOW_DIR_REPLY: u8 = FlowDir::Reply as u8;

/// Key of `LB_FLOWS_V3` (and V2, V1) and, with IPv6 addresses, of `LB_FLOWS6_V1`.
///
/// A forward entry is keyed by the packet as the client sent it (client -> VIP). A reply
/// entry is keyed by the packet as the backend sends it (backend -> client), with the
/// client's address and port as the backend sees them (the node's address and another port
/// when the flow is source-NATed, another port when its tuple clashed).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKeyOf<A> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
/// An IPv4 flow key (`LB_FLOWS_V3`).
pub type FlowKey = FlowKeyOf<V4>;
/// An IPv6 flow key (`LB_FLOWS6_V1`).
pub type FlowKey6 = FlowKeyOf<V6>;
const _: () = assert!(core::mem::size_of::<FlowKey>() == 16);
const _: () = assert!(core::mem::size_of::<FlowKey6>() == 40);

impl<A: Addr> FlowKeyOf<A> {
    /// Whether the reply entry `r` is the partner of the forward entry `f` keyed `self`:
    /// it restores this key's frontend to this key's client, for the same service and
    /// backend. A takeover hands a flow over half by half, the forward half first, each
    /// written with the service and backend ids the adopted halves had none of: until the
    /// reply half follows, a reply half still conntrack's pairs a handed-over forward half
    /// by its tuple alone (else the flow would be balanced anew, and an established TCP
    /// connection reset by the backend it moved to).
    #[inline(always)]
    pub fn pairs(&self, f: &FlowValueOf<A>, r: &FlowValueOf<A>) -> bool {
        r.nat_addr == self.dst_addr
            && r.peer_addr == self.src_addr
            && r.nat_port_be == self.dst_port_be
            && r.peer_port_be == self.src_port_be
            && ((r.svc_id == f.svc_id && r.backend_id == f.backend_id)
                || (f.adopted == FLOW_ADOPTED_HANDOVER && r.adopted == FLOW_ADOPTED_CONNTRACK))
    }

    /// The key of the other half of the flow whose entry is `self` -> `v`: the reply key of a
    /// forward entry, the forward key of a reply entry.
    #[inline(always)]
    pub const fn partner(&self, v: &FlowValueOf<A>) -> FlowKeyOf<A> {
        if self.dir == FLOW_DIR_FORWARD {
            FlowKeyOf {
                src_addr: v.nat_addr,
                dst_addr: v.peer_addr,
                src_port_be: v.nat_port_be,
                dst_port_be: v.peer_port_be,
                proto: self.proto,
                dir: FLOW_DIR_REPLY,
                _pad: [0; 2],
            }
        } else {
            FlowKeyOf {
                src_addr: v.peer_addr,
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

/// Value of `LB_FLOWS_V3` and, with IPv6 addresses, of `LB_FLOWS6_V1`.
///
/// - Forward entry: the destination becomes `nat_addr:nat_port_be` (the backend) and the
///   source becomes `peer_addr:peer_port_be`: the client's own address and port, or
///   - another port when the client's tuple towards this backend was already taken by a
///     flow through another VIP (a tuple clash, resolved as netfilter does);
///   - the node's address and a port of the SNAT range, for traffic from outside the node
///     to a backend on another node (source NAT, so the replies come back through here).
/// - Reply entry: the source becomes `nat_addr:nat_port_be` (the VIP) and the destination
///   becomes `peer_addr:peer_port_be` (the client's own address and port again).
///
/// The partner of a forward entry is the reply key (nat -> peer); the partner of a reply
/// entry is the forward key (peer -> nat). Each half writes only its own
/// `flags`; `state` is written single-byte in both halves. Whole entries are only ever
/// replaced through a map update, never written in place, so no CPU reads a torn entry.
///
/// Times are `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC at tick resolution).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValueOf<A: Addr> {
    pub nat_addr: A,
    pub nat_port_be: u16,
    pub peer_port_be: u16,
    /// A [`FlowState`].
    pub state: u8,
    /// [`FlowFlags`] seen in this half's direction.
    pub flags: u8,
    pub _pad: [u8; 2],
    pub svc_id: u32,
    pub backend_id: u32,
    /// Forward half: the interface the client's packets of this flow arrive on, whose source
    /// check they passed; a packet of the flow that arrives on it again is not checked again.
    /// 0 when unknown (a forward half recreated from its reply half, or migrated from V1).
    /// Reply half: 0.
    pub ifindex: u32,
    /// Keeps `created_ns` aligned after an IPv6 `nat_addr` (no bytes for IPv4).
    pub _pad_a: A::Pad,
    pub created_ns: u64,
    pub last_seen_ns: u64,
    /// Forward half: the source address the backend sees (the client's own, or the node's
    /// when source-NATed). Reply half: the client's own address, restored as the
    /// destination.
    pub peer_addr: A,
    /// A [`FlowAdopted`]: whose translation this flow is. Both halves carry the same value.
    pub adopted: u8,
    /// [`FLOW_DISPATCH_SNAT`] or [`FLOW_DISPATCH_DSR`]. Both halves carry the same value.
    pub dispatch: u8,
    /// Zero; room for more without a new layout.
    pub _reserved: [u8; 2],
    /// Makes an IPv6 entry's size a multiple of 8 explicitly (no bytes for IPv4).
    pub _pad_b: A::Pad,
}
/// An IPv4 flow entry (`LB_FLOWS_V3`).
pub type FlowValue = FlowValueOf<V4>;
/// An IPv6 flow entry (`LB_FLOWS6_V1`).
pub type FlowValue6 = FlowValueOf<V6>;
const _: () = assert!(core::mem::size_of::<FlowValue>() == 48);
const _: () = assert!(core::mem::size_of::<FlowValue6>() == 80);
const _: () = assert!(core::mem::offset_of!(FlowValue6, created_ns) == 40);

impl<A: Addr> FlowValueOf<A> {
    /// Whether this flow is over as far as this half can tell: a RST either way, or (with
    /// the partner's flags) a FIN both ways.
    #[inline(always)]
    pub const fn closed_with(&self, partner_flags: u8) -> bool {
        (self.flags | partner_flags) & FLOW_F_RST != 0
            || (self.flags & partner_flags & FLOW_F_FIN) != 0
    }

    /// Whether this flow is source-NATed: the backend sees another source address than the
    /// client's (`key` is this half's key). Its packets are then redirected by the datapath,
    /// since the stack drops a packet that arrives with one of the node's own addresses as
    /// its source.
    #[inline(always)]
    pub fn snat(&self, key: &FlowKeyOf<A>) -> bool {
        if key.dir == FLOW_DIR_FORWARD {
            self.peer_addr != key.src_addr
        } else {
            self.peer_addr != key.dst_addr
        }
    }
}

/// Value of `LB_FLOWS_V2`, read once at start to migrate it: [`FlowValue`] without
/// `peer_addr` (always the client's own address then).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValueV2 {
    pub nat_addr: [u8; 4],
    pub nat_port_be: u16,
    pub peer_port_be: u16,
    pub state: u8,
    pub flags: u8,
    pub _pad: [u8; 2],
    pub svc_id: u32,
    pub backend_id: u32,
    pub ifindex: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FlowValueV2>() == 40);

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
    "LB_FLOWS_V3",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);

/// The IPv6 flow table: the same halves as `LB_FLOWS_V3`, with IPv6 addresses.
/// `max_entries` is the default; the loader overrides it with `--flow6-map-size`.
pub const SPEC6: MapSpec = MapSpec::of::<FlowKey6, FlowValue6>(
    "LB_FLOWS6_V1",
    "flows6",
    MapKind::LruHash,
    DEFAULT_FLOW6_MAP_SIZE,
);

/// The datapath's working state while it looks up and creates a flow (`flow::forward`):
/// the keys and the new value it passes to the map helpers, and the backend and peer it
/// writes into them. On the stack for IPv4; in map memory for IPv6 (`LB_SCRATCH6_V1`, one
/// per CPU), since in registers and stack slots an IPv6 path's addresses do not fit the
/// verifier's 512-byte stack. Never read by userspace.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlowWork<A: Addr> {
    pub key: FlowKeyOf<A>,
    pub rkey: FlowKeyOf<A>,
    pub old_reply: FlowKeyOf<A>,
    pub value: FlowValueOf<A>,
    pub backend: crate::BackendOf<A>,
    pub peer: A,
}

/// One entry per CPU: an IPv4 [`FlowWork`].
pub const SCRATCH_SPEC: MapSpec =
    MapSpec::of::<u32, FlowWork<V4>>("LB_SCRATCH_V1", "scratch", MapKind::PerCpuArray, 1);

/// One entry per CPU: an IPv6 [`FlowWork`].
pub const SCRATCH6_SPEC: MapSpec =
    MapSpec::of::<u32, FlowWork<V6>>("LB_SCRATCH6_V1", "scratch6", MapKind::PerCpuArray, 1);

/// The layout before source NAT (no client address in the value); migrated into V3 at start.
pub const SPEC_V2: MapSpec = MapSpec::of::<FlowKey, FlowValueV2>(
    "LB_FLOWS_V2",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);

/// The layout before tuple-clash ports and per-direction flags; migrated into V3 at start.
pub const SPEC_V1: MapSpec = MapSpec::of::<FlowKey, FlowValueV1>(
    "LB_FLOWS_V1",
    "flows",
    MapKind::LruHash,
    DEFAULT_FLOW_MAP_SIZE,
);
