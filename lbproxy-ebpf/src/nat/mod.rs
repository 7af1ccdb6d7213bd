//! Stage 4: translate L3 then L4, with incremental checksum updates (the kernel's
//! `bpf_l3_csum_replace`/`bpf_l4_csum_replace` here; [`csum`] where a stage rewrites a header
//! itself).

pub mod csum;

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, IPPROTO_UDP};

use crate::{
    flow::NatTarget,
    parse::{IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, L4, L4_DPORT_OFF, L4_SPORT_OFF, Packet},
    reason::Verdict,
};

/// The address is part of the L4 pseudo-header.
const BPF_F_PSEUDO_HDR: u64 = 0x10;
/// UDP: a zero checksum means "none" and must stay zero; a computed zero becomes 0xffff.
const BPF_F_MARK_MANGLED_0: u64 = 0x20;

/// Rewrites the destination (client -> VIP becomes client -> backend), and the source
/// when the flow is source-NATed (`to.peer_addr`, the node's address).
#[inline(always)]
pub fn dnat(ctx: &TcContext, pkt: &Packet, to: NatTarget) -> Result<(), Verdict> {
    dnat_l4(ctx, pkt, to)?;
    rewrite_l3(ctx, IP_DST_OFF, pkt.dst_addr, to.addr)?;
    rewrite_l3(ctx, IP_SRC_OFF, pkt.src_addr, to.peer_addr)
}

/// Rewrites the source (backend -> client becomes VIP -> client), and the destination back
/// to the client's own address when the flow is source-NATed (`to.peer_addr`).
#[inline(always)]
pub fn snat(ctx: &TcContext, pkt: &Packet, to: NatTarget) -> Result<(), Verdict> {
    snat_l4(ctx, pkt, to)?;
    rewrite_l3(ctx, IP_SRC_OFF, pkt.src_addr, to.addr)?;
    rewrite_l3(ctx, IP_DST_OFF, pkt.dst_addr, to.peer_addr)
}

/// The L4 half of [`dnat`]: the destination port, the source port when the flow's tuple
/// clashed (`to.peer_port_be`), and the L4 checksum. The caller writes the IP header itself
/// (the stack bypass rewrites it together with the hop's TTL and MACs).
#[inline(always)]
pub fn dnat_l4(ctx: &TcContext, pkt: &Packet, to: NatTarget) -> Result<(), Verdict> {
    rewrite_l4(
        ctx,
        pkt,
        [(pkt.dst_addr, to.addr), (pkt.src_addr, to.peer_addr)],
        [
            (pkt.l4_off + L4_DPORT_OFF, pkt.dst_port_be, to.port_be),
            (pkt.l4_off + L4_SPORT_OFF, pkt.src_port_be, to.peer_port_be),
        ],
    )
}

/// The L4 half of [`snat`]: the source port, the destination port back to the client's own
/// (`to.peer_port_be`), and the L4 checksum.
#[inline(always)]
pub fn snat_l4(ctx: &TcContext, pkt: &Packet, to: NatTarget) -> Result<(), Verdict> {
    rewrite_l4(
        ctx,
        pkt,
        [(pkt.src_addr, to.addr), (pkt.dst_addr, to.peer_addr)],
        [
            (pkt.l4_off + L4_SPORT_OFF, pkt.src_port_be, to.port_be),
            (pkt.l4_off + L4_DPORT_OFF, pkt.dst_port_be, to.peer_port_be),
        ],
    )
}

const FAIL: Verdict = Verdict::Drop(DropReason::NatFailed);

/// The ports (offset, old, new; unchanged ones are skipped), and the L4 checksum for them and
/// for the addresses (old, new; part of the pseudo-header; unchanged ones are skipped). Nothing for a packet without its L4 header (a
/// fragment after the first): only its IP header is translated.
#[inline(always)]
fn rewrite_l4(
    ctx: &TcContext,
    pkt: &Packet,
    addrs: [([u8; 4], [u8; 4]); 2],
    ports: [(usize, u16, u16); 2],
) -> Result<(), Verdict> {
    if pkt.l4 != L4::Header {
        // A fragment after the first: no L4 header here. The first fragment's checksum
        // covers the whole datagram and was updated for the new address and port.
        return Ok(());
    }
    let l4_flags = if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    let csum_off = pkt.l4_csum_off();
    for (old_addr, new_addr) in addrs {
        let old_a = u64::from(u32::from_ne_bytes(old_addr));
        let new_a = u64::from(u32::from_ne_bytes(new_addr));
        if old_a != new_a {
            ctx.l4_csum_replace(csum_off, old_a, new_a, l4_flags | BPF_F_PSEUDO_HDR | 4)
                .map_err(|_| FAIL)?;
        }
    }
    for (off, old, new) in ports {
        if old != new {
            ctx.l4_csum_replace(csum_off, u64::from(old), u64::from(new), l4_flags | 2)
                .map_err(|_| FAIL)?;
            ctx.store(off, &new, 0).map_err(|_| FAIL)?;
        }
    }
    Ok(())
}

/// The address in the IP header, and the header checksum.
#[inline(always)]
fn rewrite_l3(
    ctx: &TcContext,
    addr_off: usize,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
) -> Result<(), Verdict> {
    if old_addr == new_addr {
        return Ok(());
    }
    let old_a = u64::from(u32::from_ne_bytes(old_addr));
    let new_a = u64::from(u32::from_ne_bytes(new_addr));
    ctx.l3_csum_replace(IP_CSUM_OFF, old_a, new_a, 4)
        .map_err(|_| FAIL)?;
    ctx.store(addr_off, &new_addr, 0).map_err(|_| FAIL)
}
