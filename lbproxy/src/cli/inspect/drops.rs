//! `inspect drops` and `inspect events`: the datapath's drop counters, and its counters of
//! what it did that is not a drop.

use std::collections::BTreeMap;

use super::{Output, table};
use crate::bpf::PinnedMaps;

/// `inspect drops`: the datapath's drop counters by reason, then its events.
///
/// `--json` is one object, every reason of `LB_DROPS_V2` to its count, the deprecated ones
/// that are not drops included (scripts read it: a field is never renamed or removed without
/// a release of notice). The table shows the real drops, then the events apart.
pub fn render(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let counts = maps.drop_counts();
    if out.machine() {
        let m: BTreeMap<&str, u64> = counts.iter().map(|(r, n)| (r.label(), *n)).collect();
        return out.encode(&m);
    }
    let drops: Vec<(&str, u64)> = counts
        .iter()
        .filter(|(r, _)| r.is_drop())
        .map(|(r, n)| (r.label(), *n))
        .collect();
    let mut text = counts_table("REASON", &drops);
    text.push('\n');
    text.push_str(&events_table(maps));
    Ok(text)
}

/// `inspect events`: what the datapath did that is not a drop, by event. `--json` is one
/// object, every event to its count.
pub fn render_events(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let Some(counts) = event_counts(maps) else {
        anyhow::bail!("{}", NO_EVENTS_MAP);
    };
    Ok(if out.machine() {
        out.encode(&counts.into_iter().collect::<BTreeMap<_, _>>())?
    } else {
        counts_table("EVENT", &counts)
    })
}

/// Why there are no event counters: the maps were pinned by an lbproxy from before them.
const NO_EVENTS_MAP: &str = "no event counters (LB_DPEVENTS_V1) under this --bpffs-dir: the \
     running lbproxy is older than this one; its events are counted as drop reasons (`lbproxy \
     inspect drops --json`) until it is upgraded";

fn event_counts(maps: &PinnedMaps) -> Option<Vec<(&'static str, u64)>> {
    let counts = maps.event_counts()?;
    Some(counts.into_iter().map(|(e, n)| (e.label(), n)).collect())
}

/// The events' table for `inspect drops`, or why there is none.
fn events_table(maps: &PinnedMaps) -> String {
    match event_counts(maps) {
        Some(counts) => counts_table("EVENT (NOT A DROP)", &counts),
        None => format!("{NO_EVENTS_MAP}\n"),
    }
}

fn counts_table(what: &str, rows: &[(&str, u64)]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|(r, n)| vec![(*r).to_string(), n.to_string()])
        .collect();
    table(&[what, "PACKETS"], &cells)
}
