//! Direct server return (`--load-balancer-mode dsr|hybrid`): a north-south flow to a backend
//! on another node keeps the client's address, and the backend's node answers the client
//! itself, from the frontend, instead of through this node.
//!
//! **Dispatch.** The receiving node translates the client's packet to the backend (DNAT
//! only) and sends it to the backend's node as any packet to a pod there, with the frontend
//! the client used (address and port) in an option of its IP header: an IPv4 option (type
//! 0x9e: RFC 4727's experimental number 30, copied into fragments; 8 bytes) or an IPv6
//! destination options header (option type 0x1e, experimental, skipped by a stack that does
//! not know it; 24 bytes). The option is added to a TCP flow's SYNs, and to every UDP
//! datagram that still fits the interface's MTU with it: only the first packets need it, and
//! a TCP segment of full size would no longer fit. No encapsulation, so this kernel's missing
//! ipip, gre and fou modules do not matter, and a packet keeps its 5-tuple on the wire.
//!
//! **The backend's node** reads the option on its uplink (`lb_from_node`) and records the
//! flow as one of its own to a local backend (`flow::record_dispatched`): its replies are
//! then translated to come from the frontend as they leave the node (`lb_to_node`), straight
//! to the client, and so are the ICMP errors its stack sends the client about the flow's
//! packets (PMTU included). The option is left in the packet: a stack ignores an IPv4 option
//! it does not know in a received packet, and skips an unknown IPv6 option of this type.

use aya_ebpf::{helpers::generated::bpf_check_mtu, programs::TcContext};
use lbproxy_common::{
    CONFIG_F_DSR_TCP, CONFIG_F_DSR_UDP, DatapathConfig, Delivery, DropReason, IPPROTO_TCP,
    IPPROTO_UDP,
};

use crate::{
    csum, deliver,
    family::Family,
    nat, north,
    packet::{ETH_LEN, IP_LEN, IP6_LEN, IP6_NEXT_OFF, Packet},
    stage::NatTarget,
};

/// The IPv4 option: copied (bit 7), class 0, number 30 (RFC 4727's experimental number).
pub const OPT4_TYPE: u8 = 0x9e;
/// Its length: type, length, the frontend's port and address.
pub const OPT4_LEN: usize = 8;
/// The IPv6 destination option: type 0x1e (RFC 4727's experimental type; its top bits 00:
/// skipped by a node that does not know it, not changed en route).
pub const OPT6_TYPE: u8 = 0x1e;
/// The destination options header carrying it: next header, length (2: 24 bytes), the
/// option (type, length 18, port, address), and a PadN of 2.
pub const OPT6_HDR_LEN: usize = 24;
/// IPv6's next-header value of a destination options header.
const NH_DEST_OPTS: u8 = 60;
/// `bpf_skb_adjust_room`'s mode that adds room right after the fixed IP header.
const BPF_ADJ_ROOM_NET: u32 = 0;

/// Whether new north-south flows of protocol `proto` to a backend on another node are
/// dispatched with direct server return on this node (`CONFIG_F_DSR_TCP`,
/// `CONFIG_F_DSR_UDP`).
#[inline(always)]
pub fn enabled_for(config: &DatapathConfig, proto: u8) -> bool {
    match proto {
        IPPROTO_TCP => config.flags & CONFIG_F_DSR_TCP != 0,
        IPPROTO_UDP => config.flags & CONFIG_F_DSR_UDP != 0,
        _ => false,
    }
}

/// Whether this node records the flows other nodes dispatch to its pods with direct server
/// return: whenever it runs in `dsr` or `hybrid` mode itself.
#[inline(always)]
pub fn receiving(config: &DatapathConfig) -> bool {
    config.flags & (CONFIG_F_DSR_TCP | CONFIG_F_DSR_UDP) != 0
}

/// What differs between the families' options.
pub trait Dispatch: Family {
    /// The bytes the option adds to a packet.
    const OPTION_LEN: u32;
    /// Adds the option carrying frontend `fe` (address, port) right after the fixed IP
    /// header. `Ok(false)`, nothing changed, when the header has no room for it (an IPv4
    /// header with 24 or more bytes of options already).
    fn push_frontend(ctx: &TcContext, fe: (&Self, u16)) -> Result<bool, DropReason>;
    /// The frontend a packet carries in lbproxy's option, right after the fixed IP header.
    fn frontend_of(ctx: &TcContext) -> Option<(Self, u16)>;
}

const FAIL: DropReason = DropReason::NatFailed;

impl Dispatch for [u8; 4] {
    const OPTION_LEN: u32 = OPT4_LEN as u32;

    #[inline(always)]
    fn push_frontend(ctx: &TcContext, fe: (&Self, u16)) -> Result<bool, DropReason> {
        let ip: [u8; IP_LEN] = ctx.load(ETH_LEN).map_err(|_| FAIL)?;
        let ihl = ip[0] & 0x0f;
        if ihl + (OPT4_LEN as u8) / 4 > 15 {
            return Ok(false);
        }
        ctx.adjust_room(OPT4_LEN as i32, BPF_ADJ_ROOM_NET, 0)
            .map_err(|_| FAIL)?;
        let mut h = ip;
        h[0] = (ip[0] & 0xf0) | (ihl + (OPT4_LEN as u8) / 4);
        let tot = u16::from_be_bytes([ip[2], ip[3]]) + OPT4_LEN as u16;
        h[2..4].copy_from_slice(&tot.to_be_bytes());
        let p = fe.1.to_ne_bytes();
        let a = fe.0;
        let opt = [
            OPT4_TYPE,
            OPT4_LEN as u8,
            p[0],
            p[1],
            a[0],
            a[1],
            a[2],
            a[3],
        ];
        let w = |b: &[u8], at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
        // The header checksum: the first word (IHL) and the total length change, and the
        // option's four words join the sum (they were not there: 0 before).
        let sum = csum::update(
            w(&ip, 10),
            &[w(&ip, 0), w(&ip, 2), 0, 0, 0, 0],
            &[
                w(&h, 0),
                w(&h, 2),
                w(&opt, 0),
                w(&opt, 2),
                w(&opt, 4),
                w(&opt, 6),
            ],
        );
        h[10..12].copy_from_slice(&sum.to_ne_bytes());
        ctx.store(ETH_LEN, &h, 0).map_err(|_| FAIL)?;
        ctx.store(ETH_LEN + IP_LEN, &opt, 0).map_err(|_| FAIL)?;
        Ok(true)
    }

