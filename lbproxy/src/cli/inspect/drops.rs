//! `inspect drops`: the datapath's drop counters.

use std::collections::BTreeMap;

use super::{Output, table};
use crate::bpf::PinnedMaps;

/// `inspect drops`: the datapath's drop counters by reason.
pub fn render(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let rows: Vec<(String, u64)> = maps
        .drop_counts()
        .into_iter()
        .map(|(r, n)| (r.label().to_string(), n))
        .collect();
    Ok(if out.machine() {
        let m: BTreeMap<String, u64> = rows.into_iter().collect();
        out.encode(&m)?
    } else {
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|(r, n)| vec![r.clone(), n.to_string()])
            .collect();
        table(&["REASON", "PACKETS"], &cells)
    })
}
