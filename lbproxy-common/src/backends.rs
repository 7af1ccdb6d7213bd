//! `LB_BACKENDS_V1`: backend addresses, by backend id.

use crate::family::{V4, V6};
use crate::spec::{MapKind, MapSpec};

/// Room in `LB_BACKENDS_V1`.
pub const MAX_BACKENDS: u32 = 262_144;

/// Value of `LB_BACKENDS_V1` (and, with an IPv6 address, `LB_BACKENDS6_V1`), keyed by a
/// `u32` backend id. Ids are one space across both maps: an id names one backend of one
/// family, so the slots, members and flows that name it need no family of their own.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendOf<A> {
    pub addr: A,
    pub port_be: u16,
    pub proto: u8,
    pub _pad: u8,
}
/// An IPv4 backend (`LB_BACKENDS_V1`).
pub type Backend = BackendOf<V4>;
/// An IPv6 backend (`LB_BACKENDS6_V1`).
pub type Backend6 = BackendOf<V6>;
const _: () = assert!(core::mem::size_of::<Backend>() == 8);
const _: () = assert!(core::mem::size_of::<Backend6>() == 20);

pub const SPEC: MapSpec =
    MapSpec::of::<u32, Backend>("LB_BACKENDS_V1", "backends", MapKind::Hash, MAX_BACKENDS);

pub const SPEC6: MapSpec =
    MapSpec::of::<u32, Backend6>("LB_BACKENDS6_V1", "backends6", MapKind::Hash, MAX_BACKENDS);
