//! Stage 2a: session affinity (`sessionAffinity: ClientIP`).
//!
//! A new flow from a client IP goes to the backend that client last got for this service,
//! while that was less than `timeoutSeconds` ago and the backend is still eligible for new
//! flows (in `LB_MEMBERS_V1`: still in one of the service's slots, whichever). Otherwise the
//! usual selection runs and its choice is remembered. As with kube-proxy, only new flows refresh the entry.

use lbproxy_common::{AffinityKey, AffinityValue, Backend, ServiceValue};

use super::select;
use crate::{maps::LB_AFFINITY_V1, parse::Packet, reason::Verdict};

/// Selects a backend for a new flow of a service with affinity (`seed`: see
/// [`select::select`]).
#[inline(always)]
pub fn select(
    pkt: &Packet,
    svc: &ServiceValue,
    now: u64,
    seed: u64,
) -> Result<(u32, Backend), Verdict> {
    select_for(svc, pkt.src_addr, now, || select::select(svc, pkt, seed))
}

/// [`select`] for the client `client_addr` (the socket programs' too), with `pick` choosing
/// when the client has no live choice to keep.
#[inline(always)]
pub fn select_for<E>(
    svc: &ServiceValue,
    client_addr: [u8; 4],
    now: u64,
    pick: impl FnOnce() -> Result<(u32, Backend), E>,
) -> Result<(u32, Backend), E> {
    let client = u32::from_ne_bytes(client_addr);
    let kept = kept(svc.svc_id, client, svc.affinity_timeout_s, now);
    if kept != 0
        && let Some(b) = select::backend(kept)
    {
        return Ok((kept, b));
    }
    let (backend_id, backend) = pick()?;
    remember(svc.svc_id, client, backend_id, now);
    Ok((backend_id, backend))
}

/// The backend `client` (an address as read, network order) last got for service `svc_id`,
/// if that was at most `timeout_s` ago and the backend is still eligible for new flows; its
/// entry is refreshed. 0 otherwise (never a backend id). Its own BPF function with scalar
/// arguments and result, so the key and entry stay out of the callers' frames.
#[inline(never)]
fn kept(svc_id: u32, client: u32, timeout_s: u32, now: u64) -> u32 {
    let key = AffinityKey {
        svc_id,
        client_addr: client.to_ne_bytes(),
    };
    let Some(entry) = LB_AFFINITY_V1.get_ptr_mut(key) else {
        return 0;
    };
    // SAFETY: a successful lookup; single-field reads and writes.
    let (backend_id, last) = unsafe { ((*entry).backend_id, (*entry).last_ns) };
    if now.wrapping_sub(last) > u64::from(timeout_s) * 1_000_000_000
        || !select::is_member(svc_id, backend_id)
    {
        return 0;
    }
    unsafe { (*entry).last_ns = now };
    backend_id
}

/// Remembers `backend_id` as `client`'s choice for service `svc_id`. Failing to remember
/// only costs affinity for the next flow, not this one.
#[inline(never)]
fn remember(svc_id: u32, client: u32, backend_id: u32, now: u64) {
    let key = AffinityKey {
        svc_id,
        client_addr: client.to_ne_bytes(),
    };
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_ns: now,
    };
    let _ = LB_AFFINITY_V1.insert(key, value, 0);
}
