//! `LB_FRAGS_V1`: the ports of IPv4 datagrams that arrive in fragments.
//!
//! Only the first fragment of a datagram carries the TCP/UDP header. The datapath records
//! that fragment's ports under the datagram's identity (source, destination, IP id,
//! protocol: RFC 791's reassembly key), so the later fragments, which carry no L4 header,
//! can be given the same flow and translated the same way (Cilium's
//! `IPV4_FRAG_DATAGRAMS_MAP`). An LRU: a datagram whose fragments are all through is
//! forgotten as newer ones arrive; nothing deletes entries.

use crate::spec::{MapKind, MapSpec};

/// Room in `LB_FRAGS_V1`: datagrams in flight at once on a node (Cilium's default too).
pub const MAX_FRAG_DATAGRAMS: u32 = 8_192;

/// Key of `LB_FRAGS_V1`: a datagram, as the IP header of each of its fragments names it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    /// The IP identification field, as read (network order).
    pub id_be: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<FragKey>() == 12);

/// Value of `LB_FRAGS_V1`: the ports the first fragment carried, as read (network order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragPorts {
    pub src_port_be: u16,
    pub dst_port_be: u16,
}
const _: () = assert!(core::mem::size_of::<FragPorts>() == 4);

/// Key of `LB_FRAGS6_V1`: an IPv6 datagram, as the fragment header of each of its fragments
/// names it (RFC 8200, 4.5: source, destination and the 32-bit identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragKey6 {
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    /// The fragment header's identification, as read (network order).
    pub id_be: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<FragKey6>() == 40);

/// The IPv6 twin of `LB_FRAGS_V1`: the ports of IPv6 datagrams that arrive in fragments.
pub const SPEC6: MapSpec = MapSpec::of::<FragKey6, FragPorts>(
    "LB_FRAGS6_V1",
    "frags6",
    MapKind::LruHash,
    MAX_FRAG_DATAGRAMS,
);

pub const SPEC: MapSpec =
    MapSpec::of::<FragKey, FragPorts>("LB_FRAGS_V1", "frags", MapKind::LruHash, MAX_FRAG_DATAGRAMS);
