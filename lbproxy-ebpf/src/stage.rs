//! The types the stages hand each other: what a stage decided ([`Verdict`] and the typed
//! outcomes of the hooks' stages), where a flow translates to ([`NatTarget`], [`Source`]),
//! and the per-CPU state a hook's stages share ([`StagedPacket`]). Every stage
//! imports them and they import nothing of the stages, so the datapath's module graph has
//! no circle (`packet` and `csum` are the other leaves).

use lbproxy_common::{Addr, DropReason, FlowValueOf};

use crate::packet::Packet;

/// tcx: hand the packet to the next program (or the stack, when this is the last one).
pub const TC_ACT_UNSPEC: i32 = -1;
/// Drop the packet.
pub const TC_ACT_SHOT: i32 = 2;

/// What a stage decided instead of letting the packet continue.
#[derive(Clone, Copy)]
pub enum Verdict {
    /// Drop and count under this reason.
    Drop(DropReason),
    /// Answer the client at once (TCP RST or ICMP unreachable), counted under this reason.
    Reject(DropReason),
}

impl Verdict {
    #[inline(always)]
    pub fn reason(self) -> DropReason {
        match self {
            Verdict::Drop(r) | Verdict::Reject(r) => r,
        }
    }
}

/// Where a packet is translated to.
#[derive(Clone, Copy)]
pub struct NatTarget<A = [u8; 4]> {
    /// Forward: the backend. Reply: the VIP.
    pub addr: A,
    pub port_be: u16,
    /// The client's port on the far side of the translation. Forward: the source port the
    /// backend sees (the client's own, unless the tuple clashed or the flow is
    /// source-NATed). Reply: the client's own port, restored as the destination port.
    pub peer_port_be: u16,
    /// The same for the address. Forward: the source address the backend sees (the
    /// client's own, or the node's when source-NATed). Reply: the client's own address.
    pub peer_addr: A,
    /// The flow's `FlowValue::adopted`: whether netfilter's conntrack entry still
    /// translates it (`lbproxy_common::FlowAdopted`).
    pub adopted: u8,
    /// The flow's `FlowValue::dispatch`: `FLOW_DISPATCH_DSR` for a flow dispatched with
    /// direct server return (`dsr`), else 0. A field of its own, not padding: no implicit
    /// padding, whose undefined bytes LLVM may copy in a register the verifier then refuses
    /// to read.
    pub dispatch: u8,
}

impl<A: Addr> NatTarget<A> {
    /// A packet conntrack translates, passed untranslated by every hook, as an adopted
    /// flow's whose entry still exists (`flow::forward`'s packets of no flow while kube-proxy's
    /// rules may hold their connection).
    #[inline(always)]
    pub fn conntrack() -> NatTarget<A> {
        NatTarget {
            addr: A::ZERO,
            port_be: 0,
            peer_port_be: 0,
            peer_addr: A::ZERO,
            adopted: lbproxy_common::FLOW_ADOPTED_CONNTRACK,
            dispatch: 0,
        }
    }

    #[inline(always)]
    pub fn of(v: &FlowValueOf<A>) -> NatTarget<A> {
        NatTarget {
            addr: v.nat_addr,
            port_be: v.nat_port_be,
            peer_port_be: v.peer_port_be,
            peer_addr: v.peer_addr,
            adopted: v.adopted,
            dispatch: v.dispatch,
        }
    }
}

/// Where a new flow's packets come from as the backend sees them: the client itself
/// ([`Source::CLIENT`]); source-NATed (`snat`) to the node's address `addr` on the interface
/// towards the backend with a port of the SNAT range (`min..=max`, host order); or, without
/// `snat`, from another address `addr` with the client's own port (a pod's flow to itself,
/// `hairpin`), moved like a clashing tuple's when another flow holds it.
///
/// A struct whose every field is always set, not an enum with payload: the fields of an
/// enum variant not taken are undefined, and LLVM may then compute with whatever register
/// it likes, a map pointer included, which the verifier refuses. A caller whose sources
/// never set `snat` (`lb_from_pod`) has the SNAT port search folded away.
#[derive(Clone, Copy)]
pub struct Source<A = [u8; 4]> {
    pub snat: bool,
    /// Direct server return: the client's own address, the packets dispatched to the
    /// backend's node carrying the frontend (`dsr`).
    pub dsr: bool,
    /// The source address the backend sees; the unspecified address: the client's own.
    pub addr: A,
    pub min: u16,
    pub max: u16,
}

impl<A: Addr> Source<A> {
    pub const CLIENT: Source<A> = Source {
        snat: false,
        dsr: false,
        addr: A::ZERO,
        min: 0,
        max: 0,
    };
    /// The client's own address and port, dispatched with direct server return.
    pub const DSR: Source<A> = Source {
        snat: false,
        dsr: true,
        addr: A::ZERO,
        min: 0,
        max: 0,
    };
}

/// What a hook's parse stage (a BPF function of its own) did with the packet. A scalar, so it crosses the call in a register.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A TCP or UDP packet, now in [`StagedPacket::pkt`].
    Packet = 0,
    /// Not the load balancer's (not TCP or UDP, or not understood): it passes.
    Pass = 1,
    /// Malformed: dropped, already counted.
    Dropped = 2,
}

/// What the frontend, source and flow stages decided for a parsed packet, when those run as
/// a BPF function of their own. The answer's data is in the [`StagedPacket`]:
/// [`StagedPacket::to`] for `Translate`, [`StagedPacket::reason`] for
/// `Drop` and `Reject`. A scalar, so it crosses the call in a register.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// Translate the packet to the flow's backend.
    Translate = 0,
    /// Drop it, counted under the reason.
    Drop = 1,
    /// Answer the client at once, counted under the reason.
    Reject = 2,
    /// Not addressed to a frontend this hook serves: maybe a reply to translate back.
    NoFrontend = 3,
}

impl Forwarded {
    /// Writes `flow::forward`'s answer `r` into `staged` and says which kind it is.
    #[inline(always)]
    pub fn record<A: Addr>(
        staged: &mut StagedPacket<A>,
        r: Result<NatTarget<A>, Verdict>,
    ) -> Forwarded {
        match r {
            Ok(t) => {
                staged.to = t;
                Forwarded::Translate
            }
            Err(Verdict::Drop(r)) => {
                staged.reason = r;
                Forwarded::Drop
            }
            Err(Verdict::Reject(r)) => {
                staged.reason = r;
                Forwarded::Reject
            }
        }
    }
}

/// A packet going through a hook's stages, with what the flow stage chose for it: parsed
/// (`pkt`), then translated to `to` or given up for `reason`. A hook's stages are BPF
/// functions of their own, run one after the other (the verifier allows 512 bytes of stack
/// along a call chain, and the IPv6 stages together need more); what they hand on crosses
/// the calls in this CPU's entry of `maps::LB_PACKET4`/`LB_PACKET6`, not on the stack. The
/// datapath's own scratch: not pinned, not in `lbproxy_common::MAPS`, created afresh with
/// each load.
pub struct StagedPacket<A> {
    pub pkt: Packet<A>,
    pub to: NatTarget<A>,
    pub reason: DropReason,
}
