//! `LB_SERVICES_V2`: the frontends, VIP:port/proto -> service.
//!
//! A frontend's key carries a lookup scope and its value a kind and flags, as Cilium's
//! `lb4_key.scope` (`LB_LOOKUP_SCOPE_EXT`/`_INT`) and `lb4_service.flags` (`SVC_FLAG_*`) do.
//! They reserve room for NodePort, LoadBalancer IPs and split traffic policies without a new
//! layout. All-zero scope, kind and flags is exactly what every entry held before they were
//! named, so entries written by earlier versions keep their meaning.

use crate::family::{V4, V6};
use crate::spec::{MapKind, MapSpec};

/// Room in `LB_SERVICES_V2`, and in `LB_LABELS_V1` (one label per `svc_id`).
pub const MAX_SERVICES: u32 = 65_536;

wire_enum! {
    /// `ServiceKey::scope`: which of a frontend's entries a lookup finds.
    pub enum Scope: u8 {
        /// The entry every lookup finds first. A frontend with one endpoint set for all its
        /// clients has only this entry. Cilium's `LB_LOOKUP_SCOPE_EXT`.
        Default = 0,
        /// A frontend's second entry, for traffic from inside the cluster when it uses another
        /// endpoint set than external traffic (e.g. `externalTrafficPolicy: Local` with
        /// `internalTrafficPolicy: Cluster`). Looked up only when the default entry has
        /// [`SvcFlags::SPLIT_SCOPE`] and the packet comes from one of this node's pods
        /// (`lb_from_pod`). Cilium's `LB_LOOKUP_SCOPE_INT`.
        Internal = 1,
    }
}

/// [`Scope::Default`] as the key holds it.
pub const SCOPE_DEFAULT: u8 = Scope::Default as u8;
/// [`Scope::Internal`] as the key holds it.
pub const SCOPE_INTERNAL: u8 = Scope::Internal as u8;

wire_enum! {
    /// `ServiceValue::kind` (and `UnservedKey::kind`): how the frontend is reached. Reserved
    /// for metrics and inspection; the datapath does not read it yet. 0 is what every entry
    /// held before kinds were named.
    pub enum SvcKind: u8 {
        ClusterIp = 0,
        NodePort = 1,
        ExternalIp = 2,
        LoadBalancer = 3,
    }
}

pub const SVC_KIND_CLUSTER_IP: u8 = SvcKind::ClusterIp as u8;
pub const SVC_KIND_NODE_PORT: u8 = SvcKind::NodePort as u8;
pub const SVC_KIND_EXTERNAL_IP: u8 = SvcKind::ExternalIp as u8;
pub const SVC_KIND_LOAD_BALANCER: u8 = SvcKind::LoadBalancer as u8;

wire_flags! {
    /// `ServiceValue::flags`. Empty means a plain frontend.
    pub struct SvcFlags: u16 {
        /// Look the frontend up again with [`Scope::Internal`] when the packet comes from one
        /// of this node's pods: this entry's endpoints are for external clients
        /// (`externalTrafficPolicy: Local`).
        const SPLIT_SCOPE = 1 << 0;
        /// Only node-local backends are in this entry's slots (`externalTrafficPolicy:
        /// Local`) and other nodes have endpoints: with none here (count 0), traffic is
        /// dropped (`no_local_endpoint`), as kube-proxy does, not rejected: the client's load
        /// balancer is expected to steer it to a node that has some (the health check says
        /// which).
        const LOCAL_ONLY = 1 << 1;
        /// SNAT the client to the node's address before forwarding (traffic that arrives from
        /// outside the node and leaves to a remote backend, so replies come back through this
        /// node).
        const SNAT = 1 << 2;
        /// Only sources in this frontend's `loadBalancerSourceRanges` (`LB_SRCRANGES_V1`,
        /// keyed by its `svc_id`) may use it; others are dropped (`source_range_denied`).
        const SOURCE_RANGES = 1 << 3;
        /// Not read by the datapath: this frontend's slots hold endpoints that are serving but
        /// terminating, because none is ready (KEP-1669's fallback), for `lbproxy inspect`.
        const TERMINATING_FALLBACK = 1 << 4;
        /// Not read by the datapath, for `lbproxy inspect`: the slots hold the endpoints
        /// hinted for this node (`PreferSameNode`).
        const TOPOLOGY_NODE = 1 << 5;
        /// Not read by the datapath: the slots hold the endpoints hinted for this node's zone
        /// (`PreferSameZone`).
        const TOPOLOGY_ZONE = 1 << 6;
        /// Not read by the datapath: the endpoints have hints, not used because a ready
        /// endpoint has no zone hint.
        const HINTS_INCOMPLETE = 1 << 7;
        /// Not read by the datapath: hints not used, every endpoint has a node hint and none
        /// names this node.
        const HINTS_NOT_FOR_NODE = 1 << 8;
        /// Not read by the datapath: hints not used, none names this node's zone.
        const HINTS_NOT_FOR_ZONE = 1 << 9;
        /// Not read by the datapath: zone hints not used, this node has no zone label.
        const HINTS_NO_ZONE_LABEL = 1 << 10;
        /// Not read by the datapath: hints not used, the traffic policy is `Local`.
        const HINTS_LOCAL_POLICY = 1 << 11;
        /// New flows take entry `hash % m` of this frontend's Maglev table
        /// (`LB_MAGLEV_V1`, keyed by its `svc_id`) instead of the jump hash over its slots
        /// (`--lb-algorithm maglev`).
        const MAGLEV = 1 << 12;
    }
}

