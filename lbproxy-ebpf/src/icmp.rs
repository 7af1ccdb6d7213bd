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
//! Only quotes with a 20-byte inner IP header of TCP or UDP are translated; the ICMP
//! checksum (which covers the quote), the quoted IP header checksum and, when the quote holds
//! it, the quoted L4 checksum are updated incrementally. Nothing here creates or changes flow
//! state. Errors for no known flow pass untouched.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{IPPROTO_TCP, IPPROTO_UDP};
use network_types::{eth::EtherType, ip::Ipv4Hdr};

use crate::{
    flow::{self, NatTarget},
    nat::csum,
    parse::{ETH_LEN, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, TCP_CSUM_OFF, UDP_CSUM_OFF},
};

pub const IPPROTO_ICMP: u8 = 1;
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
    if !(ETH_LEN + Ipv4Hdr::LEN..=ETH_LEN + 60).contains(&icmp_off) {
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
    // The outer header: the VIP as the source of a backend's own error, the backend as the
    // destination of a client's error to the VIP; and, for a source-NATed flow, the client
    // as the destination of an error addressed to the node's SNAT address.
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
            word(&outer, 10),
            &[
                word(&outer, 12),
                word(&outer, 14),
                word(&outer, 16),
                word(&outer, 18),
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
