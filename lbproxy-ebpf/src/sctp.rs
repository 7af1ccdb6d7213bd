//! SCTP's port rewrite: the ports and the CRC32c checksum, updated by difference
//! (`lbproxy_common::sctp`; docs/sctp.md says why not a full recompute). Only an SCTP
//! packet (protocol 132) ever comes here: `nat` calls it instead of the TCP/UDP checksum
//! update, so TCP and UDP pay one compare for it.

use aya_ebpf::programs::TcContext;
use lbproxy_common::sctp::port_delta;

use crate::packet::{ETH_LEN, IP6_LEN};

/// The SCTP common header: ports, verification tag, checksum.
pub const SCTP_HDR_LEN: usize = 12;
/// Offset of the checksum in the common header.
const SCTP_CSUM_OFF: usize = 8;

/// `bpf_skb_store_bytes`: keep a `CHECKSUM_COMPLETE` skb's sum right (the ports and the
/// CRC change the one's-complement sum of the packet, and nothing else makes up for it).
const BPF_F_RECOMPUTE_CSUM: u64 = 1;

/// Writes the ports word `new` (source then destination, as they lie in the packet) over
/// `old` in the SCTP header at `l4_off`, and the CRC32c for it. `af` is the family's
/// `AF_*`, for where the IP header says the packet ends: the CRC covers the SCTP packet up
/// to there, not Ethernet padding after it. Returns 0, or -1 when the header or the length
/// are not there (the caller drops the packet as `NatFailed`).
///
/// A BPF function of its own: the TCP/UDP path does not carry its code, and its frame is
/// apart. A packet whose checksum is left to offload (`CHECKSUM_PARTIAL`, SCTP CRC
/// offload) has a field the stack overwrites later: the update changes nothing then.
#[inline(never)]
pub fn rewrite_ports(ctx: &TcContext, l4_off: usize, af: u8, old: u32, new: u32) -> i32 {
    let ip_end = if af == 2 {
        let Ok(total) = ctx.load::<[u8; 2]>(ETH_LEN + 2) else {
            return -1;
        };
        ETH_LEN + usize::from(u16::from_be_bytes(total))
    } else {
        let Ok(payload) = ctx.load::<[u8; 2]>(ETH_LEN + 4) else {
            return -1;
        };
        ETH_LEN + IP6_LEN + usize::from(u16::from_be_bytes(payload))
    };
    if ip_end < l4_off + SCTP_HDR_LEN || ip_end > ctx.len() as usize {
        return -1;
    }
    let len = (ip_end - l4_off) as u32;
    let Ok(field) = ctx.load::<u32>(l4_off + SCTP_CSUM_OFF) else {
        return -1;
    };
    // Both are read as the bytes lie in the packet: little-endian on bpfel, as the CRC's
    // reflected representation and SCTP's field order want.
    let csum = field ^ port_delta(old, new, len);
    if ctx
        .store(l4_off, &new.to_ne_bytes(), BPF_F_RECOMPUTE_CSUM)
        .is_err()
        || ctx
            .store(
                l4_off + SCTP_CSUM_OFF,
                &csum.to_ne_bytes(),
                BPF_F_RECOMPUTE_CSUM,
            )
            .is_err()
    {
        return -1;
    }
    0
}
