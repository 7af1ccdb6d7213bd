//! `LB_MEMBERS_V1`: which backends belong to a service, keyed by (svc_id, backend_id), and
//! how ([`MEMBER_SERVING`] or [`MEMBER_DRAINING`]).

use crate::slots::MAX_SLOTS;
use crate::spec::{MapKind, MapSpec};

wire_enum! {
    /// Value of `LB_MEMBERS_V1`: how a backend belongs to a service.
    pub enum Membership: u32 {
        /// The backend is in one of the service's slots, i.e. eligible for new flows. Session
        /// affinity accepts only these, so a backend that left (or turned not-ready) loses its
        /// affinity clients at once, whatever slot it had. (Maps written before `Draining`
        /// existed hold 1 for every member, which still means this.)
        Serving = 1,
        /// The backend is still listed in one of the service's EndpointSlices (terminating,
        /// not ready) but takes no new flows: it keeps the flows it has.
        Draining = 2,
    }
}

/// [`Membership::Serving`] as the map holds it.
pub const MEMBER_SERVING: u32 = Membership::Serving as u32;
/// [`Membership::Draining`] as the map holds it.
pub const MEMBER_DRAINING: u32 = Membership::Draining as u32;

/// Key of `LB_MEMBERS_V1`: backend `backend_id` is a member of service `svc_id`: serving
/// ([`MEMBER_SERVING`]) or draining ([`MEMBER_DRAINING`]). A flow is live only while its
/// backend is a member of the flow's service, whatever other service still holds the same
/// address and port: that is how a backend leaving one of two Services loses that Service's
/// flows, and only those.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub svc_id: u32,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<MemberKey>() == 8);

/// One member per endpoint listed in a slice at most; the slots hold the serving ones.
pub const SPEC: MapSpec =
    MapSpec::of::<MemberKey, u32>("LB_MEMBERS_V1", "members", MapKind::Hash, MAX_SLOTS);
