//! `LB_SVCCIDRS_V1` (IPv4) and `LB_SVCCIDR6_V1` (IPv6): the cluster's ServiceCIDRs and,
//! inside them, the ClusterIPs of proxied Services, as one LPM trie per family.
//!
//! Consulted only when a packet (or a node process's `connect()`) to TCP or UDP missed
//! every frontend, so traffic to a frontend pays nothing. The longest prefix that holds the
//! destination says what to do:
//! - a ClusterIP's own entry (`/32`, `/128`) with [`CIDR_ALLOCATED`]: an allocated
//!   ClusterIP on a port or protocol no Service port defines: rejected at once (TCP RST,
//!   ICMP port unreachable);
//! - a ServiceCIDR's entry with [`CIDR_SERVICE_RANGE`]: an address no Service holds:
//!   dropped;
//! - nothing: not a service address, untouched.
//!
//! kube-proxy's nftables mode does the same with its `cluster-ips` set and its "Drop traffic
//! to unallocated ClusterIPs" rule. With no ServiceCIDR object the controller writes no
//! entry at all, so nothing changes.

use crate::family::{V4, V6};
use crate::spec::{MapKind, MapSpec};

/// ServiceCIDRs and ClusterIPs on one node, per family.
pub const MAX_SERVICE_CIDR_ENTRIES: u32 = 65_536;

/// The entry is a ServiceCIDR: an address inside it that no longer entry covers is
/// unallocated, and traffic to it is dropped.
pub const CIDR_SERVICE_RANGE: u32 = 1;
/// The entry is an allocated ClusterIP: traffic to a port or protocol none of its Service's
/// ports defines is rejected.
pub const CIDR_ALLOCATED: u32 = 2;

/// The whole key: the prefix length in bits and the address (network order, host bits
/// zero), the kernel's `bpf_lpm_trie_key` layout.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CidrKeyOf<A: Copy> {
    pub prefix_len: u32,
    pub addr: A,
}
pub type CidrKey = CidrKeyOf<V4>;
pub type CidrKey6 = CidrKeyOf<V6>;
const _: () = assert!(core::mem::size_of::<CidrKey>() == 8);
const _: () = assert!(core::mem::size_of::<CidrKey6>() == 20);

/// The value: [`CIDR_SERVICE_RANGE`] or [`CIDR_ALLOCATED`].
pub type CidrValue = u32;

pub const SPEC: MapSpec = MapSpec::of::<CidrKey, CidrValue>(
    "LB_SVCCIDRS_V1",
    "service_cidrs",
    MapKind::LpmTrie,
    MAX_SERVICE_CIDR_ENTRIES,
)
// The kernel refuses an LPM trie without it.
.no_prealloc();

pub const SPEC6: MapSpec = MapSpec::of::<CidrKey6, CidrValue>(
    "LB_SVCCIDR6_V1",
    "service_cidrs6",
    MapKind::LpmTrie,
    MAX_SERVICE_CIDR_ENTRIES,
)
.no_prealloc();
