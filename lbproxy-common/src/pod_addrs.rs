//! `LB_PODADDRS_V1`: on a routed pod network, the addresses the node routes to each pod
//! interface (a `/32` route out of it in the main table), by address.
//!
//! The source check's fast path (`lbproxy-ebpf/src/source.rs`): a packet whose source is
//! listed here with the very interface it came in on passes with one hash lookup. Any other
//! packet (not listed, listed for another interface, a bridged pod network) gets the full
//! check, a FIB lookup, so a missing or stale entry costs time, never a wrong drop. The
//! controller keeps the map from the node's routes (re-listed on every route change and
//! every 2 s); an entry can outlive its route by that long.

use crate::spec::{MapKind, MapSpec};

/// Pod addresses on one node.
pub const MAX_POD_ADDRS: u32 = 16_384;

/// Value of `LB_PODADDRS_V1`, keyed by the address (`[u8; 4]`, network order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodAddr {
    /// The host-side ifindex of the pod interface the address is routed to.
    pub ifindex: u32,
}
const _: () = assert!(core::mem::size_of::<PodAddr>() == 4);

pub const SPEC: MapSpec =
    MapSpec::of::<[u8; 4], PodAddr>("LB_PODADDRS_V1", "pod_addrs", MapKind::Hash, MAX_POD_ADDRS);
