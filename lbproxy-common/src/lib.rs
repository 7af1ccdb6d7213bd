//! Types shared by the eBPF datapath and the userspace controller.
//!
//! Every type here is `#[repr(C)]`, holds only fixed-width integers and byte arrays, and has
//! explicit padding, so both sides (and `bpftool map dump`, through BTF) agree on the layout.
//! Addresses and ports are kept in network byte order: addresses as `[u8; 4]`, ports in
//! fields ending in `_be`. Userspace converts once; the datapath never converts.
//!
//! Map layouts are versioned in their names (`..._V1`). A layout change adds a `_V2` map beside
//! the old one, so a restarted controller never reads a pinned map of the wrong shape.
#![no_std]

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

/// Names of the maps, as pinned under `--bpffs-dir`. Kernel map names are cut at 15 bytes,
/// so keep these short.
pub mod map_names {
    pub const SERVICES: &str = "LB_SERVICES_V2";
    /// The layout before session affinity; migrated into V2 at start (ids kept, so flows
    /// survive the upgrade).
    pub const SERVICES_V1: &str = "LB_SERVICES_V1";
    pub const SLOTS: &str = "LB_SLOTS_V1";
    pub const BACKENDS: &str = "LB_BACKENDS_V1";
    pub const FLOWS: &str = "LB_FLOWS_V1";
    pub const DROPS: &str = "LB_DROPS_V2";
    /// Earlier layouts a controller removes at start (V1 had room for 6 reasons only; the
    /// counters are statistics, so nothing is migrated).
    pub const RETIRED: [&str; 1] = ["LB_DROPS_V1"];
    /// Service names by `svc_id`, for `lbproxy inspect`; the datapath never reads it.
    pub const LABELS: &str = "LB_LABELS_V1";
    /// Session affinity: the backend a client IP last got, per service.
    pub const AFFINITY: &str = "LB_AFFINITY_V1";
    /// Which backends are in a service's slots, keyed by (svc_id, backend_id).
    pub const MEMBERS: &str = "LB_MEMBERS_V1";
    /// Datapath settings the controller writes at start (`DatapathConfig`, one entry).
    pub const CONFIG: &str = "LB_CONFIG_V1";
    /// Host-side pod interfaces a packet may be redirected into the peer of, by ifindex.
    pub const POD_IFS: &str = "LB_PODIFS_V1";
    /// Per-CPU counters of how translated packets were delivered (`Delivery`).
    pub const DELIVERY: &str = "LB_DELIVERY_V1";
    /// Every map the controller pins.
    pub const PINNED: [&str; 11] = [
        BACKENDS, SLOTS, SERVICES, FLOWS, DROPS, LABELS, AFFINITY, MEMBERS, CONFIG, POD_IFS,
        DELIVERY,
    ];
}

/// Names of the TC programs in the object file.
pub mod program_names {
    /// tcx ingress on the host side of a pod interface: traffic leaving the pod.
    pub const FROM_POD: &str = "lb_from_pod";
    /// tcx egress on the host side of a pod interface: traffic entering the pod.
    pub const TO_POD: &str = "lb_to_pod";
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Default capacities. The flow map's is set at load time by `--flow-map-size`.
pub const MAX_SERVICES: u32 = 65_536;
pub const MAX_BACKENDS: u32 = 262_144;
pub const MAX_SLOTS: u32 = 262_144;
pub const DEFAULT_FLOW_MAP_SIZE: u32 = 262_144;
pub const MAX_AFFINITY: u32 = 262_144;
/// Host-side pod interfaces on one node that can take redirected packets.
pub const MAX_POD_IFS: u32 = 4_096;

/// `DatapathConfig::flags`: redirect translated packets whose next hop is a local pod's
/// interface straight into that pod, skipping the node's routing and netfilter.
pub const CONFIG_F_STACK_BYPASS: u32 = 1;

/// The single value of `LB_CONFIG_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// `CONFIG_F_*` bits.
    pub flags: u32,
    pub _reserved: [u32; 3],
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 16);

/// `PodIf::kind`: the interface is a veth whose peer lives in another network namespace,
/// so `bpf_redirect_peer` can hand it a packet.
pub const POD_IF_VETH: u32 = 1;
/// The same for a netkit device.
pub const POD_IF_NETKIT: u32 = 2;

