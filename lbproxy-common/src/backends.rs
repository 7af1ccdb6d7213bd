//! `LB_BACKENDS_V1`: backend addresses, by backend id.

use crate::spec::{MapKind, MapSpec};

/// Room in `LB_BACKENDS_V1`.
pub const MAX_BACKENDS: u32 = 262_144;

/// Value of `LB_BACKENDS_V1`, keyed by a `u32` backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: [u8; 4],
    pub port_be: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 8);

pub const SPEC: MapSpec =
    MapSpec::of::<u32, Backend>("LB_BACKENDS_V1", "backends", MapKind::Hash, MAX_BACKENDS);
