//! SCTP packets for the packet tests: the common header, chunks, and the CRC32c computed
//! bit by bit, independent of the datapath's update by difference.

/// An SCTP packet (RFC 9260): the common header, then `chunks` as given (each already
/// padded to 4 bytes; [`chunk`] builds one). Its checksum covers no pseudo-header, so the
/// same bytes go over IPv4 and IPv6.
#[derive(Clone, Debug)]
pub struct Sctp {
    pub sport: u16,
    pub dport: u16,
    pub vtag: u32,
    pub chunks: Vec<u8>,
}

impl Sctp {
    /// An INIT from `sport` to `dport` (verification tag 0, as RFC 9260 5.1 requires).
    pub fn init(sport: u16, dport: u16) -> Sctp {
        let mut init = Vec::new();
        init.extend_from_slice(&0x5c7a_11f0u32.to_be_bytes()); // initiate tag
        init.extend_from_slice(&0x0002_0000u32.to_be_bytes()); // a_rwnd
        init.extend_from_slice(&10u16.to_be_bytes()); // outbound streams
        init.extend_from_slice(&65535u16.to_be_bytes()); // inbound streams
        init.extend_from_slice(&0x2f1e_0d3cu32.to_be_bytes()); // initial TSN
        Sctp {
            sport,
            dport,
            vtag: 0,
            chunks: chunk(1, 0, &init),
        }
    }

    /// The same association's packet carrying `chunks` (tag `vtag`).
    pub fn with_chunks(sport: u16, dport: u16, vtag: u32, chunks: Vec<u8>) -> Sctp {
        Sctp {
            sport,
            dport,
            vtag,
            chunks,
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12 + self.chunks.len());
        b.extend_from_slice(&self.sport.to_be_bytes());
        b.extend_from_slice(&self.dport.to_be_bytes());
        b.extend_from_slice(&self.vtag.to_be_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&self.chunks);
        let c = crc32c(&b);
        // RFC 9260 appendix A: the CRC's least significant byte first (Linux's
        // `cpu_to_le32`).
        b[8..12].copy_from_slice(&c.to_le_bytes());
        b
    }
}

/// One SCTP chunk: type, flags, length, `value`, padded with zeros to 4 bytes.
pub fn chunk(kind: u8, flags: u8, value: &[u8]) -> Vec<u8> {
    let mut c = vec![kind, flags];
    c.extend_from_slice(&((4 + value.len()) as u16).to_be_bytes());
    c.extend_from_slice(value);
    while !c.len().is_multiple_of(4) {
        c.push(0);
    }
    c
}

/// A DATA chunk (type 0, beginning and end of a message) of `user` bytes, TSN `tsn`.
pub fn data_chunk(tsn: u32, user: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(12 + user.len());
    v.extend_from_slice(&tsn.to_be_bytes());
    v.extend_from_slice(&[0, 1, 0, 0]); // stream 1, sequence 0
    v.extend_from_slice(&[0, 0, 0, 0]); // payload protocol id
    v.extend_from_slice(user);
    chunk(0, 0x03, &v)
}

/// CRC32c (Castagnoli) as SCTP computes it, bit by bit: reflected polynomial 0x82F63B78,
/// initial value and final XOR all ones. Written here, apart from the datapath's and
/// `lbproxy_common`'s code, so that an expected packet is an independent statement.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Whether the SCTP packet `b` (common header and chunks) carries its right CRC32c.
pub fn sctp_crc_ok(b: &[u8]) -> bool {
    if b.len() < 12 {
        return false;
    }
    let mut z = b.to_vec();
    z[8..12].fill(0);
    b[8..12] == crc32c(&z).to_le_bytes()
}

/// One line for an SCTP packet (IPv4 or IPv6): ports, tag, the CRC32c checked, the chunks'
/// types and lengths.
pub fn describe_sctp(l4: &[u8]) -> String {
    let stored = u32::from_le_bytes([l4[8], l4[9], l4[10], l4[11]]);
    let mut chunks = Vec::new();
    let mut at = 12;
    while at + 4 <= l4.len() {
        let len = usize::from(u16::from_be_bytes([l4[at + 2], l4[at + 3]]));
        chunks.push(format!("type {} len {len}", l4[at]));
        if len < 4 {
            break;
        }
        at += len.next_multiple_of(4);
    }
    format!(
        "sctp {} -> {} vtag {:#010x} crc32c {stored:#010x} ({}) chunks [{}], {} bytes",
        u16::from_be_bytes([l4[0], l4[1]]),
        u16::from_be_bytes([l4[2], l4[3]]),
        u32::from_be_bytes([l4[4], l4[5], l4[6], l4[7]]),
        if sctp_crc_ok(l4) {
            "verifies"
        } else {
            "DOES NOT VERIFY"
        },
        chunks.join(", "),
        l4.len()
    )
}
