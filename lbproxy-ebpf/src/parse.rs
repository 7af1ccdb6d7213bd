//! Stage 0: parse. The fields of an IPv4 or IPv6 TCP, UDP or SCTP packet the load balancer
//! looks at, read once into a [`Packet`]; `packet` says where everything is and checks
//! access to it.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    DropReason, FragKey, FragKey6, FragPorts, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};

use crate::{
    maps::{LB_FRAGS_V1, LB_FRAGS6_V1},
    packet::*,
    reason::count,
    sctp::SCTP_HDR_LEN,
    stage::Verdict,
};

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
///   EtherType whose header says another version), not TCP, UDP or SCTP, a fragment of an
///   SCTP packet, a later fragment whose first fragment was not seen (counted,
///   `FragmentWithoutFirst`), a TCP, UDP or SCTP header cut before its ports (counted,
///   `L4HeaderBadPassed`);
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
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP {
        return Ok(None);
    }
    if proto == IPPROTO_SCTP && frags & (IP_FRAG_MF | IP_FRAG_OFFSET) != 0 {
        // A fragment of an SCTP packet: its CRC32c covers the whole packet, which no
        // fragment holds, so a port cannot be rewritten in it. Passed (docs/sctp.md).
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
    // Ports are the first four bytes of TCP, UDP and SCTP; NAT also rewrites the checksum
    // field, so the whole fixed header must be there.
    let need = l4_header_len(proto);
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

/// The fixed header of a TCP, UDP or SCTP packet (`proto`): what must be there to rewrite
/// its ports and checksum.
#[inline(always)]
fn l4_header_len(proto: u8) -> usize {
    if proto == IPPROTO_TCP {
        TcpHdr::LEN
    } else if proto == IPPROTO_UDP {
        UdpHdr::LEN
    } else {
        SCTP_HDR_LEN
    }
}

/// IPv6 next-header values the extension-header walk knows (RFC 8200, 4.1; RFC 4302).
const NH_HOP_BY_HOP: u8 = 0;
const NH_ROUTING: u8 = 43;
const NH_FRAGMENT: u8 = 44;
const NH_AH: u8 = 51;
const NH_DEST_OPTS: u8 = 60;

/// How many extension headers [`parse6`] walks before it gives up on a packet (and passes
/// it): more than any packet a stack sends (hop-by-hop, destination options, routing,
/// fragment, AH, destination options is six).
pub const MAX_EXT_HEADERS: u32 = 8;

/// Reads an IPv6 packet (the EtherType said IPv6). Everything not understood passes
/// (`Ok(None)`): a header cut short, another version, an upper layer other than TCP, UDP
/// or SCTP (ICMPv6 and so neighbour discovery among them), a fragment of an SCTP packet,
/// more than [`MAX_EXT_HEADERS`] extension headers, an extension header cut short, ESP.
/// The walk steps over hop-by-hop options, routing, destination options, AH and fragment
/// headers to find TCP, UDP or SCTP.
///
/// Fragments are handled as IPv4's: a first fragment (offset 0, M set) is parsed like a
/// whole datagram and its ports recorded in `LB_FRAGS6_V1` under the datagram's identity
/// (source, destination, identification, protocol); a later one gets those ports, with no L4
/// header ([`L4::Absent`]), or passes counted as `fragment_without_first`.
///
/// The extension headers and the L4 fields are read with `bpf_skb_load_bytes` at the
/// offsets the walk found, so paged data needs no pull for them.
#[inline(always)]
pub fn parse6(ctx: &TcContext) -> Result<Option<Packet<[u8; 16]>>, Verdict> {
    // The fixed header is read in place (pulled into the linear part when it is not there),
    // its addresses copied once, straight into the packet's fields.
    pull(ctx, L2_L3_LEN6);
    let Some(ip) = ptr_at::<[u8; IP6_LEN]>(ctx, ETH_LEN) else {
        return Ok(None);
    };
    // SAFETY: bounds checked by `ptr_at`.
    let (vtc, next) = unsafe { ((*ip)[0], (*ip)[6]) };
    if vtc >> 4 != 6 {
        return Ok(None);
    }
    let mut pkt = Packet {
        src_addr: [0u8; 16],
        dst_addr: [0u8; 16],
        src_port_be: 0,
        dst_port_be: 0,
        proto: 0,
        tcp_flags: 0,
        l4_off: 0,
        l4: L4::Bad,
    };
    // SAFETY: as above; both within the 40 bytes.
    unsafe {
        pkt.src_addr = ip.cast::<u8>().add(8).cast::<[u8; 16]>().read_unaligned();
        pkt.dst_addr = ip.cast::<u8>().add(24).cast::<[u8; 16]>().read_unaligned();
    }
    let Some(Walk {
        next,
        off,
        later_fragment,
        frag,
    }) = walk_ext6(ctx, next)
    else {
        return Ok(None);
    };
    if next != IPPROTO_TCP && next != IPPROTO_UDP && next != IPPROTO_SCTP {
        return Ok(None);
    }
    if next == IPPROTO_SCTP && (later_fragment || matches!(frag, Some((_, true)))) {
        // A fragment of an SCTP packet: passed, as IPv4's.
        return Ok(None);
    }
    if later_fragment {
        // No L4 header: the first fragment's ports, when it was seen.
        let id = frag.map_or(0, |(id, _)| id);
        let found = frag6_ports(&pkt.src_addr, &pkt.dst_addr, id, next);
        if found == 0 {
            count(DropReason::FragmentWithoutFirst);
            return Ok(None);
        }
        pkt.src_port_be = found as u16;
        pkt.dst_port_be = (found >> 16) as u16;
        pkt.proto = next;
        pkt.l4_off = off;
        pkt.l4 = L4::Absent;
        return Ok(Some(pkt));
    }
    let Ok(ports) = ctx.load::<[u16; 2]>(off) else {
        count(DropReason::L4HeaderBadPassed);
        return Ok(None);
    };
    let need = l4_header_len(next);
    let whole = off + need <= ctx.len() as usize;
    let (tcp_flags, l4) = if next == IPPROTO_TCP {
        match ctx.load::<[u8; 2]>(off + TCP_FLAGS_OFF - 1) {
            // Data offset (high nibble) below 5: a header shorter than its fixed part.
            Ok(w) if whole && w[0] >> 4 >= 5 => (w[1], L4::Header),
            _ => (0, L4::Bad),
        }
    } else if whole {
        (0, L4::Header)
    } else {
        (0, L4::Bad)
    };
    if let Some((id, true)) = frag
        && l4 == L4::Header
    {
        // A first fragment: the later ones will need its ports.
        let word = u32::from(ports[0]) | u32::from(ports[1]) << 16;
        record_frag6(&pkt.src_addr, &pkt.dst_addr, id, next, word);
    }
    pkt.src_port_be = ports[0];
    pkt.dst_port_be = ports[1];
    pkt.proto = next;
    pkt.tcp_flags = tcp_flags;
    pkt.l4_off = off;
    pkt.l4 = l4;
    Ok(Some(pkt))
}

/// Where [`walk_ext6`] stopped: the next header there and its offset, whether a fragment
/// header said the rest is a later fragment's, and that header's identification (as read)
/// and M flag, when there is one.
struct Walk {
    next: u8,
    off: usize,
    later_fragment: bool,
    frag: Option<(u32, bool)>,
}

/// The IPv6 extension-header walk of [`parse6`], from the fixed header's next header
/// `next`: steps over hop-by-hop options, routing, destination options, AH and fragment
/// headers, at most [`MAX_EXT_HEADERS`]. `None` when an extension header is cut short.
#[inline(always)]
fn walk_ext6(ctx: &TcContext, next: u8) -> Option<Walk> {
    let mut next = next;
    let mut off = L2_L3_LEN6;
    let mut later_fragment = false;
    // The fragment header's identification (as read) and M flag, when there is one.
    let mut frag: Option<(u32, bool)> = None;
    let mut walked = 0;
    while walked < MAX_EXT_HEADERS {
        if next != NH_HOP_BY_HOP
            && next != NH_ROUTING
            && next != NH_DEST_OPTS
            && next != NH_AH
            && next != NH_FRAGMENT
        {
            break;
        }
        let Ok(h) = ctx.load::<[u8; 4]>(off) else {
            return None;
        };
        let len = if next == NH_FRAGMENT {
            let Ok(id) = ctx.load::<u32>(off + 4) else {
                return None;
            };
            // Offset (13 bits, in 8-byte units), 2 reserved bits, the M flag.
            let word = u16::from_be_bytes([h[2], h[3]]);
            later_fragment = word & 0xfff8 != 0;
            frag = Some((id, word & 1 != 0));
            8
        } else if next == NH_AH {
            (usize::from(h[1]) + 2) * 4
        } else {
            (usize::from(h[1]) + 1) * 8
        };
        next = h[0];
        off += len;
        walked += 1;
        if later_fragment {
            // What follows is the middle of a datagram, not headers.
            break;
        }
    }
    Some(Walk {
        next,
        off,
        later_fragment,
        frag,
    })
}

/// The `LB_FRAGS6_V1` key of the IPv6 datagram `(src, dst, id, proto)`.
#[inline(always)]
fn frag6_key(src: &[u8; 16], dst: &[u8; 16], id: u32, proto: u8) -> FragKey6 {
    FragKey6 {
        src_addr: *src,
        dst_addr: *dst,
        id_be: id,
        proto,
        _pad: [0; 3],
    }
}

/// The ports recorded for the IPv6 datagram `(src, dst, id, proto)` (`LB_FRAGS6_V1`): the
/// source port in bits 0-15 and the destination port in bits 16-31, each as read, and bit
/// 32 set; 0 when none are. Its own BPF function, so that the 40-byte key takes room in its
/// frame only; a scalar result, since an `Option` of a struct comes back in two registers
/// of which the verifier finds one unset on the `None` path.
#[inline(never)]
fn frag6_ports(src: &[u8; 16], dst: &[u8; 16], id: u32, proto: u8) -> u64 {
    let key = frag6_key(src, dst, id, proto);
    // SAFETY: read at once.
    match unsafe { LB_FRAGS6_V1.get(key) } {
        Some(p) => 1 << 32 | u64::from(p.src_port_be) | u64::from(p.dst_port_be) << 16,
        None => 0,
    }
}

/// Records the ports of the IPv6 datagram `(src, dst, id, proto)`'s first fragment
/// (`ports`: the source port in the low half, the destination port in the high half, each
/// as read; one argument, as a BPF function takes at most five). Overwrites an entry of an
/// earlier datagram with the same identity.
#[inline(never)]
fn record_frag6(src: &[u8; 16], dst: &[u8; 16], id: u32, proto: u8, ports: u32) {
    let key = frag6_key(src, dst, id, proto);
    let ports = FragPorts {
        src_port_be: ports as u16,
        dst_port_be: (ports >> 16) as u16,
    };
    let _ = LB_FRAGS6_V1.insert(key, ports, 0);
}

/// Whether an IPv4 frame (by its EtherType) carries ICMP: version 4, protocol ICMP, and the
/// whole fixed header there (a shorter one is [`parse`]'s to drop as malformed).
#[inline(always)]
pub fn is_icmp4(ctx: &TcContext) -> bool {
    // Every packet of a hook asks, before its parse: the three fields read in place when the
    // headers are in the linear part (two helper loads here cost ~40 ns a packet), and
    // nothing copied to this frame, which is the hook's entry point's and counts towards
    // every stage's stack. Headers outside the linear part: `is_icmp4_loaded`.
    let Some(h) = ptr_at::<[u8; L2_L3_LEN]>(ctx, 0) else {
        return is_icmp4_loaded(ctx);
    };
    let h = h.cast::<u8>();
    // SAFETY: `ptr_at` checked that all `L2_L3_LEN` bytes are in the packet.
    let (ether_type, version, proto) = unsafe {
        (
            [*h.add(12), *h.add(13)],
            *h.add(ETH_LEN) >> 4,
            *h.add(IP_PROTO_OFF),
        )
    };
    is_icmp4_fields(ether_type, version, proto)
}

/// [`is_icmp4`] for headers outside the linear part, read with the helper: a BPF function
/// of its own, so that its buffer is not in the entry point's frame.
#[inline(never)]
fn is_icmp4_loaded(ctx: &TcContext) -> bool {
    match ctx.load::<[u8; L2_L3_LEN]>(0) {
        Ok(h) => is_icmp4_fields([h[12], h[13]], h[ETH_LEN] >> 4, h[IP_PROTO_OFF]),
        Err(_) => false,
    }
}

#[inline(always)]
fn is_icmp4_fields(ether_type: [u8; 2], version: u8, proto: u8) -> bool {
    u16::from_ne_bytes(ether_type) == EtherType::Ipv4 as u16
        && version == 4
        && proto == IPPROTO_ICMP
}

/// Whether an IPv6 frame carries ICMPv6 right after its fixed header.
#[inline(always)]
pub fn is_icmp6(ctx: &TcContext) -> bool {
    // Read in place when the byte is in the linear part (every IPv6 packet asks), with a
    // helper call only when it is not (`is_icmp6_loaded`, as `is_icmp4`'s).
    match ptr_at::<u8>(ctx, IP6_NEXT_OFF) {
        // SAFETY: bounds checked by `ptr_at`.
        Some(p) => unsafe { *p == IPPROTO_ICMPV6 },
        None => is_icmp6_loaded(ctx),
    }
}

/// [`is_icmp6`] with the helper: a BPF function of its own, its buffer not in the entry
/// point's frame.
#[inline(never)]
fn is_icmp6_loaded(ctx: &TcContext) -> bool {
    ctx.load::<u8>(IP6_NEXT_OFF) == Ok(IPPROTO_ICMPV6)
}

/// Whether the frame is IPv6 by its EtherType: which of [`parse`] and [`parse6`] reads it.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    match ptr_at::<EthHdr>(ctx, 0) {
        // SAFETY: bounds checked by `ptr_at`.
        Some(eth) => (unsafe { (*eth).ether_type }) == EtherType::Ipv6 as u16,
        None => false,
    }
}
