//! `lbproxy flows flush`: removes flows from the datapath's flow table, both halves
//! together, as `conntrack -D` or `cilium bpf ct flush` would. What a stuck flow needs: its
//! next packet is load-balanced afresh (a TCP segment other than a SYN goes to a newly
//! selected backend, which normally answers with a RST, so the client reconnects).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;

use lbproxy_common::{FLOW_DIR_FORWARD, FlowKey, FlowValue};
use serde::Serialize;

use crate::bpf::{PinnedMaps, label_str};
use crate::model::Protocol;

/// Which flows: every given filter must match; at least one filter, or `all`.
#[derive(Default)]
pub struct Selector {
    /// `namespace/name` (every port) or `namespace/name:port-name`.
    pub service: Option<String>,
    /// The backend's `IP` or `IP:port`.
    pub backend: Option<String>,
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

/// A backend filter: an address, with or without a port.
#[derive(Debug, PartialEq, Eq)]
enum BackendSel {
    Addr(Ipv4Addr),
    AddrPort(Ipv4Addr, u16),
}

fn parse_backend(s: &str) -> anyhow::Result<BackendSel> {
    if let Ok(a) = s.parse::<Ipv4Addr>() {
        return Ok(BackendSel::Addr(a));
    }
    match s.parse::<SocketAddr>() {
        Ok(SocketAddr::V4(sa)) => Ok(BackendSel::AddrPort(*sa.ip(), sa.port())),
        Ok(SocketAddr::V6(_)) => {
            anyhow::bail!("--backend {s}: IPv6 backends are not served yet, so hold no flows")
        }
        Err(_) => anyhow::bail!("--backend {s}: not an IPv4 address or IPv4 address:port"),
    }
}

fn parse_client(s: &str) -> anyhow::Result<Ipv4Addr> {
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(_)) => {
            anyhow::bail!("--client {s}: IPv6 clients are not served yet, so hold no flows")
        }
        Err(_) => anyhow::bail!("--client {s}: not an IP address (a client is matched by address)"),
    }
}

/// One half seen from the flow's point of view: client, backend and service.
struct Half {
    client: [u8; 4],
    backend: ([u8; 4], u16),
    svc_id: u32,
}

fn half(k: &FlowKey, v: &FlowValue) -> Half {
    if k.dir == FLOW_DIR_FORWARD {
        Half {
            client: k.src_addr,
            backend: (v.nat_addr, u16::from_be(v.nat_port_be)),
            svc_id: v.svc_id,
        }
    } else {
        Half {
            client: v.peer_addr,
            backend: (k.src_addr, u16::from_be(k.src_port_be)),
            svc_id: v.svc_id,
        }
    }
}

