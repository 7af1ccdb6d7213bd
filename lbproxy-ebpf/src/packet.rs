//! Bounds-checked packet access and the header offsets the other stages use.

use core::mem::{offset_of, size_of};

use aya_ebpf::programs::TcContext;
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};

use crate::reason::Verdict;
use lbproxy_common::{DropReason, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_LEN: usize = EthHdr::LEN;
pub const IP_CSUM_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, check);
pub const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
pub const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);
pub const TCP_CSUM_OFF: usize = offset_of!(TcpHdr, check);
pub const UDP_CSUM_OFF: usize = offset_of!(UdpHdr, check);
/// Both TCP and UDP start with source port then destination port.
pub const L4_SPORT_OFF: usize = 0;
pub const L4_DPORT_OFF: usize = 2;
/// The more-fragments flag and fragment offset, in network order as read raw.
const IP_FRAG_MASK_BE: u16 = 0x3fff_u16.to_be();

/// A pointer to `T` at `offset` in the packet, or `None` if it would run past the end.
#[inline(always)]
pub fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *const T)
}

/// The parts of an IPv4 TCP or UDP packet the load balancer looks at. Addresses and ports
/// are raw network-order bytes, as in the maps.
#[derive(Clone, Copy)]
pub struct Packet {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    pub proto: u8,
    /// TCP flags (byte 13 of the header); 0 for UDP.
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame.
    pub l4_off: usize,
}

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_ACK: u8 = 0x10;

impl Packet {
    /// A SYN without ACK: the first segment of a TCP connection (or its retransmission).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.proto == IPPROTO_TCP && self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
    }
}

impl Packet {
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

/// Stage 0: parse. Returns `Ok(None)` for anything that is not a first-or-only fragment of
/// IPv4 TCP or UDP (the load balancer leaves it alone), `Err(Malformed)` for a packet whose
/// headers are cut short.
#[inline(always)]
pub fn parse(ctx: &TcContext) -> Result<Option<Packet>, Verdict> {
    let eth: *const EthHdr = ptr_at(ctx, 0).ok_or(Verdict::Drop(DropReason::Malformed))?;
    // network-types 0.2: EtherType values are already in network order.
    if unsafe { (*eth).ether_type } != EtherType::Ipv4 as u16 {
        return Ok(None);
    }
    let ip: *const Ipv4Hdr = ptr_at(ctx, ETH_LEN).ok_or(Verdict::Drop(DropReason::Malformed))?;
    let (vihl, proto, frags, src_addr, dst_addr) = unsafe {
        (
            (*ip).vihl,
            (*ip).proto,
            u16::from_ne_bytes((*ip).frags),
            (*ip).src_addr,
            (*ip).dst_addr,
        )
    };
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(None);
    }
    if frags & IP_FRAG_MASK_BE != 0 {
        // Fragments are not translated: only the first carries ports. Documented limitation.
        return Ok(None);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    if ihl < Ipv4Hdr::LEN {
        return Err(Verdict::Drop(DropReason::Malformed));
    }
    let l4_off = ETH_LEN + ihl;
    // Ports are the first four bytes of both TCP and UDP; make sure the checksum field is
    // there too, since NAT rewrites it.
    let need = if proto == IPPROTO_TCP {
        TcpHdr::LEN
    } else {
        UdpHdr::LEN
    };
    if ctx.data() + l4_off + need > ctx.data_end() {
        return Err(Verdict::Drop(DropReason::Malformed));
    }
    let ports: *const [u16; 2] = ptr_at(ctx, l4_off).ok_or(Verdict::Drop(DropReason::Malformed))?;
    let [src_port_be, dst_port_be] = unsafe { *ports };
    let tcp_flags = if proto == IPPROTO_TCP {
        let f: *const u8 = ptr_at(ctx, l4_off + 13).ok_or(Verdict::Drop(DropReason::Malformed))?;
        unsafe { *f }
    } else {
        0
    };
    Ok(Some(Packet {
        src_addr,
        dst_addr,
        src_port_be,
        dst_port_be,
        proto,
        tcp_flags,
        l4_off,
    }))
}
