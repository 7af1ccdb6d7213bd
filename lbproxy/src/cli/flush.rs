//! `lbproxy flows flush`: removes flows from the datapath's flow table, both halves
//! together, as `conntrack -D` or `cilium bpf ct flush` would. What a stuck flow needs: its
//! next packet is load-balanced afresh (a TCP segment other than a SYN goes to a newly
//! selected backend, which normally answers with a RST, so the client reconnects).

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, MapData};
use lbproxy_common::{FlowKeyOf, FlowValueOf};
use serde::Serialize;

use crate::bpf::PinnedMaps;
use crate::cli::inspect::{Filter, FlowEnds};
use crate::model::Protocol;

/// Which flows: every given selector must match; at least one, or `all`.
#[derive(Default)]
pub struct Selector {
    /// `--service` and `--backend`, matched as `inspect` matches them.
    pub filter: Filter,
    /// The client's own address.
    pub client: Option<String>,
    pub all: bool,
}

/// A flow removed (or, with `--dry-run`, that would be).
#[derive(Serialize, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlushedFlow {
    pub service: String,
    pub client: String,
    pub frontend: String,
    pub backend: String,
    pub protocol: String,
}

#[derive(Serialize)]
struct Report<'a> {
    dry_run: bool,
    flushed: usize,
    /// Flow table entries removed: two per flow, one for a half whose partner was gone.
    entries: usize,
    flows: &'a [FlushedFlow],
}

/// `--backend`: an address, with or without a port (`addr:port`, `[v6addr]:port`).
fn check_backend(s: &str) -> anyhow::Result<()> {
    match (s.parse::<IpAddr>(), s.parse::<SocketAddr>()) {
        (Ok(_), _) | (_, Ok(_)) => Ok(()),
        _ => anyhow::bail!(
            "--backend {s}: not an IP address or address:port (an IPv6 one as [addr]:port)"
        ),
    }
}

fn parse_client(s: &str) -> anyhow::Result<IpAddr> {
    s.parse::<IpAddr>().map_err(|_| {
        anyhow::anyhow!("--client {s}: not an IP address (a client is matched by address)")
    })
}

pub fn run(dir: &Path, sel: &Selector, dry_run: bool, json: bool) -> anyhow::Result<()> {
    let f = &sel.filter;
    let any = f.service.is_some() || f.backend.is_some() || sel.client.is_some();
    if !any && !sel.all {
        anyhow::bail!(
            "say which flows: --service, --backend or --client (combined, all must match), or --all for every flow"
        );
    }
    if sel.all && any {
        anyhow::bail!("--all flushes every flow; leave it out to flush only the flows selected");
    }
    if let Some(b) = &f.backend {
        check_backend(b)?;
    }
    let client = sel.client.as_deref().map(parse_client).transpose()?;
    if !dir.exists() {
        anyhow::bail!(
            "{} does not exist: lbproxy has not run with this --bpffs-dir (or was cleaned up)",
            dir.display()
        );
    }
    let mut maps = PinnedMaps::open(dir)?;
    let labels: BTreeMap<u32, String> = maps.labels_by_id();
    if let Some(want) = &f.service
        && !labels.values().any(|l| f.service_ok(l))
    {
        anyhow::bail!(
            "--service {want}: no such service is programmed (see `lbproxy inspect services`; give namespace/name or namespace/name:port-name)"
        );
    }
    let mut flushed: Vec<FlushedFlow> = Vec::new();
    let select = Selection {
        filter: f,
        all: sel.all,
        client,
        labels: &labels,
        dry_run,
    };
    let entries = flush_map(&mut maps.flows, &select, &mut flushed)
        + flush_map(&mut maps.flows6, &select, &mut flushed);
    flushed.sort();
    if json {
        let report = Report {
            dry_run,
            flushed: flushed.len(),
            entries,
            flows: &flushed,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = flushed
        .iter()
        .map(|f| {
            vec![
                f.service.clone(),
                f.client.clone(),
                f.frontend.clone(),
                f.backend.clone(),
            ]
        })
        .collect();
    if !rows.is_empty() {
        print!(
            "{}",
            crate::cli::inspect::table(&["SERVICE", "CLIENT", "FRONTEND", "BACKEND"], &rows)
        );
    }
    if dry_run {
        println!(
            "would flush {} flows ({} entries); nothing removed (--dry-run)",
            flushed.len(),
            entries
        );
    } else {
        println!("flushed {} flows ({entries} entries)", flushed.len());
    }
    Ok(())
}

/// What a flush selects, for [`flush_map`].
struct Selection<'a> {
    filter: &'a Filter,
    all: bool,
    client: Option<IpAddr>,
    labels: &'a BTreeMap<u32, String>,
    dry_run: bool,
}

/// Removes (or, dry, only lists) the flows of one family's flow map that `sel` selects,
/// both halves of each; returns the entries removed (or that would be).
fn flush_map<A: lbproxy_common::Addr>(
    map: &mut BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    sel: &Selection,
    flushed: &mut Vec<FlushedFlow>,
) -> usize
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let f = sel.filter;
    let entries: Vec<(FlowKeyOf<A>, FlowValueOf<A>)> = map.iter().flatten().collect();
    let mut to_remove: HashSet<FlowKeyOf<A>> = HashSet::new();
    for (k, v) in &entries {
        if to_remove.contains(k) {
            continue;
        }
        let ends = FlowEnds::of(k, v);
        let label = sel.labels.get(&ends.svc_id).cloned().unwrap_or_default();
        let ok = sel.all
            || (f.service_ok(&label)
                && f.backend_ok(&ends.backend.ip().to_string(), ends.backend.port())
                && sel.client.is_none_or(|c| c == ends.client.ip()));
        if !ok {
            continue;
        }
        to_remove.insert(*k);
        // The partner, if it names this half back (else it belongs to another flow now).
        let pk = k.partner(v);
        if map.get(&pk, 0).is_ok_and(|pv| pk.partner(&pv) == *k) {
            to_remove.insert(pk);
        }
        let proto = Protocol::from_number(k.proto).map_or("?", Protocol::as_str);
        flushed.push(FlushedFlow {
            service: label,
            client: ends.client.to_string(),
            frontend: format!("{}/{proto}", ends.frontend),
            backend: ends.backend.to_string(),
            protocol: proto.to_string(),
        });
    }
    if sel.dry_run {
        return to_remove.len();
    }
    let mut removed = 0;
    for k in &to_remove {
        // A half the LRU or the collector removed meanwhile is gone already: fine.
        if map.remove(k).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_with_or_without_port_and_bad_ones_name_themselves() {
        check_backend("10.0.0.1").unwrap();
        check_backend("10.0.0.1:8080").unwrap();
        let e = check_backend("web-1").unwrap_err().to_string();
        assert!(e.contains("--backend web-1"), "{e}");
        check_backend("fd00::7").unwrap();
        check_backend("[fd00::7]:8080").unwrap();
        assert_eq!(
            parse_client("fd00::2").unwrap(),
            "fd00::2".parse::<IpAddr>().unwrap()
        );
        let e = parse_client("10.0.0.1:80").unwrap_err().to_string();
        assert!(e.contains("--client 10.0.0.1:80"), "{e}");
    }
}
