//! Stage 2b: the source check. A pod can put any source address on its packets. Were those
//! translated, one pod could fill the node's one flow table with flows of made-up clients
//! and evict everyone's flows, or pass itself off as another pod to a backend. So a packet
//! from a pod interface to a service frontend is translated only if its source address is
//! one the node routes back to that pod: a strict reverse-path check, as Calico's BPF
//! dataplane does for workload interfaces. A packet that fails is dropped and counted as
//! `SpoofedSource`, before `flow` sees it, so it never takes a flow entry.
//!
//! The check asks the kernel's FIB (`bpf_fib_lookup`) for the route to the packet's source
//! address, as if the packet were being answered, and compares the interface that route
//! leads out of with the one the controller wrote for the ingress interface in
//! `LB_SRCCHECK_V1`:
//! - on a routed pod network (a `/32` route per pod, as Calico or kindnet set up), the pod
//!   interface itself: only the pod's own addresses pass;
//! - on a bridged pod network (`cni0`), the bridge the pod interface is a port of: any
//!   address the node routes to the bridge passes, so the check stops sources from outside
//!   the bridge's subnets (another node's pods, the internet, the node itself), not a pod
//!   that takes a neighbour's address on the same bridge.
//!
//! The lookup is made as the node's IP layer would make it, on the interface where the
//! packet enters it (the expected interface: the pod interface, or its bridge), with source
//! and destination swapped. An interface without an entry is not checked: the controller
//! writes an entry before it attaches the programs to an interface, and leaves out only the
//! interfaces it cannot check (a port of a master that is not a bridge, see
//! `lbproxy/src/bpf/attach.rs`). Frames run with `BPF_PROG_TEST_RUN` on an interface lbproxy
//! does not manage are therefore not checked either.
//!
//! On a routed pod network the controller also lists each pod interface's `/32` addresses
//! in `LB_PODADDRS_V1` (from the node's routes): a source listed there for the interface the
//! packet came in on passes with one hash lookup, without the FIB. A source not listed, or
//! listed for another interface, gets the FIB check, so the list can only save time: a
//! missing entry never drops a packet, and a spoofed source is never listed for the
//! spoofer's interface. The list can lag a route change by the controller's reaction to it
//! (a route event, or the 2 s re-list).
//!
//! Cost: two hash lookups (routed, listed source) or one hash lookup and one FIB lookup (no
//! neighbour lookup) per new tuple. `flow`
//! records in the forward half the interface whose check the flow's first packet passed, and
//! runs the check again only for a packet of the flow that arrives on another interface (a
//! pod sending with another pod's tuple), so packets of existing flows pay nothing. Packets
//! not addressed to a frontend are never checked.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SKIP_NEIGH, bpf_fib_lookup as FibParams},
    helpers::generated::bpf_fib_lookup,
    programs::TcContext,
};
use lbproxy_common::DropReason;

use crate::{family::Family, maps::LB_SRCCHECK_V1, packet::Packet};

const _: () = assert!(size_of::<FibParams>() == 64);

/// The interface the packet arrived on (the host side of a pod interface).
#[inline(always)]
pub fn ingress(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is valid for the whole program run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// `Ok` when `pkt` (addressed to a frontend, arriving on the interface `ctx` runs on) may be
/// translated: its interface is not checked, or the node's route back to its source leads
/// out of the expected interface. `Err(SpoofedSource)` otherwise, for the caller to drop and
/// count.
#[inline(always)]
pub fn check<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Result<(), DropReason> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer is valid for the whole program run.
    let in_ifindex = unsafe { (*skb).ifindex };
    // SAFETY: a plain lookup; the value is copied out at once.
    let Some(expected) = (unsafe { LB_SRCCHECK_V1.get(in_ifindex) }).map(|c| c.expected_ifindex)
    else {
        return Ok(());
    };
    // The fast path: a routed pod network's address, listed (`LB_PODADDRS_V1`) for the very
    // interface the packet came in on. Anything else gets the FIB's answer.
    if A::pod_addr_on(&pkt.src_addr, in_ifindex) {
        return Ok(());
    }
    // The input, as bpf_fib_lookup's little-endian words (see `deliver::fib`): family,
    // l4_protocol, sport and dport swapped (the way back), tot_len 1 (so the MTU is checked
    // against 1 byte, never failing: the route is what is checked, not the packet's size);
    // ifindex (the expected interface, where the packet enters the node's IP layer), tos or
    // flow label 0; the source = the packet's destination; the destination = the packet's
    // source ([`Family::fib_addrs`]). The other words are ignored with only
    // BPF_FIB_LOOKUP_SKIP_NEIGH (tbid/VLAN, mark) or outputs (MACs); they get a filler known
    // only at run time, so that no constant bytes are merged into a BPF-to-BPF memset call.
    let filler = u64::from(in_ifindex);
    let a = A::fib_addrs(&pkt.dst_addr, &pkt.src_addr, filler);
    let words: [u64; 8] = [
        u64::from(A::AF)
            | u64::from(pkt.proto) << 8
            | u64::from(pkt.dst_port_be) << 16
            | u64::from(pkt.src_port_be) << 32
            | 1 << 48,
        u64::from(expected),
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
    let rc = unsafe {
        bpf_fib_lookup(
            skb.cast(),
            &raw mut p,
            size_of::<FibParams>() as i32,
            BPF_FIB_LOOKUP_SKIP_NEIGH,
        )
    };
    // No route, a route that is not unicast (local, blackhole, unreachable, prohibit), or a
    // route out of another interface: not an address of this pod.
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && p.ifindex == expected {
        Ok(())
    } else {
        Err(DropReason::SpoofedSource)
    }
}
