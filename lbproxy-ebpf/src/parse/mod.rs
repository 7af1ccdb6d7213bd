//! Stage 0: parse. The fields of an IPv4 or IPv6 TCP or UDP packet the load balancer looks
//! at, read once; [`offsets`] says where everything is and checks access to it.

mod offsets;

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, FragKey, FragPorts, IPPROTO_TCP, IPPROTO_UDP};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};

pub use self::offsets::*;
use crate::{
    maps::LB_FRAGS_V1,
    reason::{Verdict, count},
};

/// What a [`Packet`] holds of its TCP or UDP header.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L4 {
    /// The whole fixed header: translatable, answerable.
    Header,
    /// None: an IPv4 fragment after the first. The ports are the first fragment's (from
    /// `LB_FRAGS_V1`) and `tcp_flags` is 0. Only the IP header may be rewritten, and such a
    /// packet is never answered.
    Absent,
    /// The ports, but the rest of the header cut short, or a TCP data offset below 5. Not
    /// translatable: dropped as `Malformed` when it is addressed to a frontend, else passed
    /// (and counted, `L4HeaderBadPassed`).
    Bad,
}

/// The parts of a TCP or UDP packet the load balancer looks at, of an IPv4 (`A = [u8; 4]`)
/// or IPv6 (`A = [u8; 16]`) packet. Addresses and ports are raw network-order bytes, as in
/// the maps.
#[derive(Clone, Copy)]
pub struct Packet<A = [u8; 4]> {
    pub src_addr: A,
    pub dst_addr: A,
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub proto: u8,
    /// TCP flags (byte 13 of the header); 0 for UDP and for a fragment after the first.
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame (where it would be, for
    /// [`L4::Absent`]).
    pub l4_off: usize,
    /// Whether the L4 header is here to be rewritten or answered.
    pub l4: L4,
}

impl<A> Packet<A> {
    /// A SYN without ACK: the first segment of a TCP connection (or its retransmission).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.proto == IPPROTO_TCP && self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }

    /// Whether a reject may answer this packet: it carries its whole L4 header (so it is not
    /// a later fragment) and is not a TCP RST (RFC 793: a RST is never answered).
    #[inline(always)]
    pub fn answerable(&self) -> bool {
        self.l4 == L4::Header && self.tcp_flags & TCP_FLAG_RST == 0
    }

    /// Offset of the L4 checksum field for this packet's protocol.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        if self.proto == IPPROTO_TCP {
            self.l4_off + TCP_CSUM_OFF
        } else {
            self.l4_off + UDP_CSUM_OFF
        }
    }
}

/// Makes the first `len` bytes of the packet (or all of it, when shorter) readable in the
/// linear part of the skb, with `bpf_skb_pull_data`, when they are not already. Headers a
/// driver, GRO or a tunnel left in paged data are then parsed like any other.
#[inline(always)]
fn pull(ctx: &TcContext, len: usize) {
    if ctx.data() + len > ctx.data_end() {
        let have = ctx.len() as usize;
        let want = if len < have { len } else { have };
        // A failure leaves the packet as it was; the bounds checks that follow decide.
        let _ = ctx.pull_data(want as u32);
    }
}

/// Reads the packet. Returns:
/// - `Ok(None)` for anything the load balancer leaves alone: not IPv4 (also an IPv4
///   EtherType whose header says another version), neither TCP nor UDP, a later fragment
///   whose first fragment was not seen (counted, `FragmentWithoutFirst`), a TCP or UDP
///   header cut before its ports (counted, `L4HeaderBadPassed`);
/// - `Err(Malformed)` for an IPv4 header that is cut short or whose IHL is impossible (the
///   stack drops those too);
/// - otherwise the packet, saying in [`Packet::l4`] whether its L4 header is all there.
///
/// The destination address of an IPv4 packet (`None` for anything else), for a packet
/// [`parse`] left alone (`Ok(None)`: neither TCP nor UDP).
#[inline(always)]
pub fn ipv4_dst(ctx: &TcContext) -> Option<[u8; 4]> {
    let ether_type: u16 = ctx.load(12).ok()?;
    if ether_type != EtherType::Ipv4 as u16 {
        return None;
    }
    ctx.load(IP_DST_OFF).ok()
}

