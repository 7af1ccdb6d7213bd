//! `LB_AFFINITY_V1`: session affinity, the backend a client IP last got, per service.

use crate::family::{V4, V6};
use crate::spec::{MapKind, MapSpec};

/// Room in `LB_AFFINITY_V1` (an LRU: the least recently used client is forgotten first).
pub const MAX_AFFINITY: u32 = 262_144;

/// Key of `LB_AFFINITY_V1` (and, with an IPv6 client, `LB_AFFINITY6_V1`): a client IP of a
/// service.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKeyOf<A> {
    pub svc_id: u32,
    pub client_addr: A,
}
/// An IPv4 client's key (`LB_AFFINITY_V1`).
pub type AffinityKey = AffinityKeyOf<V4>;
/// An IPv6 client's key (`LB_AFFINITY6_V1`).
pub type AffinityKey6 = AffinityKeyOf<V6>;
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 8);
const _: () = assert!(core::mem::size_of::<AffinityKey6>() == 20);

/// Value of `LB_AFFINITY_V1`: the backend the client last got, and when. Whether that
/// backend is still eligible is `LB_MEMBERS_V1`'s to say, not a slot number.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    pub last_ns: u64,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

pub const SPEC: MapSpec = MapSpec::of::<AffinityKey, AffinityValue>(
    "LB_AFFINITY_V1",
    "affinity",
    MapKind::LruHash,
    MAX_AFFINITY,
);

/// Session affinity of IPv6 clients: the same values, keyed by an IPv6 client.
pub const SPEC6: MapSpec = MapSpec::of::<AffinityKey6, AffinityValue>(
    "LB_AFFINITY6_V1",
    "affinity6",
    MapKind::LruHash,
    MAX_AFFINITY,
);
