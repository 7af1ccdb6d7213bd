//! `LB_MEMBERS_V1`: which backends are in a service's slots, keyed by (svc_id, backend_id).

use crate::slots::MAX_SLOTS;
use crate::spec::{MapKind, MapSpec};

/// Key of `LB_MEMBERS_V1`: backend `backend_id` is in one of service `svc_id`'s slots, i.e.
/// eligible for new flows. The value is unused (1). Session affinity checks it, so a backend
/// that left (or turned not-ready) loses its clients at once, whatever slot it had.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub svc_id: u32,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<MemberKey>() == 8);

/// One member per slot at most.
pub const SPEC: MapSpec =
    MapSpec::of::<MemberKey, u32>("LB_MEMBERS_V1", "members", MapKind::Hash, MAX_SLOTS);
