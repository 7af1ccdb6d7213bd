//! Stage 3: the flow table. lbproxy's own state, not the kernel's conntrack.
//!
//! Every new flow gets two entries in `LB_FLOWS_V1`: a forward entry keyed by the client's
//! packet (client -> VIP) that names the backend, and a reply entry keyed by the backend's
//! packet (backend -> client) that names the VIP to restore. A forward entry whose backend is
//! no longer live (removed from `LB_BACKENDS_V1`, or its id reused for another address), or
//! whose service was replaced, is treated as a new flow on its next packet.

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;
use lbproxy_common::{
    DropReason, FLOW_DIR_FORWARD, FLOW_DIR_REPLY, FLOW_STATE_CLOSING, FLOW_STATE_ESTABLISHED,
    FLOW_STATE_NONE, FLOW_STATE_SYN_SENT, FlowKey, FlowValue, IPPROTO_TCP, ServiceValue,
};

use crate::{
    lb::{affinity, select},
    maps::LB_FLOWS_V1,
    parse::{Packet, TCP_FLAG_FIN, TCP_FLAG_RST},
    reason::Verdict,
};

/// `last_seen_ns` is refreshed at most this often, to keep writes off the hot path.
const TOUCH_INTERVAL_NS: u64 = 1_000_000_000;

/// Where a packet is translated to.
#[derive(Clone, Copy)]
pub struct NatTarget {
    pub addr: [u8; 4],
    pub port_be: u16,
}

#[inline(always)]
fn touch(entry: *mut FlowValue, now: u64) {
    // SAFETY: `entry` came from a successful lookup; a racing writer can only store another
    // timestamp, which is harmless.
    unsafe {
        if now.wrapping_sub((*entry).last_seen_ns) > TOUCH_INTERVAL_NS {
            (*entry).last_seen_ns = now;
        }
    }
}

/// The key of a packet as it travels, in direction `dir`.
#[inline(always)]
fn key_of(pkt: &Packet, dir: u8) -> FlowKey {
    FlowKey {
        src_addr: pkt.src_addr,
        dst_addr: pkt.dst_addr,
        src_port_be: pkt.src_port_be,
        dst_port_be: pkt.dst_port_be,
        proto: pkt.proto,
        dir,
        _pad: [0; 2],
    }
}

