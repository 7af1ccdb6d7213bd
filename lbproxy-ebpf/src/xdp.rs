//! `lb_xdp` (XDP on the node's own interfaces, `--xdp-acceleration`): north-south packets
//! of established flows, translated in the driver before the kernel builds an skb for them.
//!
//! It is a fast path in front of `lb_from_node`, not a second load balancer. It handles
//! three kinds of packet, each of a flow the TC program already made:
//! - a client's packet to a backend on another node (source-NATed, or a TCP segment after
//!   the SYN of a flow dispatched with direct server return): translated and sent back out
//!   of the interface it came in on (`XDP_TX`), as `lb_from_node` would redirect it;
//! - that backend's reply, to this node's SNAT address: translated back and sent to the
//!   client (`XDP_TX`);
//! - a client's packet to a backend on this node: translated and passed up the stack to the
//!   pod, as `lb_from_node` would.
//!
//! Everything else passes untouched to the TC program (`XDP_PASS`), which does what it did
//! without XDP: a new flow (a SYN, the first datagram), a flow that is not live or not
//! lbproxy's own (`flow::established_only`), a frontend's source ranges refusing the client,
//! ICMP, IPv4 fragments, IPv6 packets with extension headers, SCTP, a next hop out of
//! another interface (only its own interface takes an XDP frame back without the other
//! driver's support) or with no neighbour entry yet, a TTL that would expire, and every
//! packet while a takeover or hand-back runs (their untrack marks are skb marks, which XDP
//! cannot set). A packet is written only once every check passed, so a packet passed to TC
//! untranslated is always the one that arrived.

use core::mem::size_of;

use aya_ebpf::{
    EbpfContext as _,
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, xdp_action, xdp_md},
    programs::XdpContext,
};
use lbproxy_common::{
    CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_STRAYS_TO_CONNTRACK, CONFIG_F_UNTRACK,
    CONFIG_F_UNTRACK_OWN, Delivery, FLOW_DISPATCH_DSR, IPPROTO_TCP, IPPROTO_UDP,
    SVC_KIND_CLUSTER_IP, ServiceValue,
};

use crate::{
    csum::{self, csum_add, fold, words_diff},
    deliver,
    family::Family,
    flow, lb, maps,
    packet::{
        ETH_LEN, IP_FRAG_MF, IP_FRAG_OFFSET, IP_LEN, IP6_LEN, L4, L4_SPORT_OFF, Packet, TCP_LEN,
    },
};

const PASS: u32 = xdp_action::XDP_PASS;
const TX: u32 = xdp_action::XDP_TX;

/// The `DatapathConfig` flags of a takeover or hand-back: while any is on, every packet
/// goes to the TC program.
const TC_ONLY: u32 = CONFIG_F_UNTRACK
    | CONFIG_F_UNTRACK_OWN
    | CONFIG_F_STRAYS_TO_CONNTRACK
    | CONFIG_F_NEW_TO_CONNTRACK;

/// A UDP header's length.
const UDP_LEN: usize = 8;

/// A pointer to `T` at `offset` in the frame, or `None` if it would run past its end.
/// Writable: an XDP program rewrites its frame in place.
#[inline(always)]
fn at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// What XDP reads and writes differently in an IPv4 and an IPv6 frame.
pub trait Frame: Family {
    /// The EtherType, as its two bytes on the wire.
    const ETHER_TYPE: [u8; 2];
    /// Offset in the frame of the source address, the destination's right after it.
    const SRC_OFF: usize;
    /// Whether a UDP checksum of 0 means "none" (IPv4; IPv6 requires one).
    const UDP_ZERO_CSUM: bool;
    /// Where the TCP or UDP header starts and the protocol, or `None` for a packet left to
    /// TC: an IPv4 fragment, an IPv6 packet with extension headers.
    fn l4(ctx: &XdpContext) -> Option<(usize, u8)>;
    /// Writes the addresses `addrs` (source, destination), with the header checksum where
    /// the family has one, and, for a packet sent on (`hop`), the TTL or hop limit one
    /// lower. `None`, and nothing written, if that would reach 0 or the header is cut short.
    fn write_l3(ctx: &XdpContext, addrs: (&Self, &Self), hop: bool) -> Option<()>;
}

impl Frame for [u8; 4] {
    const ETHER_TYPE: [u8; 2] = [0x08, 0x00];
    const SRC_OFF: usize = ETH_LEN + 12;
    const UDP_ZERO_CSUM: bool = true;

    #[inline(always)]
    fn l4(ctx: &XdpContext) -> Option<(usize, u8)> {
        let ip: *const [u8; IP_LEN] = at(ctx, ETH_LEN)?;
        // SAFETY: bounds-checked by `at`.
        let h = unsafe { *ip };
        let ihl = usize::from(h[0] & 0x0f);
        if h[0] >> 4 != 4 || ihl < 5 {
            return None;
        }
        if u16::from_be_bytes([h[6], h[7]]) & (IP_FRAG_MF | IP_FRAG_OFFSET) != 0 {
            return None;
        }
        Some((ETH_LEN + ihl * 4, h[9]))
    }

