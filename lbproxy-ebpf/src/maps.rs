//! Every map of the datapath, declared once, from `lbproxy_common`'s specs (Katran's
//! `balancer_maps.h`, with the layouts checked at compile time).
//!
//! Each declaration takes its capacity from its spec, and asserts at compile time that its
//! identifier (which `#[btf_map]` makes the kernel map name) is the spec's name and that its
//! map type, key and value sizes are the spec's. A declaration that disagrees with
//! `lbproxy_common::MAPS` does not build, so userspace and the object always agree.

use aya_ebpf::btf_maps::{
    Array, HashMap, LpmTrie, LruHashMap, LruPerCpuHashMap, PerCpuArray, RingBuf, lpm_trie::Key,
};
use lbproxy_common::{
    AffinityKey, AffinityKey6, AffinityValue, Backend, Backend6, DatapathConfig, FlowKey, FlowKey6,
    FlowValue, FlowValue6, FlowWork, FragKey, FragKey6, FragPorts, MaglevChunk, MaglevConfig,
    MaglevKey, MemberKey, MonitorCtl, MonitorEvent, MonitorRate, NodeAddr, NodeIf, NodeIf6,
    PodAddr, PodIf, ServiceKey, ServiceKey6, ServiceLabel, ServiceValue, SlotKey, SockConfig,
    SockRevKey, SockRevKey6, SockRevValue, SockRevValue6, SrcCheck, SrcRangeData, SrcRangeData6,
    SvcStatKey, UnservedKey, UnservedValue, affinity, backends, config, delivery, drops, flows,
    frags, labels, members, monitor, node_addrs, node_ifs, pod_addrs, pod_ifs, service_cidrs,
    services, slots, snat_tries, sock,
    spec::{MapKind, MapSpec, size_u32, str_eq},
    src_check, src_ranges, unserved,
};

/// The kernel map type, key and value sizes and capacity of an aya BTF map type.
trait Layout {
    const KIND: MapKind;
    const KEY_SIZE: u32;
    const VALUE_SIZE: u32;
    const MAX_ENTRIES: usize;
    const FLAGS: usize;
}

macro_rules! layout {
    ($map:ident<K, V>, $kind:ident) => {
        impl<K, V, const M: usize, const F: usize> Layout for $map<K, V, M, F> {
            const KIND: MapKind = MapKind::$kind;
            const KEY_SIZE: u32 = size_u32::<K>();
            const VALUE_SIZE: u32 = size_u32::<V>();
            const MAX_ENTRIES: usize = M;
            const FLAGS: usize = F;
        }
    };
    ($map:ident<T>, $kind:ident) => {
        impl<T, const M: usize, const F: usize> Layout for $map<T, M, F> {
            const KIND: MapKind = MapKind::$kind;
            /// Arrays are indexed by a `u32`.
            const KEY_SIZE: u32 = size_u32::<u32>();
            const VALUE_SIZE: u32 = size_u32::<T>();
            const MAX_ENTRIES: usize = M;
            const FLAGS: usize = F;
        }
    };
}
layout!(HashMap<K, V>, Hash);
layout!(LruHashMap<K, V>, LruHash);
layout!(LruPerCpuHashMap<K, V>, LruPerCpuHash);
layout!(Array<T>, Array);
layout!(PerCpuArray<T>, PerCpuArray);

impl<T, const M: usize, const F: usize> Layout for RingBuf<T, M, F> {
    const KIND: MapKind = MapKind::RingBuf;
    /// A ring buffer has no key or value size; `M` is its size in bytes.
    const KEY_SIZE: u32 = 0;
    const VALUE_SIZE: u32 = 0;
    const MAX_ENTRIES: usize = M;
    const FLAGS: usize = F;
}

impl<K, V, const M: usize, const F: usize> Layout for LpmTrie<K, V, M, F> {
    const KIND: MapKind = MapKind::LpmTrie;
    /// The kernel's key is the prefix length and then the data.
    const KEY_SIZE: u32 = size_u32::<Key<K>>();
    const VALUE_SIZE: u32 = size_u32::<V>();
    const MAX_ENTRIES: usize = M;
    const FLAGS: usize = F;
}

