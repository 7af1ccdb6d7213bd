//! The maps of each IP family, behind one trait, so that the stages are written once and
//! compiled for both: `flow::forward::<[u8; 16]>` is the IPv6 flow table's code, from the
//! same source as the IPv4 one.
//!
//! Each family has its own frontend, backend and flow maps (`LB_SERVICES_V2`,
//! `LB_BACKENDS_V1`, `LB_FLOWS_V3` for IPv4; `LB_SERVICES6_V1`, `LB_BACKENDS6_V1`,
//! `LB_FLOWS6_V1` for IPv6). Service and backend ids are one space across both, so the
//! slots, members and counters keyed by id are shared.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    Addr, AffinityKeyOf, AffinityValue, BackendOf, DropReason, FlowKeyOf, FlowValueOf, FlowWork,
    HAIRPIN_ADDR, HAIRPIN_ADDR6, NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, ServiceKeyOf,
    ServiceValue,
};

use crate::{
    flow::Source,
    maps::{
        LB_AFFINITY_V1, LB_AFFINITY6_V1, LB_BACKENDS_V1, LB_BACKENDS6_V1, LB_FLOWS_V3,
        LB_FLOWS6_V1, LB_NODEADDR6_V1, LB_NODEADDRS_V1, LB_NODEIFS_V1, LB_NODEIFS6_V1,
        LB_PODADDRS_V1, LB_SCRATCH_V1, LB_SCRATCH6_V1, LB_SERVICES_V2, LB_SERVICES6_V1,
    },
    nat::csum,
    parse::{
        IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP_TTL_OFF, IP6_DST_OFF, IP6_HOPS_OFF, IP6_SRC_OFF,
        L2_L3_LEN, ptr_at,
    },
    reason::Verdict,
};

const FAIL: Verdict = Verdict::Drop(DropReason::NatFailed);

