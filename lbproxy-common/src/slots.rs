//! `LB_SLOTS_V1`: each service's backends, by slot. Selection picks a slot in `0..count`.

use crate::spec::{MapKind, MapSpec};

/// Room in `LB_SLOTS_V1`, and in `LB_MEMBERS_V1` (one member per slot).
pub const MAX_SLOTS: u32 = 262_144;

/// Key of `LB_SLOTS_V1`: slot `slot` of service `svc_id`. The value is a backend id (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    pub svc_id: u32,
    pub slot: u32,
}
const _: () = assert!(core::mem::size_of::<SlotKey>() == 8);

pub const SPEC: MapSpec =
    MapSpec::of::<SlotKey, u32>("LB_SLOTS_V1", "slots", MapKind::Hash, MAX_SLOTS);
