//! `inspect backends`: every backend the maps know, by id.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::{Filter, Output, table};
use crate::bpf::PinnedMaps;
use crate::desired::BackendAddr;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackendRow {
    pub id: u32,
    pub addr: String,
    pub port: u16,
    pub protocol: String,
    /// In a service's list: `ready` (gets new connections), `terminating` (gets new
    /// connections because no endpoint is ready: KEP-1669's fallback) or `draining` (no new
    /// connections; `flows` of its flows are still served).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// A draining backend's flows of this service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flows: Option<usize>,
}

impl BackendRow {
    /// `addr:port`, an IPv6 address in brackets.
    pub(super) fn at(&self) -> String {
        match self.addr.parse::<std::net::IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, self.port).to_string(),
            Err(_) => format!("{}:{}", self.addr, self.port),
        }
    }

    pub(super) fn of(id: u32, b: &BackendAddr) -> BackendRow {
        BackendRow {
            id,
            addr: b.addr.to_string(),
            port: b.port,
            protocol: b.proto.as_str().to_string(),
            state: None,
            flows: None,
        }
    }
}

pub fn backends(maps: &PinnedMaps) -> Vec<BackendRow> {
    let mut rows: Vec<BackendRow> = maps
        .all_backends()
        .filter_map(|(id, b)| BackendAddr::from_value(&b).map(|a| BackendRow::of(id, &a)))
        .collect();
    rows.sort_by_key(|r| r.id);
    rows
}

/// `inspect backends`.
pub fn render(maps: &PinnedMaps, out: Output, filter: &Filter) -> anyhow::Result<String> {
    let mut rows = backends(maps);
    rows.retain(|r| filter.backend_ok(&r.addr, r.port));
    Ok(if out.machine() {
        out.encode(&rows)?
    } else {
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|r| vec![r.id.to_string(), r.at(), r.protocol.clone()])
            .collect();
        table(&["ID", "BACKEND", "PROTO"], &cells)
    })
}
