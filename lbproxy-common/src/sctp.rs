//! SCTP's checksum (RFC 9260, appendix A: CRC32c, Castagnoli) updated for a change of bytes
//! at a known place, without reading the rest of the packet. Pure integer code, shared by
//! the datapath (which applies it) and the host tests (which check it against a CRC32c
//! computed in full).
//!
//! The CRC covers the SCTP packet only (common header and chunks), with its own field taken
//! as zero; no IP pseudo-header. A translation that changes only addresses leaves it as it
//! is; one that changes a port changes it.
//!
//! CRC32c is affine over GF(2): for two messages `a` and `b` of the same length,
//! `crc(a) ^ crc(b)` is the CRC, with no initial value and no final XOR, of `a ^ b`. When
//! only the first four bytes (the two ports) differ, `a ^ b` is those four bytes of
//! difference `d` followed by `len - 4` zero bytes, and its CRC register is
//! `d(x) * x^(8 * len) mod P` (in the reflected representation the CRC uses, where bit 31
//! is `x^0`): one multiplication by a power of `x` that depends only on the packet's
//! length. That power is looked up in two tables of 256 constants
//! (`x^(8 * len) = x^(2048 * (len >> 8)) * x^(8 * (len & 0xff))`), so an update costs two
//! carry-less multiplications of 32 steps each, whatever the packet's length.

/// The CRC32c polynomial, reflected.
pub const POLY: u32 = 0x82F6_3B78;

/// `x^0` in the reflected representation: the identity of [`mulmod`].
const ONE: u32 = 0x8000_0000;

/// `a * b mod P`, both in the reflected representation (bit 31 is `x^0`). Branch-free, 32
/// steps: the datapath's verifier walks it once, whatever the values.
#[inline(always)]
pub const fn mulmod(a: u32, b: u32) -> u32 {
    let mut b = b;
    let mut p = 0u32;
    let mut i = 0;
    while i < 32 {
        // Coefficient of x^i in `a` is bit 31 - i.
        let bit = (a >> (31 - i)) & 1;
        p ^= b & 0u32.wrapping_sub(bit);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    p
}

/// `x^8 mod P`: one byte's shift.
const X8: u32 = ONE >> 8;

/// `X8_LO[i] = x^(8 * i) mod P`, for `i` in `0..256`.
pub static X8_LO: [u32; 256] = {
    let mut t = [0u32; 256];
    t[0] = ONE;
    let mut i = 1;
    while i < 256 {
        t[i] = mulmod(t[i - 1], X8);
        i += 1;
    }
    t
};

/// `X8_HI[i] = x^(8 * 256 * i) mod P`, for `i` in `0..256`.
pub static X8_HI: [u32; 256] = {
    let step = mulmod(X8_LO[255], X8);
    let mut t = [0u32; 256];
    t[0] = ONE;
    let mut i = 1;
    while i < 256 {
        t[i] = mulmod(t[i - 1], step);
        i += 1;
    }
    t
};

/// `x^(8 * len) mod P`, for a length below 65,536 bytes (higher bits are ignored: no IPv4
/// or IPv6 packet without a jumbogram is that long).
#[inline(always)]
pub fn shift_bytes(len: u32) -> u32 {
    let hi = ((len >> 8) & 0xff) as usize;
    let lo = (len & 0xff) as usize;
    mulmod(X8_HI[hi], X8_LO[lo])
}

/// What to XOR into the checksum field, read as a little-endian `u32` (the byte order SCTP
/// stores it in, as Linux's `cpu_to_le32`), when the first four bytes of an SCTP packet of
/// `len` bytes change from `old` to `new` (each those four bytes read as a little-endian
/// `u32`). 0 when they do not change.
#[inline(always)]
pub fn port_delta(old: u32, new: u32, len: u32) -> u32 {
    mulmod(old ^ new, shift_bytes(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC32c as SCTP computes it, bit by bit: initial value all ones, final XOR all ones,
    /// reflected. Independent of the tables above.
    fn crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ POLY
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn crc32c_check_value() {
        // The CRC catalogue's check value for CRC-32/ISCSI.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    /// A packet of `len` bytes with the checksum field (bytes 8..12) computed.
    fn packet(len: usize, seed: u8) -> Vec<u8> {
        let mut p: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        p[8..12].fill(0);
        let c = crc32c(&p);
        p[8..12].copy_from_slice(&c.to_le_bytes());
        p
    }

    #[test]
    fn port_delta_matches_a_full_recompute() {
        let ports = [
            ([0x9c, 0x41, 0x00, 0x50], [0x9c, 0x41, 0x1f, 0x90]),
            ([0x00, 0x00, 0x00, 0x00], [0xff, 0xff, 0xff, 0xff]),
            ([0x12, 0x34, 0x56, 0x78], [0x12, 0x34, 0x56, 0x78]),
            ([0xab, 0xcd, 0x00, 0x63], [0x13, 0x88, 0x00, 0x63]),
        ];
        for len in [12, 16, 28, 48, 255, 256, 257, 1400, 1480, 9000, 65_515] {
            for (old, new) in ports {
                let mut p = packet(len, len as u8);
                p[..4].copy_from_slice(&old);
                p[8..12].fill(0);
                let c = crc32c(&p);
                p[8..12].copy_from_slice(&c.to_le_bytes());

                let d = port_delta(u32::from_le_bytes(old), u32::from_le_bytes(new), len as u32);
                let field = u32::from_le_bytes(p[8..12].try_into().unwrap()) ^ d;
                p[..4].copy_from_slice(&new);
                p[8..12].fill(0);
                assert_eq!(
                    field,
                    crc32c(&p),
                    "len {len}, ports {old:02x?} -> {new:02x?}"
                );
            }
        }
    }

    #[test]
    fn tables_are_powers_of_x() {
        assert_eq!(X8_LO[0], ONE);
        assert_eq!(X8_LO[1], X8);
        assert_eq!(X8_HI[1], mulmod(X8_LO[128], X8_LO[128]));
        assert_eq!(shift_bytes(256 + 3), mulmod(X8_HI[1], X8_LO[3]));
    }
}