/// A first fragment (MF set, offset 0) is parsed like a whole datagram and its ports are
/// recorded in `LB_FRAGS_V1`; a later fragment (offset > 0) gets the recorded ports.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Result<Option<Packet>, Verdict> {
    const MALFORMED: Verdict = Verdict::Drop(DropReason::Malformed);
    let eth: *const EthHdr = ptr_at(ctx, 0).ok_or(MALFORMED)?;
    // network-types 0.2: EtherType values are already in network order.
    if unsafe { (*eth).ether_type } != EtherType::Ipv4 as u16 {
        return Ok(None);
    }
    pull(ctx, L2_L3_LEN);
    let ip: *const Ipv4Hdr = ptr_at(ctx, ETH_LEN).ok_or(MALFORMED)?;
    let (vihl, proto, id_be, frags, src_addr, dst_addr) = unsafe {
        (
            (*ip).vihl,
            (*ip).proto,
            u16::from_ne_bytes((*ip).id),
            u16::from_be_bytes((*ip).frags),
            (*ip).src_addr,
            (*ip).dst_addr,
        )
    };
    if vihl >> 4 != 4 {
        // Not IPv4 after all; the stack drops it. Not ours to judge.
        return Ok(None);
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(None);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    if ihl < Ipv4Hdr::LEN {
        return Err(MALFORMED);
    }
    let l4_off = ETH_LEN + ihl;
    let frag_key = FragKey {
        src_addr,
        dst_addr,
        id_be,
        proto,
        _pad: 0,
    };
    if frags & IP_FRAG_OFFSET != 0 {
        // A later fragment: no L4 header, the first fragment's ports.
        let Some(ports) = (unsafe { LB_FRAGS_V1.get(frag_key) }).copied() else {
            count(DropReason::FragmentWithoutFirst);
            return Ok(None);
        };
        return Ok(Some(Packet {
            src_addr,
            dst_addr,
            src_port_be: ports.src_port_be,
            dst_port_be: ports.dst_port_be,
            proto,
            tcp_flags: 0,
            l4_off,
            l4: L4::Absent,
        }));
    }
    // Ports are the first four bytes of both TCP and UDP; NAT also rewrites the checksum
    // field, so the whole fixed header must be there.
    let need = if proto == IPPROTO_TCP {
        TcpHdr::LEN
    } else {
        UdpHdr::LEN
    };
    pull(ctx, l4_off + need);
    if ctx.data() + l4_off > ctx.data_end() {
        // IHL runs past the end of the packet.
        return Err(MALFORMED);
    }
    let Some(ports) = ptr_at::<[u16; 2]>(ctx, l4_off) else {
        count(DropReason::L4HeaderBadPassed);
        return Ok(None);
    };
    let [src_port_be, dst_port_be] = unsafe { *ports };
    let whole = ctx.data() + l4_off + need <= ctx.data_end();
    let (tcp_flags, l4) = if proto == IPPROTO_TCP {
        match ptr_at::<[u8; 2]>(ctx, l4_off + TCP_FLAGS_OFF - 1) {
            // Data offset (high nibble) below 5: a header shorter than its fixed part.
            Some(w) if whole && unsafe { (*w)[0] } >> 4 >= 5 => (unsafe { (*w)[1] }, L4::Header),
            _ => (0, L4::Bad),
        }
    } else if whole {
        (0, L4::Header)
    } else {
        (0, L4::Bad)
    };
    if frags & IP_FRAG_MF != 0 && l4 == L4::Header {
        // A first fragment: the later ones will need its ports. Overwrites an entry of an
        // earlier datagram with the same id.
        let ports = FragPorts {
            src_port_be,
            dst_port_be,
        };
        let _ = LB_FRAGS_V1.insert(frag_key, ports, 0);
    }
    Ok(Some(Packet {
        src_addr,
        dst_addr,
        src_port_be,
        dst_port_be,
        proto,
        tcp_flags,
        l4_off,
        l4,
    }))
}
