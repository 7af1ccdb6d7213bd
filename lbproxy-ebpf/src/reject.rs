//! Stage 5 (on the reject path): answer the client at once instead of dropping.
//!
//! - TCP: the packet becomes a RST from the address the client connected to; the client sees
//!   "connection refused" (for a SYN) or "connection reset" (mid-stream).
//! - UDP: the packet becomes an ICMP port unreachable, quoting the original IP header and the
//!   first 8 bytes of the datagram, as a host would answer.
//!
//! For IPv6 ([`answer6`]) the same, with an ICMPv6 port unreachable (type 1, code 4) quoting
//! the IPv6 header and 8 bytes. A packet with extension headers first loses them
//! (`bpf_skb_adjust_room` at the network layer, the header's payload length and next header
//! set to the TCP or UDP segment's), so the answer and its quote are as if it had none: the
//! client's stack matches the quote by addresses, protocol and ports.
//!
//! Either way the answer is written over the packet in place and redirected out of the
//! interface it came in on, so it goes straight back to the pod. Packets with IP options are
//! not rewritten (they are dropped and counted as `reject_failed` instead). A TCP RST (RFC
//! 793) and a fragment after the first (no header to answer) are never answered: they are
//! dropped and counted as `reject_not_answered`.

use aya_ebpf::{
    EbpfContext as _,
    bindings::__sk_buff,
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use lbproxy_common::{DropReason, IPPROTO_TCP, VERDICT_REJECT};
use network_types::ip::Ipv4Hdr;

use crate::{
    csum::{fold, sum_words},
    monitor,
    packet::{
        ETH_LEN, IP_LEN, IP6_DST_OFF, IP6_LEN, IP6_SRC_OFF, Packet, TCP_FLAG_ACK, TCP_FLAG_FIN,
        TCP_FLAG_RST, TCP_FLAG_SYN, TCP_LEN, ptr_at,
    },
    reason::count,
    stage::Verdict,
};

const IPPROTO_ICMP: u8 = 1;
const BPF_ADJ_ROOM_MAC: u32 = 1;
const BPF_ADJ_ROOM_NET: u32 = 0;

const ICMP_LEN: usize = 8;
/// ICMP quotes the original IP header and 8 bytes of its payload.
const QUOTE_LEN: usize = IP_LEN + 8;

#[inline(always)]
fn fail() -> Verdict {
    Verdict::Drop(DropReason::RejectFailed)
}

#[inline(always)]
fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is the program's __sk_buff.
    unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex }
}

/// Cuts the packet to its answer's `len` bytes and sends it back out of the interface it
/// came in on.
#[inline(always)]
fn send_back(ctx: &TcContext, len: u32) -> Result<i32, Verdict> {
    // SAFETY: helpers of tc programs, with this program's own context.
    if unsafe { bpf_skb_change_tail(ctx.as_ptr().cast(), len, 0) } != 0 {
        return Err(fail());
    }
    Ok(unsafe { bpf_redirect(ifindex(ctx), 0) } as i32)
}

#[inline(always)]
fn swap_macs(ctx: &TcContext) -> Result<(), Verdict> {
    let macs: *const [u8; 12] = ptr_at(ctx, 0).ok_or_else(fail)?;
    let m = unsafe { *macs };
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&m[6..12]);
    swapped[6..].copy_from_slice(&m[..6]);
    ctx.store(0, &swapped, 0).map_err(|_| fail())
}

#[inline(always)]
fn ip_header(total_len: u16, proto: u8, src: [u8; 4], dst: [u8; 4]) -> [u8; IP_LEN] {
    let mut h = [0u8; IP_LEN];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total_len.to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src);
    h[16..20].copy_from_slice(&dst);
    let csum = fold(sum_words(&h, 0));
    h[10..12].copy_from_slice(&csum.to_be_bytes());
    h
}

#[inline(always)]
fn require_plain_ip(ctx: &TcContext, pkt: &Packet) -> Result<(), Verdict> {
    if pkt.l4_off != ETH_LEN + IP_LEN {
        return Err(fail());
    }
    let _: *const Ipv4Hdr = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    Ok(())
}

