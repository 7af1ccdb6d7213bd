//! What differs between IPv4 and IPv6 in the maps, behind one trait built on
//! [`Headers`], so that the stages are written once and compiled for both:
//! `flow::forward::<[u8; 16]>` is the IPv6 flow table's code, from the same source as the
//! IPv4 one.
//!
//! Each family has its own frontend, backend and flow maps (`LB_SERVICES_V2`,
//! `LB_BACKENDS_V1`, `LB_FLOWS_V3` for IPv4; `LB_SERVICES6_V1`, `LB_BACKENDS6_V1`,
//! `LB_FLOWS6_V1` for IPv6). Service and backend ids are one space across both, so the
//! slots, members and counters keyed by id are shared.

use aya_ebpf::btf_maps::lpm_trie::Key;
use lbproxy_common::{
    AffinityKeyOf, AffinityValue, BackendOf, FlowKeyOf, FlowValueOf, FlowWork,
    NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, ServiceKeyOf, ServiceValue, SrcRangeData,
    SrcRangeData6,
};

pub use crate::headers::Headers;
use crate::{
    maps::{
        LB_AFFINITY_V1, LB_AFFINITY6_V1, LB_BACKENDS_V1, LB_BACKENDS6_V1, LB_FLOWS_V3,
        LB_FLOWS6_V1, LB_NODEADDR6_V1, LB_NODEADDRS_V1, LB_NODEIFS_V1, LB_NODEIFS6_V1, LB_PACKET6,
        LB_PODADDRS_V1, LB_SCRATCH_V1, LB_SCRATCH6_V1, LB_SERVICES_V2, LB_SERVICES6_V1,
        LB_SRCRANGE6_V1, LB_SRCRANGES_V1, LB_SVCCIDR6_V1, LB_SVCCIDRS_V1,
    },
    stage::{Source, StagedPacket},
};

/// One IP family's maps (and, through [`Headers`], its header).
pub trait Family: Headers {
    /// Whether the controller listed `addr` as a routed pod address of interface `ifindex`
    /// (the source check's fast path; `LB_PODADDRS_V1`).
    fn pod_addr_on(addr: &Self, ifindex: u32) -> bool;
    /// The frontend entry under `key`, copied out.
    fn service(key: &ServiceKeyOf<Self>) -> Option<ServiceValue>;
    /// Whether `addr` is one of this node's NodePort addresses.
    fn nodeport_addr(addr: Self) -> bool;
    /// Whether `addr` is one of this node's SNAT addresses (`NODE_ADDR_F_SNAT`).
    fn snat_addr(addr: &Self) -> bool;
    /// The SNAT source of node interface `ifindex` (`LB_NODEIFS_V1`, `LB_NODEIFS6_V1`): its
    /// address and port range, if it has one of the family.
    fn node_if_source(ifindex: u32) -> Option<Source<Self>>;
    /// Whether `src` is in one of frontend `svc_id`'s `loadBalancerSourceRanges`.
    fn in_source_ranges(svc_id: u32, src: Self) -> bool;
    /// What the longest ServiceCIDR entry holding `dst` says (`LB_SVCCIDRS_V1`,
    /// `LB_SVCCIDR6_V1`): `CIDR_ALLOCATED`, `CIDR_SERVICE_RANGE`, or 0 for none.
    fn service_cidr(dst: &Self) -> u32;
    /// The backend with this id, if it is still live.
    fn backend(id: u32) -> Option<BackendOf<Self>>;
    /// The flow half under `key`.
    fn flow(key: &FlowKeyOf<Self>) -> Option<*mut FlowValueOf<Self>>;
    fn flow_insert(key: &FlowKeyOf<Self>, value: &FlowValueOf<Self>, flags: u64) -> Result<(), ()>;
    fn flow_remove(key: &FlowKeyOf<Self>);
    /// `flow`'s working state ([`FlowWork`]: the keys and the value it hands the map
    /// helpers), this CPU's entry of the family's scratch map (`LB_SCRATCH_V1`,
    /// `LB_SCRATCH6_V1`). In map memory, not on the stack: held in registers and stack
    /// slots, an IPv6 flow's addresses need more than the verifier's 512 bytes of stack
    /// (docs/design.md has the measurements). `None` only if the entry were missing (an
    /// array's entry 0 always exists). Every field is written before it is read.
    ///
    /// One program runs at a time on a CPU and `flow` takes the entry once per packet, so
    /// nothing else uses it meanwhile.
    fn work() -> Option<&'static mut FlowWork<Self>>;
    /// The session-affinity entry under `key`.
    fn affinity(key: &AffinityKeyOf<Self>) -> Option<*mut AffinityValue>;
    fn affinity_insert(key: &AffinityKeyOf<Self>, value: &AffinityValue);
    /// Whether a hook's stages run as BPF functions of their own, handing the packet on in
    /// [`Family::staged`] (IPv6), or inlined into one function, the packet on its stack
    /// (IPv4). The verifier allows 512 bytes of stack along a call chain: an IPv6 packet's
    /// stages inlined together need more, and an IPv4 packet's fit with room to spare,
    /// and inlined they save a call and a scratch lookup per stage on every packet
    /// (docs/design.md, "The hooks' stages"). `hooks::stage!` reads it.
    const STAGES_APART: bool;
    /// The packet this CPU's hook is running through its stages ([`StagedPacket`]), this
    /// CPU's entry of the family's `LB_PACKET6`, when the stages are apart
    /// ([`Family::STAGES_APART`]). One program runs at a time on a CPU and a hook takes the
    /// entry once per packet. `None` only if the entry were missing (an array's entry 0
    /// always exists), and always for a family whose stages are inlined.
    fn staged() -> Option<&'static mut StagedPacket<Self>>;
}

