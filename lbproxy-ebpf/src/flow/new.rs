//! The flow stage's new flow: started in the halves of the tuple's previous flow when they
//! match, else written afresh, the reply half first, with the client's own port, a SNAT port
//! or a clash port (see the `flow` module's docs).

use aya_ebpf::bindings::{BPF_ANY, BPF_NOEXIST};
use lbproxy_common::{
    Addr, BackendOf, DropReason, FLOW_ADOPTED_OWN, FLOW_DISPATCH_DSR, FLOW_DISPATCH_SNAT,
    FlowKeyOf, FlowValueOf, FlowWork, ServiceValue,
    select::{CLASH_PORT_ATTEMPTS, clash_port},
};

use crate::{
    family::Family,
    maps::LB_SNATTRIES_V1,
    packet::Packet,
    reason::count,
    stage::{NatTarget, Source, Verdict},
};

use super::halves::{insert, reply_key};

/// Tries for a SNAT port: random ones first, then linear.
const SNAT_ATTEMPTS: u32 = 16;

const _: () = assert!(lbproxy_common::snat_tries::MAX_SNAT_TRIES == SNAT_ATTEMPTS + 1);

const SNAT_RANDOM_ATTEMPTS: u32 = 8;

/// What [`established`] learnt of the tuple's previous flow, for [`create`].
pub(super) struct Previous<A: Addr> {
    /// The packet passed the source check, now or before on this interface.
    pub(super) verified: bool,
    /// The reply key of this tuple's previous flow, when it is that flow's own partner: it
    /// is removed or replaced by the new flow, never left behind (`w.old_reply`).
    pub(super) has_old: bool,
    /// That previous flow's two halves and its choice (service, backend), when the new flow
    /// may reuse them in place (see [`reopen`]).
    pub(super) reusable: Option<Reusable<A>>,
}

/// The flow stage's new flow, to `w.backend` (`backend_id`, selected), in `state`, seen by
/// the backend as coming from `nat_source`: its halves are started in the tuple's previous
/// flow's when they match (`prev`), else written afresh, the reply half first
/// ([`claim_reply`]).
#[expect(
    clippy::too_many_arguments,
    reason = "the flow stage's state, handed on in registers"
)]
#[inline(always)]
pub(super) fn create<A: Family>(
    pkt: &Packet<A>,
    svc: &ServiceValue,
    seed: u64,
    ingress: u32,
    w: &mut FlowWork<A>,
    now: u64,
    prev: &Previous<A>,
    backend_id: u32,
    state: u8,
    nat_source: &Source<A>,
) -> Result<NatTarget<A>, Verdict> {
    let backend = &w.backend;
    w.peer = if nat_source.addr == A::ZERO {
        pkt.src_addr
    } else {
        nat_source.addr
    };
    let peer_addr = &w.peer;
    // The port the backend sees: the client's own, or, when this tuple's previous flow went
    // to the same backend from the same address, that flow's (a source-NATed or clash
    // port), so that the new flow can start in its halves below instead of searching for a
    // port and allocating both halves again. At tens of thousands of connections a second
    // from one client, its ports come round again within a second or two.
    let o = &w.old_reply;
    let port_be = if prev.has_old
        && o.src_addr == backend.addr
        && o.src_port_be == backend.port_be
        && o.dst_addr == *peer_addr
        && (!nat_source.snat
            || (u16::from_be(o.dst_port_be) >= nat_source.min
                && u16::from_be(o.dst_port_be) <= nat_source.max))
    {
        o.dst_port_be
    } else {
        pkt.src_port_be
    };
    w.rkey = reply_key(
        backend.addr,
        backend.port_be,
        *peer_addr,
        port_be,
        pkt.proto,
    );
    let rkey = &mut w.rkey;
    // Whether the new flow's reply tuple is its tuple's previous flow's.
    let same_reply = prev.has_old && *o == *rkey;
    if let Some(old) = &prev.reusable
        && same_reply
        && old.svc_id == svc.svc_id
        && old.backend_id == backend_id
    {
        // The same service, backend and reply tuple as the tuple's previous flow (a SYN
        // retransmitted, a port reused towards the same backend): every field a translation
        // reads is already right, so only the flow's state is reset, in place.
        reopen(old, state, now, u8::from(nat_source.dsr));
        if nat_source.snat {
            // The previous flow's SNAT port, kept: one try.
            count_snat_tries(1);
        }
        return Ok(NatTarget {
            addr: backend.addr,
            port_be: backend.port_be,
            peer_port_be: rkey.dst_port_be,
            peer_addr: *peer_addr,
            adopted: FLOW_ADOPTED_OWN,
            dispatch: u8::from(nat_source.dsr),
        });
    }
    let reply = &mut w.value;
    reply.nat_addr = pkt.dst_addr;
    reply.nat_port_be = pkt.dst_port_be;
    reply.peer_port_be = pkt.src_port_be;
    reply.state = state;
    reply.flags = 0;
    reply._pad = [0; 2];
    reply.svc_id = svc.svc_id;
    reply.backend_id = backend_id;
    reply.ifindex = 0;
    reply._pad_a = A::PAD;
    reply.created_ns = now;
    reply.last_seen_ns = now;
    reply.peer_addr = pkt.src_addr;
    reply.adopted = 0;
    reply.dispatch = if nat_source.dsr {
        FLOW_DISPATCH_DSR
    } else {
        FLOW_DISPATCH_SNAT
    };
    reply._reserved = [0; 2];
    reply._pad_b = A::PAD;
    if prev.has_old && !same_reply {
        A::flow_remove(o);
    }
    claim_reply(
        pkt, seed, &w.key, rkey, reply, backend, same_reply, nat_source,
    )?;
    // The forward half is the reply half with the other ends: built in the same place, which
    // keeps an IPv6 flow's two 80-byte values from both taking room on the stack.
    let forward = reply;
    forward.nat_addr = backend.addr;
    forward.nat_port_be = backend.port_be;
    forward.peer_port_be = rkey.dst_port_be;
    forward.peer_addr = *peer_addr;
    forward.ifindex = ingress;
    // A map update: a CPU reading this key meanwhile sees the old entry or the new one.
    insert(&w.key, forward, BPF_ANY)?;
    Ok(NatTarget::of(forward))
}

