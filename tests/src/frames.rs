//! A hand-built frame for each case of the packet tests (`tests/tests/packet/`), in the
//! way of Cilium's `pktgen` and Katran's fixtures: Ethernet, IPv4 (options, fragments),
//! TCP (options, payload), UDP (checksum or none), SCTP (chunks, CRC32c), raw IPv6 with
//! extension headers.
//!
//! Every checksum is computed in full (RFC 1071; SCTP's CRC32c bit by bit, [`crc32c`]) over
//! the bytes built, never by replaying a datapath's incremental update, so an expected frame is an independent statement of what
//! the bytes must be. [`describe`] and [`diff`] decode frames for failure messages, each
//! checksum recomputed over the bytes shown.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

mod sctp;
pub use sctp::*;

/// MACs in the frames (locally administered); the programs never read them, a reject swaps
/// them.
pub const POD_MAC: [u8; 6] = [0x02, 0x00, 0xc6, 0x12, 0x00, 0x02];
pub const GW_MAC: [u8; 6] = [0x02, 0x00, 0xc6, 0x12, 0x00, 0x01];

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_IPV6: u16 = 0x86dd;
/// IEEE 802 local experimental EtherType 1.
pub const ETH_P_EXPERIMENTAL: u16 = 0x88b5;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

// ---------------------------------------------------------------------------------------
// Checksums, computed in full (RFC 1071).

/// The Internet checksum of `data`: the one's complement of the one's-complement sum of its
/// big-endian 16-bit words, an odd last byte padded with zero.
pub fn inet_csum(data: &[u8]) -> u16 {
    let mut sum: u64 = data
        .chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP checksum of `segment` (its checksum field zeroed) between `src` and `dst`:
/// the pseudo-header is source, destination, zero, protocol, L4 length (RFC 793, RFC 768).
pub fn l4_csum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, segment: &[u8]) -> u16 {
    let mut buf = Vec::with_capacity(12 + segment.len());
    buf.extend_from_slice(&src.octets());
    buf.extend_from_slice(&dst.octets());
    buf.extend_from_slice(&[0, proto]);
    buf.extend_from_slice(&(segment.len() as u16).to_be_bytes());
    buf.extend_from_slice(segment);
    inet_csum(&buf)
}

// ---------------------------------------------------------------------------------------
// Frames.

#[derive(Clone, Debug)]
pub struct Ip {
    /// The version nibble; 4 except to test what a wrong one does.
    pub version: u8,
    pub tos: u8,
    pub id: u16,
    pub df: bool,
    pub mf: bool,
    /// Fragment offset in 8-byte units.
    pub frag_off: u16,
    pub ttl: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// IP options, a multiple of 4 bytes (IHL = 5 + len / 4).
    pub options: Vec<u8>,
}

impl Ip {
    /// What a Linux pod sends: DF, TTL 64.
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr) -> Ip {
        Ip {
            version: 4,
            tos: 0,
            id: 0x1c46,
            df: true,
            mf: false,
            frag_off: 0,
            ttl: 64,
            src,
            dst,
            options: Vec::new(),
        }
    }

    /// The header for `payload_len` bytes of protocol `proto`, checksum computed.
    pub fn header(&self, proto: u8, payload_len: usize) -> Vec<u8> {
        assert!(
            self.options.len().is_multiple_of(4),
            "IP options must fill 32-bit words"
        );
        let ihl = 5 + self.options.len() / 4;
        let mut h = vec![0u8; 20];
        h[0] = self.version << 4 | ihl as u8;
        h[1] = self.tos;
        h[2..4].copy_from_slice(&((ihl * 4 + payload_len) as u16).to_be_bytes());
        h[4..6].copy_from_slice(&self.id.to_be_bytes());
        let frags = u16::from(self.df) << 14 | u16::from(self.mf) << 13 | self.frag_off;
        h[6..8].copy_from_slice(&frags.to_be_bytes());
        h[8] = self.ttl;
        h[9] = proto;
        h[12..16].copy_from_slice(&self.src.octets());
        h[16..20].copy_from_slice(&self.dst.octets());
        h.extend_from_slice(&self.options);
        let csum = inet_csum(&h);
        h[10..12].copy_from_slice(&csum.to_be_bytes());
        h
    }
}

