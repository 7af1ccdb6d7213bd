//! Stage 5: deliver. With the stack bypass on (`CONFIG_F_STACK_BYPASS`), a translated packet
//! whose next hop is a local pod's interface is redirected straight into that pod with
//! `bpf_redirect_peer`: the node's routing, netfilter and the veth's queue are skipped, and
//! the other direction's program never runs. Everything else goes up the node's stack as
//! before, counted under the reason it could not be redirected.
//!
//! The next hop comes from the kernel's own FIB (`bpf_fib_lookup`), so routes, policy rules
//! and neighbour entries stay the node's: lbproxy keeps no copy of them. A redirect is made
//! only into an interface the controller listed in `LB_PODIFS_V1` (a veth or netkit whose
//! peer is in a pod's namespace), never elsewhere.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::generated::{bpf_fib_lookup, bpf_redirect_peer},
    programs::TcContext,
};
use lbproxy_common::{CONFIG_F_STACK_BYPASS, DatapathConfig, Delivery, POD_IF_BRIDGE};

use crate::{
    family::Family,
    maps::{LB_DELIVERY_V1, LB_PODIFS_V1},
    packet::{Packet, ptr_at},
    stage::Verdict,
};

pub use aya_ebpf::bindings::bpf_fib_lookup as FibParams;

const _: () = assert!(size_of::<FibParams>() == 64);

/// Where to send a translated packet instead of the node's stack.
#[derive(Clone, Copy)]
pub struct Peer {
    ifindex: u32,
    /// Destination then source MAC: the first 12 bytes of the frame as the stack would
    /// have written them when forwarding.
    pub macs: [u8; 12],
}

impl Peer {
    /// The pod the packet came from, for a packet sent back to it (hairpin): its own
    /// interface, with the frame's MACs swapped (the pod's MAC as destination, its
    /// gateway's as source), as the stack's hop back out of that interface would write them.
    #[inline(always)]
    pub fn sender(ctx: &TcContext) -> Option<Peer> {
        let eth: *const [u8; 12] = ptr_at(ctx, 0)?;
        // SAFETY: bounds-checked by ptr_at.
        let m = unsafe { *eth };
        Some(Peer {
            // SAFETY: the context pointer is valid for the whole program run.
            ifindex: unsafe { (*ctx.skb.skb).ifindex },
            macs: [
                m[6], m[7], m[8], m[9], m[10], m[11], m[0], m[1], m[2], m[3], m[4], m[5],
            ],
        })
    }
}

/// Counts one packet under `d` (per CPU).
#[inline(always)]
pub fn count(d: Delivery) {
    if let Some(c) = LB_DELIVERY_V1.get_ptr_mut(d as u32) {
        // Per-CPU slot: no other writer.
        unsafe { *c += 1 };
    }
}

/// Whether the controller turned the bypass on (`config` is this packet's
/// `maps::config()`).
#[inline(always)]
pub fn enabled(config: &DatapathConfig) -> bool {
    config.flags & CONFIG_F_STACK_BYPASS != 0
}

/// The pod interface `pkt`, once addressed to `dst`, can be redirected into, or `None` (and
/// the reason counted) when it must go through the node's stack. Call before translating:
/// the route is the one the stack would pick for the packet after translation.
#[inline(always)]
pub fn route<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    dst: &A,
    dst_port_be: u16,
) -> Option<Peer> {
    match try_route(ctx, pkt, dst, dst_port_be) {
        Ok(peer) => Some(peer),
        Err(why) => {
            count(why);
            None
        }
    }
}

#[inline(always)]
fn try_route<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    dst: &A,
    dst_port_be: u16,
) -> Result<Peer, Delivery> {
    let ttl: *const u8 = ptr_at(ctx, A::TTL_OFF).ok_or(Delivery::StackNoRoute)?;
    // SAFETY: bounds-checked by ptr_at.
    if unsafe { *ttl } <= 1 {
        return Err(Delivery::StackTtl);
    }
    let (rc, p, in_ifindex) = fib(
        ctx,
        pkt.proto,
        &pkt.src_addr,
        dst,
        pkt.src_port_be,
        dst_port_be,
    );
    if rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return Err(Delivery::StackNoNeighbour);
    }
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return Err(Delivery::StackNoRoute);
    }
    let out = p.ifindex;
    if out == in_ifindex {
        return Err(Delivery::StackHairpin);
    }
    // SAFETY: a plain lookup, the value copied out at once. A pod bridge is listed for
    // north-south's sake only: the bypass never redirects into it.
    match unsafe { LB_PODIFS_V1.get(out) }.copied() {
        Some(i) if i.kind != POD_IF_BRIDGE => {}
        _ => return Err(Delivery::StackNotPodInterface),
    }
    Ok(Peer {
        ifindex: out,
        macs: macs(&p),
    })
}

