//! `inspect snat`: source NAT's port space, the busiest destinations first.

use crate::model::Protocol;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use super::{Output, table};
use crate::bpf::PinnedMaps;

/// One destination of source-NATed flows: its ports in use out of the SNAT range.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SnatRow {
    pub snat_address: String,
    /// The backend `ip:port`.
    pub destination: String,
    pub protocol: String,
    pub ports_in_use: usize,
    pub range_size: u32,
    pub used_fraction: f64,
}

/// The SNAT port space per (SNAT address, backend, protocol), most used first: a port only
/// needs to be unique per destination, so each destination has the whole range. Read from
/// the reply halves of source-NATed flows in `LB_FLOWS_V3` and the range in
/// `LB_NODEIFS_V1`. Pods' flows to themselves (hairpin) are listed under
/// `lbproxy_common::HAIRPIN_ADDR`, whose ports are the clash ports' range.
pub fn snat(maps: &PinnedMaps) -> Vec<SnatRow> {
    let span = |min: u16, max: u16| u32::from(max.saturating_sub(min)) + 1;
    let range: BTreeMap<[u8; 4], u32> = maps
        .node_ifs
        .iter()
        .flatten()
        .map(|(_, n)| (n.snat_addr, span(n.snat_port_min, n.snat_port_max)))
        .chain([(
            lbproxy_common::HAIRPIN_ADDR,
            span(lbproxy_common::select::CLASH_PORT_MIN, u16::MAX),
        )])
        .collect();
    let mut used: BTreeMap<([u8; 4], [u8; 4], u16, u8), usize> = BTreeMap::new();
    for (k, v) in maps.flows.iter().flatten() {
        if k.dir == lbproxy_common::FLOW_DIR_REPLY && v.snat(&k) {
            *used
                .entry((k.dst_addr, k.src_addr, k.src_port_be, k.proto))
                .or_default() += 1;
        }
    }
    let mut rows: Vec<SnatRow> = used
        .into_iter()
        .map(|((snat, backend, port_be, proto), n)| {
            let size = range.get(&snat).copied().unwrap_or(0);
            SnatRow {
                snat_address: Ipv4Addr::from(snat).to_string(),
                destination: format!("{}:{}", Ipv4Addr::from(backend), u16::from_be(port_be)),
                protocol: Protocol::from_number(proto)
                    .map_or("?", Protocol::as_str)
                    .to_string(),
                ports_in_use: n,
                range_size: size,
                used_fraction: if size == 0 {
                    0.0
                } else {
                    n as f64 / f64::from(size)
                },
            }
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.ports_in_use));
    rows
}

/// `inspect snat`: the 20 destinations with the most SNAT ports in use (all as JSON/YAML).
pub fn render(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let rows = snat(maps);
    Ok(if out.machine() {
        out.encode(&rows)?
    } else {
        let cells: Vec<Vec<String>> = rows
            .iter()
            .take(20)
            .map(|r| {
                vec![
                    r.snat_address.clone(),
                    r.destination.clone(),
                    r.protocol.clone(),
                    r.ports_in_use.to_string(),
                    r.range_size.to_string(),
                    format!("{:.1}%", r.used_fraction * 100.0),
                ]
            })
            .collect();
        table(
            &[
                "SNAT ADDRESS",
                "DESTINATION",
                "PROTO",
                "PORTS IN USE",
                "OF",
                "USED",
            ],
            &cells,
        )
    })
}