/// The bits of [`SvcFlags`] as the datapath tests them.
pub const SVC_F_SPLIT_SCOPE: u16 = SvcFlags::SPLIT_SCOPE.bits();
pub const SVC_F_LOCAL_ONLY: u16 = SvcFlags::LOCAL_ONLY.bits();
pub const SVC_F_SNAT: u16 = SvcFlags::SNAT.bits();
pub const SVC_F_SOURCE_RANGES: u16 = SvcFlags::SOURCE_RANGES.bits();
pub const SVC_F_MAGLEV: u16 = SvcFlags::MAGLEV.bits();
pub const SVC_F_TERMINATING_FALLBACK: u16 = SvcFlags::TERMINATING_FALLBACK.bits();

/// Key of `LB_SERVICES_V2` (and of the retired `LB_SERVICES_V1`): one frontend, a
/// VIP:port/proto, in one lookup scope.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKeyOf<A> {
    pub addr: A,
    pub port_be: u16,
    pub proto: u8,
    /// A [`Scope`]: [`Scope::Default`], or [`Scope::Internal`] for the pods' entry of a split
    /// frontend. (This byte was padding, always 0.)
    pub scope: u8,
}
/// An IPv4 frontend (`LB_SERVICES_V2`).
pub type ServiceKey = ServiceKeyOf<V4>;
/// An IPv6 frontend (`LB_SERVICES6_V1`); its value is the same [`ServiceValue`], its
/// `svc_id` from the same id space, so slots, members, labels and flows name services alike
/// in both families.
pub type ServiceKey6 = ServiceKeyOf<V6>;
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 8);
const _: () = assert!(core::mem::size_of::<ServiceKey6>() == 20);

/// Value of `LB_SERVICES_V2`.
///
/// `svc_id` names the frontend in `LB_SLOTS_V1` and in flow entries. `count` is how many
/// slots `0..count` hold a backend for new flows; 0 means the service has no usable endpoint.
/// `affinity_timeout_s` is `sessionAffinity: ClientIP`'s timeout, 0 for no affinity.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceValue {
    pub svc_id: u32,
    pub count: u32,
    pub affinity_timeout_s: u32,
    /// [`SvcFlags`] bits. (These four bytes were one reserved `u32`, always 0.)
    pub flags: u16,
    /// A [`SvcKind`].
    pub kind: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);

/// Value of the retired `LB_SERVICES_V1`, read once to migrate.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceValueV1 {
    pub svc_id: u32,
    pub count: u32,
}
const _: () = assert!(core::mem::size_of::<ServiceValueV1>() == 8);

pub const SPEC: MapSpec = MapSpec::of::<ServiceKey, ServiceValue>(
    "LB_SERVICES_V2",
    "services",
    MapKind::Hash,
    MAX_SERVICES,
);

/// The IPv6 frontends. A NodePort's entry has the unspecified address `::`.
pub const SPEC6: MapSpec = MapSpec::of::<ServiceKey6, ServiceValue>(
    "LB_SERVICES6_V1",
    "services6",
    MapKind::Hash,
    MAX_SERVICES,
);

/// The layout before session affinity. A controller migrates a pinned V1 into V2 at start
/// (ids kept, so flows survive the upgrade) and removes it; nothing declares it any more.
pub const SPEC_V1: MapSpec = MapSpec::of::<ServiceKey, ServiceValueV1>(
    "LB_SERVICES_V1",
    "services",
    MapKind::Hash,
    MAX_SERVICES,
);
