//! The maps of an IP family, behind one trait, so that the stages (`lb`, `flow`, `nat`) are
//! written once over the family's address type and compiled for each: `flow::forward` is
//! generic over [`Family`], and IPv4 (`[u8; 4]`) is the one family implemented so far.
//!
//! The plan for IPv6 (`docs/design.md`): its own frontend, backend, flow and affinity maps
//! with the layouts `lbproxy_common` already defines generically (`FlowKeyOf<[u8; 16]>`
//! and the others), and service and backend ids in one space across both families, so the
//! slots, members and counters keyed by id are shared. Implementing [`Family`] for
//! `[u8; 16]` is what remains of the stages; the IPv6 path's stack use is the open problem
//! (see the design notes).

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    Addr, AffinityKeyOf, AffinityValue, BackendOf, DropReason, FlowKeyOf, FlowValueOf,
    NODE_ADDR_F_NODEPORT, ServiceKeyOf, ServiceValue,
};

use crate::{
    maps::{LB_AFFINITY_V1, LB_BACKENDS_V1, LB_FLOWS_V3, LB_NODEADDRS_V1, LB_SERVICES_V2},
    parse::{IP_CSUM_OFF, IP_SRC_OFF},
    reason::Verdict,
};

const FAIL: Verdict = Verdict::Drop(DropReason::NatFailed);

/// One IP family's maps and the parts of its header that differ.
pub trait Family: Addr {
    /// The frontend entry under `key`, copied out.
    fn service(key: &ServiceKeyOf<Self>) -> Option<ServiceValue>;
    /// Whether `addr` is one of this node's NodePort addresses.
    fn nodeport_addr(addr: Self) -> bool;
    /// Whether `src` is in one of frontend `svc_id`'s `loadBalancerSourceRanges`.
    fn in_source_ranges(svc_id: u32, src: Self) -> bool;
    /// The backend with this id, if it is still live.
    fn backend(id: u32) -> Option<BackendOf<Self>>;
    /// The flow half under `key`.
    fn flow(key: &FlowKeyOf<Self>) -> Option<*mut FlowValueOf<Self>>;
    fn flow_insert(key: &FlowKeyOf<Self>, value: &FlowValueOf<Self>, flags: u64) -> Result<(), ()>;
    fn flow_remove(key: &FlowKeyOf<Self>);
    /// Runs `f` on room for a new flow's half while it is built and inserted: the stack for
    /// IPv4, the per-CPU `LB6_SCRATCH_V1` for IPv6, whose 80-byte value the 512-byte stack
    /// has no room for beside the rest of the path. `f` sets every field. `None` only if
    /// the scratch entry were missing (an array's entry 0 always exists).
    fn with_new_value<R>(f: impl FnOnce(&mut FlowValueOf<Self>) -> R) -> Option<R>;
    /// The session-affinity entry under `key`.
    fn affinity(key: &AffinityKeyOf<Self>) -> Option<*mut AffinityValue>;
    fn affinity_insert(key: &AffinityKeyOf<Self>, value: &AffinityValue);
    /// The checksum difference (as `bpf_csum_diff` computes it, over the words that change)
    /// of the source and destination addresses changing from `old` to `new`: what the L4
    /// checksum's pseudo-header sees. By reference: an IPv6 pair is 32 bytes, and copies of
    /// it add up in the stack frame.
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32;
    /// Writes the addresses `new` (source, destination) into the IP header, with the
    /// header checksum where the family has one; nothing when neither changes.
    fn rewrite_l3(ctx: &TcContext, old: (&Self, &Self), new: (&Self, &Self))
    -> Result<(), Verdict>;
}

/// 32-bit one's-complement addition (end-around carry), the kernel's `csum_add`.
#[inline(always)]
pub fn csum_add(a: u32, b: u32) -> u32 {
    let (sum, carry) = a.overflowing_add(b);
    sum.wrapping_add(u32::from(carry))
}