#[derive(Clone, Debug)]
pub struct Tcp {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub window: u16,
    /// TCP options, a multiple of 4 bytes (data offset = 5 + len / 4).
    pub options: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Tcp {
    pub fn new(sport: u16, dport: u16, flags: u8) -> Tcp {
        Tcp {
            sport,
            dport,
            seq: 0x9a3b_c2d1,
            ack: if flags & ACK != 0 { 0x0102_0304 } else { 0 },
            flags,
            window: 64240,
            options: Vec::new(),
            payload: Vec::new(),
        }
    }

    /// A SYN as Linux sends it: MSS, SACK permitted, timestamps, window scale.
    pub fn linux_syn(sport: u16, dport: u16) -> Tcp {
        Tcp {
            options: vec![
                2, 4, 0x05, 0xb4, // MSS 1460
                4, 2, // SACK permitted
                8, 10, 0x00, 0x0f, 0x42, 0x40, 0, 0, 0, 0, // timestamps
                1, // NOP
                3, 3, 7, // window scale 7
            ],
            ..Tcp::new(sport, dport, SYN)
        }
    }

    pub fn bytes(&self, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        assert!(
            self.options.len().is_multiple_of(4),
            "TCP options must fill 32-bit words"
        );
        let doff = 5 + self.options.len() / 4;
        let mut t = vec![0u8; 20];
        t[0..2].copy_from_slice(&self.sport.to_be_bytes());
        t[2..4].copy_from_slice(&self.dport.to_be_bytes());
        t[4..8].copy_from_slice(&self.seq.to_be_bytes());
        t[8..12].copy_from_slice(&self.ack.to_be_bytes());
        t[12] = (doff as u8) << 4;
        t[13] = self.flags;
        t[14..16].copy_from_slice(&self.window.to_be_bytes());
        t.extend_from_slice(&self.options);
        t.extend_from_slice(&self.payload);
        let csum = l4_csum(src, dst, IPPROTO_TCP, &t);
        t[16..18].copy_from_slice(&csum.to_be_bytes());
        t
    }
}

#[derive(Clone, Debug)]
pub struct Udp {
    pub sport: u16,
    pub dport: u16,
    pub payload: Vec<u8>,
    /// Send checksum 0 ("no checksum", RFC 768).
    pub no_csum: bool,
}

impl Udp {
    pub fn new(sport: u16, dport: u16) -> Udp {
        Udp {
            sport,
            dport,
            // Odd length: the checksum pads it.
            payload: b"lbproxy packet test".to_vec(),
            no_csum: false,
        }
    }

    pub fn bytes(&self, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        let mut u = vec![0u8; 8];
        u[0..2].copy_from_slice(&self.sport.to_be_bytes());
        u[2..4].copy_from_slice(&self.dport.to_be_bytes());
        u[4..6].copy_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
        u.extend_from_slice(&self.payload);
        if !self.no_csum {
            // RFC 768: a computed zero is sent as all ones.
            let csum = match l4_csum(src, dst, IPPROTO_UDP, &u) {
                0 => 0xffff,
                c => c,
            };
            u[6..8].copy_from_slice(&csum.to_be_bytes());
        }
        u
    }
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp(Tcp),
    Udp(Udp),
    Sctp(Sctp),
    /// Any other payload, as is.
    Raw {
        proto: u8,
        bytes: Vec<u8>,
    },
}

/// An Ethernet + IPv4 frame.
#[derive(Clone, Debug)]
pub struct Frame {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub ip: Ip,
    pub l4: L4,
}

impl Frame {
    /// A frame leaving the client pod towards the gateway.
    pub fn from_pod(ip: Ip, l4: L4) -> Frame {
        Frame {
            dst_mac: GW_MAC,
            src_mac: POD_MAC,
            ip,
            l4,
        }
    }

    pub fn tcp(src: Ipv4Addr, dst: Ipv4Addr, tcp: Tcp) -> Frame {
        Frame::from_pod(Ip::new(src, dst), L4::Tcp(tcp))
    }

    pub fn udp(src: Ipv4Addr, dst: Ipv4Addr, udp: Udp) -> Frame {
        Frame::from_pod(Ip::new(src, dst), L4::Udp(udp))
    }