/// Answers `pkt`, which a stage rejected for `reason`: a TCP RST or an ICMP port
/// unreachable, counted under `reason` once it is written. A packet that must not be
/// answered ([`Packet::answerable`]) is dropped as `RejectNotAnswered`; an answer that cannot
/// be written is dropped as `RejectFailed`. A listening `lbproxy monitor` gets the packet as
/// it came, with the verdict `reject`.
#[inline(always)]
pub fn answer(ctx: &TcContext, pkt: &Packet, reason: DropReason, hook: u8) -> Result<i32, Verdict> {
    if !pkt.answerable() {
        return Err(Verdict::Drop(DropReason::RejectNotAnswered));
    }
    // Before the packet becomes its answer. An answer that then cannot be written also
    // shows as a `reject_failed` drop.
    monitor::event(ctx, hook, VERDICT_REJECT, reason);
    let action = if pkt.proto == IPPROTO_TCP {
        tcp_reset(ctx, pkt)?
    } else {
        udp_unreachable(ctx, pkt)?
    };
    count(reason);
    Ok(action)
}

/// The TCP header (checksum 0) of the RST answering the segment at `l4_off` from port
/// `sport` to `dport`, `l4_len` bytes with its header.
#[inline(always)]
fn rst_for(
    ctx: &TcContext,
    l4_off: usize,
    sport: u16,
    dport: u16,
    l4_len: usize,
) -> Result<[u8; TCP_LEN], Verdict> {
    let raw: *const [u8; 14] = ptr_at(ctx, l4_off).ok_or_else(fail)?;
    // SAFETY: bounds checked by `ptr_at`.
    let r = unsafe { *raw };
    let seq = u32::from_be_bytes([r[4], r[5], r[6], r[7]]);
    let ack_seq = u32::from_be_bytes([r[8], r[9], r[10], r[11]]);
    let doff = usize::from(r[12] >> 4) * 4;
    let payload = l4_len.saturating_sub(doff) as u32;
    Ok(rst_header(sport, dport, seq, ack_seq, r[13], payload))
}