/// The map accessors of [`Family`], the same code over each family's maps: its frontends,
/// backends, flows, working state and affinity.
macro_rules! family_maps {
    ($services:ident, $backends:ident, $flows:ident, $scratch:ident, $affinity:ident) => {
        #[inline(always)]
        fn service(key: &ServiceKeyOf<Self>) -> Option<ServiceValue> {
            // SAFETY: copied out at once; hash map values are not freed under RCU while
            // this program runs.
            unsafe { $services.get(key) }.copied()
        }
        #[inline(always)]
        fn backend(id: u32) -> Option<BackendOf<Self>> {
            // SAFETY: as above.
            unsafe { $backends.get(id) }.copied()
        }
        #[inline(always)]
        fn flow(key: &FlowKeyOf<Self>) -> Option<*mut FlowValueOf<Self>> {
            $flows.get_ptr_mut(key)
        }
        #[inline(always)]
        fn flow_insert(
            key: &FlowKeyOf<Self>,
            value: &FlowValueOf<Self>,
            flags: u64,
        ) -> Result<(), ()> {
            $flows.insert(key, value, flags).map_err(|_| ())
        }
        #[inline(always)]
        fn flow_remove(key: &FlowKeyOf<Self>) {
            let _ = $flows.remove(key);
        }
        #[inline(always)]
        fn work() -> Option<&'static mut FlowWork<Self>> {
            let w = $scratch.get_ptr_mut(0)?;
            // SAFETY: this CPU's entry, used by one program run at a time (see the trait).
            Some(unsafe { &mut *w })
        }
        #[inline(always)]
        fn affinity(key: &AffinityKeyOf<Self>) -> Option<*mut AffinityValue> {
            $affinity.get_ptr_mut(key)
        }
        /// Failing to remember only costs affinity for the next flow, not this one.
        #[inline(always)]
        fn affinity_insert(key: &AffinityKeyOf<Self>, value: &AffinityValue) {
            let _ = $affinity.insert(key, value, 0);
        }
    };
}

impl Family for [u8; 4] {
    family_maps!(
        LB_SERVICES_V2,
        LB_BACKENDS_V1,
        LB_FLOWS_V3,
        LB_SCRATCH_V1,
        LB_AFFINITY_V1
    );
    const STAGES_APART: bool = false;
    /// Never called: IPv4's stages are inlined, the packet on `run`'s stack.
    #[inline(always)]
    fn staged() -> Option<&'static mut StagedPacket<Self>> {
        None
    }
    #[inline(always)]
    fn pod_addr_on(addr: &Self, ifindex: u32) -> bool {
        // SAFETY: a plain lookup; the value is copied out at once.
        unsafe { LB_PODADDRS_V1.get(addr) }.is_some_and(|a| a.ifindex == ifindex)
    }
    #[inline(always)]
    fn nodeport_addr(addr: Self) -> bool {
        // SAFETY: copied out at once.
        matches!(unsafe { LB_NODEADDRS_V1.get(addr) }, Some(n) if n.flags & NODE_ADDR_F_NODEPORT != 0)
    }
    #[inline(always)]
    fn snat_addr(addr: &Self) -> bool {
        // SAFETY: a plain lookup; the value is copied out at once.
        unsafe { LB_NODEADDRS_V1.get(addr) }.is_some_and(|a| a.flags & NODE_ADDR_F_SNAT != 0)
    }
    #[inline(always)]
    fn node_if_source(ifindex: u32) -> Option<Source<Self>> {
        // SAFETY: a plain lookup; the value is copied out at once.
        let nif = unsafe { LB_NODEIFS_V1.get(ifindex) }.copied()?;
        Some(Source {
            dsr: false,
            snat: true,
            addr: nif.snat_addr,
            min: nif.snat_port_min,
            max: nif.snat_port_max,
        })
    }
    #[inline(always)]
    fn in_source_ranges(svc_id: u32, src: Self) -> bool {
        in_ranges(svc_id, u32::from_ne_bytes(src)) != 0
    }
    #[inline(always)]
    fn service_cidr(dst: &Self) -> u32 {
        cidr_of(u32::from_ne_bytes(*dst))
    }
}

