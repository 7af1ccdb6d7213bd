//! Types shared by the eBPF datapath and the userspace controller.
//!
//! One module per pinned map ([`services`], [`slots`], [`backends`], [`members`], [`flows`],
//! [`drops`], [`dp_events`], [`labels`], [`affinity`], [`config`], [`pod_ifs`], [`delivery`], [`frags`],
//! [`src_check`], [`pod_addrs`], and the north-south maps), each with its key and value types and one `SPEC` ([`MapSpec`]: name,
//! kind, sizes, capacity). [`MAPS`] lists every spec: the datapath declares its maps from
//! them and userspace pins and checks them from the same table. The types are re-exported
//! here.
//!
//! Every type here is `#[repr(C)]`, holds only fixed-width integers and byte arrays, and has
//! explicit padding, so both sides (and `bpftool map dump`, through BTF) agree on the layout.
//! Addresses and ports are kept in network byte order: addresses as `[u8; 4]`, ports in
//! fields ending in `_be`. Userspace converts once; the datapath never converts.
//!
//! Map layouts are versioned in their names (`LB_SERVICES_V2`, `LB_FLOWS_V2`, ...). A layout
//! change adds a map of the next version beside the old one, so a restarted controller never
//! reads a pinned map of the wrong shape; the old one is then migrated ([`MIGRATED`]) or
//! removed ([`RETIRED`]).
#![cfg_attr(not(test), no_std)]

/// Declares a `#[repr(u32)]` enum of per-CPU counter indices with `COUNT`, `SLOTS` (the
/// counter map's room, so values can be added without a new layout), `ALL` and `label()`
/// (the name in metrics and `lbproxy inspect`).
macro_rules! counter_enum {
    (
        $(#[$doc:meta])*
        pub enum $name:ident, slots $slots:literal {
            $($(#[$vdoc:meta])* $variant:ident = $value:literal => $label:literal,)*
        }
    ) => {
        $(#[$doc])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vdoc])* $variant = $value,)*
        }

        impl $name {
            /// How many values exist now.
            pub const COUNT: u32 = [$($name::$variant),*].len() as u32;
            /// Room in the counter map.
            pub const SLOTS: u32 = $slots;
            pub const ALL: [$name; Self::COUNT as usize] = [$($name::$variant),*];

            /// The label used in metrics and `lbproxy inspect`.
            pub const fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)*
                }
            }
        }

        const _: () = assert!($name::COUNT <= $name::SLOTS);
    };
}