    pub fn bytes(&self) -> Vec<u8> {
        let (proto, l4) = match &self.l4 {
            L4::Tcp(t) => (IPPROTO_TCP, t.bytes(self.ip.src, self.ip.dst)),
            L4::Udp(u) => (IPPROTO_UDP, u.bytes(self.ip.src, self.ip.dst)),
            L4::Sctp(c) => (IPPROTO_SCTP, c.bytes()),
            L4::Raw { proto, bytes } => (*proto, bytes.clone()),
        };
        let mut f = eth(self.dst_mac, self.src_mac, ETH_P_IP);
        f.extend_from_slice(&self.ip.header(proto, l4.len()));
        f.extend_from_slice(&l4);
        f
    }

    /// The same frame with the destination rewritten to `addr:port` (DNAT).
    pub fn with_dest(&self, addr: Ipv4Addr, port: u16) -> Frame {
        let mut f = self.clone();
        f.ip.dst = addr;
        match &mut f.l4 {
            L4::Tcp(t) => t.dport = port,
            L4::Udp(u) => u.dport = port,
            L4::Sctp(c) => c.dport = port,
            L4::Raw { .. } => panic!("to_dest: not TCP, UDP or SCTP"),
        }
        f
    }

    /// The same frame with the source rewritten to `addr:port` (reverse NAT).
    pub fn with_source(&self, addr: Ipv4Addr, port: u16) -> Frame {
        let mut f = self.clone();
        f.ip.src = addr;
        match &mut f.l4 {
            L4::Tcp(t) => t.sport = port,
            L4::Udp(u) => u.sport = port,
            L4::Sctp(c) => c.sport = port,
            L4::Raw { .. } => panic!("from_source: not TCP, UDP or SCTP"),
        }
        f
    }

    pub fn tcp_hdr(&self) -> &Tcp {
        match &self.l4 {
            L4::Tcp(t) => t,
            _ => panic!("not a TCP frame: {self:?}"),
        }
    }
}

pub fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(128);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

// ---------------------------------------------------------------------------------------
// Decoding, for failure messages: every checksum is recomputed over the bytes shown.

pub fn mac(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn csum_note(stored: u16, verifies: bool) -> String {
    if verifies {
        format!("{stored:#06x} (verifies)")
    } else {
        format!("{stored:#06x} (DOES NOT VERIFY)")
    }
}

/// A one-line-per-layer decoding of `f`, with each checksum checked by summing the bytes
/// as they are (a correct checksum makes the sum verify).
pub fn describe(f: &[u8]) -> String {
    let mut s = String::new();
    if f.len() < 14 {
        return format!("{} bytes, shorter than an Ethernet header", f.len());
    }
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let _ = writeln!(
        s,
        "  eth {} -> {} type {ethertype:#06x}, {} bytes",
        mac(&f[6..12]),
        mac(&f[0..6]),
        f.len()
    );
    let ip = &f[14..];
    if ethertype != ETH_P_IP || ip.len() < 20 {
        let _ = write!(s, "  payload {}", hex(ip));
        return s;
    }
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let tot_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let frags = u16::from_be_bytes([ip[6], ip[7]]);
    let ip_ok = ihl >= 20 && ip.len() >= ihl && inet_csum(&ip[..ihl]) == 0;
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let _ = writeln!(
        s,
        "  ipv4 v{} header {ihl} bytes, tos {:#04x} len {tot_len} id {:#06x} frags {frags:#06x} ttl {} \
         proto {} csum {} {src} -> {dst}",
        ip[0] >> 4,
        ip[1],
        u16::from_be_bytes([ip[4], ip[5]]),
        ip[8],
        ip[9],
        csum_note(u16::from_be_bytes([ip[10], ip[11]]), ip_ok)
    );
    if ihl < 20 || ip.len() < ihl {
        return s;
    }
    let l4 = &ip[ihl..ip.len().min(tot_len.max(ihl))];
    let first_fragment = frags & 0x1fff == 0;
    match ip[9] {
        IPPROTO_TCP if l4.len() >= 20 && first_fragment => {
            let stored = u16::from_be_bytes([l4[16], l4[17]]);
            let mut z = l4.to_vec();
            z[16..18].fill(0);
            let ok = l4_csum(src, dst, IPPROTO_TCP, &z) == stored;
            let _ = write!(
                s,
                "  tcp {} -> {} seq {:#010x} ack {:#010x} header {} bytes, flags {} win {} \
                 csum {} payload {} bytes",
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
                u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]),
                u32::from_be_bytes([l4[8], l4[9], l4[10], l4[11]]),
                (l4[12] >> 4) * 4,
                tcp_flags(l4[13]),
                u16::from_be_bytes([l4[14], l4[15]]),
                csum_note(stored, ok),
                l4.len().saturating_sub(usize::from(l4[12] >> 4) * 4),
            );
        }
        IPPROTO_UDP if l4.len() >= 8 && first_fragment => {
            let stored = u16::from_be_bytes([l4[6], l4[7]]);
            let note = if stored == 0 {
                "0x0000 (none)".to_owned()
            } else {
                let mut z = l4.to_vec();
                z[6..8].fill(0);
                let want = match l4_csum(src, dst, IPPROTO_UDP, &z) {
                    0 => 0xffff,
                    c => c,
                };
                csum_note(stored, want == stored)
            };
            let _ = write!(
                s,
                "  udp {} -> {} len {} csum {note}",
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
                u16::from_be_bytes([l4[4], l4[5]]),
            );
        }
        IPPROTO_SCTP if l4.len() >= 12 && first_fragment => {
            let _ = write!(s, "  {}", describe_sctp(l4));
        }
        IPPROTO_ICMP if l4.len() >= 8 => {
            let _ = write!(
                s,
                "  icmp type {} code {} csum {}, then {}",
                l4[0],
                l4[1],
                csum_note(u16::from_be_bytes([l4[2], l4[3]]), inet_csum(l4) == 0),
                hex(&l4[4..]),
            );
        }
        _ => {
            let _ = write!(s, "  l4 {}", hex(l4));
        }
    }
    s
}

