//! `lbproxy flows flush`: removes flows from the datapath's flow table, both halves
//! together, as `conntrack -D` or `cilium bpf ct flush` would. What a stuck flow needs: its
//! next packet is load-balanced afresh (a TCP segment other than a SYN goes to a newly
//! selected backend, which normally answers with a RST, so the client reconnects).

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

use lbproxy_common::{FlowKey, FlowValue};
use serde::Serialize;

use crate::bpf::{PinnedMaps, label_str};
use crate::inspect::{Filter, FlowEnds};
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

/// `--backend`: an IPv4 address, with or without a port.
fn check_backend(s: &str) -> anyhow::Result<()> {
    match (s.parse::<Ipv4Addr>(), s.parse::<SocketAddr>()) {
        (Ok(_), _) | (_, Ok(SocketAddr::V4(_))) => Ok(()),
        (_, Ok(SocketAddr::V6(_))) => {
            anyhow::bail!("--backend {s}: flushing IPv6 flows is not supported yet (LB_FLOWS6_V1)")
        }
        _ => anyhow::bail!("--backend {s}: not an IPv4 address or IPv4 address:port"),
    }
}

fn parse_client(s: &str) -> anyhow::Result<Ipv4Addr> {
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(_)) => {
            anyhow::bail!("--client {s}: flushing IPv6 flows is not supported yet (LB_FLOWS6_V1)")
        }
        Err(_) => anyhow::bail!("--client {s}: not an IP address (a client is matched by address)"),
    }
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
    let labels: BTreeMap<u32, String> = maps
        .labels
        .iter()
        .flatten()
        .map(|(id, l)| (id, label_str(&l)))
        .collect();
    if let Some(want) = &f.service
        && !labels.values().any(|l| f.service_ok(l))
    {
        anyhow::bail!(
            "--service {want}: no such service is programmed (see `lbproxy inspect services`; give namespace/name or namespace/name:port-name)"
        );
    }
    let entries: Vec<(FlowKey, FlowValue)> = maps.flows.iter().flatten().collect();
    let mut to_remove: HashSet<FlowKey> = HashSet::new();
    let mut flushed: Vec<FlushedFlow> = Vec::new();
    for (k, v) in &entries {
        if to_remove.contains(k) {
            continue;
        }
        let ends = FlowEnds::of(k, v);
        let label = labels.get(&ends.svc_id).cloned().unwrap_or_default();
        let ok = sel.all
            || (f.service_ok(&label)
                && f.backend_ok(&ends.backend.ip().to_string(), ends.backend.port())
                && client.is_none_or(|c| c == *ends.client.ip()));
        if !ok {
            continue;
        }
        to_remove.insert(*k);
        // The partner, if it names this half back (else it belongs to another flow now).
        let pk = k.partner(v);
        if maps.flows.get(&pk, 0).is_ok_and(|pv| pk.partner(&pv) == *k) {
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
    let mut removed = 0;
    if !dry_run {
        for k in &to_remove {
            // A half the LRU or the collector removed meanwhile is gone already: fine.
            if maps.flows.remove(k).is_ok() {
                removed += 1;
            }
        }
    }
    flushed.sort();
    if json {
        let report = Report {
            dry_run,
            flushed: flushed.len(),
            entries: if dry_run { to_remove.len() } else { removed },
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
            crate::inspect::table(&["SERVICE", "CLIENT", "FRONTEND", "BACKEND"], &rows)
        );
    }
    if dry_run {
        println!(
            "would flush {} flows ({} entries); nothing removed (--dry-run)",
            flushed.len(),
            to_remove.len()
        );
    } else {
        println!("flushed {} flows ({removed} entries)", flushed.len());
    }
    Ok(())
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
        let e = parse_client("10.0.0.1:80").unwrap_err().to_string();
        assert!(e.contains("--client 10.0.0.1:80"), "{e}");
    }
}