/// Value of `LB_PODIFS_V1`, keyed by the host-side ifindex (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodIf {
    /// `POD_IF_*`.
    pub kind: u32,
}
const _: () = assert!(core::mem::size_of::<PodIf>() == 4);

counter_enum! {
    /// How a translated packet left the datapath: the index into `LB_DELIVERY_V1`. Redirects
    /// skip the node's stack; every other value names why a packet went through it instead.
    pub enum Delivery, slots 16 {
        /// A client's packet, translated, redirected into the backend's pod.
        RedirectToBackend = 0 => "redirect_to_backend",
        /// A backend's reply, translated, redirected into the client's pod.
        RedirectToClient = 1 => "redirect_to_client",
        /// The route's next hop is not a pod interface lbproxy manages (a bridge, another
        /// node, the node itself).
        StackNotPodInterface = 2 => "stack_not_pod_interface",
        /// The node has no neighbour entry for the destination yet; the stack resolves it.
        StackNoNeighbour = 3 => "stack_no_neighbour",
        /// The route lookup gave another answer (no route, forwarding disabled, MTU).
        StackNoRoute = 4 => "stack_no_route",
        /// The TTL would expire at this hop; the stack answers with ICMP.
        StackTtl = 5 => "stack_ttl",
        /// The destination pod is the sender itself (hairpin).
        StackHairpin = 6 => "stack_hairpin",
    }
}

/// Key of `LB_SERVICES_V1`: one frontend, a VIP:port/proto.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u8; 4],
    pub port_be: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 8);

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
    pub _reserved: u32,
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

/// Key of `LB_AFFINITY_V1`: a client IP of a service.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    pub svc_id: u32,
    pub client_addr: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 8);

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

/// Key of `LB_SLOTS_V1`: slot `slot` of service `svc_id`. The value is a backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    pub svc_id: u32,
    pub slot: u32,
}
const _: () = assert!(core::mem::size_of::<SlotKey>() == 8);

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

/// Value of `LB_LABELS_V1`, keyed by `svc_id`: `namespace/name:port-name`, NUL-padded.
/// Only userspace reads it; it lets `lbproxy inspect` name services without the controller.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLabel {
    pub name: [u8; 128],
}
const _: () = assert!(core::mem::size_of::<ServiceLabel>() == 128);

/// Flow states. UDP flows stay `NONE`. A TCP flow is `SYN_SENT` until the backend answers.
pub const FLOW_STATE_NONE: u8 = 0;
pub const FLOW_STATE_SYN_SENT: u8 = 1;
pub const FLOW_STATE_ESTABLISHED: u8 = 2;
/// A FIN or RST was seen in either direction.
pub const FLOW_STATE_CLOSING: u8 = 3;

/// Which way a flow entry translates.
pub const FLOW_DIR_FORWARD: u8 = 0;
pub const FLOW_DIR_REPLY: u8 = 1;

/// Key of `LB_FLOWS_V1`, the datapath's own flow table (an LRU hash).
///
/// A forward entry is keyed by the packet as the client sent it (client -> VIP). A reply
/// entry is keyed by the packet as the backend sends it (backend -> client).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<FlowKey>() == 16);

/// Value of `LB_FLOWS_V1`.
///
/// Forward entries rewrite the destination to `nat_addr:nat_port_be` (the backend); reply
/// entries rewrite the source to it (the VIP). Times are `bpf_ktime_get_coarse_ns`
/// (CLOCK_MONOTONIC at tick resolution).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowValue {
    pub nat_addr: [u8; 4],
    pub nat_port_be: u16,
    /// `FLOW_STATE_*`.
    pub state: u8,
    pub _pad: u8,
    pub svc_id: u32,
    pub backend_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}
const _: () = assert!(core::mem::size_of::<FlowValue>() == 32);