pub fn tcp_flags(f: u8) -> String {
    let names = [
        (FIN, "FIN"),
        (SYN, "SYN"),
        (RST, "RST"),
        (PSH, "PSH"),
        (ACK, "ACK"),
    ];
    let v: Vec<&str> = names
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| *n)
        .collect();
    format!("{f:#04x}[{}]", v.join("|"))
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect::<String>()
}

/// The byte ranges where `got` and `want` differ, as `[start..end) got .. want ..`.
pub fn diff(got: &[u8], want: &[u8]) -> String {
    let n = got.len().max(want.len());
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        if got.get(i) == want.get(i) {
            i += 1;
            continue;
        }
        let start = i;
        while i < n && got.get(i) != want.get(i) {
            i += 1;
        }
        let g = got.get(start..i.min(got.len())).unwrap_or_default();
        let w = want.get(start..i.min(want.len())).unwrap_or_default();
        out.push(format!("[{start}..{i}) got {} want {}", hex(g), hex(w)));
    }
    if got.len() != want.len() {
        out.push(format!("length got {} want {}", got.len(), want.len()));
    }
    out.join("; ")
}

// ---------------------------------------------------------------------------------------
// What the datapath answers or builds, as expected frames.

/// The RST RFC 793 prescribes for a segment arriving for no connection ("If the state is
/// CLOSED ..."), as (seq, ack, flags), or `None`: a RST is never answered.
pub fn rfc793_reset(t: &Tcp) -> Option<(u32, u32, u8)> {
    if t.flags & RST != 0 {
        return None;
    }
    if t.flags & ACK != 0 {
        return Some((t.ack, 0, RST));
    }
    let len =
        t.payload.len() as u32 + u32::from(t.flags & SYN != 0) + u32::from(t.flags & FIN != 0);
    Some((0, t.seq.wrapping_add(len), RST | ACK))
}

/// The frame reject.rs writes for `input`: MACs swapped, a fresh IP header from the address
/// the client connected to (id 0, DF, TTL 64), a bare TCP header with window 0.
pub fn reset_frame(input: &Frame, (seq, ack, flags): (u32, u32, u8)) -> Frame {
    let t = input.tcp_hdr();
    let mut ip = Ip::new(input.ip.dst, input.ip.src);
    ip.id = 0;
    Frame {
        dst_mac: input.src_mac,
        src_mac: input.dst_mac,
        ip,
        l4: L4::Tcp(Tcp {
            sport: t.dport,
            dport: t.sport,
            seq,
            ack,
            flags,
            window: 0,
            options: Vec::new(),
            payload: Vec::new(),
        }),
    }
}

