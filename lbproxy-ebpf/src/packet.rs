//! Where things are in a frame, bounds-checked access to them, and the parsed [`Packet`]
//! the stages hand each other. Shared by every stage, so it imports nothing of the datapath
//! (a leaf of its module graph).
//!
//! Every offset is from the start of the Ethernet frame unless its name says `L4_` or `TCP_`
//! (then it is from the start of the L4 header), and is computed from the header types with
//! `offset_of!` so it cannot disagree with them.

use core::mem::{offset_of, size_of};

use aya_ebpf::programs::TcContext;
use lbproxy_common::IPPROTO_TCP;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr, udp::UdpHdr};

pub const ETH_LEN: usize = EthHdr::LEN;
/// An IPv4 header without options (the only kind the reject path rewrites).
pub const IP_LEN: usize = Ipv4Hdr::LEN;
/// A TCP header without options.
pub const TCP_LEN: usize = TcpHdr::LEN;

/// The IPv4 TTL, followed by the protocol: the two make one checksummed 16-bit word.
pub const IP_TTL_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, ttl);
pub const IP_PROTO_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, proto);
pub const IP_CSUM_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, check);
pub const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
pub const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);
/// The longest IPv4 header (IHL 15), options included.
pub const IP_MAX_LEN: usize = 60;
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
const _: () = assert!(IP_PROTO_OFF == ETH_LEN + 9 && IP_SRC_OFF == ETH_LEN + 12);

/// The upper-layer protocol numbers of ICMP and ICMPv6.
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;

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
