//! ICMP errors about translated flows: the outer and the quoted inner header are translated
//! too, as netfilter's NAT does for RELATED packets.
//!
//! An ICMP error (destination unreachable, including PMTU's fragmentation needed, or time
//! exceeded) quotes the IP header and at least the first 8 bytes of the packet it is about.
//! For a load-balanced flow that packet was translated, so the quote names the backend, not
//! the VIP the client's socket is connected to, and the client's kernel would find no socket
//! for it: a PMTU update would never arrive (large transfers hang) and a UDP client would
//! wait for a timeout instead of seeing "connection refused".
//!
//! - [`to_client`] (`lb_to_pod`): an error travelling to a client about its packet
//!   client:port -> backend. The quote becomes client:port -> VIP:port (the client's own
//!   port restored when the tuple clashed), and an outer source that is the backend itself
//!   becomes the VIP. A router's own address (PMTU from a hop between node and backend)
//!   stays.
//! - [`from_client`] (`lb_from_pod`): an error a client sends about a reply it got,
//!   VIP:port -> client:port. The outer destination (the VIP) becomes the backend, and the
//!   quote becomes backend:port -> client:port as the backend sent it.
//!
//! - [`to_snat_client`] (`lb_from_node`): an error addressed to one of the node's SNAT
//!   addresses about a source-NATed packet node:port -> backend (a router's PMTU error on the
//!   way to a backend on another node, or that backend's port unreachable). The quote
//!   becomes client:port -> frontend, the outer destination the client, and a source that
//!   is the backend itself the frontend; the caller sends it to the client.
//! - `lb_to_node` uses [`to_client`] for the errors of this node's backends to clients
//!   outside, and `lb_from_node` [`from_client`] for outside clients' errors about replies.
//!
//! IPv6 ([`to_client6`], [`from_client6`], [`to_snat_client6`]): ICMPv6 destination
//! unreachable, packet too big, time exceeded and parameter problem, quoting an IPv6 header
//! of TCP or UDP without extension headers, right after the outer IPv6 header, are
//! translated the same way, for pods' flows and north-south ones alike. Their checksum
//! covers the outer addresses too (the pseudo-header), and is updated for both.
//!
//! Only quotes with a 20-byte inner IP header of TCP or UDP are translated; the ICMP
//! checksum (which covers the quote), the quoted IP header checksum and, when the quote holds
//! it, the quoted L4 checksum are updated incrementally. Nothing here creates or changes flow
//! state. Errors for no known flow pass untouched.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{IPPROTO_TCP, IPPROTO_UDP};
use network_types::{eth::EtherType, ip::Ipv4Hdr};

use crate::{
    csum, flow,
    packet::{
        ETH_LEN, IP_CSUM_OFF, IP_DST_OFF, IP_MAX_LEN, IP_SRC_OFF, IP6_DST_OFF, IPPROTO_ICMP,
        IPPROTO_ICMPV6, L2_L3_LEN6, TCP_CSUM_OFF, UDP_CSUM_OFF, ptr_at,
    },
    stage::NatTarget,
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_LEN: usize = 8;
const ICMP_CSUM: usize = 2;
/// The quoted IP header (without options) and the 8 bytes of L4 header every quote has.
const QUOTE_LEN: usize = Ipv4Hdr::LEN + 8;

/// Which side of the flow sent the error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// About a packet client -> backend: travelling to the client.
    ToClient,
    /// About a packet VIP -> client: sent by the client.
    FromClient,
}

/// See the module docs. Returns whether the packet was an ICMP error that was translated.
#[inline(always)]
pub fn to_client(ctx: &TcContext) -> bool {
    translate(ctx, Side::ToClient).is_some()
}

/// See the module docs.
#[inline(always)]
pub fn from_client(ctx: &TcContext) -> bool {
    translate(ctx, Side::FromClient).is_some()
}

/// [`to_client`] for an error addressed to one of this node's SNAT addresses (`lb_from_node`),
/// about a source-NATed packet SNAT address:port -> backend: translated, it is addressed to
/// the client. Returns the new outer (source, destination) for the caller to send it on.
#[inline(always)]
pub fn to_snat_client(ctx: &TcContext) -> Option<([u8; 4], [u8; 4])> {
    translate(ctx, Side::ToClient)
}