/// Inserts a new flow's reply half `reply` under `rkey`, first, so the backend's first
/// answer always finds it. The client's own port (or the tuple's previous flow's, when the
/// reply tuple is that flow's: `same_reply`) is used unless another live flow holds that
/// tuple towards this backend; then a SNAT port is searched ([`snat_port`]) or, without
/// SNAT, a clash port (`TupleClashPortRewritten`). `rkey.dst_port_be` ends as the port
/// claimed.
#[expect(
    clippy::too_many_arguments,
    reason = "the flow stage's state, handed on in registers"
)]
#[inline(always)]
pub(super) fn claim_reply<A: Family>(
    pkt: &Packet<A>,
    seed: u64,
    key: &FlowKeyOf<A>,
    rkey: &mut FlowKeyOf<A>,
    reply: &FlowValueOf<A>,
    backend: &BackendOf<A>,
    same_reply: bool,
    nat_source: &Source<A>,
) -> Result<(), Verdict> {
    let claimed = if same_reply {
        insert(rkey, reply, BPF_ANY).is_ok()
    } else if nat_source.snat {
        let port = u16::from_be(pkt.src_port_be);
        port >= nat_source.min
            && port <= nat_source.max
            && (insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, key))
    } else {
        insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, key)
    };
    if nat_source.snat && claimed {
        // The client's own port (or this tuple's previous flow's): the first try.
        count_snat_tries(1);
    } else if nat_source.snat {
        // The client's own port was tried above when it is in the range.
        let port = u16::from_be(pkt.src_port_be);
        let own_tried = u32::from(port >= nat_source.min && port <= nat_source.max);
        rkey.dst_port_be = snat_port(rkey, reply, key, nat_source.min, nat_source.max, own_tried)?;
    } else if !claimed {
        let mut found = false;
        let mut attempt = 0;
        while attempt < CLASH_PORT_ATTEMPTS {
            rkey.dst_port_be =
                clash_port(seed, pkt.src_addr, backend.addr, pkt.src_port_be, attempt);
            if insert(rkey, reply, BPF_NOEXIST).is_ok() {
                found = true;
                break;
            }
            attempt += 1;
        }
        if !found {
            return Err(Verdict::Drop(DropReason::TupleClashNoPort));
        }
        count(DropReason::TupleClashPortRewritten);
    }
    Ok(())
}

/// The two halves of a tuple's previous flow, found by `forward`, and the service and
/// backend they name.
#[derive(Clone, Copy)]
pub(super) struct Reusable<A: Addr> {
    pub(super) forward: *mut FlowValueOf<A>,
    pub(super) reply: *mut FlowValueOf<A>,
    pub(super) svc_id: u32,
    pub(super) backend_id: u32,
}

