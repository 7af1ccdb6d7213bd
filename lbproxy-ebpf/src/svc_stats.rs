//! Per-Service traffic counters (`LB_SVCSTATS_V1`, `lbproxy_common::svc_stats`): a new flow
//! for a frontend, and a packet to a frontend rejected or dropped, each counted under the
//! frontend's service id. Only the stages that decide something count: the flow stage when
//! it creates a flow, the socket programs when they connect a socket, and the hooks when a
//! stage refuses a packet to a frontend. A packet of an established flow never comes here.

use aya_ebpf::bindings::BPF_NOEXIST;
use lbproxy_common::{
    CONFIG_F_NO_SERVICE_STATS, SVC_STAT_DROP, SVC_STAT_NEW_FLOW, SVC_STAT_REJECT, SvcStatKey,
};

use crate::{maps, stage::Verdict};

/// Counts a new flow of service `svc_id`.
#[inline(always)]
pub fn new_flow(svc_id: u32) {
    bump(svc_id, SVC_STAT_NEW_FLOW, 0);
}

/// Counts a packet to service `svc_id` that a stage refused with `v`.
#[inline(always)]
pub fn refused(svc_id: u32, v: &Verdict) {
    match v {
        Verdict::Reject(r) => bump(svc_id, SVC_STAT_REJECT, *r as u8),
        Verdict::Drop(r) => bump(svc_id, SVC_STAT_DROP, *r as u8),
    }
}

/// One count under (`svc_id`, `kind`, `reason`) on this CPU, unless the counters are off
/// (`CONFIG_F_NO_SERVICE_STATS`). Its own BPF function taking scalars, so the key and the
/// config stay out of the callers' frames.
#[inline(never)]
fn bump(svc_id: u32, kind: u8, reason: u8) {
    if maps::config().flags & CONFIG_F_NO_SERVICE_STATS != 0 {
        return;
    }
    let key = SvcStatKey {
        svc_id,
        kind,
        reason,
        _pad: [0; 2],
    };
    match maps::LB_SVCSTATS_V1.get_ptr_mut(key) {
        // This CPU's own value: no other writer.
        Some(n) => unsafe { *n += 1 },
        None => {
            // A first count on this CPU. Should another CPU have created the entry since
            // the lookup, the insert fails and this CPU's value is there, at 0: counted there.
            if maps::LB_SVCSTATS_V1
                .insert(key, 1, u64::from(BPF_NOEXIST))
                .is_err()
                && let Some(n) = maps::LB_SVCSTATS_V1.get_ptr_mut(key)
            {
                unsafe { *n += 1 };
            }
        }
    }
}