    #[inline(always)]
    fn write_l3(ctx: &XdpContext, addrs: (&Self, &Self), hop: bool) -> Option<()> {
        let ip: *mut [u8; IP_LEN] = at(ctx, ETH_LEN)?;
        // SAFETY: bounds-checked by `at`.
        let mut h = unsafe { *ip };
        if hop && h[8] <= 1 {
            return None;
        }
        let word = |h: &[u8; IP_LEN], at: usize| u16::from_ne_bytes([h[at], h[at + 1]]);
        let words = |h: &[u8; IP_LEN]| {
            [
                word(h, 8),
                word(h, 12),
                word(h, 14),
                word(h, 16),
                word(h, 18),
            ]
        };
        let old = words(&h);
        if hop {
            h[8] -= 1;
        }
        h[12..16].copy_from_slice(addrs.0);
        h[16..20].copy_from_slice(addrs.1);
        let sum = csum::update(word(&h, 10), &old, &words(&h));
        h[10..12].copy_from_slice(&sum.to_ne_bytes());
        // SAFETY: as above; one store of the header.
        unsafe { *ip = h };
        Some(())
    }
}

impl Frame for [u8; 16] {
    const ETHER_TYPE: [u8; 2] = [0x86, 0xdd];
    const SRC_OFF: usize = ETH_LEN + 8;
    const UDP_ZERO_CSUM: bool = false;

    #[inline(always)]
    fn l4(ctx: &XdpContext) -> Option<(usize, u8)> {
        let next: *const u8 = at(ctx, ETH_LEN + 6)?;
        // SAFETY: bounds-checked by `at`.
        Some((ETH_LEN + IP6_LEN, unsafe { *next }))
    }

    #[inline(always)]
    fn write_l3(ctx: &XdpContext, addrs: (&Self, &Self), hop: bool) -> Option<()> {
        let hops: *mut u8 = at(ctx, ETH_LEN + 7)?;
        let src: *mut [u8; 16] = at(ctx, Self::SRC_OFF)?;
        let dst: *mut [u8; 16] = at(ctx, Self::SRC_OFF + 16)?;
        // SAFETY: bounds-checked by `at`.
        unsafe {
            if hop {
                if *hops <= 1 {
                    return None;
                }
                *hops -= 1;
            }
            *src = *addrs.0;
            *dst = *addrs.1;
        }
        Some(())
    }
}

/// The entry point's work: the family from the EtherType, each family's pipeline a BPF
/// function of its own (the context crosses as its raw pointer).
#[inline(always)]
pub fn run(ctx: &XdpContext) -> u32 {
    let Some(eth) = at::<[u8; ETH_LEN]>(ctx, 0) else {
        return PASS;
    };
    // SAFETY: bounds-checked by `at`.
    let ether_type = unsafe { [(*eth)[12], (*eth)[13]] };
    let raw = ctx.as_ptr().cast::<xdp_md>();
    if ether_type == <[u8; 4]>::ETHER_TYPE {
        run_family::<[u8; 4]>(raw)
    } else if ether_type == <[u8; 16]>::ETHER_TYPE {
        run_family::<[u8; 16]>(raw)
    } else {
        PASS
    }
}

#[inline(never)]
fn run_family<A: Frame>(raw: *mut xdp_md) -> u32 {
    let ctx = &XdpContext::new(raw);
    if maps::config().flags & TC_ONLY != 0 {
        return PASS;
    }
    let Some(pkt) = parse::<A>(ctx) else {
        return PASS;
    };
    let ingress = ctx.ingress_ifindex() as u32;
    match lb::service::lookup(&pkt) {
        Some(svc) if svc.kind != SVC_KIND_CLUSTER_IP => forward(ctx, &pkt, &svc, ingress),
        Some(_) => PASS,
        None if A::snat_addr(&pkt.dst_addr) => reply(ctx, &pkt, ingress),
        None => PASS,
    }
}

/// A TCP or UDP packet with its whole fixed L4 header, or `None` (passed).
#[inline(always)]
fn parse<A: Frame>(ctx: &XdpContext) -> Option<Packet<A>> {
    let (l4_off, proto) = A::l4(ctx)?;
    if l4_off > ETH_LEN + 60 {
        return None;
    }
    let tcp_flags = match proto {
        IPPROTO_TCP => {
            let h: *const [u8; TCP_LEN] = at(ctx, l4_off)?;
            // SAFETY: bounds-checked by `at`.
            let h = unsafe { *h };
            if h[12] >> 4 < 5 {
                return None;
            }
            h[13]
        }
        IPPROTO_UDP => {
            at::<[u8; UDP_LEN]>(ctx, l4_off)?;
            0
        }
        _ => return None,
    };
    let ports: *const [u16; 2] = at(ctx, l4_off + L4_SPORT_OFF)?;
    let src: *const A = at(ctx, A::SRC_OFF)?;
    let dst: *const A = at(ctx, A::SRC_OFF + size_of::<A>())?;
    // SAFETY: bounds-checked by `at`.
    let (ports, src_addr, dst_addr) = unsafe { (*ports, *src, *dst) };
    Some(Packet {
        src_addr,
        dst_addr,
        src_port_be: ports[0],
        dst_port_be: ports[1],
        proto,
        tcp_flags,
        l4_off,
        l4: L4::Header,
    })
}