/// Starts a new flow in the halves of the previous one on its tuple, which name the same
/// service, backend and reply tuple: single-field writes of the fields a new flow sets
/// (times, state, close flags), the clock first so that the collector never finds a
/// reset flow with an old timestamp. No field a translation reads changes, so a CPU that
/// reads either half meanwhile translates exactly as it would with the old flow or the new
/// one; and no entry is freed or allocated (two LRU updates, about half of a new flow's cost
/// on a reused port, measured with `cargo xtask bench programs`).
#[inline(always)]
pub(super) fn reopen<A: Addr>(old: &Reusable<A>, state: u8, now: u64, dispatch: u8) {
    for half in [old.reply, old.forward] {
        // SAFETY: both came from successful lookups in this run of the program; each write
        // is one aligned field.
        unsafe {
            (*half).last_seen_ns = now;
            (*half).created_ns = now;
            (*half).state = state;
            (*half).flags = 0;
            // A new flow on an adopted flow's tuple is lbproxy's own.
            (*half).adopted = FLOW_ADOPTED_OWN;
            (*half).dispatch = dispatch;
        }
    }
}

/// Counts one SNAT port allocation that took `tries` tries (0: it found no port) in
/// `LB_SNATTRIES_V1`.
#[inline(always)]
pub(super) fn count_snat_tries(tries: u32) {
    if let Some(c) = LB_SNATTRIES_V1.get_ptr_mut(tries) {
        // SAFETY: a per-CPU slot: no other writer.
        unsafe { *c += 1 };
    }
}

/// Claims a free SNAT port in `min..=max` for the reply half `reply` keyed `rkey` (whose
/// destination port is changed while trying): [`SNAT_RANDOM_ATTEMPTS`] random ports, then a
/// linear scan from the last one, [`SNAT_ATTEMPTS`] tries in all (one loop, which keeps the
/// verifier's path short), after `own_tried` (0 or 1) tries of the client's own port. A
/// port held by a flow that is over (a RST, or FINs both ways) is taken over, as netfilter
/// and Cilium reuse a closed connection's tuple: at tens of thousands of connections a
/// second towards one backend, closed flows would otherwise hold most of the range until
/// the collector removes them. `own` is the new flow's forward key. Returns the port
/// (network order); dropped as `SnatNoPort` when every try found its port held by a live
/// flow. The tries are counted in `LB_SNATTRIES_V1`.
#[inline(always)]
pub(super) fn snat_port<A: Family>(
    rkey: &mut FlowKeyOf<A>,
    reply: &FlowValueOf<A>,
    own: &FlowKeyOf<A>,
    min: u16,
    max: u16,
    own_tried: u32,
) -> Result<u16, Verdict> {
    let span = u32::from(max.saturating_sub(min)) + 1;
    let mut port = min;
    let mut attempt = 0;
    while attempt < SNAT_ATTEMPTS {
        port = if attempt < SNAT_RANDOM_ATTEMPTS {
            // SAFETY: a helper call without arguments.
            let r = unsafe { aya_ebpf::helpers::generated::bpf_get_prandom_u32() };
            min + (r % span) as u16
        } else if port >= max {
            min
        } else {
            port + 1
        };
        rkey.dst_port_be = port.to_be();
        if insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, own) {
            count_snat_tries(own_tried + attempt + 1);
            return Ok(port.to_be());
        }
        attempt += 1;
    }
    count_snat_tries(0);
    Err(Verdict::Drop(DropReason::SnatNoPort))
}

/// The reply tuple `rkey` is taken. Takes it over (and forgets the flow holding it) when
/// that flow is over (it saw a RST, or a FIN both ways) or is this tuple's own previous flow
/// (forward key `own`, being replaced now, e.g. after its service was re-created). Returns
/// whether `reply` is now in place.
#[inline(always)]
pub(super) fn replace_if_stale<A: Family>(
    rkey: &FlowKeyOf<A>,
    reply: &FlowValueOf<A>,
    own: &FlowKeyOf<A>,
) -> bool {
    let Some(r) = A::flow(rkey) else {
        // Removed meanwhile.
        return insert(rkey, reply, BPF_NOEXIST).is_ok();
    };
    // SAFETY: a successful lookup.
    let r = unsafe { &*r };
    let fkey = rkey.partner(r);
    if fkey == *own {
        return insert(rkey, reply, BPF_ANY).is_ok();
    }
    let closed = match A::flow(&fkey) {
        // SAFETY: as above.
        Some(f) => unsafe { r.closed_with((*f).flags) },
        None => r.closed_with(0),
    };
    if !closed {
        return false;
    }
    A::flow_remove(&fkey);
    insert(rkey, reply, BPF_ANY).is_ok()
}