/// The destination then source MAC of a FIB answer: the first 12 bytes of the frame as the
/// stack's hop would write them.
#[inline(always)]
pub fn macs(p: &FibParams) -> [u8; 12] {
    let (d, s) = (p.dmac, p.smac);
    [
        d[0], d[1], d[2], d[3], d[4], d[5], s[0], s[1], s[2], s[3], s[4], s[5],
    ]
}

/// The kernel FIB's answer (`bpf_fib_lookup`'s return code and parameters) for a packet of
/// `proto` from `src:sport` to `dst:dport` arriving on this packet's interface, and that
/// interface's index.
#[inline(always)]
pub fn fib<A: Family>(
    ctx: &TcContext,
    proto: u8,
    src: &A,
    dst: &A,
    sport_be: u16,
    dport_be: u16,
) -> (i64, FibParams, u32) {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer is valid for the whole program run.
    let in_ifindex = unsafe { (*skb).ifindex };
    let (rc, p) = fib_from(
        skb.cast(),
        in_ifindex,
        proto,
        (src, sport_be),
        (dst, dport_be),
    );
    (rc, p, in_ifindex)
}

/// [`fib`] for any program's context (`ctx`, the raw pointer `bpf_fib_lookup` takes: a TC
/// program's skb or an XDP program's `xdp_md`), for a packet that arrived on `in_ifindex`.
#[inline(always)]
pub fn fib_from<A: Family>(
    ctx: *mut core::ffi::c_void,
    in_ifindex: u32,
    proto: u8,
    src: (&A, u16),
    dst: (&A, u16),
) -> (i64, FibParams) {
    // The input, as bpf_fib_lookup's little-endian words: family, l4_protocol, sport, dport,
    // tot_len 0 (the MTU check then uses the skb, which understands GSO; an XDP frame is
    // not checked); ifindex, tos or flow label 0; the source; the destination
    // ([`Family::fib_addrs`]). The other words are ignored without flags (tbid/VLAN, mark,
    // and for IPv4 the rest of the IPv6 addresses) or outputs (MACs). They get a filler
    // known only at run time: constant bytes there would be merged into a call to a
    // BPF-to-BPF memset subprogram, which costs more than the lookup's own setup.
    let filler = u64::from(in_ifindex);
    let a = A::fib_addrs(src.0, dst.0, filler);
    let words: [u64; 8] = [
        u64::from(A::AF) | u64::from(proto) << 8 | u64::from(src.1) << 16 | u64::from(dst.1) << 32,
        u64::from(in_ifindex),
        a[0],
        a[1],
        a[2],
        a[3],
        filler,
        filler,
    ];
    // SAFETY: bpf_fib_lookup is 64 bytes of plain integers (asserted at the top).
    let mut p: FibParams = unsafe { core::mem::transmute::<[u64; 8], FibParams>(words) };
    // SAFETY: `p` is a properly sized, initialized bpf_fib_lookup on our stack.
    let rc = unsafe { bpf_fib_lookup(ctx, &raw mut p, size_of::<FibParams>() as i32, 0) };
    (rc, p)
}

/// Finishes a translation's L3 half (the addresses become `addrs`, source then destination)
/// and the hop the stack would have made (MACs, TTL or hop limit; [`Family::write_hop`]),
/// then redirects into the pod and counts the packet under `counted`. The L4 half
/// (`nat::dnat_l4`/`snat_l4`) is the caller's. A TTL of 1 is left as it is (the bypass
/// checked it before; a hairpin packet goes back into the pod it came from). Returns the TC
/// action.
#[inline(always)]
pub fn redirect<A: Family>(
    ctx: &TcContext,
    peer: Peer,
    addrs: (&A, &A),
    counted: Delivery,
) -> Result<i32, Verdict> {
    A::write_hop(ctx, &peer.macs, addrs)?;
    count(counted);
    // SAFETY: a helper call with no pointer arguments.
    Ok(unsafe { bpf_redirect_peer(peer.ifindex, 0) } as i32)
}