counter_enum! {
    /// Why the datapath dropped (or, for `MidstreamWithoutFlow`, handled) a packet. The values
    /// index `LB_DROPS_V2` and are the `reason` label of `lbproxy_datapath_drops_total`. They
    /// never collide with TC action codes because they only ever index the counter map.
    pub enum DropReason, slots 32 {
        /// The packet was too short for the headers its protocol fields promise.
        Malformed = 0 => "malformed",
        /// The service exists but has no usable endpoint.
        NoBackend = 1 => "no_backend",
        /// A slot pointed at a backend id that is not in `LB_BACKENDS_V1`.
        BackendMissing = 2 => "backend_missing",
        /// The flow table rejected a new entry.
        FlowInsertFailed = 3 => "flow_insert_failed",
        /// A checksum or store helper failed while translating.
        NatFailed = 4 => "nat_failed",
        /// A slot of a service with a non-zero count was missing.
        SlotMissing = 5 => "slot_missing",
        /// TCP to a service with no usable endpoint: answered with a RST.
        NoBackendTcpReset = 6 => "no_backend_tcp_reset",
        /// UDP to a service with no usable endpoint: answered with ICMP port unreachable.
        NoBackendUdpUnreachable = 7 => "no_backend_icmp_unreachable",
        /// A TCP segment of a flow whose backend left: answered with a RST, flow forgotten.
        BackendGoneReset = 8 => "backend_gone_tcp_reset",
        /// A reject could not be written (IP options, helper failure): dropped instead.
        RejectFailed = 9 => "reject_failed",
        /// Not a drop: a TCP segment other than a SYN reached a service with no flow entry,
        /// which is what a live flow evicted from a full flow table looks like. It is sent to
        /// a newly selected backend.
        MidstreamWithoutFlow = 10 => "tcp_midstream_without_flow",
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::{
        AffinityKey, AffinityValue, Backend, DatapathConfig, FlowKey, FlowValue, MemberKey, PodIf,
        ServiceKey, ServiceLabel, ServiceValue, ServiceValueV1, SlotKey,
    };
    // SAFETY: all of these are repr(C), Copy, made only of integers and byte arrays, and have
    // no implicit padding (sizes are asserted above).
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for SlotKey {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for FlowValue {}
    unsafe impl aya::Pod for ServiceLabel {}
    unsafe impl aya::Pod for ServiceValueV1 {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for MemberKey {}
    unsafe impl aya::Pod for DatapathConfig {}
    unsafe impl aya::Pod for PodIf {}
}

/// Backend selection: jump consistent hashing (Lamping and Veach, 2014) over a service's
/// slots, keyed by the flow's 5-tuple.
///
/// Chosen instead of a Maglev table because it gives the same guarantees with no table:
/// - uniform spread over the `n` slots;
/// - appending a backend (slot `n`) moves only the ~1/(n+1) of keys that now belong to it;
/// - the controller removes a backend by moving the last slot into its hole, which moves ~2/n
///   of keys (the removed backend's, and a share of the last slot's) instead of Maglev's ~1/n.
///
/// There is no per-service table to size, store or rebuild: a service costs one slot per
/// backend, and the datapath runs at most [`JUMP_MAX_STEPS`] iterations of integer arithmetic
/// per new flow.
pub mod select {
    /// Bound on the loop, for the verifier. The expected number of steps is ln(n) + 1;
    /// 64 steps reach beyond n = 10^20.
    pub const JUMP_MAX_STEPS: u32 = 64;

    /// Maps `key` to a bucket in `0..n` (`n` > 0).
    #[inline(always)]
    pub fn jump(mut key: u64, n: u32) -> u32 {
        let n = i64::from(n);
        let mut b: i64 = -1;
        let mut j: i64 = 0;
        let mut steps = 0;
        while j < n && steps < JUMP_MAX_STEPS {
            b = j;
            key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
            // (b + 1) * 2^31 / ((key >> 33) + 1), in integers.
            j = (((b as u64) + 1) << 31).wrapping_div((key >> 33) + 1) as i64;
            steps += 1;
        }
        if b < 0 { 0 } else { b as u32 }
    }

    /// A 64-bit hash of a flow's 5-tuple (addresses and ports as raw network-order bytes).
    #[inline(always)]
    pub fn flow_hash(src: [u8; 4], dst: [u8; 4], sport_be: u16, dport_be: u16, proto: u8) -> u64 {
        let a = u64::from(u32::from_ne_bytes(src)) << 32 | u64::from(u32::from_ne_bytes(dst));
        let b = u64::from(sport_be) << 32 | u64::from(dport_be) << 16 | u64::from(proto);
        fmix64(fmix64(a) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// MurmurHash3's 64-bit finalizer.
    #[inline(always)]
    fn fmix64(mut k: u64) -> u64 {
        k ^= k >> 33;
        k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
        k ^= k >> 33;
        k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        k ^ (k >> 33)
    }
}
