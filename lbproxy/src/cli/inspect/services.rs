//! `inspect services`: every frontend with its backends, read from the pinned maps.

use lbproxy_common::SlotKey;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::backends::BackendRow;
use super::{Filter, Output, split_label, table};
use crate::bpf::pinned::label_bytes;
use crate::bpf::{PinnedMaps, label_str};
use crate::desired::Topology;
use crate::desired::{BackendAddr, Frontend, FrontendKind};
use crate::model::Protocol;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceRow {
    pub frontend: String,
    pub vip: String,
    pub port: u16,
    pub protocol: String,
    pub service: String,
    pub port_name: String,
    pub svc_id: u32,
    /// `sessionAffinity: ClientIP` timeout in seconds; 0 without affinity.
    pub affinity_timeout_s: u32,
    /// The backends that get new connections (`ready`, or `terminating` as the fallback).
    pub backends: Vec<BackendRow>,
    /// Backends out of the service that still serve flows of it (`draining`).
    pub draining: Vec<BackendRow>,
    /// `ClusterIP`, `NodePort`, `ExternalIP` or `LoadBalancerIP`.
    pub kind: String,
    /// Whether the datapath serves this frontend. A frontend the Service asks for but
    /// lbproxy does not serve yet (a NodePort, an IPv6 cluster IP, ...) has `served: false`,
    /// `svc_id` 0, no backends, and the reason in `not_served`.
    pub served: bool,
    pub not_served: String,
    /// The topology mode its backends follow: `PreferSameNode`, `PreferSameZone`, or empty
    /// (no hint, hints ignored, or a `Local` traffic policy).
    #[serde(default)]
    pub topology: String,
    /// Why the endpoints' hints are not used, when they have some; empty otherwise.
    #[serde(default)]
    pub topology_note: String,
    /// How new flows pick among `backends`: `maglev` (the frontend's Maglev table) or
    /// `jump`; empty for a frontend not served.
    #[serde(default)]
    pub selection: String,
    /// This frontend's flows in the flow table now.
    #[serde(default)]
    pub active_flows: u64,
    /// New flows created for it since its counters began (`LB_SVCSTATS_V1`; 0 with
    /// `--per-service-metrics=false`).
    #[serde(default)]
    pub new_flows: u64,
    /// Packets to it answered with a RST or an ICMP error.
    #[serde(default)]
    pub rejects: u64,
    /// Packets to it dropped.
    #[serde(default)]
    pub drops: u64,
}

pub fn services(maps: &PinnedMaps) -> Vec<ServiceRow> {
    let backends: BTreeMap<u32, BackendAddr> = maps
        .all_backends()
        .filter_map(|(id, b)| BackendAddr::from_value(&b).map(|a| (id, a)))
        .collect();
    // Each service's backends by the flows still using them, to tell the draining ones.
    let mut flows_of: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    for ids in maps.forward_flows() {
        *flows_of.entry(ids).or_default() += 1;
    }
    // Each frontend's traffic counters, by service id: (new flows, rejects, drops).
    let mut stats: BTreeMap<u32, [u64; 3]> = BTreeMap::new();
    for (key, n) in maps.service_stats() {
        let i = usize::from(key.kind.min(2));
        stats.entry(key.svc_id).or_default()[i] += n;
    }
    let mut rows = Vec::new();
    for (k, v) in maps.all_services() {
        let Some(fe) = Frontend::from_key(&k) else {
            continue;
        };
        let label = maps
            .labels
            .get(&v.svc_id, 0)
            .map(|l| label_str(&l))
            .unwrap_or_default();
        let (service, port_name) = split_label(&label);
        let mut bes = Vec::new();
        for slot in 0..v.count {
            let Ok(id) = maps.slots.get(
                &SlotKey {
                    svc_id: v.svc_id,
                    slot,
                },
                0,
            ) else {
                continue;
            };
            if let Some(b) = backends.get(&id) {
                let fallback = v.flags & lbproxy_common::SVC_F_TERMINATING_FALLBACK != 0;
                bes.push(BackendRow {
                    state: Some(if fallback { "terminating" } else { "ready" }.into()),
                    ..BackendRow::of(id, b)
                });
            }
        }
        // Backends out of the slots whose flows of this service go on.
        let in_slots: Vec<u32> = bes.iter().map(|b| b.id).collect();
        let mut draining = Vec::new();
        for (&(_, id), &n) in flows_of.range((v.svc_id, 0)..=(v.svc_id, u32::MAX)) {
            if !in_slots.contains(&id)
                && let Some(b) = backends.get(&id)
            {
                draining.push(BackendRow {
                    state: Some("draining".into()),
                    flows: Some(n),
                    ..BackendRow::of(id, b)
                });
            }
        }
        bes.sort_by(|a, b| (&a.addr, a.port).cmp(&(&b.addr, b.port)));
        let topology = crate::program::encode::topology_of(v.flags);
        rows.push(ServiceRow {
            // A NodePort's entry is at 0.0.0.0: every node-port address of the node.
            // The pods' entry of a split frontend (`externalTrafficPolicy: Local`) says so.
            frontend: if v.kind == lbproxy_common::SVC_KIND_NODE_PORT {
                let pods = if fe.pods_only { " (pods)" } else { "" };
                format!("*:{}/{}{pods}", fe.port, fe.proto.as_str())
            } else {
                fe.to_string()
            },
            vip: fe.addr.to_string(),
            port: fe.port,
            protocol: fe.proto.as_str().to_string(),
            service,
            port_name,
            svc_id: v.svc_id,
            affinity_timeout_s: v.affinity_timeout_s,
            backends: bes,
            draining,
            kind: kind_name(v.kind).to_string(),
            served: true,
            not_served: String::new(),
            topology: topology.mode().to_string(),
            topology_note: match topology {
                Topology::Ignored(why) => why.reason().to_string(),
                _ => String::new(),
            },
            selection: if v.flags & lbproxy_common::SVC_F_MAGLEV != 0 {
                "maglev"
            } else {
                "jump"
            }
            .to_string(),
            active_flows: flows_of
                .range((v.svc_id, 0)..=(v.svc_id, u32::MAX))
                .map(|(_, n)| *n as u64)
                .sum(),
            new_flows: stats.get(&v.svc_id).map_or(0, |s| s[0]),
            rejects: stats.get(&v.svc_id).map_or(0, |s| s[1]),
            drops: stats.get(&v.svc_id).map_or(0, |s| s[2]),
        });
    }
    rows.extend(unserved_rows(maps));
    rows.sort_by(|a, b| {
        (&a.service, !a.served, &a.frontend).cmp(&(&b.service, !b.served, &b.frontend))
    });
    rows
}

