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
    let key = AffinityKey {
        svc_id: svc.svc_id,
        client_addr: pkt.src_addr,
    };
    let timeout_ns = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
    if let Some(entry) = LB_AFFINITY_V1.get_ptr_mut(key) {
        let (backend_id, last) = unsafe { ((*entry).backend_id, (*entry).last_ns) };
        if now.wrapping_sub(last) <= timeout_ns
            && select::is_member(svc, backend_id)
            && let Some(b) = select::backend(backend_id)
        {
            unsafe { (*entry).last_ns = now };
            return Ok((backend_id, b));
        }
    }
    let (backend_id, backend) = select::select(svc, pkt, seed)?;
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_ns: now,
    };
    // Failing to remember only costs affinity for the next flow, not this one.
    let _ = LB_AFFINITY_V1.insert(key, value, 0);
    Ok((backend_id, backend))
}

/// [`select`] for the client `client_addr`, with `pick` choosing when the client has no
/// live choice to keep.
#[inline(always)]
pub fn select_for<E>(
    svc: &ServiceValue,
    client_addr: [u8; 4],
    now: u64,
    pick: impl FnOnce() -> Result<(u32, Backend), E>,
) -> Result<(u32, Backend), E> {
    let key = AffinityKey {
        svc_id: svc.svc_id,
        client_addr,
    };
    let timeout_ns = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
    if let Some(entry) = LB_AFFINITY_V1.get_ptr_mut(key) {
        let (backend_id, last) = unsafe { ((*entry).backend_id, (*entry).last_ns) };
        if now.wrapping_sub(last) <= timeout_ns
            && select::is_member(svc, backend_id)
            && let Some(b) = select::backend(backend_id)
        {
            unsafe { (*entry).last_ns = now };
            return Ok((backend_id, b));
        }
    }
    let (backend_id, backend) = pick()?;
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_ns: now,
    };
    // Failing to remember only costs affinity for the next flow, not this one.
    let _ = LB_AFFINITY_V1.insert(key, value, 0);
    Ok((backend_id, backend))
}
