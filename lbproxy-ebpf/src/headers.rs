//! What differs between IPv4 and IPv6 in the headers, behind one trait, so that the stages
//! are written once and compiled for both: the family's constants and offsets, how its
//! header is parsed (IPv6's extension-header walk), rewritten (IPv4's header checksum, which
//! IPv6 does not have) and handed to the FIB. What differs in the maps is
//! [`crate::family::Family`], built on this one.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{Addr, DropReason, HAIRPIN_ADDR, HAIRPIN_ADDR6};

use crate::{
    csum::{self, csum_add, words_diff},
    packet::{
        IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IP_TTL_OFF, IP6_DST_OFF, IP6_HOPS_OFF, IP6_SRC_OFF,
        L2_L3_LEN, Packet, ptr_at,
    },
    parse,
    stage::Verdict,
};

const FAIL: Verdict = Verdict::Drop(DropReason::NatFailed);

/// One IP family's header: what the parse, translate and deliver stages do differently.
pub trait Headers: Addr {
    /// The family's `AF_*` number, as `bpf_fib_lookup` takes it.
    const AF: u8;
    /// The address a pod's hairpin flow comes from (`lbproxy_common::hairpin`).
    const HAIRPIN: Self;
    /// Words 2 to 5 of a `bpf_fib_lookup` input: its source then destination address (an
    /// IPv4 address in the low half of its word, `filler` in the words IPv4 leaves unread).
    fn fib_addrs(src: &Self, dst: &Self, filler: u64) -> [u64; 4];
    /// Offset in the frame of the TTL (IPv4) or hop limit (IPv6).
    const TTL_OFF: usize;
    /// Writes the hop the stack would have made when forwarding and a translation's L3 half:
    /// the frame's MACs (`macs`: destination then source), the TTL or hop limit one lower
    /// (unless it is 1 already), and the addresses `addrs` (source, destination), with the
    /// header checksum where the family has one.
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict>;
    /// The checksum difference (as `bpf_csum_diff` computes it, over the words that change)
    /// of the source and destination addresses changing from `old` to `new`: what the L4
    /// checksum's pseudo-header sees. By reference: an IPv6 pair is 32 bytes, and copies of
    /// it add up in the stack frame.
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32;
    /// Writes the addresses `new` (source, destination) into the IP header, with the
    /// header checksum where the family has one; nothing when neither changes.
    fn rewrite_l3(ctx: &TcContext, old: (&Self, &Self), new: (&Self, &Self))
    -> Result<(), Verdict>;
    /// Reads a TCP or UDP packet of this family (`parse::parse`, `parse::parse6`): `Ok(None)`
    /// for anything the load balancer leaves alone, `Err` for a header the stack would drop.
    fn parse(ctx: &TcContext) -> Result<Option<Packet<Self>>, Verdict>;
    /// Whether the packet carries ICMP (IPv4) or ICMPv6 right after the IP header: an error
    /// about a translated flow may need translating, by `icmp`'s stages instead of the
    /// TCP/UDP ones.
    fn is_icmp(ctx: &TcContext) -> bool;
    /// The IP destination address, read from the packet.
    fn dst_addr(ctx: &TcContext) -> Option<Self>;
    /// The IP source and destination addresses, read from the packet.
    fn addrs(ctx: &TcContext) -> Option<(Self, Self)>;
}

impl Headers for [u8; 4] {
    const AF: u8 = 2;
    const HAIRPIN: Self = HAIRPIN_ADDR;
    const TTL_OFF: usize = IP_TTL_OFF;
    /// Everything rewritten is in the first `L2_L3_LEN` bytes (the Ethernet header and the
    /// fixed part of the IPv4 header): read once, the header checksum updated incrementally,
    /// written back in one store.
    #[inline(always)]
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict> {
        let hdr: *const [u8; L2_L3_LEN] = ptr_at(ctx, 0).ok_or(FAIL)?;
        // SAFETY: bounds-checked by ptr_at.
        let mut h = unsafe { *hdr };
        let word = |h: &[u8; L2_L3_LEN], at: usize| u16::from_ne_bytes([h[at], h[at + 1]]);
        let old = [
            word(&h, IP_TTL_OFF),
            word(&h, IP_SRC_OFF),
            word(&h, IP_SRC_OFF + 2),
            word(&h, IP_DST_OFF),
            word(&h, IP_DST_OFF + 2),
        ];
        h[..12].copy_from_slice(macs);
        if h[IP_TTL_OFF] > 1 {
            h[IP_TTL_OFF] -= 1;
        }
        h[IP_SRC_OFF..IP_SRC_OFF + 4].copy_from_slice(addrs.0);
        h[IP_DST_OFF..IP_DST_OFF + 4].copy_from_slice(addrs.1);
        let sum = csum::update(
            word(&h, IP_CSUM_OFF),
            &old,
            &[
                word(&h, IP_TTL_OFF),
                word(&h, IP_SRC_OFF),
                word(&h, IP_SRC_OFF + 2),
                word(&h, IP_DST_OFF),
                word(&h, IP_DST_OFF + 2),
            ],
        );
        h[IP_CSUM_OFF..IP_CSUM_OFF + 2].copy_from_slice(&sum.to_ne_bytes());
        ctx.store(0, &h, 0).map_err(|_| FAIL)
    }
    #[inline(always)]
    fn fib_addrs(src: &Self, dst: &Self, filler: u64) -> [u64; 4] {
        [
            u64::from(u32::from_ne_bytes(*src)),
            filler,
            u64::from(u32::from_ne_bytes(*dst)),
            filler,
        ]
    }
    #[inline(always)]
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32 {
        words_diff(
            [u32::from_ne_bytes(*old.0), u32::from_ne_bytes(*old.1)],
            [u32::from_ne_bytes(*new.0), u32::from_ne_bytes(*new.1)],
        )
    }
    /// One update of the header checksum by difference and one 8-byte store.
    #[inline(always)]
    fn rewrite_l3(
        ctx: &TcContext,
        old: (&Self, &Self),
        new: (&Self, &Self),
    ) -> Result<(), Verdict> {
        if old == new {
            return Ok(());
        }
        let d = Self::addr_diff(old, new);
        // A difference of 0 (a word that changes between the two encodings of zero) leaves
        // the checksum as it is.
        if d != 0 {
            ctx.l3_csum_replace(IP_CSUM_OFF, 0, u64::from(d), 0)
                .map_err(|_| FAIL)?;
        }
        let mut both = [0u8; 8];
        both[..4].copy_from_slice(new.0);
        both[4..].copy_from_slice(new.1);
        ctx.store(IP_SRC_OFF, &both, 0).map_err(|_| FAIL)
    }
    #[inline(always)]
    fn parse(ctx: &TcContext) -> Result<Option<Packet<Self>>, Verdict> {
        parse::parse(ctx)
    }
    #[inline(always)]
    fn is_icmp(ctx: &TcContext) -> bool {
        parse::is_icmp4(ctx)
    }
    #[inline(always)]
    fn dst_addr(ctx: &TcContext) -> Option<Self> {
        parse::ipv4_dst(ctx)
    }
    #[inline(always)]
    fn addrs(ctx: &TcContext) -> Option<(Self, Self)> {
        Some((ctx.load(IP_SRC_OFF).ok()?, ctx.load(IP_DST_OFF).ok()?))
    }
}