#[inline(always)]
fn word(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

/// Translates the error in place; returns its outer (source, destination) as it now is.
#[inline(always)]
fn translate(ctx: &TcContext, side: Side) -> Option<([u8; 4], [u8; 4])> {
    let ether_type: u16 = ctx.load(12).ok()?;
    if ether_type != EtherType::Ipv4 as u16 {
        return None;
    }
    let outer: [u8; Ipv4Hdr::LEN] = ctx.load(ETH_LEN).ok()?;
    // Version 4, and only the first (or only) fragment carries the ICMP header.
    if outer[0] >> 4 != 4 || outer[9] != IPPROTO_ICMP || word(&outer, 6) & 0x1fff_u16.to_be() != 0 {
        return None;
    }
    let icmp_off = ETH_LEN + usize::from(outer[0] & 0x0f) * 4;
    if !(ETH_LEN + Ipv4Hdr::LEN..=ETH_LEN + IP_MAX_LEN).contains(&icmp_off) {
        return None;
    }
    let icmp: [u8; ICMP_LEN] = ctx.load(icmp_off).ok()?;
    if icmp[0] != ICMP_DEST_UNREACH && icmp[0] != ICMP_TIME_EXCEEDED {
        return None;
    }
    let inner_off = icmp_off + ICMP_LEN;
    let mut q: [u8; QUOTE_LEN] = ctx.load(inner_off).ok()?;
    let proto = q[9];
    if q[0] != 0x45 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
        return None;
    }
    let src: [u8; 4] = [q[12], q[13], q[14], q[15]];
    let dst: [u8; 4] = [q[16], q[17], q[18], q[19]];
    let sport = word(&q, 20);
    let dport = word(&q, 22);
    // The flow half of the quoted packet's own direction tells what it looked like before
    // translation. ToClient: the quote is client -> backend, whose reply half (backend ->
    // client) names the VIP and the client's own port. FromClient: the quote is VIP ->
    // client, whose forward half (client -> VIP) names the backend and the client's port as
    // the backend knows it.
    //
    // Both ends of the quote are rewritten: the translated end (`addr_at`, `port_at`) and
    // the client's (`peer_addr_at`, `peer_at`), which a source-NATed flow changes too
    // (node address and SNAT port <-> the client's own); for any other flow the client's
    // end writes what is already there.
    let (to, addr_at, port_at, peer_addr_at, peer_at): (NatTarget, usize, usize, usize, usize) =
        match side {
            Side::ToClient => (
                flow::quoted_reply(proto, dst, dport, src, sport)?,
                16,
                22,
                12,
                20,
            ),
            Side::FromClient => (
                flow::quoted_forward(proto, dst, dport, src, sport)?,
                12,
                20,
                16,
                22,
            ),
        };
    let (old_addr, old_peer) = match side {
        Side::ToClient => (dst, src),
        Side::FromClient => (src, dst),
    };
    let old = [
        word(&q, addr_at),
        word(&q, addr_at + 2),
        word(&q, peer_addr_at),
        word(&q, peer_addr_at + 2),
        word(&q, port_at),
        word(&q, peer_at),
        word(&q, 10),
    ];
    q[addr_at..addr_at + 4].copy_from_slice(&to.addr);
    q[peer_addr_at..peer_addr_at + 4].copy_from_slice(&to.peer_addr);
    q[port_at..port_at + 2].copy_from_slice(&to.port_be.to_ne_bytes());
    q[peer_at..peer_at + 2].copy_from_slice(&to.peer_port_be.to_ne_bytes());
    let ip_csum = csum::update(
        word(&q, 10),
        &old[..4],
        &[
            word(&q, addr_at),
            word(&q, addr_at + 2),
            word(&q, peer_addr_at),
            word(&q, peer_addr_at + 2),
        ],
    );
    q[10..12].copy_from_slice(&ip_csum.to_ne_bytes());
    let new = [
        word(&q, addr_at),
        word(&q, addr_at + 2),
        word(&q, peer_addr_at),
        word(&q, peer_addr_at + 2),
        word(&q, port_at),
        word(&q, peer_at),
        ip_csum,
    ];
    let mut icmp_csum = csum::update(word(&icmp, ICMP_CSUM), &old, &new);
    ctx.store(inner_off, &q, 0).ok()?;
    // The quoted L4 checksum, when the quote holds it (UDP's always does, inside the 8
    // bytes; TCP's only in a longer quote): the address is in its pseudo-header. Written
    // after the quote, which holds UDP's.
    let l4_csum_at = inner_off
        + Ipv4Hdr::LEN
        + if proto == IPPROTO_TCP {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
    let ip_end = ETH_LEN + usize::from(u16::from_be_bytes([outer[2], outer[3]]));
    if l4_csum_at + 2 <= ip_end
        && let Ok(c) = ctx.load::<u16>(l4_csum_at)
        && !(proto == IPPROTO_UDP && c == 0)
    {
        let c2 = csum::update(c, &old[..6], &new[..6]);
        ctx.store(l4_csum_at, &c2, 0).ok()?;
        icmp_csum = csum::update(icmp_csum, &[c], &[c2]);
    }
    let mut icmp = icmp;
    icmp[ICMP_CSUM..ICMP_CSUM + 2].copy_from_slice(&icmp_csum.to_ne_bytes());
    ctx.store(icmp_off, &icmp, 0).ok()?;
    readdress(ctx, &outer, side, (old_addr, old_peer), &to)
}

/// The outer header of an error [`translate`] rewrote the quote of (`outer`, as it came):
/// the VIP as the source of a backend's own error, the backend as the destination of a
/// client's error to the VIP; and, for a source-NATed flow, the client as the destination of
/// an error addressed to the node's SNAT address. `old` is the quote's translated end and
/// the client's end before translation. Returns the outer (source, destination) as it now
/// is.
#[inline(always)]
fn readdress(
    ctx: &TcContext,
    outer: &[u8; Ipv4Hdr::LEN],
    side: Side,
    old: ([u8; 4], [u8; 4]),
    to: &NatTarget,
) -> Option<([u8; 4], [u8; 4])> {
    let (old_addr, old_peer) = old;
    let mut out_src = [outer[12], outer[13], outer[14], outer[15]];
    let mut out_dst = [outer[16], outer[17], outer[18], outer[19]];
    let (translated, peer) = match side {
        Side::ToClient => (&mut out_src, Some(&mut out_dst)),
        Side::FromClient => (&mut out_dst, None),
    };
    let mut changed = false;
    if *translated == old_addr {
        *translated = to.addr;
        changed = true;
    }
    if let Some(peer) = peer
        && *peer == old_peer
        && old_peer != to.peer_addr
    {
        *peer = to.peer_addr;
        changed = true;
    }
    if changed {
        let c = csum::update(
            word(outer, 10),
            &[
                word(outer, 12),
                word(outer, 14),
                word(outer, 16),
                word(outer, 18),
            ],
            &[
                word(&out_src, 0),
                word(&out_src, 2),
                word(&out_dst, 0),
                word(&out_dst, 2),
            ],
        );
        ctx.store(IP_SRC_OFF, &out_src, 0).ok()?;
        ctx.store(IP_DST_OFF, &out_dst, 0).ok()?;
        ctx.store(IP_CSUM_OFF, &c, 0).ok()?;
    }
    Some((out_src, out_dst))
}

/// ICMPv6 errors (RFC 4443): destination unreachable, packet too big, time exceeded,
/// parameter problem.
const ICMPV6_ERROR_MAX: u8 = 4;
/// The quoted IPv6 header and 8 bytes of its L4 header.
const QUOTE6_LEN: usize = 40 + 8;

/// [`to_client`] for IPv6. Its own BPF function (the quote and the checksum words take
/// room in its frame only), taking the context by value.
#[inline(never)]
pub fn to_client6(ctx: TcContext) -> bool {
    translate6(&ctx, Side::ToClient, false).is_some()
}

/// [`from_client`] for IPv6.
#[inline(never)]
pub fn from_client6(ctx: TcContext) -> bool {
    translate6(&ctx, Side::FromClient, false).is_some()
}

/// [`to_snat_client`] for IPv6: translated in place, the outer destination (this node's
/// SNAT address) readdressed to the client as well. The caller reads the new outer
/// addresses from the packet and sends it on.
#[inline(never)]
pub fn to_snat_client6(ctx: TcContext) -> bool {
    translate6(&ctx, Side::ToClient, true).is_some()
}

/// The one's-complement sum of `b` (a multiple of 4 bytes) read as 16-bit words in memory
/// order, folded to 16 bits. Read a 32-bit word at a time: byte by byte, the compiler keeps
/// each byte in a stack slot of its own, and the ICMPv6 path runs out of stack.
#[inline(always)]
fn sum16(b: &[u8]) -> u16 {
    let p = b.as_ptr().cast::<u32>();
    let mut acc: u64 = 0;
    let mut i = 0;
    while i < b.len() / 4 {
        // SAFETY: within `b`; unaligned reads.
        let w = unsafe { p.add(i).read_unaligned() };
        acc += u64::from(w & 0xffff) + u64::from(w >> 16);
        i += 1;
    }
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// Whether the 16 bytes at `a` and `b` are equal, compared 8 bytes at a time.
#[inline(always)]
fn same16(a: &[u8], b: &[u8; 16]) -> bool {
    let (pa, pb) = (a.as_ptr().cast::<u64>(), b.as_ptr().cast::<u64>());
    // SAFETY: 16 bytes each (`a` is a 16-byte slice of the quote); unaligned reads.
    unsafe {
        pa.read_unaligned() == pb.read_unaligned()
            && pa.add(1).read_unaligned() == pb.add(1).read_unaligned()
    }
}

/// Checksum `csum` updated for data whose folded sum went from `old` to `new` (RFC 1624).
#[inline(always)]
fn replace_sum(csum: u16, old: u16, new: u16) -> u16 {
    csum::update(csum, &[old], &[new])
}

/// The quote of an ICMPv6 error, read in place.
#[inline(always)]
fn quote6(ctx: &TcContext, at: usize) -> Option<&[u8; QUOTE6_LEN]> {
    let p = ptr_at::<[u8; QUOTE6_LEN]>(ctx, at)?;
    // SAFETY: bounds checked by `ptr_at`; read only, and used before the packet changes.
    Some(unsafe { &*p })
}

/// Translates an ICMPv6 error in place (see the module docs). Everything is read from the
/// packet and written back with `bpf_skb_store_bytes`, the new addresses from the flow
/// entry itself: no copy of the quote takes stack room (the caller's frame and this one
/// must fit the verifier's 512 bytes together). `snat`: the outer destination is this
/// node's SNAT address, and becomes the client too.
#[inline(always)]
fn translate6(ctx: &TcContext, side: Side, snat: bool) -> Option<()> {
    let icmp_off = L2_L3_LEN6;
    let inner_off = icmp_off + ICMP_LEN;
    let end = inner_off + QUOTE6_LEN;
    if ctx.data() + end > ctx.data_end() {
        let _ = ctx.pull_data(end as u32);
    }
    let kind: u8 = ctx.load(icmp_off).ok()?;
    if kind == 0 || kind > ICMPV6_ERROR_MAX {
        return None;
    }
    // (where the translated address and port are in the quote, where the client's are,
    // where the translated address is in the outer header)
    let (addr_at, port_at, peer_addr_at, peer_at, outer_at) = match side {
        Side::ToClient => (24, 42, 8, 40, 8),
        Side::FromClient => (8, 40, 24, 42, 24),
    };
    let q = quote6(ctx, inner_off)?;
    let proto = q[6];
    if q[0] >> 4 != 6 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
        return None;
    }
    // SAFETY: within the quote; unaligned reads.
    let ports = unsafe { q.as_ptr().add(40).cast::<u32>().read_unaligned() };
    let (sport, dport) = (ports as u16, (ports >> 16) as u16);
    // The flow entry that names the other ends (see `translate`): the reply half for an
    // error to the client, the forward half for the client's own.
    let e = flow::quoted_entry6(side == Side::ToClient, proto, q, sport, dport)?;
    let outer = ptr_at::<[u8; 16]>(ctx, ETH_LEN + outer_at)?;
    // SAFETY: bounds checked by `ptr_at`.
    let outer = unsafe { &*outer };
    // A backend's own error, or a client's error to the VIP: the outer end is the quote's
    // translated address, and changes with it.
    let outer_too = same16(&q[addr_at..addr_at + 16], outer);
    let outer_sum = sum16(outer);
    // Every byte of the quote that changes is in q[8..44]: both addresses and both ports.
    let old_sum = sum16(&q[8..44]);
    let udp_csum: u16 = if proto == IPPROTO_UDP {
        ctx.load(inner_off + 46).ok()?
    } else {
        0
    };
    let icmp_csum: u16 = ctx.load(icmp_off + ICMP_CSUM).ok()?;
    ctx.store(inner_off + addr_at, &e.nat_addr, 0).ok()?;
    ctx.store(inner_off + peer_addr_at, &e.peer_addr, 0).ok()?;
    ctx.store(inner_off + port_at, &e.nat_port_be, 0).ok()?;
    ctx.store(inner_off + peer_at, &e.peer_port_be, 0).ok()?;
    // The stores moved the packet: read the quote again.
    let q = quote6(ctx, inner_off)?;
    let new_sum = sum16(&q[8..44]);
    let mut icmp_csum = replace_sum(icmp_csum, old_sum, new_sum);
    // The quoted UDP checksum (in the 8 bytes): its pseudo-header holds both addresses.
    if udp_csum != 0 {
        let c2 = replace_sum(udp_csum, old_sum, new_sum);
        ctx.store(inner_off + 46, &c2, 0).ok()?;
        icmp_csum = csum::update(icmp_csum, &[udp_csum], &[c2]);
    }
    // The outer end is in the ICMPv6 pseudo-header.
    if outer_too {
        icmp_csum = replace_sum(icmp_csum, outer_sum, sum16(&e.nat_addr));
        ctx.store(ETH_LEN + outer_at, &e.nat_addr, 0).ok()?;
    }
    if snat {
        let dst = ptr_at::<[u8; 16]>(ctx, IP6_DST_OFF)?;
        // SAFETY: bounds checked by `ptr_at`; read before the store below.
        let old = sum16(unsafe { &*dst });
        icmp_csum = replace_sum(icmp_csum, old, sum16(&e.peer_addr));
        ctx.store(IP6_DST_OFF, &e.peer_addr, 0).ok()?;
    }
    ctx.store(icmp_off + ICMP_CSUM, &icmp_csum, 0).ok()?;
    Some(())
}

/// ICMP versus ICMPv6: the error formats this module translates, per family, for the hooks'
/// pipelines (`hooks`), which are written once for both.
pub trait Errors: Sized {
    /// The upper-layer protocol number of the family's ICMP.
    const PROTO: u8;
    /// An error travelling to a client, about its translated packet: translated in place
    /// ([`to_client`], [`to_client6`]).
    fn to_client(ctx: &TcContext);
    /// An error from a client, about a reply it got: translated in place ([`from_client`],
    /// [`from_client6`]).
    fn from_client(ctx: &TcContext);
    /// An error addressed to one of this node's SNAT addresses, about a source-NATed
    /// packet: translated and readdressed to the client ([`to_snat_client`],
    /// [`to_snat_client6`]); whether it was. The caller reads the new outer addresses from
    /// the packet (`Headers::addrs`).
    fn to_snat_client(ctx: &TcContext) -> bool;
}

/// BPF functions of their own, as their IPv6 twins: the quote they read takes room in
/// their frame only, not in the hook's.
impl Errors for [u8; 4] {
    const PROTO: u8 = IPPROTO_ICMP;
    #[inline(never)]
    fn to_client(ctx: &TcContext) {
        to_client(ctx);
    }
    #[inline(never)]
    fn from_client(ctx: &TcContext) {
        from_client(ctx);
    }
    #[inline(never)]
    fn to_snat_client(ctx: &TcContext) -> bool {
        to_snat_client(ctx).is_some()
    }
}

/// The IPv6 functions take the context by value (see [`to_client6`]).
impl Errors for [u8; 16] {
    const PROTO: u8 = IPPROTO_ICMPV6;
    #[inline(always)]
    fn to_client(ctx: &TcContext) {
        to_client6(TcContext::new(ctx.skb.skb));
    }
    #[inline(always)]
    fn from_client(ctx: &TcContext) {
        from_client6(TcContext::new(ctx.skb.skb));
    }
    #[inline(always)]
    fn to_snat_client(ctx: &TcContext) -> bool {
        to_snat_client6(TcContext::new(ctx.skb.skb))
    }
}