/// Whether a map declared as `L` and named `name` is `spec`.
const fn matches<L: Layout>(name: &str, spec: &MapSpec) -> bool {
    str_eq(name, spec.name)
        && L::KIND as u8 == spec.kind as u8
        && L::KEY_SIZE == spec.key_size
        && L::VALUE_SIZE == spec.value_size
        && L::MAX_ENTRIES == spec.max_entries as usize
        && L::FLAGS == spec.flags as usize
}

/// `map! { NAME: Type<Args> = spec; ... }` declares each `#[btf_map]` `NAME` with its spec's
/// capacity, and fails to build unless it is exactly `spec` and the list is exactly
/// `lbproxy_common::MAPS`.
macro_rules! map {
    ($($(#[$doc:meta])* $name:ident: $map:ident<$($arg:ty),+> = $spec:path;)+) => {
        $(
            $(#[$doc])*
            #[aya_ebpf::macros::btf_map]
            pub static $name: $map<$($arg),+, { $spec.max_entries as usize }, { $spec.flags as usize }> =
                $map::new();
            const _: () = assert!(
                matches::<$map<$($arg),+, { $spec.max_entries as usize }, { $spec.flags as usize }>>(
                    stringify!($name),
                    &$spec,
                ),
                concat!(stringify!($name), " does not match ", stringify!($spec)),
            );
        )+
        const _: () = assert!(
            declares_every_spec(&[$(stringify!($name)),+]),
            "the maps declared are not lbproxy_common::MAPS",
        );
    };
}

/// Whether `declared` names each map of `lbproxy_common::MAPS` once, and nothing else.
const fn declares_every_spec(declared: &[&str]) -> bool {
    let maps = lbproxy_common::MAPS;
    if declared.len() != maps.len() {
        return false;
    }
    let mut i = 0;
    while i < maps.len() {
        let mut found = 0;
        let mut j = 0;
        while j < declared.len() {
            if str_eq(declared[j], maps[i].name) {
                found += 1;
            }
            j += 1;
        }
        if found != 1 {
            return false;
        }
        i += 1;
    }
    true
}

map! {
    /// Frontends: VIP:port/proto (and scope) to service. Read by `lb::service`.
    LB_SERVICES_V2: HashMap<ServiceKey, ServiceValue> = services::SPEC;
    /// Each service's backend ids by slot. Read by `lb::select`.
    LB_SLOTS_V1: HashMap<SlotKey, u32> = slots::SPEC;
    /// Backend addresses by id. Read by `lb::select` and `flow` (is a flow's backend live).
    LB_BACKENDS_V1: HashMap<u32, Backend> = backends::SPEC;
    /// Which backends are in a service's slots. Read by `lb::affinity`.
    LB_MEMBERS_V1: HashMap<MemberKey, u32> = members::SPEC;
    /// Session affinity: a client's last backend per service. Written by `lb::affinity`.
    LB_AFFINITY_V1: LruHashMap<AffinityKey, AffinityValue> = affinity::SPEC;
    /// The flow table, both directions. Owned by `flow`; userspace sizes it at load.
    LB_FLOWS_V3: LruHashMap<FlowKey, FlowValue> = flows::SPEC;
    /// Service names for `lbproxy inspect`. Declared so the object carries it (and its
    /// BTF); the datapath never reads it.
    LB_LABELS_V1: HashMap<u32, ServiceLabel> = labels::SPEC;
    /// Per-CPU drop (and reject) counters by `DropReason`. Written by `reason`.
    LB_DROPS_V2: PerCpuArray<u64> = drops::SPEC;
    /// Datapath settings, one entry. Read once per packet with [`config`].
    LB_CONFIG_V1: Array<DatapathConfig> = config::SPEC;
    /// Pod interfaces a packet may be redirected into. Read by `deliver`.
    LB_PODIFS_V1: HashMap<u32, PodIf> = pod_ifs::SPEC;
    /// Per-CPU delivery counters by `Delivery`. Written by `deliver`.
    LB_DELIVERY_V1: PerCpuArray<u64> = delivery::SPEC;
    /// Frontends asked for but not served yet, for `lbproxy inspect`. Declared so the
    /// object carries it (and its BTF); the datapath never reads it.
    LB_UNSERVED_V1: HashMap<UnservedKey, UnservedValue> = unserved::SPEC;
    /// The ports of fragmented datagrams, recorded from each first fragment for the later
    /// ones. Owned by `parse`.
    LB_FRAGS_V1: LruHashMap<FragKey, FragPorts> = frags::SPEC;
    /// The interface each pod interface's sources must route back out of. Read by
    /// `source`.
    LB_SRCCHECK_V1: HashMap<u32, SrcCheck> = src_check::SPEC;
    /// A routed pod network's pod addresses and their interfaces: the source check's fast
    /// path. Written by the controller from the node's routes.
    LB_PODADDRS_V1: HashMap<[u8; 4], PodAddr> = pod_addrs::SPEC;
    /// The node's own interfaces for north-south traffic: SNAT address and port range. Read
    /// by `north`.
    LB_NODEIFS_V1: HashMap<u32, NodeIf> = node_ifs::SPEC;
    /// The node's NodePort addresses. Read by `lb::service`.
    LB_NODEADDRS_V1: HashMap<[u8; 4], NodeAddr> = node_addrs::SPEC;
    /// Each load-balancer IP's source ranges. Read by `lb::service`.
    LB_SRCRANGES_V1: LpmTrie<SrcRangeData, u32> = src_ranges::SPEC;
    /// [`LB_SRCRANGES_V1`] for IPv6 load-balancer IPs. Read by `lb::service`.
    LB_SRCRANGE6_V1: LpmTrie<SrcRangeData6, u32> = src_ranges::SPEC6;
    /// Per-CPU counts of the tries each SNAT port allocation took. Written by `flow`.
    LB_SNATTRIES_V1: PerCpuArray<u64> = snat_tries::SPEC;
    /// Socket-level load balancing's settings, one entry. Read by `sock`.
    LB_SOCKCFG_V1: Array<SockConfig> = sock::CONFIG_SPEC;
    /// Each translated socket's backend and frontend. Owned by `sock`; the controller reads
    /// it to find the sockets of a backend that left.
    LB_SOCKREV_V1: LruHashMap<SockRevKey, SockRevValue> = sock::REV_SPEC;
    /// Per-CPU counters by `SockEvent`. Written by `sock`.
    LB_SOCKCNT_V1: PerCpuArray<u64> = sock::COUNT_SPEC;
    /// `lbproxy monitor`'s switch: events are sent only while one listens. Read by
    /// `monitor`, on the drop and reject paths only.
    LB_MONCTL_V1: Array<MonitorCtl> = monitor::CTL_SPEC;
    /// Per-CPU windows of the monitor's rate cap. Written by `monitor`.
    LB_MONRATE_V1: PerCpuArray<MonitorRate> = monitor::RATE_SPEC;
    /// Drop and reject events for `lbproxy monitor`. Written by `monitor`.
    LB_EVENTS_V1: RingBuf<MonitorEvent> = monitor::EVENTS_SPEC;
    /// IPv6 frontends: the same values as `LB_SERVICES_V2`. Read through `family`.
    LB_SERVICES6_V1: HashMap<ServiceKey6, ServiceValue> = services::SPEC6;
    /// IPv6 backend addresses by id (one id space with `LB_BACKENDS_V1`).
    LB_BACKENDS6_V1: HashMap<u32, Backend6> = backends::SPEC6;
    /// The IPv6 flow table. Owned by `flow`, through `family`.
    LB_FLOWS6_V1: LruHashMap<FlowKey6, FlowValue6> = flows::SPEC6;
    /// Session affinity of IPv6 clients. Written by `lb::affinity`, through `family`.
    LB_AFFINITY6_V1: LruHashMap<AffinityKey6, AffinityValue> = affinity::SPEC6;
    /// Per-CPU room for a new IPv6 flow's half while `flow` builds it. Through `family`.
    LB_SCRATCH6_V1: PerCpuArray<FlowWork<[u8; 16]>> = flows::SCRATCH6_SPEC;
    /// The same for IPv4.
    LB_SCRATCH_V1: PerCpuArray<FlowWork<[u8; 4]>> = flows::SCRATCH_SPEC;
    /// The ports of fragmented IPv6 datagrams, from each first fragment for the later ones.
    /// Owned by `parse6`.
    LB_FRAGS6_V1: LruHashMap<FragKey6, FragPorts> = frags::SPEC6;
    /// `LB_NODEIFS_V1` for IPv6: each node interface's IPv6 SNAT address. Read by `north`.
    LB_NODEIFS6_V1: HashMap<u32, NodeIf6> = node_ifs::SPEC6;
    /// `LB_NODEADDRS_V1` for IPv6. Read by `lb::service` and `north`.
    LB_NODEADDR6_V1: HashMap<[u8; 16], NodeAddr> = node_addrs::SPEC6;
    /// `LB_SOCKREV_V1` for IPv6 sockets talking IPv6. Owned by `sock`.
    LB_SOCKREV6_V1: LruHashMap<SockRevKey6, SockRevValue6> = sock::REV6_SPEC;
    /// Per-CPU counters of events that are not drops, by `DatapathEvent`. Written by
    /// `reason`.
    LB_DPEVENTS_V1: PerCpuArray<u64> = lbproxy_common::dp_events::SPEC;
    /// The ServiceCIDRs and the ClusterIPs inside them (`CIDR_*`). Read by `lb::cidr`, only
    /// for a packet or socket that missed every frontend.
    LB_SVCCIDRS_V1: LpmTrie<[u8; 4], u32> = service_cidrs::SPEC;
    /// [`LB_SVCCIDRS_V1`] for IPv6.
    LB_SVCCIDR6_V1: LpmTrie<[u8; 16], u32> = service_cidrs::SPEC6;
    /// The Maglev tables of the frontends flagged `SVC_F_MAGLEV`, in chunks. Read by
    /// `lb::select`, once per new flow of such a frontend.
    LB_MAGLEV_V1: HashMap<MaglevKey, MaglevChunk> = lbproxy_common::maglev::SPEC;
    /// The Maglev tables' size, one entry. Read by `lb::select` with [`LB_MAGLEV_V1`].
    LB_MAGCFG_V1: Array<MaglevConfig> = lbproxy_common::maglev::CONFIG_SPEC;
    /// Per-CPU traffic counters by service: new flows, rejects and drops. Written by
    /// `svc_stats`, never for a packet of an established flow.
    LB_SVCSTATS_V1: LruPerCpuHashMap<SvcStatKey, u64> = lbproxy_common::svc_stats::SPEC;
}

/// The controller's settings (`LB_CONFIG_V1`, entry 0): the stack bypass flag (for
/// `deliver`) and the flow-hash seed (for `lb::select`). Read once per packet and passed to
/// the stages that use it. Entry 0 of an array always exists; were it missing, the defaults
/// (all zeros: no bypass, seed 0) apply.
#[inline(always)]
pub fn config() -> DatapathConfig {
    LB_CONFIG_V1.get(0).copied().unwrap_or_default()
}

/// This CPU's [`crate::stage::StagedPacket`] of an IPv6 packet: a hook's stages, BPF
/// functions of their own, hand it on (`family::Family::staged`; IPv4's stages are inlined
/// and keep it on the stack). The datapath's own scratch: not pinned, not in
/// `lbproxy_common::MAPS`, created afresh with each load.
#[aya_ebpf::macros::btf_map]
pub static LB_PACKET6: PerCpuArray<crate::stage::StagedPacket<[u8; 16]>, 1, 0> = PerCpuArray::new();
