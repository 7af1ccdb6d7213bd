//! Stage 4: translate L3 then L4, with incremental checksum updates (the kernel's
//! `bpf_l3_csum_replace`/`bpf_l4_csum_replace` here; `csum` where a stage rewrites a header
//! itself).

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, IPPROTO_SCTP, IPPROTO_UDP};

use crate::{
    csum::words_diff,
    family::Family,
    packet::{IP_DST_OFF, IP_SRC_OFF, L4, L4_DPORT_OFF, L4_SPORT_OFF, Packet},
    sctp,
    stage::{NatTarget, Verdict},
};

/// The address is part of the L4 pseudo-header.
const BPF_F_PSEUDO_HDR: u64 = 0x10;
/// UDP: a zero checksum means "none" and must stay zero; a computed zero becomes 0xffff.
const BPF_F_MARK_MANGLED_0: u64 = 0x20;

/// Rewrites the destination (client -> VIP becomes client -> backend), and the source
/// when the flow is source-NATed (`to.peer_addr`, the node's address).
#[inline(always)]
pub fn dnat<A: Family>(ctx: &TcContext, pkt: &Packet<A>, to: NatTarget<A>) -> Result<(), Verdict> {
    dnat_l4(ctx, pkt, to)?;
    A::rewrite_l3(
        ctx,
        (&pkt.src_addr, &pkt.dst_addr),
        (&to.peer_addr, &to.addr),
    )
}

/// Rewrites the source (backend -> client becomes VIP -> client), and the destination back
/// to the client's own address when the flow is source-NATed (`to.peer_addr`).
#[inline(always)]
pub fn snat<A: Family>(ctx: &TcContext, pkt: &Packet<A>, to: NatTarget<A>) -> Result<(), Verdict> {
    snat_l4(ctx, pkt, to)?;
    A::rewrite_l3(
        ctx,
        (&pkt.src_addr, &pkt.dst_addr),
        (&to.addr, &to.peer_addr),
    )
}

/// The L4 half of [`dnat`]: the destination port, the source port when the flow's tuple
/// clashed (`to.peer_port_be`), and the L4 checksum. The caller writes the IP header itself
/// (the stack bypass rewrites it together with the hop's TTL and MACs).
#[inline(always)]
pub fn dnat_l4<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    to: NatTarget<A>,
) -> Result<(), Verdict> {
    rewrite_l4(
        ctx,
        pkt,
        (&to.peer_addr, &to.addr),
        [to.peer_port_be, to.port_be],
    )
}

/// The L4 half of [`snat`]: the source port, the destination port back to the client's own
/// (`to.peer_port_be`), and the L4 checksum.
#[inline(always)]
pub fn snat_l4<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    to: NatTarget<A>,
) -> Result<(), Verdict> {
    rewrite_l4(
        ctx,
        pkt,
        (&to.addr, &to.peer_addr),
        [to.port_be, to.peer_port_be],
    )
}

const FAIL: Verdict = Verdict::Drop(DropReason::NatFailed);

/// The two 16-bit ports (source, destination) as the one 32-bit word they form in the L4
/// header.
#[inline(always)]
fn port_word(src_be: u16, dst_be: u16) -> u32 {
    let s = src_be.to_ne_bytes();
    let d = dst_be.to_ne_bytes();
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// The ports to `ports` (source, destination; network order), and the L4 checksum for them
/// and for the IP addresses changing to `addrs` (source, destination; part of the
/// pseudo-header): one checksum update for the addresses and one for the ports, each by
/// difference, and one 4-byte store of both ports. A checksum left alone when nothing it
/// covers changes. Nothing for a packet without its L4 header (a fragment after the
/// first): only its IP header is translated. SCTP's checksum (CRC32c) covers no
/// pseudo-header: only a change of port changes it (`sctp::rewrite_ports`).
#[inline(always)]
fn rewrite_l4<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    addrs: (&A, &A),
    ports: [u16; 2],
) -> Result<(), Verdict> {
    if pkt.l4 != L4::Header {
        // A fragment after the first: no L4 header here. The first fragment's checksum
        // covers the whole datagram and was updated for the new address and port.
        return Ok(());
    }
    if pkt.proto == IPPROTO_SCTP {
        let old = port_word(pkt.src_port_be, pkt.dst_port_be);
        let new = port_word(ports[0], ports[1]);
        if old != new && sctp::rewrite_ports(ctx, pkt.l4_off, A::AF, old, new) != 0 {
            return Err(FAIL);
        }
        return Ok(());
    }
    let l4_flags = if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    let csum_off = pkt.l4_csum_off();
    let addr_diff = A::addr_diff((&pkt.src_addr, &pkt.dst_addr), (addrs.0, addrs.1));
    let old_ports = port_word(pkt.src_port_be, pkt.dst_port_be);
    let new_ports = port_word(ports[0], ports[1]);
    if addr_diff != 0 {
        // Size 0: `to` is a difference, from `diff`.
        ctx.l4_csum_replace(
            csum_off,
            0,
            u64::from(addr_diff),
            l4_flags | BPF_F_PSEUDO_HDR,
        )
        .map_err(|_| FAIL)?;
    }
    if old_ports != new_ports {
        let d = words_diff([old_ports], [new_ports]);
        ctx.l4_csum_replace(csum_off, 0, u64::from(d), l4_flags)
            .map_err(|_| FAIL)?;
        ctx.store(pkt.l4_off + L4_SPORT_OFF, &new_ports.to_ne_bytes(), 0)
            .map_err(|_| FAIL)?;
    }
    Ok(())
}

// The two addresses are one 8-byte store, and the two ports one 4-byte store.
const _: () = assert!(IP_DST_OFF == IP_SRC_OFF + 4);
const _: () = assert!(L4_DPORT_OFF == L4_SPORT_OFF + 2);
