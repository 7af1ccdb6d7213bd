//! The two IP families, as the maps hold their addresses: raw network-order bytes, `[u8; 4]`
//! for IPv4 and `[u8; 16]` for IPv6.
//!
//! The layouts that hold an address ([`crate::FlowKeyOf`], [`crate::FlowValueOf`],
//! [`crate::ServiceKeyOf`], [`crate::BackendOf`]) are generic over [`Addr`], so both families'
//! maps have the same fields and the datapath one code path for both (Cilium has `lb4_*` and
//! `lb6_*` twins of every type and function instead). Each family has its own maps: an IPv4
//! map keeps its layout, and nothing of an IPv6 entry is paid for by IPv4 traffic.

/// An address of one family, as a map holds it.
pub trait Addr: Copy + Eq + Ord + core::fmt::Debug + core::hash::Hash + Sized + 'static {
    /// Explicit padding a layout adds where this family's address size would otherwise leave
    /// a hole before an aligned field: none for IPv4, 4 bytes for IPv6.
    type Pad: Copy + Eq + Ord + core::fmt::Debug + core::hash::Hash;
    const PAD: Self::Pad;
    /// The unspecified address.
    const ZERO: Self;
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    const FAMILY: u8;
    /// The address folded to 32 bits, for the flow hash: the address itself for IPv4.
    fn fold(&self) -> u32;
    /// The address as an `IpAddr`, for userspace to show and compare.
    fn ip(self) -> core::net::IpAddr;
}

impl Addr for [u8; 4] {
    type Pad = [u8; 0];
    const PAD: [u8; 0] = [];
    const ZERO: Self = [0; 4];
    const FAMILY: u8 = crate::FAMILY_IPV4;
    #[inline(always)]
    fn fold(&self) -> u32 {
        u32::from_ne_bytes(*self)
    }
    fn ip(self) -> core::net::IpAddr {
        core::net::Ipv4Addr::from(self).into()
    }
}

impl Addr for [u8; 16] {
    type Pad = [u8; 4];
    const PAD: [u8; 4] = [0; 4];
    const ZERO: Self = [0; 16];
    const FAMILY: u8 = crate::FAMILY_IPV6;
    /// The four words, each rotated by its position so that equal words do not cancel.
    #[inline(always)]
    fn fold(&self) -> u32 {
        let p = self.as_ptr().cast::<u32>();
        // SAFETY: the four words of the 16 bytes; unaligned reads, as the array is
        // byte-aligned.
        let w = |i: usize| unsafe { p.add(i).read_unaligned() };
        w(0) ^ w(1).rotate_left(8) ^ w(2).rotate_left(16) ^ w(3).rotate_left(24)
    }
    fn ip(self) -> core::net::IpAddr {
        core::net::Ipv6Addr::from(self).into()
    }
}

/// An IPv4 address as the maps hold it.
pub type V4 = [u8; 4];
/// An IPv6 address as the maps hold it.
pub type V6 = [u8; 16];
