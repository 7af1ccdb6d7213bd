//! `inspect affinity`: each client's backend per service, and when it expires.

use std::collections::BTreeMap;

use crate::bpf::label_str;
use lbproxy_common::Addr;
use serde::{Deserialize, Serialize};

use super::{Filter, Output, table};
use crate::bpf::PinnedMaps;

/// One client's session affinity to a backend, for one service.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AffinityRow {
    pub service: String,
    pub client: String,
    pub backend: String,
    pub backend_id: u32,
    /// Since the client's last new connection or datagram flow through it.
    pub idle_seconds: f64,
    /// The service's `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub timeout_seconds: u32,
    /// `active` (the next flow goes to this backend), `expired` (timed out: the next flow
    /// picks anew) or `backend_left` (the backend is no longer in the service).
    pub state: String,
}

pub fn affinity_rows(maps: &PinnedMaps) -> Vec<AffinityRow> {
    let now = crate::bpf::flow_gc::monotonic_ns();
    // Each svc_id's timeout and label.
    let mut timeouts: BTreeMap<u32, u32> = BTreeMap::new();
    for (_, v) in maps.all_services() {
        timeouts.insert(v.svc_id, v.affinity_timeout_s);
    }
    let entries = maps
        .affinity
        .iter()
        .flatten()
        .map(|(k, v)| (k.svc_id, k.client_addr.ip(), v))
        .chain(
            maps.affinity6
                .iter()
                .flatten()
                .map(|(k, v)| (k.svc_id, k.client_addr.ip(), v)),
        );
    let mut rows: Vec<AffinityRow> = entries
        .map(|(svc_id, client, v)| {
            let k = lbproxy_common::AffinityKey {
                svc_id,
                client_addr: [0; 4],
            };
            let timeout = timeouts.get(&k.svc_id).copied().unwrap_or(0);
            let idle = now.saturating_sub(v.last_ns) as f64 / 1e9;
            let member = maps
                .members
                .get(
                    &lbproxy_common::MemberKey {
                        svc_id: k.svc_id,
                        backend_id: v.backend_id,
                    },
                    0,
                )
                .is_ok_and(|how| how & lbproxy_common::MEMBER_SERVING != 0);
            let backend = maps
                .backend(v.backend_id)
                .map_or_else(|| "?".to_string(), |b| b.to_string());
            AffinityRow {
                service: maps
                    .labels
                    .get(&k.svc_id, 0)
                    .map(|l| label_str(&l))
                    .unwrap_or_default(),
                client: client.to_string(),
                backend,
                backend_id: v.backend_id,
                idle_seconds: idle,
                timeout_seconds: timeout,
                state: if !member {
                    "backend_left"
                } else if idle > f64::from(timeout) {
                    "expired"
                } else {
                    "active"
                }
                .to_string(),
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    rows
}

/// `inspect affinity`.
pub fn render(maps: &PinnedMaps, out: Output, filter: &Filter) -> anyhow::Result<String> {
    let mut rows = affinity_rows(maps);
    rows.retain(|r| filter.service_ok(&r.service) && filter.backend_addr_ok(&r.backend));
    if out.machine() {
        return out.encode(&rows);
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.service.clone(),
                r.client.clone(),
                r.backend.clone(),
                r.state.clone(),
                format!("{:.0}s", r.idle_seconds),
                format!("{}s", r.timeout_seconds),
            ]
        })
        .collect();
    Ok(table(
        &["SERVICE", "CLIENT", "BACKEND", "STATE", "IDLE", "TIMEOUT"],
        &cells,
    ))
}
