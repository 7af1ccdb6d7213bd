//! Where things are in a frame, and bounds-checked access to them.
//!
//! Every offset is from the start of the Ethernet frame unless its name says `L4_` or `TCP_`
//! (then it is from the start of the L4 header), and is computed from the header types with
//! `offset_of!` so it cannot disagree with them.

use core::mem::{offset_of, size_of};

use aya_ebpf::programs::TcContext;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr, udp::UdpHdr};

pub const ETH_LEN: usize = EthHdr::LEN;
/// An IPv4 header without options (the only kind the reject path rewrites).
pub const IP_LEN: usize = Ipv4Hdr::LEN;
/// A TCP header without options.
pub const TCP_LEN: usize = TcpHdr::LEN;

/// The IPv4 TTL, followed by the protocol: the two make one checksummed 16-bit word.
pub const IP_TTL_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, ttl);
pub const IP_CSUM_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, check);
pub const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
pub const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);
/// The Ethernet header and an IPv4 header without options.
pub const L2_L3_LEN: usize = ETH_LEN + IP_LEN;

/// The fixed IPv6 header (RFC 8200): no checksum, extension headers after it.
pub const IP6_LEN: usize = 40;
/// Its next-header byte.
pub const IP6_NEXT_OFF: usize = ETH_LEN + 6;
/// The hop limit, IPv6's TTL.
pub const IP6_HOPS_OFF: usize = ETH_LEN + 7;
pub const IP6_SRC_OFF: usize = ETH_LEN + 8;
pub const IP6_DST_OFF: usize = ETH_LEN + 24;
/// The Ethernet header and the fixed IPv6 header.
pub const L2_L3_LEN6: usize = ETH_LEN + IP6_LEN;

/// Both TCP and UDP start with source port then destination port.
pub const L4_SPORT_OFF: usize = 0;
pub const L4_DPORT_OFF: usize = 2;
const _: () = assert!(L4_SPORT_OFF == offset_of!(TcpHdr, source));
const _: () = assert!(L4_SPORT_OFF == offset_of!(UdpHdr, src));
const _: () = assert!(L4_DPORT_OFF == offset_of!(TcpHdr, dest));
const _: () = assert!(L4_DPORT_OFF == offset_of!(UdpHdr, dst));
pub const TCP_CSUM_OFF: usize = offset_of!(TcpHdr, check);
pub const UDP_CSUM_OFF: usize = offset_of!(UdpHdr, check);
/// The TCP flags byte: the second byte of the data-offset/flags word.
pub const TCP_FLAGS_OFF: usize = offset_of!(TcpHdr, _bitfield_1) + 1;

const _: () = assert!(IP_LEN == 20 && TCP_LEN == 20 && TCP_FLAGS_OFF == 13);
const _: () = assert!(IP_TTL_OFF == ETH_LEN + 8 && L2_L3_LEN == ETH_LEN + 20);

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// The more-fragments flag, in the IPv4 flags/fragment-offset word (host order).
pub const IP_FRAG_MF: u16 = 0x2000;
/// The fragment offset, in 8-byte units, in the same word: not 0 for a later fragment.
pub const IP_FRAG_OFFSET: u16 = 0x1fff;

/// A pointer to `T` at `offset` in the packet, or `None` if it would run past the end.
///
/// There is no `ptr_at_mut`: the datapath writes packets only with `bpf_skb_store_bytes`
/// (`TcContext::store`) and the checksum helpers, never through a pointer.
#[inline(always)]
pub fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *const T)
}