/// A client's packet to frontend `svc`: translated at XDP when its flow is established.
#[inline(always)]
fn forward<A: Frame>(ctx: &XdpContext, pkt: &Packet<A>, svc: &ServiceValue, ingress: u32) -> u32 {
    if lb::service::source_allowed(svc, pkt).is_err() {
        return PASS;
    }
    let Some(to) = flow::established_only(pkt, svc, ingress) else {
        return PASS;
    };
    let (src, dst) = ((&to.peer_addr, to.peer_port_be), (&to.addr, to.port_be));
    if to.dispatch == FLOW_DISPATCH_DSR {
        // Direct server return: a TCP segment after the SYN needs no option, and goes to
        // the backend's node as it is, translated. A UDP datagram may need one: TC's.
        if pkt.proto != IPPROTO_TCP {
            return PASS;
        }
        return send_back(ctx, pkt, ingress, src, dst, Delivery::XdpToBackend);
    }
    if to.peer_addr == pkt.src_addr {
        // A backend on this node: up the stack to its pod, as `lb_from_node` sends it.
        if translate(ctx, pkt, src, dst, None).is_some() {
            deliver::count(Delivery::XdpToLocalBackend);
        }
        return PASS;
    }
    send_back(ctx, pkt, ingress, src, dst, Delivery::XdpToBackend)
}

/// A packet to a SNAT address of this node: a remote backend's reply of a source-NATed
/// flow is translated back and sent to its client.
#[inline(always)]
fn reply<A: Frame>(ctx: &XdpContext, pkt: &Packet<A>, ingress: u32) -> u32 {
    let Some(to) = flow::reply(pkt, false) else {
        return PASS;
    };
    if to.peer_addr == pkt.dst_addr {
        // Not source-NATed (a client on this node's own address): TC's.
        return PASS;
    }
    let (src, dst) = ((&to.addr, to.port_be), (&to.peer_addr, to.peer_port_be));
    send_back(ctx, pkt, ingress, src, dst, Delivery::XdpToClient)
}

/// Sends `pkt`, translated to `src -> dst`, back out of `ingress` when the FIB's next hop for
/// it is there and its neighbour known (`XDP_TX`, counted under `counted`); otherwise passes
/// it untouched.
#[inline(always)]
fn send_back<A: Frame>(
    ctx: &XdpContext,
    pkt: &Packet<A>,
    ingress: u32,
    src: (&A, u16),
    dst: (&A, u16),
    counted: Delivery,
) -> u32 {
    let (rc, p) = deliver::fib_from(ctx.as_ptr(), ingress, pkt.proto, src, dst);
    if rc != i64::from(BPF_FIB_LKUP_RET_SUCCESS) || p.ifindex != ingress {
        return PASS;
    }
    if translate(ctx, pkt, src, dst, Some(deliver::macs(&p))).is_none() {
        return PASS;
    }
    deliver::count(counted);
    TX
}

/// Rewrites `pkt` to `src -> dst` (addresses and ports, with the L4 checksum and, for IPv4,
/// the header's), and for a packet sent on (`macs`: the next hop's, destination then source)
/// its MACs and TTL. Every pointer is checked, and the TTL, before the first write: `None`
/// means the packet is as it arrived.
#[inline(always)]
fn translate<A: Frame>(
    ctx: &XdpContext,
    pkt: &Packet<A>,
    src: (&A, u16),
    dst: (&A, u16),
    macs: Option<[u8; 12]>,
) -> Option<()> {
    let ports: *mut [u16; 2] = at(ctx, pkt.l4_off + L4_SPORT_OFF)?;
    let check: *mut u16 = at(ctx, pkt.l4_csum_off())?;
    let eth: *mut [u8; 12] = at(ctx, 0)?;
    A::write_l3(ctx, (src.0, dst.0), macs.is_some())?;
    let port_word = |s: u16, d: u16| {
        let (s, d) = (s.to_ne_bytes(), d.to_ne_bytes());
        u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
    };
    let diff = csum_add(
        A::addr_diff((&pkt.src_addr, &pkt.dst_addr), (src.0, dst.0)),
        words_diff(
            [port_word(pkt.src_port_be, pkt.dst_port_be)],
            [port_word(src.1, dst.1)],
        ),
    );
    // SAFETY: bounds-checked by `at`.
    unsafe {
        let old = *check;
        let udp = pkt.proto == IPPROTO_UDP;
        if !(udp && A::UDP_ZERO_CSUM && old == 0) {
            let new = fold(csum_add(u32::from(!old), diff));
            *check = if udp && new == 0 { 0xffff } else { new };
        }
        *ports = [src.1, dst.1];
        if let Some(m) = macs {
            *eth = m;
        }
    }
    Some(())
}
