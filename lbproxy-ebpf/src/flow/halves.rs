//! A flow's two halves in the flow map: their keys, how a pair is recognised, and the
//! single-field writes a live entry gets (`touch`, `note_close`). Shared by the flow stage's
//! lookup (`flow`) and its new flows (`flow::new`); imports neither.

use aya_ebpf::bindings::BPF_NOEXIST;
use lbproxy_common::{
    Addr, DropReason, FLOW_DIR_REPLY, FLOW_F_FIN, FLOW_F_RST, FlowKeyOf, FlowValueOf, IPPROTO_TCP,
};

use crate::{
    family::Family,
    packet::{Packet, TCP_FLAG_FIN, TCP_FLAG_RST},
    reason::count,
    stage::Verdict,
};

/// `last_seen_ns` is refreshed at most this often, to keep writes off the hot path.
pub(super) const TOUCH_INTERVAL_NS: u64 = 1_000_000_000;

#[inline(always)]
pub(super) fn touch<A: Addr>(entry: *mut FlowValueOf<A>, now: u64) {
    // SAFETY: `entry` came from a successful lookup; a racing writer can only store another
    // timestamp, which is harmless.
    unsafe {
        if now.wrapping_sub((*entry).last_seen_ns) > TOUCH_INTERVAL_NS {
            (*entry).last_seen_ns = now;
        }
    }
}

/// Records this packet's FIN or RST in its own half's `flags` (a single-byte write, and only
/// when it changes).
#[inline(always)]
pub(super) fn note_close<A: Addr>(entry: *mut FlowValueOf<A>, pkt: &Packet<A>) {
    if pkt.proto != IPPROTO_TCP {
        return;
    }
    let mut seen = 0;
    if pkt.tcp_flags & TCP_FLAG_FIN != 0 {
        seen |= FLOW_F_FIN;
    }
    if pkt.tcp_flags & TCP_FLAG_RST != 0 {
        seen |= FLOW_F_RST;
    }
    // SAFETY: `entry` came from a successful lookup; only this direction writes `flags`.
    unsafe {
        let flags = (*entry).flags;
        if seen & !flags != 0 {
            (*entry).flags = flags | seen;
        }
    }
}

/// The key of a packet as it travels, in direction `dir`.
#[inline(always)]
pub(super) fn key_of<A: Addr>(pkt: &Packet<A>, dir: u8) -> FlowKeyOf<A> {
    FlowKeyOf {
        src_addr: pkt.src_addr,
        dst_addr: pkt.dst_addr,
        src_port_be: pkt.src_port_be,
        dst_port_be: pkt.dst_port_be,
        proto: pkt.proto,
        dir,
        _pad: [0; 2],
    }
}

/// The reply key of a flow from `client` (at port `client_port_be` as the backend sees it)
/// to `backend`.
#[inline(always)]
pub(super) fn reply_key<A: Addr>(
    backend: A,
    backend_port_be: u16,
    client: A,
    client_port_be: u16,
    proto: u8,
) -> FlowKeyOf<A> {
    FlowKeyOf {
        src_addr: backend,
        dst_addr: client,
        src_port_be: backend_port_be,
        dst_port_be: client_port_be,
        proto,
        dir: FLOW_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// Whether the reply entry `r` is the partner of the forward entry `f` keyed `fkey`
/// (`FlowKeyOf::pairs`, which `lbproxy explain` shares).
#[inline(always)]
pub(super) fn pairs<A: Addr>(fkey: &FlowKeyOf<A>, f: &FlowValueOf<A>, r: &FlowValueOf<A>) -> bool {
    fkey.pairs(f, r)
}

#[inline(always)]
pub(super) fn insert<A: Family>(
    key: &FlowKeyOf<A>,
    value: &FlowValueOf<A>,
    flags: u32,
) -> Result<(), Verdict> {
    A::flow_insert(key, value, u64::from(flags))
        .map_err(|_| Verdict::Drop(DropReason::FlowInsertFailed))
}

/// Recreates the half `key` (evicted alone) of the flow whose other half is `entry`: its
/// translation goes to `nat` and back to `peer` (address, port), with `state`; the rest is
/// `entry`'s. Built in `v`, the working state's value (`Family::work`).
#[inline(always)]
pub(super) fn recreate_partner<A: Family>(
    key: &FlowKeyOf<A>,
    entry: *const FlowValueOf<A>,
    nat: (A, u16),
    peer: (A, u16),
    state: u8,
    now: u64,
    v: &mut FlowValueOf<A>,
) {
    // SAFETY: `entry` came from a successful lookup in this run of the program.
    let e = unsafe { &*entry };
    v.nat_addr = nat.0;
    v.nat_port_be = nat.1;
    v.peer_port_be = peer.1;
    v.state = state;
    v.flags = 0;
    v._pad = [0; 2];
    v.svc_id = e.svc_id;
    v.backend_id = e.backend_id;
    v.ifindex = 0;
    v._pad_a = A::PAD;
    v.created_ns = e.created_ns;
    v.last_seen_ns = now;
    v.peer_addr = peer.0;
    v.adopted = e.adopted;
    v.dispatch = e.dispatch;
    v._reserved = [0; 2];
    v._pad_b = A::PAD;
    if insert(key, v, BPF_NOEXIST).is_ok() {
        count(DropReason::FlowHalfRecreated);
    }
}
