//! Stage 0: parse. The fields of an IPv4 TCP or UDP packet the load balancer looks at, read
//! once; [`offsets`] says where everything is and checks access to it.

mod offsets;

use aya_ebpf::programs::TcContext;
use lbproxy_common::{DropReason, IPPROTO_TCP, IPPROTO_UDP};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};

pub use self::offsets::*;
use crate::reason::Verdict;

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

impl Packet {
    /// A SYN without ACK: the first segment of a TCP connection (or its retransmission).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.proto == IPPROTO_TCP && self.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN
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

/// Reads the packet. Returns `Ok(None)` for anything that is not a first-or-only fragment of
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
        let f: *const u8 =
            ptr_at(ctx, l4_off + TCP_FLAGS_OFF).ok_or(Verdict::Drop(DropReason::Malformed))?;
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