/// The difference of 32-bit words changing from `old` to `new`: each old word's complement
/// and each new word, for the words that change. 0 when nothing changes.
#[inline(always)]
pub fn words_diff<const N: usize>(old: [u32; N], new: [u32; N]) -> u32 {
    let mut d = 0;
    let mut i = 0;
    while i < N {
        if old[i] != new[i] {
            d = csum_add(csum_add(d, !old[i]), new[i]);
        }
        i += 1;
    }
    d
}

impl Family for [u8; 4] {
    #[inline(always)]
    fn service(key: &ServiceKeyOf<Self>) -> Option<ServiceValue> {
        // SAFETY: copied out at once; hash map values are not freed under RCU while this
        // program runs.
        unsafe { LB_SERVICES_V2.get(key) }.copied()
    }
    #[inline(always)]
    fn nodeport_addr(addr: Self) -> bool {
        // SAFETY: as above.
        matches!(unsafe { LB_NODEADDRS_V1.get(addr) }, Some(n) if n.flags & NODE_ADDR_F_NODEPORT != 0)
    }
    #[inline(always)]
    fn in_source_ranges(svc_id: u32, src: Self) -> bool {
        crate::lb::service::in_ranges(svc_id, u32::from_ne_bytes(src)) != 0
    }
    #[inline(always)]
    fn backend(id: u32) -> Option<BackendOf<Self>> {
        // SAFETY: as above.
        unsafe { LB_BACKENDS_V1.get(id) }.copied()
    }
    #[inline(always)]
    fn flow(key: &FlowKeyOf<Self>) -> Option<*mut FlowValueOf<Self>> {
        LB_FLOWS_V3.get_ptr_mut(key)
    }
    #[inline(always)]
    fn flow_insert(key: &FlowKeyOf<Self>, value: &FlowValueOf<Self>, flags: u64) -> Result<(), ()> {
        LB_FLOWS_V3.insert(key, value, flags).map_err(|_| ())
    }
    #[inline(always)]
    fn flow_remove(key: &FlowKeyOf<Self>) {
        let _ = LB_FLOWS_V3.remove(key);
    }
    #[inline(always)]
    fn with_new_value<R>(f: impl FnOnce(&mut FlowValueOf<Self>) -> R) -> Option<R> {
        let mut v = FlowValueOf {
            nat_addr: [0; 4],
            nat_port_be: 0,
            peer_port_be: 0,
            state: 0,
            flags: 0,
            _pad: [0; 2],
            svc_id: 0,
            backend_id: 0,
            ifindex: 0,
            _pad_a: [],
            created_ns: 0,
            last_seen_ns: 0,
            peer_addr: [0; 4],
            _reserved: 0,
            _pad_b: [],
        };
        Some(f(&mut v))
    }
    #[inline(always)]
    fn affinity(key: &AffinityKeyOf<Self>) -> Option<*mut AffinityValue> {
        LB_AFFINITY_V1.get_ptr_mut(key)
    }
    /// Failing to remember only costs affinity for the next flow, not this one.
    #[inline(always)]
    fn affinity_insert(key: &AffinityKeyOf<Self>, value: &AffinityValue) {
        let _ = LB_AFFINITY_V1.insert(key, value, 0);
    }
    #[inline(always)]
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32 {
        words_diff(
            [u32::from_ne_bytes(*old.0), u32::from_ne_bytes(*old.1)],
            [u32::from_ne_bytes(*new.0), u32::from_ne_bytes(*new.1)],
        )
    }
    /// One update of the header checksum by difference and one 8-byte store.
    #[inline(always)]
    fn rewrite_l3(
        ctx: &TcContext,
        old: (&Self, &Self),
        new: (&Self, &Self),
    ) -> Result<(), Verdict> {
        if old == new {
            return Ok(());
        }
        let d = Self::addr_diff(old, new);
        // A difference of 0 (a word that changes between the two encodings of zero) leaves
        // the checksum as it is.
        if d != 0 {
            ctx.l3_csum_replace(IP_CSUM_OFF, 0, u64::from(d), 0)
                .map_err(|_| FAIL)?;
        }
        let mut both = [0u8; 8];
        both[..4].copy_from_slice(new.0);
        both[4..].copy_from_slice(new.1);
        ctx.store(IP_SRC_OFF, &both, 0).map_err(|_| FAIL)
    }
}
