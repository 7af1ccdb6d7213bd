//! Stage 5 (on the reject path): answer the client at once instead of dropping.
//!
//! - TCP: the packet becomes a RST from the address the client connected to; the client sees
//!   "connection refused" (for a SYN) or "connection reset" (mid-stream).
//! - UDP: the packet becomes an ICMP port unreachable, quoting the original IP header and the
//!   first 8 bytes of the datagram, as a host would answer.
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
use network_types::{ip::Ipv4Hdr, tcp::TcpHdr};

use crate::{
    monitor,
    nat::csum::{fold, sum_words},
    parse::{
        ETH_LEN, IP_LEN, Packet, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN, TCP_LEN,
        ptr_at,
    },
    reason::{Verdict, count},
};

const IPPROTO_ICMP: u8 = 1;
const BPF_ADJ_ROOM_MAC: u32 = 1;

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

/// Rewrites a TCP segment into the RST its sender should get, and sends it back.
#[inline(always)]
fn tcp_reset(ctx: &TcContext, pkt: &Packet) -> Result<i32, Verdict> {
    require_plain_ip(ctx, pkt)?;
    let ip: *const Ipv4Hdr = ptr_at(ctx, ETH_LEN).ok_or_else(fail)?;
    let tcp: *const TcpHdr = ptr_at(ctx, pkt.l4_off).ok_or_else(fail)?;
    let (tot_len, seq, ack_seq, doff_flags) = unsafe {
        let raw: *const [u8; 14] = tcp.cast();
        let r = *raw;
        (
            u16::from_be_bytes((*ip).tot_len),
            u32::from_be_bytes([r[4], r[5], r[6], r[7]]),
            u32::from_be_bytes([r[8], r[9], r[10], r[11]]),
            [r[12], r[13]],
        )
    };
    let doff = usize::from(doff_flags[0] >> 4) * 4;
    let flags = doff_flags[1];
    let payload = usize::from(tot_len).saturating_sub(IP_LEN + doff) as u32;

    // RFC 793: answer an ACK with a RST carrying its ack number; anything else with RST+ACK
    // acknowledging what the segment occupied.
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
    t[0..2].copy_from_slice(&pkt.dst_port_be.to_ne_bytes());
    t[2..4].copy_from_slice(&pkt.src_port_be.to_ne_bytes());
    t[4..8].copy_from_slice(&rst_seq.to_be_bytes());
    t[8..12].copy_from_slice(&rst_ack.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = rst_flags;
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
    let len = (ETH_LEN + IP_LEN + TCP_LEN) as u32;
    if unsafe { bpf_skb_change_tail(ctx.as_ptr().cast(), len, 0) } != 0 {
        return Err(fail());
    }
    Ok(unsafe { bpf_redirect(ifindex(ctx), 0) } as i32)
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
    let len = (ETH_LEN + usize::from(total)) as u32;
    if unsafe { bpf_skb_change_tail(ctx.as_ptr().cast(), len, 0) } != 0 {
        return Err(fail());
    }
    Ok(unsafe { bpf_redirect(ifindex(ctx), 0) } as i32)
}