/// One IP family's maps and the parts of its header that differ.
pub trait Family: Addr {
    /// The family's `AF_*` number, as `bpf_fib_lookup` takes it.
    const AF: u8;
    /// The address a pod's hairpin flow comes from (`lbproxy_common::hairpin`).
    const HAIRPIN: Self;
    /// Words 2 to 5 of a `bpf_fib_lookup` input: its source then destination address (an
    /// IPv4 address in the low half of its word, `filler` in the words IPv4 leaves unread).
    fn fib_addrs(src: &Self, dst: &Self, filler: u64) -> [u64; 4];
    /// Offset in the frame of the TTL (IPv4) or hop limit (IPv6).
    const TTL_OFF: usize;
    /// Writes the hop the stack would have made when forwarding and a translation's L3 half:
    /// the frame's MACs (`macs`: destination then source), the TTL or hop limit one lower
    /// (unless it is 1 already), and the addresses `addrs` (source, destination), with the
    /// header checksum where the family has one.
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict>;
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
    const AF: u8 = 2;
    const HAIRPIN: Self = HAIRPIN_ADDR;
    const TTL_OFF: usize = IP_TTL_OFF;
    /// Everything rewritten is in the first `L2_L3_LEN` bytes (the Ethernet header and the
    /// fixed part of the IPv4 header): read once, the header checksum updated incrementally,
    /// written back in one store.
    #[inline(always)]
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict> {
        let hdr: *const [u8; L2_L3_LEN] = ptr_at(ctx, 0).ok_or(FAIL)?;
        // SAFETY: bounds-checked by ptr_at.
        let mut h = unsafe { *hdr };
        let word = |h: &[u8; L2_L3_LEN], at: usize| u16::from_ne_bytes([h[at], h[at + 1]]);
        let old = [
            word(&h, IP_TTL_OFF),
            word(&h, IP_SRC_OFF),
            word(&h, IP_SRC_OFF + 2),
            word(&h, IP_DST_OFF),
            word(&h, IP_DST_OFF + 2),
        ];
        h[..12].copy_from_slice(macs);
        if h[IP_TTL_OFF] > 1 {
            h[IP_TTL_OFF] -= 1;
        }
        h[IP_SRC_OFF..IP_SRC_OFF + 4].copy_from_slice(addrs.0);
        h[IP_DST_OFF..IP_DST_OFF + 4].copy_from_slice(addrs.1);
        let sum = csum::update(
            word(&h, IP_CSUM_OFF),
            &old,
            &[
                word(&h, IP_TTL_OFF),
                word(&h, IP_SRC_OFF),
                word(&h, IP_SRC_OFF + 2),
                word(&h, IP_DST_OFF),
                word(&h, IP_DST_OFF + 2),
            ],
        );
        h[IP_CSUM_OFF..IP_CSUM_OFF + 2].copy_from_slice(&sum.to_ne_bytes());
        ctx.store(0, &h, 0).map_err(|_| FAIL)
    }
    #[inline(always)]
    fn fib_addrs(src: &Self, dst: &Self, filler: u64) -> [u64; 4] {
        [
            u64::from(u32::from_ne_bytes(*src)),
            filler,
            u64::from(u32::from_ne_bytes(*dst)),
            filler,
        ]
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
            snat: true,
            addr: nif.snat_addr,
            min: nif.snat_port_min,
            max: nif.snat_port_max,
        })
    }
    #[inline(always)]
    fn in_source_ranges(svc_id: u32, src: Self) -> bool {
        crate::lb::service::in_ranges(svc_id, u32::from_ne_bytes(src)) != 0
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

impl Family for [u8; 16] {
    family_maps!(
        LB_SERVICES6_V1,
        LB_BACKENDS6_V1,
        LB_FLOWS6_V1,
        LB_SCRATCH6_V1,
        LB_AFFINITY6_V1
    );
    const AF: u8 = 10;
    const HAIRPIN: Self = HAIRPIN_ADDR6;
    const TTL_OFF: usize = IP6_HOPS_OFF;
    /// No header checksum: the MACs, the hop limit and each address that changes, stored in
    /// place.
    #[inline(always)]
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict> {
        ctx.store(0, macs, 0).map_err(|_| FAIL)?;
        let hops: *const u8 = ptr_at(ctx, IP6_HOPS_OFF).ok_or(FAIL)?;
        // SAFETY: bounds-checked by ptr_at.
        let h = unsafe { *hops };
        if h > 1 {
            ctx.store(IP6_HOPS_OFF, &(h - 1), 0).map_err(|_| FAIL)?;
        }
        ctx.store(IP6_SRC_OFF, addrs.0, 0).map_err(|_| FAIL)?;
        ctx.store(IP6_DST_OFF, addrs.1, 0).map_err(|_| FAIL)
    }
    #[inline(always)]
    fn fib_addrs(src: &Self, dst: &Self, _filler: u64) -> [u64; 4] {
        let (s, d) = (words6(src), words6(dst));
        let w = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
        [w(s[0], s[1]), w(s[2], s[3]), w(d[0], d[1]), w(d[2], d[3])]
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
        crate::lb::service::in_ranges6(svc_id, w(0), w(4), w(8), w(12)) != 0
    }
    /// Word by word, read in place.
    #[inline(always)]
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32 {
        csum_add(
            words_diff(words6(old.0), words6(new.0)),
            words_diff(words6(old.1), words6(new.1)),
        )
    }
    /// IPv6 has no header checksum: a 16-byte store of each address that changes.
    #[inline(always)]
    fn rewrite_l3(
        ctx: &TcContext,
        old: (&Self, &Self),
        new: (&Self, &Self),
    ) -> Result<(), Verdict> {
        if old.0 != new.0 {
            ctx.store(IP6_SRC_OFF, new.0, 0).map_err(|_| FAIL)?;
        }
        if old.1 != new.1 {
            ctx.store(IP6_DST_OFF, new.1, 0).map_err(|_| FAIL)?;
        }
        Ok(())
    }
}

/// The words of an IPv6 address, as they lie in memory.
#[inline(always)]
fn words6(a: &[u8; 16]) -> [u32; 4] {
    let p = a.as_ptr().cast::<u32>();
    // SAFETY: the four words of the 16 bytes; unaligned reads, as the array is byte-aligned.
    unsafe {
        [
            p.read_unaligned(),
            p.add(1).read_unaligned(),
            p.add(2).read_unaligned(),
            p.add(3).read_unaligned(),
        ]
    }
}
