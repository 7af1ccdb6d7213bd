//! `inspect flows --top services|clients`: who fills the flow table. Every flow of both
//! families counted once (its forward half), by Service (`namespace/name`, its ports
//! together) or by client address, the largest first, each with its own top clients (or
//! Services). The counting and ordering are [`crate::bpf::flow_top`]'s, which the flow
//! collector's warnings use too.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use aya::maps::{HashMap as BpfHashMap, MapData};
use lbproxy_common::{Addr, FLOW_DIR_FORWARD, FlowKeyOf, FlowValueOf};
use serde::{Deserialize, Serialize};

use super::{Filter, Output, table};
use crate::bpf::PinnedMaps;
use crate::bpf::flow_top::{rank, service_of, thousands, unlabelled};

/// What `--top` counts flows by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TopBy {
    /// Services (`namespace/name`), each with its top clients.
    Services,
    /// Client addresses, each with its top Services.
    Clients,
}

/// `--top BY --limit N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Top {
    pub by: TopBy,
    /// The most rows, and the most clients (or Services) in each; 0 for all.
    pub limit: usize,
}

/// One Service's flows (`--top services`), or one of a client's Services (`--top clients`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopService {
    /// `namespace/name`.
    pub service: String,
    pub flows: u64,
    /// Under `--top services`: its clients with the most flows, largest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<TopClient>,
}

/// One client's flows (`--top clients`), or one of a Service's clients (`--top services`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopClient {
    /// The client's own address (nothing in the pinned maps names its pod).
    pub client: String,
    pub flows: u64,
    /// Under `--top clients`: its Services with the most flows, largest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<TopService>,
}

/// The first `limit` of `v` (all for 0).
fn first<T>(mut v: Vec<T>, limit: usize) -> Vec<T> {
    if limit > 0 {
        v.truncate(limit);
    }
    v
}

/// Flows counted by (Service, client) pair.
#[derive(Debug, Default)]
pub struct Pairs(HashMap<(String, IpAddr), u64>);

impl Pairs {
    pub fn add(&mut self, service: String, client: IpAddr) {
        *self.0.entry((service, client)).or_default() += 1;
    }

    pub fn flows(&self) -> u64 {
        self.0.values().sum()
    }