impl Family for [u8; 16] {
    family_maps!(
        LB_SERVICES6_V1,
        LB_BACKENDS6_V1,
        LB_FLOWS6_V1,
        LB_SCRATCH6_V1,
        LB_AFFINITY6_V1
    );
    const STAGES_APART: bool = true;
    #[inline(always)]
    fn staged() -> Option<&'static mut StagedPacket<Self>> {
        let s = LB_PACKET6.get_ptr_mut(0)?;
        // SAFETY: this CPU's entry, used by one program run at a time (see the trait).
        Some(unsafe { &mut *s })
    }
    /// IPv6 pod addresses are not listed: every new IPv6 tuple gets the FIB's answer.
    #[inline(always)]
    fn pod_addr_on(_addr: &Self, _ifindex: u32) -> bool {
        false
    }
    #[inline(always)]
    fn nodeport_addr(addr: Self) -> bool {
        // SAFETY: copied out at once.
        matches!(unsafe { LB_NODEADDR6_V1.get(addr) }, Some(n) if n.flags & NODE_ADDR_F_NODEPORT != 0)
    }
    #[inline(always)]
    fn snat_addr(addr: &Self) -> bool {
        // SAFETY: a plain lookup; the value is copied out at once.
        unsafe { LB_NODEADDR6_V1.get(addr) }.is_some_and(|a| a.flags & NODE_ADDR_F_SNAT != 0)
    }
    #[inline(always)]
    fn node_if_source(ifindex: u32) -> Option<Source<Self>> {
        // SAFETY: a plain lookup; the value is copied out at once.
        let nif = unsafe { LB_NODEIFS6_V1.get(ifindex) }.copied()?;
        Some(Source {
            dsr: false,
            snat: true,
            addr: nif.snat_addr,
            min: nif.snat_port_min,
            max: nif.snat_port_max,
        })
    }
    /// A longest-prefix lookup in `LB_SRCRANGE6_V1`, in its own BPF function.
    #[inline(always)]
    fn in_source_ranges(svc_id: u32, src: Self) -> bool {
        let w = |i: usize| u32::from_ne_bytes([src[i], src[i + 1], src[i + 2], src[i + 3]]);
        in_ranges6(svc_id, w(0), w(4), w(8), w(12)) != 0
    }
    /// A longest-prefix lookup in `LB_SVCCIDR6_V1`, in its own BPF function.
    #[inline(always)]
    fn service_cidr(dst: &Self) -> u32 {
        let w = |i: usize| u32::from_ne_bytes([dst[i], dst[i + 1], dst[i + 2], dst[i + 3]]);
        cidr_of6(w(0), w(4), w(8), w(12))
    }
}

/// 1 when `src` (network order, as read) is in one of frontend `svc_id`'s ranges. Its own
/// BPF function, so the trie lookup's key and registers stay out of the callers' frames.
#[inline(never)]
pub fn in_ranges(svc_id: u32, src: u32) -> u32 {
    let key = Key::new(
        SrcRangeData::prefix_len(32),
        SrcRangeData {
            svc_id_be: svc_id.to_be_bytes(),
            addr: src.to_ne_bytes(),
        },
    );
    u32::from(LB_SRCRANGES_V1.get(&key).is_some())
}

/// [`in_ranges`] for an IPv6 source, given as its four words (network order, as read), in
/// `LB_SRCRANGE6_V1`.
#[inline(never)]
pub fn in_ranges6(svc_id: u32, a: u32, b: u32, c: u32, d: u32) -> u32 {
    let mut addr = [0u8; 16];
    addr[0..4].copy_from_slice(&a.to_ne_bytes());
    addr[4..8].copy_from_slice(&b.to_ne_bytes());
    addr[8..12].copy_from_slice(&c.to_ne_bytes());
    addr[12..16].copy_from_slice(&d.to_ne_bytes());
    let key = Key::new(
        SrcRangeData6::prefix_len(128),
        SrcRangeData6 {
            svc_id_be: svc_id.to_be_bytes(),
            addr,
        },
    );
    u32::from(LB_SRCRANGE6_V1.get(&key).is_some())
}

/// The value of the longest `LB_SVCCIDRS_V1` entry holding `dst` (network order, as read),
/// 0 for none. Its own BPF function, as [`in_ranges`]; called only for a packet or socket
/// that missed every frontend.
#[inline(never)]
pub fn cidr_of(dst: u32) -> u32 {
    let key = Key::new(32, dst.to_ne_bytes());
    LB_SVCCIDRS_V1.get(&key).copied().unwrap_or(0)
}

/// [`cidr_of`] for an IPv6 destination, given as its four words, in `LB_SVCCIDR6_V1`.
#[inline(never)]
pub fn cidr_of6(a: u32, b: u32, c: u32, d: u32) -> u32 {
    let mut addr = [0u8; 16];
    addr[0..4].copy_from_slice(&a.to_ne_bytes());
    addr[4..8].copy_from_slice(&b.to_ne_bytes());
    addr[8..12].copy_from_slice(&c.to_ne_bytes());
    addr[12..16].copy_from_slice(&d.to_ne_bytes());
    let key = Key::new(128, addr);
    LB_SVCCIDR6_V1.get(&key).copied().unwrap_or(0)
}