/// The frontends the Services ask for that the datapath does not serve yet.
fn unserved_rows(maps: &PinnedMaps) -> Vec<ServiceRow> {
    let mut rows = Vec::new();
    for (k, v) in maps.unserved.iter().flatten() {
        let (service, port_name) = split_label(&label_bytes(&v.label));
        let proto = Protocol::from_number(k.proto).map_or("?", Protocol::as_str);
        let port = u16::from_be(k.port_be);
        let vip = if k.addr == [0; 16] {
            "*".to_string()
        } else if k.family == lbproxy_common::FAMILY_IPV4 {
            Ipv4Addr::new(k.addr[0], k.addr[1], k.addr[2], k.addr[3]).to_string()
        } else {
            std::net::Ipv6Addr::from(k.addr).to_string()
        };
        let frontend = if vip.contains(':') {
            format!("[{vip}]:{port}/{proto}")
        } else {
            format!("{vip}:{port}/{proto}")
        };
        rows.push(ServiceRow {
            frontend,
            vip,
            port,
            protocol: proto.to_string(),
            service,
            port_name,
            svc_id: 0,
            affinity_timeout_s: 0,
            backends: Vec::new(),
            draining: Vec::new(),
            kind: kind_name(k.kind).to_string(),
            served: false,
            not_served: label_bytes(&v.reason),
            topology: String::new(),
            topology_note: String::new(),
            selection: String::new(),
            active_flows: 0,
            new_flows: 0,
            rejects: 0,
            drops: 0,
        });
    }
    rows
}

/// The name of a `SVC_KIND_*`.
fn kind_name(kind: u8) -> &'static str {
    FrontendKind::from_number(kind).map_or("?", FrontendKind::display)
}

/// `inspect services`: the rows `--service` and `--backend` keep, as JSON/YAML or a table of
/// one line per backend.
pub fn render(maps: &PinnedMaps, out: Output, filter: &Filter) -> anyhow::Result<String> {
    let mut rows = services(maps);
    rows.retain(|r| {
        filter.service_ok(&r.service)
            && (filter.backend.is_none()
                || r.backends
                    .iter()
                    .chain(&r.draining)
                    .any(|b| filter.backend_ok(&b.addr, b.port)))
    });
    Ok(if out.machine() {
        out.encode(&rows)?
    } else {
        let mut cells: Vec<Vec<String>> = Vec::new();
        for r in &rows {
            let head = [
                r.service.clone(),
                r.port_name.clone(),
                r.kind.clone(),
                r.frontend.clone(),
                match (r.topology.as_str(), r.topology_note.as_str()) {
                    ("", "") => "-".into(),
                    ("", note) => note.to_string(),
                    (mode, _) => mode.to_string(),
                },
                r.active_flows.to_string(),
                r.new_flows.to_string(),
                r.rejects.to_string(),
                r.drops.to_string(),
            ];
            let tails: Vec<[String; 2]> = if !r.served {
                vec![["-".into(), format!("not served yet: {}", r.not_served)]]
            } else if r.backends.is_empty() && r.draining.is_empty() {
                vec![["(none)".into(), "-".into()]]
            } else {
                r.backends
                    .iter()
                    .chain(&r.draining)
                    .map(|b| {
                        let state = match (&b.state, b.flows) {
                            (Some(s), Some(n)) => format!("{s} ({n} flows)"),
                            (Some(s), None) => s.clone(),
                            (None, _) => "-".into(),
                        };
                        [b.at(), state]
                    })
                    .collect()
            };
            for t in tails {
                cells.push(head.iter().cloned().chain(t).collect());
            }
        }
        table(
            &[
                "SERVICE", "PORT", "KIND", "FRONTEND", "TOPOLOGY", "FLOWS", "NEW", "REJECTED",
                "DROPPED", "BACKEND", "STATE",
            ],
            &cells,
        )
    })
}