/// Declares a `#[repr(u8)]` (or other integer) enum of the values a map field may hold, with
/// the one conversion each way: `From<E> for u8` (what is written) and `TryFrom<u8>` (what
/// is read, failing with the unknown value). Map values keep the plain integer (no enum
/// inside a map value: a wrong byte would be undefined behaviour); code on both sides
/// converts at the edge. `ALL` lists the variants, so a test can check both ways round-trip.
macro_rules! wire_enum {
    (
        $(#[$doc:meta])*
        pub enum $name:ident: $int:ty {
            $($(#[$vdoc:meta])* $variant:ident = $value:literal,)*
        }
    ) => {
        $(#[$doc])*
        #[repr($int)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant = $value,)*
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),*];
        }

        impl From<$name> for $int {
            #[inline(always)]
            fn from(v: $name) -> $int {
                v as $int
            }
        }

        impl TryFrom<$int> for $name {
            /// The value no variant has.
            type Error = $int;
            #[inline(always)]
            fn try_from(n: $int) -> Result<Self, $int> {
                match n {
                    $($value => Ok($name::$variant),)*
                    other => Err(other),
                }
            }
        }
    };
}

/// Declares a bit set over a map field's integer: a `Copy` newtype with one associated
/// constant per bit, `bits()`/`from_bits_retain()` (the one conversion each way), `contains`,
/// `|` and `|=`. Unknown bits are kept, so a newer writer's bits survive an older reader.
macro_rules! wire_flags {
    (
        $(#[$doc:meta])*
        pub struct $name:ident: $int:ty {
            $($(#[$vdoc:meta])* const $flag:ident = $value:expr;)*
        }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name($int);

        impl $name {
            $($(#[$vdoc])* pub const $flag: $name = $name($value);)*
            /// No bit set.
            pub const EMPTY: $name = $name(0);
            /// Every named bit, with its name, for display.
            pub const NAMED: &'static [(&'static str, $name)] = &[$((stringify!($flag), $name::$flag)),*];

            /// The integer a map holds.
            #[inline(always)]
            pub const fn bits(self) -> $int {
                self.0
            }
            /// The set a map's integer stands for, unknown bits included.
            #[inline(always)]
            pub const fn from_bits_retain(bits: $int) -> Self {
                $name(bits)
            }
            /// Whether every bit of `other` is set.
            #[inline(always)]
            pub const fn contains(self, other: $name) -> bool {
                self.0 & other.0 == other.0
            }
            #[inline(always)]
            pub const fn union(self, other: $name) -> $name {
                $name(self.0 | other.0)
            }
            #[inline(always)]
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }
        }

        impl core::ops::BitOr for $name {
            type Output = $name;
            #[inline(always)]
            fn bitor(self, o: $name) -> $name {
                self.union(o)
            }
        }

        impl core::ops::BitOrAssign for $name {
            #[inline(always)]
            fn bitor_assign(&mut self, o: $name) {
                self.0 |= o.0;
            }
        }

        impl From<$name> for $int {
            #[inline(always)]
            fn from(f: $name) -> $int {
                f.0
            }
        }

        impl From<$int> for $name {
            #[inline(always)]
            fn from(bits: $int) -> $name {
                $name(bits)
            }
        }
    };
}

/// `unsafe impl aya::Pod` for map types, with the userspace feature only.
macro_rules! pod {
    ($($t:ty),* $(,)?) => {
        // SAFETY: each type is repr(C), Copy, made only of integers and byte arrays, and has
        // no implicit padding (its size is asserted beside it).
        $(
            #[cfg(feature = "user")]
            unsafe impl aya::Pod for $t {}
        )*
    };
}

pub mod spec;

pub mod affinity;
pub mod backends;
pub mod config;
pub mod delivery;
pub mod dp_events;
pub mod drops;
pub mod family;
pub mod flows;
pub mod frags;
pub mod hairpin;
pub mod labels;
pub mod maglev;
pub mod members;
pub mod monitor;
pub mod node_addrs;
pub mod node_ifs;
pub mod pod_addrs;
pub mod pod_ifs;
pub mod sctp;
pub mod select;
pub mod service_cidrs;
pub mod services;
pub mod slots;
pub mod snat_tries;
pub mod sock;
pub mod src_check;
pub mod src_ranges;
pub mod svc_stats;
pub mod unserved;

pub use affinity::{AffinityKey, AffinityKey6, AffinityKeyOf, AffinityValue, MAX_AFFINITY};
pub use backends::{Backend, Backend6, BackendOf, MAX_BACKENDS};
pub use config::{
    CONFIG_F_DSR_TCP, CONFIG_F_DSR_UDP, CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_NO_SERVICE_STATS,
    CONFIG_F_SERVICE_CIDRS, CONFIG_F_STACK_BYPASS, CONFIG_F_STRAYS_TO_CONNTRACK, CONFIG_F_UNTRACK,
    CONFIG_F_UNTRACK_OWN, DatapathConfig, UNTRACK_MARK,
};
pub use delivery::Delivery;
pub use dp_events::DatapathEvent;
pub use drops::DropReason;
pub use family::Addr;
pub use flows::{
    DEFAULT_FLOW_MAP_SIZE, DEFAULT_FLOW6_MAP_SIZE, FLOW_ADOPTED_CONNTRACK, FLOW_ADOPTED_HANDOVER,
    FLOW_ADOPTED_OWN, FLOW_DIR_FORWARD, FLOW_DIR_REPLY, FLOW_DISPATCH_DSR, FLOW_DISPATCH_SNAT,
    FLOW_F_FIN, FLOW_F_RST, FLOW_STATE_CLOSING_V1, FLOW_STATE_ESTABLISHED, FLOW_STATE_NONE,
    FLOW_STATE_SYN_SENT, FlowAdopted, FlowDir, FlowFlags, FlowKey, FlowKey6, FlowKeyOf, FlowState,
    FlowValue, FlowValue6, FlowValueOf, FlowValueV1, FlowValueV2, FlowWork,
};
pub use frags::{FragKey, FragKey6, FragPorts, MAX_FRAG_DATAGRAMS};
pub use hairpin::{HAIRPIN_ADDR, HAIRPIN_ADDR6};
pub use labels::{ServiceLabel, nul_padded};
pub use maglev::{MAGLEV_CHUNK, MAX_MAGLEV_CHUNKS, MaglevChunk, MaglevConfig, MaglevKey};
pub use members::{MEMBER_DRAINING, MEMBER_SERVING, MemberKey, Membership};
pub use monitor::{
    DEFAULT_EVENTS_PER_CPU_PER_SEC, HOOK_FROM_NODE, HOOK_FROM_POD, HOOK_TO_NODE, HOOK_TO_POD, Hook,
    MonitorCtl, MonitorEvent, MonitorRate, VERDICT_DROP, VERDICT_REJECT, Verdict,
};
pub use node_addrs::{MAX_NODE_ADDRS, NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, NodeAddr};
pub use node_ifs::{
    DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, MAX_NODE_IFS, NodeIf, NodeIf6, NodeIfOf,
};
pub use pod_addrs::{MAX_POD_ADDRS, PodAddr};
pub use pod_ifs::{MAX_POD_IFS, POD_IF_BRIDGE, POD_IF_NETKIT, POD_IF_VETH, PodIf};
pub use service_cidrs::{
    CIDR_ALLOCATED, CIDR_SERVICE_RANGE, CidrKey, CidrKey6, CidrKeyOf, CidrValue,
    MAX_SERVICE_CIDR_ENTRIES,
};
pub use services::{
    MAX_SERVICES, SCOPE_DEFAULT, SCOPE_INTERNAL, SVC_F_LOCAL_ONLY, SVC_F_MAGLEV, SVC_F_SNAT,
    SVC_F_SOURCE_RANGES, SVC_F_SPLIT_SCOPE, SVC_F_TERMINATING_FALLBACK, SVC_KIND_CLUSTER_IP,
    SVC_KIND_EXTERNAL_IP, SVC_KIND_LOAD_BALANCER, SVC_KIND_NODE_PORT, Scope, ServiceKey,
    ServiceKey6, ServiceKeyOf, ServiceValue, ServiceValueV1, SvcFlags, SvcKind,
};
pub use slots::{MAX_SLOTS, SlotKey};
pub use sock::{
    SOCK_F_ALL_NETNS, SOCK_F_ENABLED, SockConfig, SockEvent, SockRevKey, SockRevKey6, SockRevValue,
    SockRevValue6,
};
pub use spec::{MapKind, MapSpec};
pub use src_check::{MAX_SRC_CHECKS, SrcCheck};
pub use src_ranges::{
    MAX_SRC_RANGES, SrcRangeData, SrcRangeData6, SrcRangeDataOf, SrcRangeKey, SrcRangeKey6,
    SrcRangeKeyOf, SrcRangeValue,
};
pub use svc_stats::{MAX_SVC_STATS, SVC_STAT_DROP, SVC_STAT_NEW_FLOW, SVC_STAT_REJECT, SvcStatKey};
pub use unserved::{FAMILY_IPV4, FAMILY_IPV6, IpFamily, UnservedKey, UnservedValue};

pod!(
    ServiceKey,
    ServiceKey6,
    Backend6,
    FlowKey6,
    FlowValue6,
    AffinityKey6,
    FragKey6,
    ServiceValue,
    ServiceValueV1,
    SlotKey,
    MemberKey,
    Backend,
    FlowKey,
    FlowValue,
    FlowValueV1,
    FlowValueV2,
    ServiceLabel,
    UnservedKey,
    UnservedValue,
    AffinityKey,
    AffinityValue,
    DatapathConfig,
    PodIf,
    FragKey,
    FragPorts,
    SrcCheck,
    PodAddr,
    NodeIf,
    NodeIf6,
    NodeAddr,
    SrcRangeData,
    SrcRangeKey,
    SrcRangeData6,
    SrcRangeKey6,
    SockConfig,
    SockRevKey,
    SockRevValue,
    SockRevKey6,
    SockRevValue6,
    MonitorCtl,
    MonitorRate,
    MonitorEvent,
    CidrKey,
    CidrKey6,
    MaglevKey,
    MaglevChunk,
    MaglevConfig,
    SvcStatKey,
);

/// Every map the controller pins, and the datapath declares.
pub const MAPS: &[MapSpec] = &[
    backends::SPEC,
    slots::SPEC,
    services::SPEC,
    flows::SPEC,
    drops::SPEC,
    labels::SPEC,
    affinity::SPEC,
    members::SPEC,
    config::SPEC,
    pod_ifs::SPEC,
    delivery::SPEC,
    unserved::SPEC,
    frags::SPEC,
    src_check::SPEC,
    node_ifs::SPEC,
    node_addrs::SPEC,
    src_ranges::SPEC,
    pod_addrs::SPEC,
    snat_tries::SPEC,
    sock::CONFIG_SPEC,
    sock::REV_SPEC,
    sock::COUNT_SPEC,
    monitor::CTL_SPEC,
    monitor::RATE_SPEC,
    monitor::EVENTS_SPEC,
    services::SPEC6,
    backends::SPEC6,
    flows::SPEC6,
    affinity::SPEC6,
    flows::SCRATCH6_SPEC,
    flows::SCRATCH_SPEC,
    frags::SPEC6,
    node_ifs::SPEC6,
    node_addrs::SPEC6,
    sock::REV6_SPEC,
    src_ranges::SPEC6,
    dp_events::SPEC,
    service_cidrs::SPEC,
    service_cidrs::SPEC6,
    maglev::SPEC,
    maglev::CONFIG_SPEC,
    svc_stats::SPEC,
];

/// Earlier layouts a controller reads once at start, copies into their successor, then
/// unpins: `LB_SERVICES_V1` into `LB_SERVICES_V2`, `LB_FLOWS_V1` and `LB_FLOWS_V2` into
/// `LB_FLOWS_V3`.
pub const MIGRATED: &[MapSpec] = &[services::SPEC_V1, flows::SPEC_V1, flows::SPEC_V2];

/// Earlier layouts a controller unpins at start without reading them: `LB_DROPS_V1` had room
/// for 6 reasons only, and counters are statistics, so nothing is migrated.
pub const RETIRED: &[&str] = &["LB_DROPS_V1"];

/// The spec named `name`, among [`MAPS`] and [`MIGRATED`].
pub fn spec_by_name(name: &str) -> Option<&'static MapSpec> {
    MAPS.iter().chain(MIGRATED).find(|s| s.name == name)
}

/// Names of the maps, as pinned under `--bpffs-dir`, from their specs ([`MAPS`]).
pub mod map_names {
    use crate::MAPS;

    pub const SERVICES: &str = crate::services::SPEC.name;
    /// The layout before session affinity; migrated into V2 at start (ids kept, so flows
    /// survive the upgrade).
    pub const SERVICES_V1: &str = crate::services::SPEC_V1.name;
    pub const SLOTS: &str = crate::slots::SPEC.name;
    pub const BACKENDS: &str = crate::backends::SPEC.name;
    pub const FLOWS: &str = crate::flows::SPEC.name;
    /// The IPv6 frontends, backends and flows: the same layouts with IPv6 addresses.
    pub const SERVICES6: &str = crate::services::SPEC6.name;
    pub const BACKENDS6: &str = crate::backends::SPEC6.name;
    pub const FLOWS6: &str = crate::flows::SPEC6.name;
    pub const AFFINITY6: &str = crate::affinity::SPEC6.name;
    /// The flow layout before tuple-clash ports; migrated into V3 at start (every live flow
    /// keeps its backend).
    pub const FLOWS_V1: &str = crate::flows::SPEC_V1.name;
    /// The flow layout before source NAT; migrated into V3 at start.
    pub const FLOWS_V2: &str = crate::flows::SPEC_V2.name;
    pub const DROPS: &str = crate::drops::SPEC.name;
    /// Per-CPU counters of the datapath's events that are not drops (`DatapathEvent`).
    pub const DP_EVENTS: &str = crate::dp_events::SPEC.name;
    /// Earlier layouts a controller removes at start ([`crate::RETIRED`]).
    pub const RETIRED: [&str; crate::RETIRED.len()] = {
        let mut out = [""; crate::RETIRED.len()];
        let mut i = 0;
        while i < out.len() {
            out[i] = crate::RETIRED[i];
            i += 1;
        }
        out
    };
    /// Service names by `svc_id`, for `lbproxy inspect`; the datapath never reads it.
    pub const LABELS: &str = crate::labels::SPEC.name;
    /// Frontends asked for but not served yet, for `lbproxy inspect`; the datapath never
    /// reads it.
    pub const UNSERVED: &str = crate::unserved::SPEC.name;
    /// Session affinity: the backend a client IP last got, per service.
    pub const AFFINITY: &str = crate::affinity::SPEC.name;
    /// Which backends are in a service's slots, keyed by (svc_id, backend_id).
    pub const MEMBERS: &str = crate::members::SPEC.name;
    /// Datapath settings the controller writes at start (`DatapathConfig`, one entry).
    pub const CONFIG: &str = crate::config::SPEC.name;
    /// Host-side pod interfaces a packet may be redirected into the peer of, by ifindex.
    pub const POD_IFS: &str = crate::pod_ifs::SPEC.name;
    /// Per-CPU counters of how translated packets were delivered (`Delivery`).
    pub const DELIVERY: &str = crate::delivery::SPEC.name;
    /// The ports of fragmented datagrams, by (source, destination, IP id, protocol).
    pub const FRAGS: &str = crate::frags::SPEC.name;
    /// The interface each pod interface's sources must route back out of, by ifindex.
    pub const SRC_CHECK: &str = crate::src_check::SPEC.name;
    /// A routed pod network's pod addresses, by address: the source check's fast path.
    pub const POD_ADDRS: &str = crate::pod_addrs::SPEC.name;
    /// The node's own interfaces for north-south traffic (SNAT address, port range).
    pub const NODE_IFS: &str = crate::node_ifs::SPEC.name;
    /// The node's addresses that serve NodePorts.
    pub const NODE_ADDRS: &str = crate::node_addrs::SPEC.name;
    /// [`NODE_IFS`] for IPv6: each node interface's IPv6 SNAT address and ports.
    pub const NODE_IFS6: &str = crate::node_ifs::SPEC6.name;
    /// [`NODE_ADDRS`] for IPv6.
    pub const NODE_ADDRS6: &str = crate::node_addrs::SPEC6.name;
    /// Each load-balancer IP's `loadBalancerSourceRanges`, by (service id, prefix).
    pub const SRC_RANGES: &str = crate::src_ranges::SPEC.name;
    /// [`SRC_RANGES`] for IPv6 load-balancer IPs.
    pub const SRC_RANGES6: &str = crate::src_ranges::SPEC6.name;
    /// The ServiceCIDRs and the ClusterIPs inside them, by prefix.
    pub const SERVICE_CIDRS: &str = crate::service_cidrs::SPEC.name;
    /// [`SERVICE_CIDRS`] for IPv6.
    pub const SERVICE_CIDRS6: &str = crate::service_cidrs::SPEC6.name;
    /// Per-CPU counts of the tries each SNAT port allocation took.
    pub const SNAT_TRIES: &str = crate::snat_tries::SPEC.name;
    /// Socket-level load balancing: its settings (`SockConfig`, one entry).
    pub const SOCK_CONFIG: &str = crate::sock::CONFIG_SPEC.name;
    /// Socket-level load balancing: each translated socket's backend and frontend.
    pub const SOCK_REV: &str = crate::sock::REV_SPEC.name;
    /// [`SOCK_REV`] for IPv6 sockets talking IPv6.
    pub const SOCK_REV6: &str = crate::sock::REV6_SPEC.name;
    /// Socket-level load balancing: per-CPU counters by `SockEvent`.
    pub const SOCK_EVENTS: &str = crate::sock::COUNT_SPEC.name;
    /// `lbproxy monitor`'s switch and rate cap (`MonitorCtl`, one entry).
    pub const MONITOR_CTL: &str = crate::monitor::CTL_SPEC.name;
    /// Per-CPU windows of the monitor's rate cap (`MonitorRate`).
    pub const MONITOR_RATE: &str = crate::monitor::RATE_SPEC.name;
    /// The ring buffer of drop and reject events (`MonitorEvent`).
    pub const EVENTS: &str = crate::monitor::EVENTS_SPEC.name;
    /// The frontends' Maglev tables, in chunks (`MaglevKey` -> `MaglevChunk`).
    pub const MAGLEV: &str = crate::maglev::SPEC.name;
    /// The Maglev tables' size (`MaglevConfig`, one entry).
    pub const MAGLEV_CONFIG: &str = crate::maglev::CONFIG_SPEC.name;
    /// Per-CPU traffic counters by service (`SvcStatKey` -> `u64`).
    pub const SVC_STATS: &str = crate::svc_stats::SPEC.name;
    /// Every map the controller pins: the names of [`MAPS`], in its order.
    pub const PINNED: [&str; MAPS.len()] = {
        let mut out = [""; MAPS.len()];
        let mut i = 0;
        while i < out.len() {
            out[i] = MAPS[i].name;
            i += 1;
        }
        out
    };
}

/// Names of the programs in the object file.
pub mod program_names {
    /// tcx ingress on the host side of a pod interface: traffic leaving the pod.
    pub const FROM_POD: &str = "lb_from_pod";
    /// tcx egress on the host side of a pod interface: traffic entering the pod.
    pub const TO_POD: &str = "lb_to_pod";
    /// tcx ingress on a node interface (an uplink): traffic from outside the node.
    pub const FROM_NODE: &str = "lb_from_node";
    /// tcx egress on a node interface: traffic leaving the node.
    pub const TO_NODE: &str = "lb_to_node";
    /// XDP on a node interface (`--xdp-acceleration`): north-south packets of established
    /// flows, translated before an skb exists; everything else passes to `lb_from_node`.
    pub const XDP: &str = "lb_xdp";
    /// cgroup `connect4`: a socket of the node connecting to a frontend.
    pub const CONNECT4: &str = "lb_connect4";
    /// cgroup `sendmsg4`: a datagram of an unconnected UDP socket of the node.
    pub const SENDMSG4: &str = "lb_sendmsg4";
    /// cgroup `recvmsg4`: a datagram received by a translated UDP socket.
    pub const RECVMSG4: &str = "lb_recvmsg4";
    /// cgroup `getpeername4`: the peer of a translated socket.
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    /// cgroup `connect6`, `sendmsg6`, `recvmsg6`, `getpeername6`: the same for a dual-stack
    /// IPv6 socket addressing an IPv4-mapped frontend (`::ffff:a.b.c.d`).
    pub const CONNECT6: &str = "lb_connect6";
    pub const SENDMSG6: &str = "lb_sendmsg6";
    pub const RECVMSG6: &str = "lb_recvmsg6";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
    /// The tcx programs, each attached to interfaces.
    pub const TC: [&str; 4] = [FROM_POD, TO_POD, FROM_NODE, TO_NODE];
    /// The cgroup programs, each attached to the `--cgroup-root` cgroup.
    pub const SOCK: [&str; 8] = [
        CONNECT4,
        SENDMSG4,
        RECVMSG4,
        GETPEERNAME4,
        CONNECT6,
        SENDMSG6,
        RECVMSG6,
        GETPEERNAME6,
    ];
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

#[cfg(test)]
mod tests;