impl Headers for [u8; 16] {
    const AF: u8 = 10;
    const HAIRPIN: Self = HAIRPIN_ADDR6;
    const TTL_OFF: usize = IP6_HOPS_OFF;
    /// No header checksum: the MACs, the hop limit and each address that changes, stored in
    /// place.
    #[inline(always)]
    fn write_hop(ctx: &TcContext, macs: &[u8; 12], addrs: (&Self, &Self)) -> Result<(), Verdict> {
        ctx.store(0, macs, 0).map_err(|_| FAIL)?;
        let hops: *const u8 = ptr_at(ctx, IP6_HOPS_OFF).ok_or(FAIL)?;
        // SAFETY: bounds-checked by ptr_at.
        let h = unsafe { *hops };
        if h > 1 {
            ctx.store(IP6_HOPS_OFF, &(h - 1), 0).map_err(|_| FAIL)?;
        }
        ctx.store(IP6_SRC_OFF, addrs.0, 0).map_err(|_| FAIL)?;
        ctx.store(IP6_DST_OFF, addrs.1, 0).map_err(|_| FAIL)
    }
    #[inline(always)]
    fn fib_addrs(src: &Self, dst: &Self, _filler: u64) -> [u64; 4] {
        let (s, d) = (words6(src), words6(dst));
        let w = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
        [w(s[0], s[1]), w(s[2], s[3]), w(d[0], d[1]), w(d[2], d[3])]
    }
    /// Word by word, read in place.
    #[inline(always)]
    fn addr_diff(old: (&Self, &Self), new: (&Self, &Self)) -> u32 {
        csum_add(
            words_diff(words6(old.0), words6(new.0)),
            words_diff(words6(old.1), words6(new.1)),
        )
    }
    /// IPv6 has no header checksum: a 16-byte store of each address that changes.
    #[inline(always)]
    fn rewrite_l3(
        ctx: &TcContext,
        old: (&Self, &Self),
        new: (&Self, &Self),
    ) -> Result<(), Verdict> {
        if old.0 != new.0 {
            ctx.store(IP6_SRC_OFF, new.0, 0).map_err(|_| FAIL)?;
        }
        if old.1 != new.1 {
            ctx.store(IP6_DST_OFF, new.1, 0).map_err(|_| FAIL)?;
        }
        Ok(())
    }
    #[inline(always)]
    fn parse(ctx: &TcContext) -> Result<Option<Packet<Self>>, Verdict> {
        parse::parse6(ctx)
    }
    #[inline(always)]
    fn is_icmp(ctx: &TcContext) -> bool {
        parse::is_icmp6(ctx)
    }
    #[inline(always)]
    fn dst_addr(ctx: &TcContext) -> Option<Self> {
        ctx.load(IP6_DST_OFF).ok()
    }
    #[inline(always)]
    fn addrs(ctx: &TcContext) -> Option<(Self, Self)> {
        Some((ctx.load(IP6_SRC_OFF).ok()?, ctx.load(IP6_DST_OFF).ok()?))
    }
}

/// The words of an IPv6 address, as they lie in memory.
#[inline(always)]
fn words6(a: &[u8; 16]) -> [u32; 4] {
    let p = a.as_ptr().cast::<u32>();
    // SAFETY: the four words of the 16 bytes; unaligned reads, as the array is byte-aligned.
    unsafe {
        [
            p.read_unaligned(),
            p.add(1).read_unaligned(),
            p.add(2).read_unaligned(),
            p.add(3).read_unaligned(),
        ]
    }
}
