//! Stage 2: select a backend for a new flow, and look a backend up by id.

use lbproxy_common::select::{
    Refusal, SelectionMaps, backend_id, flow_hash, maglev_index, no_endpoint, slot_of,
};
use lbproxy_common::{
    BackendOf, DropReason, MEMBER_SERVING, MaglevKey, MemberKey, ServiceValue, SlotKey, maglev,
};

use crate::{
    family::Family,
    maps::{LB_MAGCFG_V1, LB_MAGLEV_V1, LB_MEMBERS_V1, LB_SLOTS_V1},
    packet::Packet,
    stage::Verdict,
};

/// Picks one of the service's `count` slots by jump consistent hashing of the 5-tuple, keyed
/// by the node's `seed` (`DatapathConfig::hash_seed`, so a client cannot pick its backend by
/// picking its source port), and returns the backend id and the backend in it. Errors: a
/// reject when the service has no usable endpoint,
/// `SlotMissing`/`BackendMissing` when the maps are inconsistent (never expected: the
/// controller writes backends before slots before the count).
#[inline(always)]
pub fn select<A: Family>(
    svc: &ServiceValue,
    pkt: &Packet<A>,
    seed: u64,
) -> Result<(u32, BackendOf<A>), Verdict> {
    // No usable endpoint (lbproxy_common::select::no_endpoint, which `lbproxy explain`
    // shares): dropped for externalTrafficPolicy: Local, else answered at once.
    match no_endpoint(svc, pkt.proto) {
        None => {}
        Some(Refusal::Drop(r)) => return Err(Verdict::Drop(r)),
        Some(Refusal::Reject(r)) => return Err(Verdict::Reject(r)),
    }
    // Consistent in the 5-tuple: the same flow maps to the same slot while the service's
    // slots and the seed stay, and a backend added or removed moves few flows
    // (lbproxy_common::select).
    let hash = flow_hash(
        seed,
        pkt.src_addr,
        pkt.dst_addr,
        pkt.src_port_be,
        pkt.dst_port_be,
        pkt.proto,
    );
    select_by_hash(svc, hash).map_err(Verdict::Drop)
}

/// The backend in slot `jump(hash, count)` of a service with at least one slot: its id and
/// address (`SlotMissing`/`BackendMissing` when the maps are inconsistent). The packet
/// programs come here through [`select`], the socket programs directly.
#[inline(always)]
pub fn select_by_hash<A: Family>(
    svc: &ServiceValue,
    hash: u64,
) -> Result<(u32, BackendOf<A>), DropReason> {
    // A Maglev frontend's table entry, else the jump hash over its slots: the selection
    // `lbproxy explain` runs too, against the pinned maps (lbproxy_common::select).
    let backend_id = backend_id(&KernelMaps, svc, hash);
    if backend_id == 0 {
        return Err(DropReason::SlotMissing);
    }
    let backend = backend(backend_id).ok_or(DropReason::BackendMissing)?;
    Ok((backend_id, backend))
}

/// The selection's map reads, from the kernel's maps.
struct KernelMaps;

impl SelectionMaps for KernelMaps {
    #[inline(always)]
    fn maglev_backend(&self, svc_id: u32, hash: u64) -> u32 {
        maglev_backend(svc_id, hash)
    }
    #[inline(always)]
    fn slot_backend(&self, svc_id: u32, count: u32, hash: u64) -> u32 {
        slot_backend(svc_id, count, hash)
    }
}

/// The backend id in slot `slot_of(hash, count)` of service `svc_id`, or 0 (never an id: the
/// controller hands out ids from 1) when the slot is missing. Its own BPF function, taking
/// and returning scalars only, so the hash loop and the slot key stay out of the callers'
/// frames (the north-south program is close to the 512-byte stack limit).
#[inline(never)]
fn slot_backend(svc_id: u32, count: u32, hash: u64) -> u32 {
    let key = SlotKey {
        svc_id,
        slot: slot_of(hash, count),
    };
    // SAFETY: the value is copied out at once.
    unsafe { LB_SLOTS_V1.get(key) }.copied().unwrap_or(0)
}

/// The backend id in entry `hash % m` of service `svc_id`'s Maglev table, or 0 when the
/// table or its size is missing. Its own BPF function, as [`slot_backend`].
#[inline(never)]
fn maglev_backend(svc_id: u32, hash: u64) -> u32 {
    let m = LB_MAGCFG_V1.get(0).map_or(0, |c| c.m);
    if m == 0 {
        return 0;
    }
    let (chunk, pos) = maglev::position(hash, m);
    // SAFETY: the value is read at once.
    unsafe { LB_MAGLEV_V1.get(MaglevKey { svc_id, chunk }) }.map_or(0, |c| {
        c.backend_ids.get(maglev_index(pos)).copied().unwrap_or(0)
    })
}

/// Whether `backend_id` is in one of the service's slots, i.e. still eligible for new flows
/// (a backend that left, or turned not-ready, is not).
#[inline(always)]
pub fn is_serving(svc_id: u32, backend_id: u32) -> bool {
    // SAFETY: the value is read at once.
    unsafe { LB_MEMBERS_V1.get(MemberKey { svc_id, backend_id }) }
        .is_some_and(|m| *m & MEMBER_SERVING != 0)
}

/// Whether `backend_id` still belongs to service `svc_id`, serving or draining: whether the
/// service's flows to it are live. A backend that left this service is not, even when the
/// same address and port is still a backend of another service (its id then lives on).
#[inline(always)]
pub fn is_member(svc_id: u32, backend_id: u32) -> bool {
    // SAFETY: only the presence is read.
    unsafe { LB_MEMBERS_V1.get(MemberKey { svc_id, backend_id }) }.is_some()
}

/// The backend with this id, if it is still live.
#[inline(always)]
pub fn backend<A: Family>(backend_id: u32) -> Option<BackendOf<A>> {
    A::backend(backend_id)
}