#[inline(always)]
fn reply_key(backend_addr: [u8; 4], backend_port_be: u16, pkt: &Packet) -> FlowKey {
    FlowKey {
        src_addr: backend_addr,
        dst_addr: pkt.src_addr,
        src_port_be: backend_port_be,
        dst_port_be: pkt.src_port_be,
        proto: pkt.proto,
        dir: FLOW_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// Forward direction: the backend this client packet goes to. Reuses the flow's backend while
/// it is live; otherwise selects one and records both directions.
///
/// A flow whose backend left (gone from `LB_BACKENDS_V1`, its id reused, or its service
/// replaced) is noticed here, on its next packet:
/// - UDP and a TCP SYN are treated as a new flow and go to a live backend;
/// - any other TCP segment is answered with a RST (`Reject`), so the client reconnects
///   instead of hanging, and the flow is forgotten.
///
/// A TCP flow still in SYN_SENT (the backend never answered) that sees another SYN, a
/// retransmission from the same source port, is also treated as new: it is never pinned to a
/// backend that did not answer. So is a SYN on a closed flow (the source port reused).
///
/// `seed` is the node's flow-hash seed (`DatapathConfig::hash_seed`), used only when a
/// backend is selected.
#[inline(always)]
pub fn forward(pkt: &Packet, svc: &ServiceValue, seed: u64) -> Result<NatTarget, Verdict> {
    let key = key_of(pkt, FLOW_DIR_FORWARD);
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // An entry of this tuple's previous flow, rewritten in place below instead of being
    // deleted and inserted again: a client reusing source ports quickly (one connection
    // after another) then costs no LRU churn. `old_reply` is that flow's reply key.
    let mut reuse: Option<(*mut FlowValue, FlowKey)> = None;
    if let Some(entry) = LB_FLOWS_V1.get_ptr_mut(key) {
        let (svc_id, backend_id, addr, port_be, state) = unsafe {
            (
                (*entry).svc_id,
                (*entry).backend_id,
                (*entry).nat_addr,
                (*entry).nat_port_be,
                (*entry).state,
            )
        };
        let live = svc_id == svc.svc_id
            && matches!(select::backend(backend_id), Some(b) if b.addr == addr && b.port_be == port_be);
        // A SYN on a flow that never got an answer, or that already closed (source port
        // reused), starts over.
        let syn_retry =
            pkt.is_syn() && (state == FLOW_STATE_SYN_SENT || state == FLOW_STATE_CLOSING);
        if live && !syn_retry {
            touch(entry, now);
            if pkt.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0 && state != FLOW_STATE_CLOSING {
                unsafe { (*entry).state = FLOW_STATE_CLOSING };
            }
            return Ok(NatTarget { addr, port_be });
        }
        let old_reply = reply_key(addr, port_be, pkt);
        if !live && pkt.proto == IPPROTO_TCP && !pkt.is_syn() {
            // Forget both directions of the old flow.
            let _ = LB_FLOWS_V1.remove(old_reply);
            let _ = LB_FLOWS_V1.remove(key);
            return Err(Verdict::Reject(DropReason::BackendGoneReset));
        }
        reuse = Some((entry, old_reply));
    }

    let (backend_id, backend) = if svc.affinity_timeout_s != 0 {
        affinity::select(pkt, svc, now, seed)?
    } else {
        select::select(svc, pkt, seed)?
    };
    let state = if pkt.proto != IPPROTO_TCP {
        FLOW_STATE_NONE
    } else if pkt.is_syn() {
        FLOW_STATE_SYN_SENT
    } else {
        // Mid-stream without an entry (evicted from a full table, or older than lbproxy):
        // counted, and the new backend will answer or reset it.
        crate::reason::count(DropReason::MidstreamWithoutFlow);
        FLOW_STATE_ESTABLISHED
    };
    let forward = FlowValue {
        nat_addr: backend.addr,
        nat_port_be: backend.port_be,
        state,
        _pad: 0,
        svc_id: svc.svc_id,
        backend_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let reply = FlowValue {
        nat_addr: pkt.dst_addr,
        nat_port_be: pkt.dst_port_be,
        ..forward
    };
    let new_reply = reply_key(backend.addr, backend.port_be, pkt);
    // Reply entry first, so the backend's first answer always finds it.
    match reuse {
        Some((entry, old_reply)) => {
            if old_reply != new_reply {
                let _ = LB_FLOWS_V1.remove(old_reply);
            }
            put(new_reply, reply)?;
            // SAFETY: `entry` came from a successful lookup of `key`. The previous flow on
            // this tuple is over (closed or never answered), so no packet of it races this
            // write.
            unsafe { *entry = forward };
        }
        None => {
            insert(new_reply, reply)?;
            insert(key, forward)?;
        }
    }
    Ok(NatTarget {
        addr: backend.addr,
        port_be: backend.port_be,
    })
}

/// Writes `value` under `key`: in place when the entry exists, else as a new entry.
#[inline(always)]
fn put(key: FlowKey, value: FlowValue) -> Result<(), Verdict> {
    if let Some(e) = LB_FLOWS_V1.get_ptr_mut(key) {
        // SAFETY: `e` came from a successful lookup; see `forward` on racing readers.
        unsafe { *e = value };
        return Ok(());
    }
    insert(key, value)
}

#[inline(always)]
fn insert(key: FlowKey, value: FlowValue) -> Result<(), Verdict> {
    LB_FLOWS_V1
        .insert(key, value, 0)
        .map_err(|_| Verdict::Drop(DropReason::FlowInsertFailed))
}

/// Reply direction: the VIP:port a backend's packet to a client must appear to come from,
/// or `None` when the packet is not a reply of a load-balanced flow. The first TCP answer
/// from the backend moves the flow from SYN_SENT to ESTABLISHED.
#[inline(always)]
pub fn reply(pkt: &Packet) -> Option<NatTarget> {
    let key = key_of(pkt, FLOW_DIR_REPLY);
    let entry = LB_FLOWS_V1.get_ptr_mut(key)?;
    touch(entry, unsafe { bpf_ktime_get_coarse_ns() });
    let (addr, port_be, state) =
        unsafe { ((*entry).nat_addr, (*entry).nat_port_be, (*entry).state) };
    let closing = pkt.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST) != 0;
    let new_state = if closing {
        FLOW_STATE_CLOSING
    } else if state == FLOW_STATE_SYN_SENT {
        FLOW_STATE_ESTABLISHED
    } else {
        state
    };
    if pkt.proto == IPPROTO_TCP && new_state != state && state != FLOW_STATE_CLOSING {
        unsafe { (*entry).state = new_state };
        let fwd = FlowKey {
            src_addr: pkt.dst_addr,
            dst_addr: addr,
            src_port_be: pkt.dst_port_be,
            dst_port_be: port_be,
            proto: pkt.proto,
            dir: FLOW_DIR_FORWARD,
            _pad: [0; 2],
        };
        if let Some(f) = LB_FLOWS_V1.get_ptr_mut(fwd) {
            unsafe { (*f).state = new_state };
        }
    }
    Some(NatTarget { addr, port_be })
}
