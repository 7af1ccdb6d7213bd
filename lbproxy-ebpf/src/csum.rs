//! One's-complement checksum arithmetic (RFC 1071), for the translations' incremental
//! updates and the headers the reject path writes from scratch. Pure integer code: it reads
//! and writes no packet, and imports nothing of the datapath (a leaf of its module graph).

/// One's complement checksum `csum` (as read from the packet) updated for 16-bit words
/// changing from `old` to `new` (RFC 1624, eqn. 3). Byte order does not matter as long as
/// the checksum and the words are read the same way.
#[inline(always)]
pub fn update(csum: u16, old: &[u16], new: &[u16]) -> u16 {
    let mut sum = u32::from(!csum);
    for w in old {
        sum += u32::from(!*w);
    }
    for w in new {
        sum += u32::from(*w);
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// One's-complement sum of big-endian 16-bit words.
#[inline(always)]
pub fn sum_words(bytes: &[u8], mut acc: u32) -> u32 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        acc += u32::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    acc
}

/// Folds a one's-complement sum to 16 bits and complements it: the value of a checksum field.
#[inline(always)]
pub fn fold(mut acc: u32) -> u16 {
    acc = (acc & 0xffff) + (acc >> 16);
    acc = (acc & 0xffff) + (acc >> 16);
    !(acc as u16)
}

/// 32-bit one's-complement addition (end-around carry), the kernel's `csum_add`.
#[inline(always)]
pub fn csum_add(a: u32, b: u32) -> u32 {
    let (sum, carry) = a.overflowing_add(b);
    sum.wrapping_add(u32::from(carry))
}

/// The difference of 32-bit words changing from `old` to `new`: each old word's complement
/// and each new word, for the words that change. 0 when nothing changes.
#[inline(always)]
pub fn words_diff<const N: usize>(old: [u32; N], new: [u32; N]) -> u32 {
    let mut d = 0;
    let mut i = 0;
    while i < N {
        if old[i] != new[i] {
            d = csum_add(csum_add(d, !old[i]), new[i]);
        }
        i += 1;
    }
    d
}
