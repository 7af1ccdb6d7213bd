//! Stage 2a: session affinity (`sessionAffinity: ClientIP`).
//!
//! A new flow from a client IP goes to the backend that client last got for this service,
//! while that was less than `timeoutSeconds` ago and the backend is still eligible for new
//! flows (in `LB_MEMBERS_V1`: still in one of the service's slots, whichever). Otherwise the
//! usual selection runs and its choice is remembered. As with kube-proxy, only new flows refresh the entry.

use lbproxy_common::{AffinityKeyOf, AffinityValue, BackendOf, ServiceValue};

use super::select;
use crate::{family::Family, packet::Packet, stage::Verdict};

/// Selects a backend for a new flow of a service with affinity (`seed`: see
/// [`select::select`]).
#[inline(always)]
pub fn select<A: Family>(
    pkt: &Packet<A>,
    svc: &ServiceValue,
    now: u64,
    seed: u64,
) -> Result<(u32, BackendOf<A>), Verdict> {
    select_for(svc, pkt.src_addr, now, || select::select(svc, pkt, seed))
}

/// [`select`] for the client `client_addr` (the socket programs' too), with `pick` choosing
/// when the client has no live choice to keep.
#[inline(always)]
pub fn select_for<A: Family, E>(
    svc: &ServiceValue,
    client_addr: A,
    now: u64,
    pick: impl FnOnce() -> Result<(u32, BackendOf<A>), E>,
) -> Result<(u32, BackendOf<A>), E> {
    let key = AffinityKeyOf {
        svc_id: svc.svc_id,
        client_addr,
    };
    let kept = kept(&key, svc.affinity_timeout_s, now);
    if kept != 0
        && let Some(b) = select::backend(kept)
    {
        return Ok((kept, b));
    }
    let (backend_id, backend) = pick()?;
    remember(&key, backend_id, now);
    Ok((backend_id, backend))
}

/// The backend the client of `key` last got for its service, if that was at most
/// `timeout_s` ago and the backend is still eligible for new flows; its entry is refreshed.
/// 0 otherwise (never a backend id). Its own BPF function, with the key by reference and a
/// scalar result, so the entry stays out of the callers' frames.
#[inline(never)]
fn kept<A: Family>(key: &AffinityKeyOf<A>, timeout_s: u32, now: u64) -> u32 {
    let Some(entry) = A::affinity(key) else {
        return 0;
    };
    // SAFETY: a successful lookup; single-field reads and writes.
    let (backend_id, last) = unsafe { ((*entry).backend_id, (*entry).last_ns) };
    if now.wrapping_sub(last) > u64::from(timeout_s) * 1_000_000_000
        || !select::is_serving(key.svc_id, backend_id)
    {
        return 0;
    }
    unsafe { (*entry).last_ns = now };
    backend_id
}

/// Remembers `backend_id` as the choice of `key`'s client for its service.
#[inline(never)]
fn remember<A: Family>(key: &AffinityKeyOf<A>, backend_id: u32, now: u64) {
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_ns: now,
    };
    A::affinity_insert(key, &value);
}