pub fn run(dir: &Path, sel: &Selector, dry_run: bool, json: bool) -> anyhow::Result<()> {
    if sel.service.is_none() && sel.backend.is_none() && sel.client.is_none() && !sel.all {
        anyhow::bail!(
            "say which flows: --service, --backend or --client (combined, all must match), or --all for every flow"
        );
    }
    if sel.all && (sel.service.is_some() || sel.backend.is_some() || sel.client.is_some()) {
        anyhow::bail!("--all flushes every flow; leave it out to flush only the flows selected");
    }
    let backend = sel.backend.as_deref().map(parse_backend).transpose()?;
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
    if let Some(want) = &sel.service
        && !labels.values().any(|l| service_matches(want, l))
    {
        anyhow::bail!(
            "--service {want}: no such service is programmed (see `lbproxy inspect services`; give namespace/name or namespace/name:port-name)"
        );
    }
    let entries: Vec<(FlowKey, FlowValue)> = maps.flows.iter().flatten().collect();
    let mut doomed: BTreeSet<[u8; 16]> = BTreeSet::new();
    let mut to_remove: Vec<FlowKey> = Vec::new();
    let mut flushed: Vec<FlushedFlow> = Vec::new();
    for (k, v) in &entries {
        if doomed.contains(&key_bytes(k)) {
            continue;
        }
        let h = half(k, v);
        let label = labels.get(&h.svc_id).cloned().unwrap_or_default();
        let ok = sel.all
            || (sel
                .service
                .as_deref()
                .is_none_or(|w| service_matches(w, &label))
                && client.is_none_or(|c| c.octets() == h.client)
                && backend.as_ref().is_none_or(|b| match b {
                    BackendSel::Addr(a) => a.octets() == h.backend.0,
                    BackendSel::AddrPort(a, p) => a.octets() == h.backend.0 && *p == h.backend.1,
                }));
        if !ok {
            continue;
        }
        // The partner, if it names this half back (else it belongs to another flow now).
        let pk = k.partner(v);
        let partner = maps
            .flows
            .get(&pk, 0)
            .ok()
            .filter(|pv| pk.partner(pv) == *k);
        for key in std::iter::once(*k).chain(partner.map(|_| pk)) {
            doomed.insert(key_bytes(&key));
            to_remove.push(key);
        }
        let proto = Protocol::from_number(k.proto).map_or("?", Protocol::as_str);
        flushed.push(FlushedFlow {
            service: label,
            // A forward half is keyed by the client's own tuple; a reply half restores it.
            client: if k.dir == FLOW_DIR_FORWARD {
                format!(
                    "{}:{}",
                    Ipv4Addr::from(k.src_addr),
                    u16::from_be(k.src_port_be)
                )
            } else {
                format!(
                    "{}:{}",
                    Ipv4Addr::from(v.peer_addr),
                    u16::from_be(v.peer_port_be)
                )
            },
            frontend: if k.dir == FLOW_DIR_FORWARD {
                format!(
                    "{}:{}/{proto}",
                    Ipv4Addr::from(k.dst_addr),
                    u16::from_be(k.dst_port_be)
                )
            } else {
                format!(
                    "{}:{}/{proto}",
                    Ipv4Addr::from(v.nat_addr),
                    u16::from_be(v.nat_port_be)
                )
            },
            backend: format!("{}:{}", Ipv4Addr::from(h.backend.0), h.backend.1),
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

/// Whether service label `label` (`namespace/name:port-name`) is `want`: the same label, or
/// `namespace/name` of any port.
pub fn service_matches(want: &str, label: &str) -> bool {
    label == want || label.split_once(':').is_some_and(|(svc, _)| svc == want)
}

fn key_bytes(k: &FlowKey) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&k.src_addr);
    b[4..8].copy_from_slice(&k.dst_addr);
    b[8..10].copy_from_slice(&k.src_port_be.to_ne_bytes());
    b[10..12].copy_from_slice(&k.dst_port_be.to_ne_bytes());
    b[12] = k.proto;
    b[13] = k.dir;
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_with_or_without_port_and_bad_ones_name_themselves() {
        assert_eq!(
            parse_backend("10.0.0.1").unwrap(),
            BackendSel::Addr(Ipv4Addr::new(10, 0, 0, 1))
        );
        assert_eq!(
            parse_backend("10.0.0.1:8080").unwrap(),
            BackendSel::AddrPort(Ipv4Addr::new(10, 0, 0, 1), 8080)
        );
        let e = parse_backend("web-1").unwrap_err().to_string();
        assert!(e.contains("--backend web-1"), "{e}");
        let e = parse_client("10.0.0.1:80").unwrap_err().to_string();
        assert!(e.contains("--client 10.0.0.1:80"), "{e}");
    }

    #[test]
    fn a_service_matches_by_name_or_by_name_and_port() {
        assert!(service_matches("default/web", "default/web:http"));
        assert!(service_matches("default/web:http", "default/web:http"));
        assert!(!service_matches("default/web:dns", "default/web:http"));
        assert!(!service_matches("default/we", "default/web:http"));
    }
}