/// The TCP header (checksum 0) of the RST answering a segment from port `sport` to `dport`
/// with sequence `seq`, acknowledgment `ack_seq`, `flags` and `payload` bytes. RFC 793:
/// answer an ACK with a RST carrying its ack number; anything else with RST+ACK
/// acknowledging what the segment occupied.
#[inline(always)]
fn rst_header(
    sport: u16,
    dport: u16,
    seq: u32,
    ack_seq: u32,
    flags: u8,
    payload: u32,
) -> [u8; TCP_LEN] {
    let (rst_seq, rst_ack, rst_flags) = if flags & TCP_FLAG_ACK != 0 {
        (ack_seq, 0, TCP_FLAG_RST)
    } else {
        let mut len = payload;
        if flags & TCP_FLAG_SYN != 0 {
            len += 1;
        }
        if flags & TCP_FLAG_FIN != 0 {
            len += 1;
        }
        (0, seq.wrapping_add(len), TCP_FLAG_RST | TCP_FLAG_ACK)
    };
    let mut t = [0u8; TCP_LEN];
    t[0..2].copy_from_slice(&dport.to_ne_bytes());
    t[2..4].copy_from_slice(&sport.to_ne_bytes());
    t[4..8].copy_from_slice(&rst_seq.to_be_bytes());
    t[8..12].copy_from_slice(&rst_ack.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = rst_flags;
    t
}

/// Rewrites a TCP segment into the RST its sender should get, and sends it back.
#[inline(always)]
fn tcp_reset(ctx: &TcContext, pkt: &Packet) -> Result<i32, Verdict> {
    require_plain_ip(ctx, pkt)?;
    let ip: *const Ipv4Hdr = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    // SAFETY: bounds checked by `ptr_at`.
    let tot_len = usize::from(u16::from_be_bytes(unsafe { (*ip).tot_len }));
    let mut t = rst_for(
        ctx,
        pkt.l4_off,
        pkt.src_port_be,
        pkt.dst_port_be,
        tot_len.saturating_sub(IP_LEN),
    )?;
    // Pseudo-header: source, destination, zero, protocol, TCP length.
    let mut acc = sum_words(&pkt.dst_addr, 0);
    acc = sum_words(&pkt.src_addr, acc);
    acc += 6 + TCP_LEN as u32;
    let csum = fold(sum_words(&t, acc));
    t[16..18].copy_from_slice(&csum.to_be_bytes());
    let iph = ip_header((IP_LEN + TCP_LEN) as u16, 6, pkt.dst_addr, pkt.src_addr);

    swap_macs(ctx)?;
    ctx.store(ETH_LEN, &iph, 0).map_err(|_| fail())?;
    ctx.store(ETH_LEN + IP_LEN, &t, 0).map_err(|_| fail())?;
    send_back(ctx, (ETH_LEN + IP_LEN + TCP_LEN) as u32)
}

/// Rewrites a UDP datagram into the ICMP port unreachable its sender should get, and sends
/// it back.
#[inline(always)]
fn udp_unreachable(ctx: &TcContext, pkt: &Packet) -> Result<i32, Verdict> {
    require_plain_ip(ctx, pkt)?;
    // The quote needs the original IP header and 8 bytes after it, all present.
    let _: *const [u8; QUOTE_LEN] = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    // Room for a new IP header and the ICMP header before the original IP header.
    ctx.adjust_room((IP_LEN + ICMP_LEN) as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| fail())?;
    let quote_off = ETH_LEN + IP_LEN + ICMP_LEN;
    let quote: *const [u8; QUOTE_LEN] = ptr_at(ctx, quote_off).ok_or_else(fail)?;
    let q = unsafe { *quote };
    let mut icmp = [0u8; ICMP_LEN];
    icmp[0] = 3; // destination unreachable
    icmp[1] = 3; // port unreachable
    let csum = fold(sum_words(&q, sum_words(&icmp, 0)));
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let total = (IP_LEN + ICMP_LEN + QUOTE_LEN) as u16;
    let iph = ip_header(total, IPPROTO_ICMP, pkt.dst_addr, pkt.src_addr);

    swap_macs(ctx)?;
    ctx.store(ETH_LEN, &iph, 0).map_err(|_| fail())?;
    ctx.store(ETH_LEN + IP_LEN, &icmp, 0).map_err(|_| fail())?;
    send_back(ctx, (ETH_LEN + usize::from(total)) as u32)
}

const IPPROTO_ICMPV6: u8 = 58;
/// ICMPv6 quotes the IPv6 header and 8 bytes of its payload here (RFC 4443 allows up to
/// the minimum MTU; the header and the ports are what the sender's stack matches on).
const QUOTE6_LEN: usize = IP6_LEN + 8;

/// [`answer`] for an IPv6 packet: a TCP RST, or an ICMPv6 port unreachable.
#[inline(always)]
pub fn answer6(
    ctx: &TcContext,
    pkt: &Packet<[u8; 16]>,
    reason: DropReason,
    hook: u8,
) -> Result<i32, Verdict> {
    if !pkt.answerable() {
        return Err(Verdict::Drop(DropReason::RejectNotAnswered));
    }
    monitor::event(ctx, hook, VERDICT_REJECT, reason);
    if pkt.l4_off != ETH_LEN + IP6_LEN {
        strip_ext6(ctx, pkt)?;
    }
    let action = if pkt.proto == IPPROTO_TCP {
        tcp_reset6(ctx, pkt)?
    } else {
        udp_unreachable6(ctx, pkt)?
    };
    count(reason);
    Ok(action)
}

/// Removes a packet's extension headers: the TCP or UDP header then follows the IPv6
/// header, whose payload length and next header are made the segment's.
#[inline(always)]
fn strip_ext6(ctx: &TcContext, pkt: &Packet<[u8; 16]>) -> Result<(), Verdict> {
    let ext = pkt
        .l4_off
        .checked_sub(ETH_LEN + IP6_LEN)
        .filter(|n| *n < 2048)
        .ok_or_else(fail)? as u16;
    let first: *const [u8; 8] = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    // SAFETY: bounds checked by `ptr_at`; read before the packet changes.
    let mut first = unsafe { *first };
    let payload_len = u16::from_be_bytes([first[4], first[5]])
        .checked_sub(ext)
        .ok_or_else(fail)?;
    ctx.adjust_room(-i32::from(ext), BPF_ADJ_ROOM_NET, 0)
        .map_err(|_| fail())?;
    first[4..6].copy_from_slice(&payload_len.to_be_bytes());
    first[6] = pkt.proto;
    ctx.store(ETH_LEN, &first, 0).map_err(|_| fail())
}

/// The first 8 bytes of an IPv6 header: version 6, no traffic class or flow label, the
/// payload length, the next header, hop limit 64.
#[inline(always)]
fn ip6_first(payload_len: u16, next: u8) -> [u8; 8] {
    let len = payload_len.to_be_bytes();
    [0x60, 0, 0, 0, len[0], len[1], next, 64]
}

/// The one's-complement sum of the IPv6 pseudo-header (RFC 8200, 8.1) of a packet from
/// `src` to `dst`, `len` bytes of upper layer `next`.
#[inline(always)]
fn pseudo6(src: &[u8; 16], dst: &[u8; 16], len: u32, next: u8) -> u32 {
    sum_words(dst, sum_words(src, 0)) + (len >> 16) + (len & 0xffff) + u32::from(next)
}

/// Writes the IPv6 header of the answer: from the address the client sent to, to the
/// client. The addresses are stored from the parsed packet as they are, not copied.
#[inline(always)]
fn answer_ip6(
    ctx: &TcContext,
    pkt: &Packet<[u8; 16]>,
    payload_len: u16,
    next: u8,
) -> Result<(), Verdict> {
    ctx.store(ETH_LEN, &ip6_first(payload_len, next), 0)
        .map_err(|_| fail())?;
    ctx.store(IP6_SRC_OFF, &pkt.dst_addr, 0)
        .map_err(|_| fail())?;
    ctx.store(IP6_DST_OFF, &pkt.src_addr, 0).map_err(|_| fail())
}

/// [`tcp_reset`] for IPv6.
#[inline(always)]
fn tcp_reset6(ctx: &TcContext, pkt: &Packet<[u8; 16]>) -> Result<i32, Verdict> {
    let first: *const [u8; 8] = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    // SAFETY: bounds checked by `ptr_at`. Without extension headers (`answer6` removed
    // any), the payload length is the L4 segment's.
    let payload_len = unsafe { u16::from_be_bytes([(*first)[4], (*first)[5]]) };
    let mut t = rst_for(
        ctx,
        ETH_LEN + IP6_LEN,
        pkt.src_port_be,
        pkt.dst_port_be,
        usize::from(payload_len),
    )?;
    let acc = pseudo6(&pkt.dst_addr, &pkt.src_addr, TCP_LEN as u32, IPPROTO_TCP);
    let csum = fold(sum_words(&t, acc));
    t[16..18].copy_from_slice(&csum.to_be_bytes());

    swap_macs(ctx)?;
    answer_ip6(ctx, pkt, TCP_LEN as u16, IPPROTO_TCP)?;
    ctx.store(ETH_LEN + IP6_LEN, &t, 0).map_err(|_| fail())?;
    send_back(ctx, (ETH_LEN + IP6_LEN + TCP_LEN) as u32)
}

/// [`udp_unreachable`] for IPv6: ICMPv6 destination unreachable, port unreachable.
#[inline(always)]
fn udp_unreachable6(ctx: &TcContext, pkt: &Packet<[u8; 16]>) -> Result<i32, Verdict> {
    let _: *const [u8; QUOTE6_LEN] = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    ctx.adjust_room((IP6_LEN + ICMP_LEN) as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| fail())?;
    let quote_off = ETH_LEN + IP6_LEN + ICMP_LEN;
    let quote: *const [u8; QUOTE6_LEN] = ptr_at(ctx, quote_off).ok_or_else(fail)?;
    let mut icmp = [0u8; ICMP_LEN];
    icmp[0] = 1; // destination unreachable
    icmp[1] = 4; // port unreachable
    let len = (ICMP_LEN + QUOTE6_LEN) as u32;
    let acc = pseudo6(&pkt.dst_addr, &pkt.src_addr, len, IPPROTO_ICMPV6);
    // SAFETY: bounds checked by `ptr_at`; read in place.
    let csum = fold(sum_words(unsafe { &*quote }, sum_words(&icmp, acc)));
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());

    swap_macs(ctx)?;
    answer_ip6(ctx, pkt, len as u16, IPPROTO_ICMPV6)?;
    ctx.store(ETH_LEN + IP6_LEN, &icmp, 0).map_err(|_| fail())?;
    send_back(ctx, (ETH_LEN + IP6_LEN) as u32 + len)
}

/// A TCP RST versus an ICMP or ICMPv6 port unreachable: the answers of each family, for the
/// hooks' pipelines (`hooks`), which are written once for both.
pub trait Answer: Sized {
    /// Answers `pkt`, rejected for `reason` ([`answer`], [`answer6`]).
    fn answer(
        ctx: &TcContext,
        pkt: &Packet<Self>,
        reason: DropReason,
        hook: u8,
    ) -> Result<i32, Verdict>;
}

impl Answer for [u8; 4] {
    #[inline(always)]
    fn answer(
        ctx: &TcContext,
        pkt: &Packet<Self>,
        reason: DropReason,
        hook: u8,
    ) -> Result<i32, Verdict> {
        answer(ctx, pkt, reason, hook)
    }
}

impl Answer for [u8; 16] {
    #[inline(always)]
    fn answer(
        ctx: &TcContext,
        pkt: &Packet<Self>,
        reason: DropReason,
        hook: u8,
    ) -> Result<i32, Verdict> {
        answer6(ctx, pkt, reason, hook)
    }
}