/// `frame` (Ethernet, IPv4 without options, TCP) with the TCP data offset set to `doff`
/// words and the TCP checksum recomputed in full.
pub fn with_tcp_doff(frame: &[u8], doff: u8, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut bytes = frame.to_vec();
    bytes[14 + 20 + 12] = doff << 4;
    bytes[14 + 20 + 16..14 + 20 + 18].fill(0);
    let csum = l4_csum(src, dst, IPPROTO_TCP, &bytes[14 + 20..]);
    bytes[14 + 20 + 16..14 + 20 + 18].copy_from_slice(&csum.to_be_bytes());
    bytes
}

/// One IPv4 fragment of a datagram of protocol `proto`: `bytes` at byte offset `off`, MF as
/// given, DF off, IP identification `id`.
pub fn fragment(
    (src, dst): (Ipv4Addr, Ipv4Addr),
    proto: u8,
    id: u16,
    mf: bool,
    off: usize,
    bytes: &[u8],
) -> Vec<u8> {
    assert!(
        off.is_multiple_of(8),
        "fragment offsets are in 8-byte units"
    );
    let mut ip = Ip::new(src, dst);
    ip.id = id;
    (ip.df, ip.mf, ip.frag_off) = (false, mf, (off / 8) as u16);
    Frame::from_pod(
        ip,
        L4::Raw {
            proto,
            bytes: bytes.to_vec(),
        },
    )
    .bytes()
}

// ---------------------------------------------------------------------------------------
// IPv6.

/// An IPv6 packet: fixed header (`next` the first next-header value, payload length from
/// `rest`), then `rest` (extension headers and the upper layer) as given.
pub fn ipv6(src: [u8; 16], dst: [u8; 16], next: u8, rest: &[u8]) -> Vec<u8> {
    let mut f = eth(GW_MAC, POD_MAC, ETH_P_IPV6);
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(rest.len() as u16).to_be_bytes());
    f.extend_from_slice(&[next, 64]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&dst);
    f.extend_from_slice(rest);
    f
}

/// An 8-byte extension header (hop-by-hop, routing or destination options): `next`, then a
/// length of 0 (8 bytes), then padding (a PadN option).
pub fn ext8(next: u8) -> [u8; 8] {
    [next, 0, 1, 4, 0, 0, 0, 0]
}

/// The TCP/UDP checksum over IPv6 (RFC 8200, 8.1): the pseudo-header is source,
/// destination, the upper-layer length (32 bits), three zero bytes and the next header.
pub fn l4_csum6(src: [u8; 16], dst: [u8; 16], proto: u8, segment: &[u8]) -> u16 {
    let mut buf = Vec::with_capacity(40 + segment.len());
    buf.extend_from_slice(&src);
    buf.extend_from_slice(&dst);
    buf.extend_from_slice(&(segment.len() as u32).to_be_bytes());
    buf.extend_from_slice(&[0, 0, 0, proto]);
    buf.extend_from_slice(segment);
    inet_csum(&buf)
}

/// `segment` (TCP or UDP bytes) with its checksum computed over IPv6 from `src` to `dst`.
pub fn with_csum6(mut segment: Vec<u8>, src: [u8; 16], dst: [u8; 16], proto: u8) -> Vec<u8> {
    let at = if proto == IPPROTO_TCP { 16 } else { 6 };
    segment[at..at + 2].copy_from_slice(&[0, 0]);
    let c = l4_csum6(src, dst, proto, &segment);
    segment[at..at + 2].copy_from_slice(&c.to_be_bytes());
    segment
}

/// `segment` with its ports set to `sport`, `dport`.
pub fn with_ports(mut segment: Vec<u8>, sport: u16, dport: u16) -> Vec<u8> {
    segment[0..2].copy_from_slice(&sport.to_be_bytes());
    segment[2..4].copy_from_slice(&dport.to_be_bytes());
    segment
}