    /// The Services by flows, largest first (equal counts by name), each with its clients.
    pub fn services(&self, limit: usize) -> Vec<TopService> {
        let mut by: BTreeMap<&str, Vec<(IpAddr, u64)>> = BTreeMap::new();
        for ((svc, client), n) in &self.0 {
            by.entry(svc.as_str()).or_default().push((*client, *n));
        }
        let totals = rank(
            by.iter()
                .map(|(svc, cs)| (*svc, cs.iter().map(|(_, n)| n).sum())),
        );
        first(totals, limit)
            .into_iter()
            .map(|(svc, flows)| TopService {
                service: svc.to_string(),
                flows,
                clients: first(rank(by[svc].iter().copied()), limit)
                    .into_iter()
                    .map(|(c, n)| TopClient {
                        client: c.to_string(),
                        flows: n,
                        services: Vec::new(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// The clients by flows, largest first (equal counts by address), each with its
    /// Services.
    pub fn clients(&self, limit: usize) -> Vec<TopClient> {
        let mut by: BTreeMap<IpAddr, Vec<(&str, u64)>> = BTreeMap::new();
        for ((svc, client), n) in &self.0 {
            by.entry(*client).or_default().push((svc.as_str(), *n));
        }
        let totals = rank(
            by.iter()
                .map(|(c, ss)| (*c, ss.iter().map(|(_, n)| n).sum())),
        );
        first(totals, limit)
            .into_iter()
            .map(|(c, flows)| TopClient {
                client: c.to_string(),
                flows,
                services: first(rank(by[&c].iter().copied()), limit)
                    .into_iter()
                    .map(|(s, n)| TopService {
                        service: s.to_string(),
                        flows: n,
                        clients: Vec::new(),
                    })
                    .collect(),
            })
            .collect()
    }
}

/// Counts the forward halves of one family's flow map that pass `filter` into `pairs`.
fn count<A: Addr>(
    map: &BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    labels: &BTreeMap<u32, String>,
    filter: &Filter,
    pairs: &mut Pairs,
) where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    for (k, v) in map.iter().flatten() {
        if k.dir != FLOW_DIR_FORWARD {
            continue;
        }
        let label = labels.get(&v.svc_id);
        let service_ok = label.map_or(filter.service.is_none(), |l| filter.service_ok(l));
        let backend = v.nat_addr.ip().to_string();
        if !service_ok || !filter.backend_ok(&backend, u16::from_be(v.nat_port_be)) {
            continue;
        }
        let service = label.map_or_else(|| unlabelled(v.svc_id), |l| service_of(l).to_string());
        pairs.add(service, k.src_addr.ip());
    }
}

/// Every flow of both families that passes `filter`, by (Service, client).
pub fn pairs(maps: &PinnedMaps, filter: &Filter) -> Pairs {
    let labels: BTreeMap<u32, String> = maps.labels_by_id();
    let mut p = Pairs::default();
    count(&maps.flows, &labels, filter, &mut p);
    count(&maps.flows6, &labels, filter, &mut p);
    p
}

/// `a 3, b 2, c 1`: the first three of a row's list, and `...` when it has more.
fn inline(list: impl Iterator<Item = (String, u64)>) -> String {
    let all: Vec<String> = list.map(|(k, n)| format!("{k} {}", thousands(n))).collect();
    let mut s = all.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    if all.len() > 3 {
        s.push_str(", ...");
    }
    s
}

/// `inspect flows --top BY`.
pub fn render(maps: &PinnedMaps, out: Output, filter: &Filter, top: Top) -> anyhow::Result<String> {
    let p = pairs(maps, filter);
    Ok(match top.by {
        TopBy::Services => {
            let rows = p.services(top.limit);
            ranked(
                out,
                &rows,
                p.flows(),
                p.services(0).len(),
                |r| {
                    let clients = r.clients.iter().map(|c| (c.client.clone(), c.flows));
                    (r.service.clone(), r.flows, inline(clients))
                },
                ["SERVICE", "FLOWS", "TOP CLIENTS"],
                "services",
            )?
        }
        TopBy::Clients => {
            let rows = p.clients(top.limit);
            ranked(
                out,
                &rows,
                p.flows(),
                p.clients(0).len(),
                |r| {
                    let services = r.services.iter().map(|s| (s.service.clone(), s.flows));
                    (r.client.clone(), r.flows, inline(services))
                },
                ["CLIENT", "FLOWS", "TOP SERVICES"],
                "clients",
            )?
        }
    })
}

/// `rows` (of `all` in all, `total` flows) as JSON, or as a table of `headers` whose cells
/// `cells` gives (name, flows, the top of the other kind), with a footer naming `what`.
fn ranked<T: Serialize>(
    out: Output,
    rows: &[T],
    total: u64,
    all: usize,
    cells: impl Fn(&T) -> (String, u64, String),
    headers: [&str; 3],
    what: &str,
) -> anyhow::Result<String> {
    if out.machine() {
        return out.encode(&rows);
    }
    let cells: Vec<(String, u64, String)> = rows.iter().map(cells).collect();
    let shown: u64 = cells.iter().map(|c| c.1).sum();
    let text: Vec<Vec<String>> = cells
        .into_iter()
        .map(|(name, flows, top)| vec![name, thousands(flows), top])
        .collect();
    Ok(footer(
        table(&headers, &text),
        total,
        shown,
        all - rows.len(),
        what,
    ))
}

fn footer(mut text: String, total: u64, shown: u64, hidden: usize, what: &str) -> String {
    text.push_str(&format!("{} flows in all", thousands(total)));
    if hidden > 0 {
        text.push_str(&format!(
            "; {hidden} more {what} with {} flows not shown (--limit)",
            thousands(total - shown)
        ));
    }
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows as `(name, flows, [(name, flows)])`.
    type Ranked = Vec<(String, u64, Vec<(String, u64)>)>;

    fn pairs(list: &[(&str, &str, u64)]) -> Pairs {
        let mut p = Pairs::default();
        for (svc, client, n) in list {
            for _ in 0..*n {
                p.add(svc.to_string(), client.parse().unwrap());
            }
        }
        p
    }

    fn flat_services(v: &[TopService]) -> Ranked {
        v.iter()
            .map(|s| {
                let cs = s
                    .clients
                    .iter()
                    .map(|c| (c.client.clone(), c.flows))
                    .collect();
                (s.service.clone(), s.flows, cs)
            })
            .collect()
    }

    fn s(v: &str) -> String {
        v.to_string()
    }

    /// Two services on one backend, clients over both families, a tie broken by name.
    fn sample() -> Pairs {
        pairs(&[
            ("default/web", "10.0.0.2", 3),
            ("default/web", "10.0.0.3", 2),
            ("default/api", "10.0.0.3", 4),
            ("default/api", "10.0.0.2", 1),
            ("default/web6", "fd00::2", 2),
        ])
    }

    #[test]
    fn services_largest_first_with_their_clients() {
        let p = sample();
        assert_eq!(p.flows(), 12);
        assert_eq!(
            flat_services(&p.services(0)),
            vec![
                // 5 and 5: by name.
                (
                    s("default/api"),
                    5,
                    vec![(s("10.0.0.3"), 4), (s("10.0.0.2"), 1)]
                ),
                (
                    s("default/web"),
                    5,
                    vec![(s("10.0.0.2"), 3), (s("10.0.0.3"), 2)]
                ),
                (s("default/web6"), 2, vec![(s("fd00::2"), 2)]),
            ]
        );
    }

    #[test]
    fn clients_largest_first_with_their_services() {
        let p = sample();
        let got: Ranked = p
            .clients(0)
            .iter()
            .map(|c| {
                let ss = c
                    .services
                    .iter()
                    .map(|s| (s.service.clone(), s.flows))
                    .collect();
                (c.client.clone(), c.flows, ss)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    s("10.0.0.3"),
                    6,
                    vec![(s("default/api"), 4), (s("default/web"), 2)]
                ),
                (
                    s("10.0.0.2"),
                    4,
                    vec![(s("default/web"), 3), (s("default/api"), 1)]
                ),
                (s("fd00::2"), 2, vec![(s("default/web6"), 2)]),
            ]
        );
    }

    #[test]
    fn limit_cuts_the_rows_and_each_rows_list() {
        let p = sample();
        assert_eq!(
            flat_services(&p.services(1)),
            vec![(s("default/api"), 5, vec![(s("10.0.0.3"), 4)])]
        );
    }

    #[test]
    fn json_leaves_out_the_empty_nested_list_and_reads_back() {
        let p = sample();
        let v = p.services(1);
        let text = serde_json::to_string(&v).unwrap();
        assert_eq!(
            text,
            r#"[{"service":"default/api","flows":5,"clients":[{"client":"10.0.0.3","flows":4}]}]"#
        );
        let back: Vec<TopService> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn the_table_says_what_the_limit_left_out() {
        let text = footer(String::new(), 12, 5, 2, "services");
        assert_eq!(
            text,
            "12 flows in all; 2 more services with 7 flows not shown (--limit)\n"
        );
        assert_eq!(
            footer(String::new(), 12, 12, 0, "services"),
            "12 flows in all\n"
        );
        assert_eq!(
            inline([(s("a"), 4), (s("b"), 3), (s("c"), 2), (s("d"), 1)].into_iter()),
            "a 4, b 3, c 2, ..."
        );
    }
}
