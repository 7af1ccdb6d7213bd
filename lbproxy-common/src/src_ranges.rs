//! `LB_SRCRANGES_V1`: each load-balancer IP frontend's `loadBalancerSourceRanges`, as an
//! LPM trie keyed by (service id, source prefix), as Cilium's `lb4_source_range`.
//!
//! A frontend whose `ServiceValue::flags` has `SVC_F_SOURCE_RANGES` accepts a packet only if
//! the longest-prefix lookup of (its `svc_id`, the packet's source) finds an entry; the
//! prefix length of an entry is 32 (the whole service id) plus the range's own.
//!
//! `LB_SRCRANGE6_V1` is the same for IPv6 load-balancer IPs and IPv6 ranges
//! ([`SrcRangeData6`]).

use crate::spec::{MapKind, MapSpec};

/// Ranges on one node, over every service.
pub const MAX_SRC_RANGES: u32 = 65_536;

/// The data part of an `LB_SRCRANGES_V1` key (the kernel's `bpf_lpm_trie_key` is this after
/// a `u32` prefix length, in bits, counted from the first byte of `svc_id_be`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SrcRangeData {
    /// The frontend's service id, big-endian so the trie's bit order covers it whole.
    pub svc_id_be: [u8; 4],
    /// The range's address (network order), host bits zero.
    pub addr: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<SrcRangeData>() == 8);

/// The whole key: the prefix length in bits (32 + the range's) and the data.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRangeKey {
    pub prefix_len: u32,
    pub data: SrcRangeData,
}
const _: () = assert!(core::mem::size_of::<SrcRangeKey>() == 12);

/// The value: 1 (the kernel wants a value; only presence matters).
pub type SrcRangeValue = u32;

pub const SPEC: MapSpec = MapSpec::of::<SrcRangeKey, SrcRangeValue>(
    "LB_SRCRANGES_V1",
    "src_ranges",
    MapKind::LpmTrie,
    MAX_SRC_RANGES,
)
// The kernel refuses an LPM trie without it.
.no_prealloc();

/// [`SrcRangeData`] with an IPv6 range.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SrcRangeData6 {
    /// The frontend's service id, big-endian.
    pub svc_id_be: [u8; 4],
    /// The range's IPv6 address (network order), host bits zero.
    pub addr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<SrcRangeData6>() == 20);

/// The whole `LB_SRCRANGE6_V1` key: the prefix length in bits (32 + the range's).
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRangeKey6 {
    pub prefix_len: u32,
    pub data: SrcRangeData6,
}
const _: () = assert!(core::mem::size_of::<SrcRangeKey6>() == 24);

pub const SPEC6: MapSpec = MapSpec::of::<SrcRangeKey6, SrcRangeValue>(
    "LB_SRCRANGE6_V1",
    "src_ranges6",
    MapKind::LpmTrie,
    MAX_SRC_RANGES,
)
.no_prealloc();