    #[inline(always)]
    fn frontend_of(ctx: &TcContext) -> Option<(Self, u16)> {
        let vihl: u8 = ctx.load(ETH_LEN).ok()?;
        if vihl & 0x0f < 5 + (OPT4_LEN as u8) / 4 {
            return None;
        }
        let opt: [u8; OPT4_LEN] = ctx.load(ETH_LEN + IP_LEN).ok()?;
        if opt[0] != OPT4_TYPE || usize::from(opt[1]) != OPT4_LEN {
            return None;
        }
        Some((
            [opt[4], opt[5], opt[6], opt[7]],
            u16::from_ne_bytes([opt[2], opt[3]]),
        ))
    }
}

impl Dispatch for [u8; 16] {
    const OPTION_LEN: u32 = OPT6_HDR_LEN as u32;

    #[inline(always)]
    fn push_frontend(ctx: &TcContext, fe: (&Self, u16)) -> Result<bool, DropReason> {
        let fixed: [u8; 8] = ctx.load(ETH_LEN).map_err(|_| FAIL)?;
        ctx.adjust_room(OPT6_HDR_LEN as i32, BPF_ADJ_ROOM_NET, 0)
            .map_err(|_| FAIL)?;
        let mut ext = [0u8; OPT6_HDR_LEN];
        ext[0] = fixed[6];
        ext[1] = (OPT6_HDR_LEN / 8 - 1) as u8;
        ext[2] = OPT6_TYPE;
        ext[3] = 18;
        ext[4..6].copy_from_slice(&fe.1.to_ne_bytes());
        ext[6..22].copy_from_slice(fe.0);
        // PadN of 2: type 1, length 0.
        ext[22] = 1;
        ext[23] = 0;
        let len = u16::from_be_bytes([fixed[4], fixed[5]]) + OPT6_HDR_LEN as u16;
        ctx.store(ETH_LEN + IP6_LEN, &ext, 0).map_err(|_| FAIL)?;
        ctx.store(ETH_LEN + 4, &len.to_be_bytes(), 0)
            .map_err(|_| FAIL)?;
        ctx.store(IP6_NEXT_OFF, &NH_DEST_OPTS, 0)
            .map_err(|_| FAIL)?;
        Ok(true)
    }

    #[inline(always)]
    fn frontend_of(ctx: &TcContext) -> Option<(Self, u16)> {
        let next: u8 = ctx.load(IP6_NEXT_OFF).ok()?;
        if next != NH_DEST_OPTS {
            return None;
        }
        let ext: [u8; OPT6_HDR_LEN] = ctx.load(ETH_LEN + IP6_LEN).ok()?;
        if usize::from(ext[1]) != OPT6_HDR_LEN / 8 - 1 || ext[2] != OPT6_TYPE || ext[3] != 18 {
            return None;
        }
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&ext[6..22]);
        Some((addr, u16::from_ne_bytes([ext[4], ext[5]])))
    }
}

/// Whether `pkt` needs the option: a TCP SYN (the backend's node records the flow from it;
/// a retransmitted SYN carries it again), every UDP datagram (any of them may be the first
/// to arrive).
#[inline(always)]
fn wants_option<A>(pkt: &Packet<A>) -> bool {
    pkt.is_syn() || pkt.proto == IPPROTO_UDP
}

/// Whether the packet still fits the MTU of the interface it arrived on with `extra` more
/// bytes (`bpf_check_mtu`); the backend's node is reached through it (a node's one uplink).
#[inline(always)]
fn fits(ctx: &TcContext, extra: u32) -> bool {
    let mut mtu_len = 0u32;
    // SAFETY: the skb of this run; `mtu_len` is ours.
    unsafe { bpf_check_mtu(ctx.skb.skb.cast(), 0, &raw mut mtu_len, extra as i32, 0) == 0 }
}

/// A client's packet of a flow dispatched with direct server return (`to`, the flow's
/// target: the backend, the client's own address and port): translated to the backend,
/// the frontend it was addressed to added as an option when the packet needs it and fits,
/// and sent out towards the backend's node past the stack (`north::redirect`). Returns the
/// TC action.
#[inline(always)]
pub fn forward<A: Family + Dispatch>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    to: NatTarget<A>,
) -> Result<i32, DropReason> {
    nat::dnat(ctx, pkt, to).map_err(|v| v.reason())?;
    if wants_option(pkt) {
        let pushed =
            fits(ctx, A::OPTION_LEN) && A::push_frontend(ctx, (&pkt.dst_addr, pkt.dst_port_be))?;
        if !pushed {
            deliver::count(Delivery::DsrNoRoomForOption);
        }
    }
    deliver::count(Delivery::DsrToBackend);
    north::redirect(
        ctx,
        pkt,
        (&to.peer_addr, to.peer_port_be),
        (&to.addr, to.port_be),
    )
}
