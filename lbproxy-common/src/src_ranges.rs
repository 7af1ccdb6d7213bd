//! `LB_SRCRANGES_V1`: each load-balancer IP frontend's `loadBalancerSourceRanges`, as an
//! LPM trie keyed by (service id, source prefix), as Cilium's `lb4_source_range`.
//!
//! A frontend whose `ServiceValue::flags` has `SVC_F_SOURCE_RANGES` accepts a packet only if
//! the longest-prefix lookup of (its `svc_id`, the packet's source) finds an entry; the
//! prefix length of an entry is 32 (the whole service id) plus the range's own.
//!
//! `LB_SRCRANGE6_V1` is the same for IPv6 load-balancer IPs and IPv6 ranges
//! ([`SrcRangeData6`]).

use crate::family::{V4, V6};
use crate::spec::{MapKind, MapSpec};

/// Ranges on one node, over every service.
pub const MAX_SRC_RANGES: u32 = 65_536;

/// The data part of a source-range key (the kernel's `bpf_lpm_trie_key` is this after a
/// `u32` prefix length, in bits, counted from the first byte of `svc_id_be`), for either
/// family's trie: [`SrcRangeData`] in `LB_SRCRANGES_V1`, [`SrcRangeData6`] in
/// `LB_SRCRANGE6_V1`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SrcRangeDataOf<A> {
    /// The frontend's service id, big-endian so the trie's bit order covers it whole.
    pub svc_id_be: [u8; 4],
    /// The range's address (network order), host bits zero.
    pub addr: A,
}
pub type SrcRangeData = SrcRangeDataOf<V4>;
pub type SrcRangeData6 = SrcRangeDataOf<V6>;
const _: () = assert!(core::mem::size_of::<SrcRangeData>() == 8);
const _: () = assert!(core::mem::size_of::<SrcRangeData6>() == 20);

impl<A> SrcRangeDataOf<A> {
    /// The key's prefix length for a range of `prefix` bits: the whole service id first.
    pub const fn prefix_len(prefix: u8) -> u32 {
        32 + prefix as u32
    }
}

/// The whole key: the prefix length in bits (32 + the range's) and the data.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrcRangeKeyOf<A: Copy> {
    pub prefix_len: u32,
    pub data: SrcRangeDataOf<A>,
}
pub type SrcRangeKey = SrcRangeKeyOf<V4>;
pub type SrcRangeKey6 = SrcRangeKeyOf<V6>;
const _: () = assert!(core::mem::size_of::<SrcRangeKey>() == 12);
const _: () = assert!(core::mem::size_of::<SrcRangeKey6>() == 24);

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

pub const SPEC6: MapSpec = MapSpec::of::<SrcRangeKey6, SrcRangeValue>(
    "LB_SRCRANGE6_V1",
    "src_ranges6",
    MapKind::LpmTrie,
    MAX_SRC_RANGES,
)
.no_prealloc();
