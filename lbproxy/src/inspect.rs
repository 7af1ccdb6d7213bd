//! `lbproxy inspect`: reads the pinned maps, whether `run` is running or not, and prints an
//! aligned table for people or JSON for scripts.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, MapData};
use lbproxy_common::{Addr, FLOW_DIR_FORWARD, FlowKeyOf, FlowValueOf, SlotKey, map_names};
use serde::Serialize;

use crate::bpf::pinned::label_bytes;
use crate::bpf::{PinnedMaps, label_str};
use crate::desired::{BackendAddr, Frontend, FrontendKind};
use crate::model::Protocol;

#[derive(Serialize)]
pub struct BackendRow {
    pub id: u32,
    pub addr: String,
    pub port: u16,
    pub protocol: String,
    /// In a service's list: `ready` (gets new connections), `terminating` (gets new
    /// connections because no endpoint is ready: KEP-1669's fallback) or `draining` (no new
    /// connections; `flows` of its flows are still served).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<&'static str>,
    /// A draining backend's flows of this service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flows: Option<usize>,
}

#[derive(Serialize)]
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
}

#[derive(Serialize)]
pub struct FlowRow {
    pub client: String,
    pub frontend: String,
    pub backend: String,
    pub protocol: String,
    pub service: String,
    pub backend_id: u32,
    /// `syn_sent`, `established`, `half_closed` (one FIN), `closed` (FINs both ways or a
    /// RST), or `-` (UDP).
    pub state: String,
    /// The source port the backend sees, when it is not the client's own: the flow's tuple
    /// clashed with another flow through another VIP and got another port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_port_at_backend: Option<u16>,
    /// The source the backend sees when the flow is source-NATed (from outside the node to
    /// a backend on another node): this node's address and a port of the SNAT range.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<String>,
    /// Whether the reply half of the flow is in the table (the datapath recreates a missing
    /// one on the flow's next packet).
    pub reply_half: bool,
    pub age_seconds: f64,
    /// Since the later of the two halves was last used.
    pub idle_seconds: f64,
}

impl BackendRow {
    /// `addr:port`, an IPv6 address in brackets.
    fn at(&self) -> String {
        match self.addr.parse::<std::net::IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, self.port).to_string(),
            Err(_) => format!("{}:{}", self.addr, self.port),
        }
    }

    fn of(id: u32, b: &BackendAddr) -> BackendRow {
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

/// A flow's ends as one of its halves records them: the client's own address and port, the
/// frontend it used and the backend. Both halves of a flow give the same ends.
pub struct FlowEnds {
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    pub svc_id: u32,
}

impl FlowEnds {
    pub fn of<A: Addr>(k: &FlowKeyOf<A>, v: &FlowValueOf<A>) -> FlowEnds {
        let at = |a: A, port_be: u16| SocketAddr::new(a.ip(), u16::from_be(port_be));
        if k.dir == FLOW_DIR_FORWARD {
            FlowEnds {
                client: at(k.src_addr, k.src_port_be),
                frontend: at(k.dst_addr, k.dst_port_be),
                backend: at(v.nat_addr, v.nat_port_be),
                svc_id: v.svc_id,
            }
        } else {
            // A reply half is keyed by the backend's packet and restores the client.
            FlowEnds {
                client: at(v.peer_addr, v.peer_port_be),
                frontend: at(v.nat_addr, v.nat_port_be),
                backend: at(k.src_addr, k.src_port_be),
                svc_id: v.svc_id,
            }
        }
    }
}

fn split_label(label: &str) -> (String, String) {
    match label.rsplit_once(':') {
        Some((svc, port)) => (svc.to_string(), port.to_string()),
        None => (label.to_string(), String::new()),
    }
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
                    state: Some(if fallback { "terminating" } else { "ready" }),
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
                    state: Some("draining"),
                    flows: Some(n),
                    ..BackendRow::of(id, b)
                });
            }
        }
        bes.sort_by(|a, b| (&a.addr, a.port).cmp(&(&b.addr, b.port)));
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
        });
    }
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
        });
    }
    rows.sort_by(|a, b| {
        (&a.service, !a.served, &a.frontend).cmp(&(&b.service, !b.served, &b.frontend))
    });
    rows
}

/// The name of a `SVC_KIND_*`.
fn kind_name(kind: u8) -> &'static str {
    FrontendKind::from_number(kind).map_or("?", FrontendKind::display)
}

pub fn backends(maps: &PinnedMaps) -> Vec<BackendRow> {
    let mut rows: Vec<BackendRow> = maps
        .all_backends()
        .filter_map(|(id, b)| BackendAddr::from_value(&b).map(|a| BackendRow::of(id, &a)))
        .collect();
    rows.sort_by_key(|r| r.id);
    rows
}

/// One destination of source-NATed flows: its ports in use out of the SNAT range.
#[derive(Debug, serde::Serialize)]
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

pub fn flows(maps: &PinnedMaps) -> Vec<FlowRow> {
    let labels: BTreeMap<u32, String> = maps
        .labels
        .iter()
        .flatten()
        .map(|(id, l)| (id, label_str(&l)))
        .collect();
    let mut rows = flow_rows(&maps.flows, &labels);
    rows.extend(flow_rows(&maps.flows6, &labels));
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    rows
}

/// One row per flow of one family's flow map.
fn flow_rows<A: Addr>(
    map: &BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    labels: &BTreeMap<u32, String>,
) -> Vec<FlowRow>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let now = crate::bpf::flow_gc::monotonic_ns();
    let secs = |ns: u64| (now.saturating_sub(ns) as f64) / 1e9;
    map.iter()
        .flatten()
        .filter(|(k, _)| k.dir == FLOW_DIR_FORWARD)
        .map(|(k, v)| {
            let ends = FlowEnds::of(&k, &v);
            let pk = k.partner(&v);
            let partner = map.get(&pk, 0).ok().filter(|p| pk.partner(p) == k);
            let proto = Protocol::from_number(k.proto).map_or("?", Protocol::as_str);
            let partner_flags = partner.map_or(0, |p| p.flags);
            let state = if k.proto != lbproxy_common::IPPROTO_TCP {
                "-"
            } else if v.closed_with(partner_flags) {
                "closed"
            } else if (v.flags | partner_flags) & lbproxy_common::FLOW_F_FIN != 0 {
                "half_closed"
            } else if v.state == lbproxy_common::FLOW_STATE_SYN_SENT {
                "syn_sent"
            } else {
                "established"
            };
            let last_seen = partner.map_or(v.last_seen_ns, |p| p.last_seen_ns.max(v.last_seen_ns));
            FlowRow {
                client: ends.client.to_string(),
                frontend: format!("{}/{proto}", ends.frontend),
                backend: ends.backend.to_string(),
                protocol: proto.to_string(),
                service: labels.get(&v.svc_id).cloned().unwrap_or_default(),
                backend_id: v.backend_id,
                state: state.to_string(),
                client_port_at_backend: (!v.snat(&k) && v.peer_port_be != k.src_port_be)
                    .then(|| u16::from_be(v.peer_port_be)),
                snat: v.snat(&k).then(|| {
                    SocketAddr::new(v.peer_addr.ip(), u16::from_be(v.peer_port_be)).to_string()
                }),
                reply_half: partner.is_some(),
                age_seconds: secs(v.created_ns),
                idle_seconds: secs(last_seen),
            }
        })
        .collect()
}

/// Prints rows as an aligned table.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let columns = rows
        .iter()
        .map(Vec::len)
        .chain([headers.len()])
        .max()
        .unwrap_or(0);
    let mut widths: Vec<usize> = vec![0; columns];
    for (i, h) in headers.iter().enumerate() {
        widths[i] = h.len();
    }
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(headers.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum What {
    Services,
    Backends,
    Flows,
    Drops,
    /// The stack bypass: whether it is on, the interfaces it redirects into, and how
    /// translated packets were delivered.
    Delivery,
    /// Source NAT's port space: the destinations with the most ports in use.
    Snat,
    /// Socket-level load balancing: its hooks, scope, and what they did.
    Sockets,
    /// Session affinity: each client's backend per service, and when it expires.
    Affinity,
    /// The controller's last sync (from its /healthz), the attached interfaces and how full
    /// each map is.
    Status,
}

/// How `inspect` prints: an aligned table for people, JSON or YAML for scripts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
    Yaml,
}

impl Output {
    fn machine(self) -> bool {
        self != Output::Table
    }

    /// `v` as JSON (pretty) or YAML, ending in a newline.
    fn encode<T: Serialize>(self, v: &T) -> anyhow::Result<String> {
        Ok(match self {
            Output::Yaml => serde_saphyr::to_string(v)?,
            _ => format!("{}\n", serde_json::to_string_pretty(v)?),
        })
    }
}

/// `lbproxy inspect`: prints `what` once, or with `watch` every `watch` seconds (the screen
/// cleared between) until interrupted.
pub fn run(
    dir: &Path,
    what: What,
    out: Output,
    filter: &Filter,
    healthz: &str,
    watch: Option<f64>,
) -> anyhow::Result<()> {
    let Some(every) = watch else {
        print!("{}", render(dir, what, out, filter, healthz)?);
        return Ok(());
    };
    let every = std::time::Duration::try_from_secs_f64(every)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--watch {every}: give a positive number of seconds"))?;
    loop {
        let text = render(dir, what, out, filter, healthz)?;
        if out == Output::Table {
            // Clear the screen and home the cursor, as watch(1) does.
            print!("\x1b[2J\x1b[H");
            println!(
                "every {:.1}s: lbproxy inspect {what:?}    {}",
                every.as_secs_f64(),
                jiff::Timestamp::now().strftime("%H:%M:%S")
            );
        }
        print!("{text}");
        use std::io::Write as _;
        std::io::stdout().flush()?;
        std::thread::sleep(every);
    }
}

/// `--service` and `--backend`.
#[derive(Default)]
pub struct Filter {
    pub service: Option<String>,
    pub backend: Option<String>,
}

impl Filter {
    /// Whether service label `label` (`namespace/name:port-name`) is the one asked for: the
    /// same label, or its `namespace/name` (every port).
    pub fn service_ok(&self, label: &str) -> bool {
        self.service.as_deref().is_none_or(|want| {
            label == want || label.split_once(':').is_some_and(|(svc, _)| svc == want)
        })
    }

    /// [`Filter::backend_ok`] of an `addr:port` string.
    fn backend_addr_ok(&self, backend: &str) -> bool {
        let (addr, port) = backend.rsplit_once(':').unwrap_or((backend, "0"));
        self.backend_ok(addr, port.parse().unwrap_or(0))
    }

    /// Whether backend `addr`, `port` is the one asked for: the address alone, or with the
    /// port (`addr:port`, an IPv6 address in brackets).
    pub fn backend_ok(&self, addr: &str, port: u16) -> bool {
        self.backend.as_deref().is_none_or(|want| {
            want == addr || want == format!("{addr}:{port}") || want == format!("[{addr}]:{port}")
        })
    }
}

pub fn render(
    dir: &Path,
    what: What,
    out: Output,
    filter: &Filter,
    healthz: &str,
) -> anyhow::Result<String> {
    if !dir.exists() {
        anyhow::bail!(
            "{} does not exist: lbproxy has not run with this --bpffs-dir (or was cleaned up)",
            dir.display()
        );
    }
    let maps = PinnedMaps::open(dir)?;
    let text = match what {
        What::Services => {
            let mut rows = services(&maps);
            rows.retain(|r| {
                filter.service_ok(&r.service)
                    && (filter.backend.is_none()
                        || r.backends
                            .iter()
                            .chain(&r.draining)
                            .any(|b| filter.backend_ok(&b.addr, b.port)))
            });
            if out.machine() {
                out.encode(&rows)?
            } else {
                let mut cells: Vec<Vec<String>> = Vec::new();
                for r in &rows {
                    let head = [
                        r.service.clone(),
                        r.port_name.clone(),
                        r.kind.clone(),
                        r.frontend.clone(),
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
                                let state = match (b.state, b.flows) {
                                    (Some(s), Some(n)) => format!("{s} ({n} flows)"),
                                    (Some(s), None) => s.to_string(),
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
                    &["SERVICE", "PORT", "KIND", "FRONTEND", "BACKEND", "STATE"],
                    &cells,
                )
            }
        }
        What::Backends => {
            let mut rows = backends(&maps);
            rows.retain(|r| filter.backend_ok(&r.addr, r.port));
            if out.machine() {
                out.encode(&rows)?
            } else {
                let cells: Vec<Vec<String>> = rows
                    .iter()
                    .map(|r| vec![r.id.to_string(), r.at(), r.protocol.clone()])
                    .collect();
                table(&["ID", "BACKEND", "PROTO"], &cells)
            }
        }
        What::Flows => {
            let mut rows = flows(&maps);
            rows.retain(|r| filter.service_ok(&r.service) && filter.backend_addr_ok(&r.backend));
            if out.machine() {
                out.encode(&rows)?
            } else {
                let cells: Vec<Vec<String>> = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.service.clone(),
                            match (&r.snat, r.client_port_at_backend) {
                                // What the backend sees: SNAT, or a port after a clash.
                                (Some(s), _) => format!("{} (as {s})", r.client),
                                (None, Some(p)) => format!("{} (as :{p})", r.client),
                                (None, None) => r.client.clone(),
                            },
                            r.frontend.clone(),
                            r.backend.clone(),
                            if r.reply_half {
                                r.state.clone()
                            } else {
                                format!("{} (reply half missing)", r.state)
                            },
                            format!("{:.0}s", r.age_seconds),
                            format!("{:.0}s", r.idle_seconds),
                        ]
                    })
                    .collect();
                table(
                    &[
                        "SERVICE", "CLIENT", "FRONTEND", "BACKEND", "STATE", "AGE", "IDLE",
                    ],
                    &cells,
                )
            }
        }
        What::Drops => {
            let rows: Vec<(String, u64)> = maps
                .drop_counts()
                .into_iter()
                .map(|(r, n)| (r.label().to_string(), n))
                .collect();
            if out.machine() {
                let m: BTreeMap<String, u64> = rows.into_iter().collect();
                out.encode(&m)?
            } else {
                let cells: Vec<Vec<String>> = rows
                    .iter()
                    .map(|(r, n)| vec![r.clone(), n.to_string()])
                    .collect();
                table(&["REASON", "PACKETS"], &cells)
            }
        }
        What::Delivery => delivery(&maps, out)?,
        What::Sockets => sockets(&maps, dir, out)?,
        What::Affinity => affinity(&maps, out, filter)?,
        What::Status => status(&maps, dir, out, healthz)?,
        What::Snat => {
            let rows = snat(&maps);
            if out.machine() {
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
            }
        }
    };
    Ok(text)
}

/// `inspect sockets`.
fn sockets(maps: &PinnedMaps, dir: &Path, out: Output) -> anyhow::Result<String> {
    let cfg = maps.sock_config.get(&0, 0).unwrap_or_default();
    let on = cfg.flags & lbproxy_common::SOCK_F_ENABLED != 0;
    let scope = match (on, cfg.flags & lbproxy_common::SOCK_F_ALL_NETNS != 0) {
        (false, _) => "off",
        (true, false) => "host",
        (true, true) => "pods",
    };
    let hooks: Vec<String> = crate::bpf::sock::pinned_links(dir)
        .iter()
        .filter_map(|p| Some(p.file_name()?.to_string_lossy().to_string()))
        .collect();
    let sockets = maps.sock_rev.keys().flatten().count() + maps.sock_rev6.keys().flatten().count();
    let counts: Vec<(&'static str, u64)> = maps
        .sock_counts()
        .into_iter()
        .map(|(e, n)| (e.label(), n))
        .collect();
    if out.machine() {
        let v = serde_json::json!({
            "mode": scope,
            "netns_cookie": cfg.netns_cookie,
            "hooks": hooks,
            "translated_sockets": sockets,
            "events": counts.iter().copied().collect::<BTreeMap<_, _>>(),
        });
        return out.encode(&v);
    }
    let mut out = format!(
        "socket-level load balancing: {scope} (network namespace cookie {})
hooks attached: {}
sockets remembered (for recvmsg/getpeername): {sockets}

",
        cfg.netns_cookie,
        if hooks.is_empty() {
            "(none)".to_string()
        } else {
            hooks.join(", ")
        }
    );
    let cells: Vec<Vec<String>> = counts
        .iter()
        .map(|(e, n)| vec![e.to_string(), n.to_string()])
        .collect();
    out.push_str(&table(&["EVENT", "COUNT"], &cells));
    Ok(out)
}

/// `inspect delivery`.
fn delivery(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let bypass = maps.stack_bypass();
    // `LB_PODIFS_V1` lists the pod interfaces whether or not the bypass is on (north-south
    // asks it which backends are local); they are redirect targets only with the bypass.
    let mut ifs: Vec<(u32, &'static str)> = maps
        .pod_ifs
        .iter()
        .flatten()
        .filter(|(_, v)| bypass && v.kind != lbproxy_common::POD_IF_BRIDGE)
        .map(|(ifindex, v)| {
            let kind = match v.kind {
                lbproxy_common::POD_IF_VETH => "veth",
                lbproxy_common::POD_IF_NETKIT => "netkit",
                _ => "unknown",
            };
            (ifindex, kind)
        })
        .collect();
    ifs.sort_unstable();
    let counts: Vec<(&'static str, u64)> = maps
        .delivery_counts()
        .into_iter()
        .map(|(d, n)| (d.label(), n))
        .collect();
    if out.machine() {
        let v = serde_json::json!({
            "stack_bypass": bypass,
            "redirect_interfaces": ifs
                .iter()
                .map(|(i, k)| serde_json::json!({"ifindex": i, "kind": k}))
                .collect::<Vec<_>>(),
            "packets": counts.iter().copied().collect::<BTreeMap<_, _>>(),
        });
        return out.encode(&v);
    }
    let mut out = format!(
        "stack bypass: {}\nredirect into: {}\n\n",
        if bypass { "on" } else { "off" },
        if ifs.is_empty() {
            "(no interface)".to_string()
        } else {
            ifs.iter()
                .map(|(i, k)| format!("ifindex {i} ({k})"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let cells: Vec<Vec<String>> = counts
        .iter()
        .map(|(p, n)| vec![(*p).to_string(), n.to_string()])
        .collect();
    out.push_str(&table(&["PATH", "PACKETS"], &cells));
    Ok(out)
}

/// One client's session affinity to a backend, for one service.
#[derive(Serialize)]
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
    pub state: &'static str,
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
                },
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    rows
}

/// `inspect affinity`.
fn affinity(maps: &PinnedMaps, out: Output, filter: &Filter) -> anyhow::Result<String> {
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
                r.state.to_string(),
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

/// What `inspect status` shows.
#[derive(Serialize)]
pub struct Status {
    /// The controller's /healthz body, or why it could not be read.
    pub controller: serde_json::Value,
    /// Seconds since the last sync that programmed the maps (from /healthz).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_age_seconds: Option<f64>,
    pub healthy: Option<bool>,
    /// Interfaces with lbproxy's pinned links, and the programs attached there.
    pub interfaces: Vec<InterfaceRow>,
    pub maps: Vec<MapFill>,
}

#[derive(Serialize)]
pub struct InterfaceRow {
    pub name: String,
    pub ifindex: u32,
    pub links: Vec<String>,
}

#[derive(Serialize)]
pub struct MapFill {
    pub map: &'static str,
    pub entries: u64,
    pub capacity: u32,
    pub fill: f64,
}

/// `inspect status`.
fn status(maps: &PinnedMaps, dir: &Path, out: Output, healthz: &str) -> anyhow::Result<String> {
    let (controller, healthy, age) = match get_json(healthz, "/healthz") {
        Ok(v) => {
            let healthy = v["healthy"].as_bool();
            let age = v["secondsSinceUpdate"].as_f64();
            (v, healthy, age)
        }
        Err(e) => (
            serde_json::json!({"error": format!("GET http://{healthz}/healthz: {e:#}")}),
            None,
            None,
        ),
    };
    let interfaces: Vec<InterfaceRow> = crate::bpf::attach::pinned_interfaces(dir)
        .into_iter()
        .map(|(iface, links)| InterfaceRow {
            name: iface.name.clone(),
            ifindex: iface.index,
            links: links
                .iter()
                .filter_map(|p| p.file_name().map(|f| f.to_string_lossy().to_string()))
                .collect(),
        })
        .collect();
    // The hash maps, whose entries come and go (arrays are always full).
    let counts: [(&'static str, usize); 12] = [
        (map_names::SERVICES, maps.services.keys().count()),
        (map_names::SLOTS, maps.slots.keys().count()),
        (map_names::BACKENDS, maps.backends.keys().count()),
        (map_names::MEMBERS, maps.members.keys().count()),
        (map_names::FLOWS, maps.flows.keys().count()),
        (map_names::AFFINITY, maps.affinity.keys().count()),
        (map_names::LABELS, maps.labels.keys().count()),
        (map_names::UNSERVED, maps.unserved.keys().count()),
        (map_names::POD_IFS, maps.pod_ifs.keys().count()),
        (map_names::NODE_IFS, maps.node_ifs.keys().count()),
        (map_names::SOCK_REV, maps.sock_rev.keys().count()),
        (map_names::SOCK_REV6, maps.sock_rev6.keys().count()),
    ];
    let capacities: BTreeMap<&str, i64> = crate::bpf::capacities(dir).into_iter().collect();
    let fills: Vec<MapFill> = counts
        .into_iter()
        .map(|(name, n)| {
            let capacity = capacities.get(name).copied().unwrap_or(0) as u32;
            MapFill {
                map: lbproxy_common::spec_by_name(name).map_or(name, |s| s.label),
                entries: n as u64,
                capacity,
                fill: n as f64 / f64::from(capacity.max(1)),
            }
        })
        .collect();
    let st = Status {
        controller,
        sync_age_seconds: age,
        healthy,
        interfaces,
        maps: fills,
    };
    if out.machine() {
        return out.encode(&st);
    }
    let mut text = String::new();
    match (&st.healthy, st.sync_age_seconds) {
        (Some(h), Some(age)) => text.push_str(&format!(
            "controller: {} (last sync {age:.1}s ago; node eligible: {})\n",
            if *h { "healthy" } else { "UNHEALTHY" },
            st.controller["nodeEligible"]
        )),
        _ => text.push_str(&format!(
            "controller: not reachable ({})\n",
            st.controller["error"]
                .as_str()
                .unwrap_or("no sync time in /healthz")
        )),
    }
    text.push_str(&format!("\ninterfaces ({}):\n", st.interfaces.len()));
    let cells: Vec<Vec<String>> = st
        .interfaces
        .iter()
        .map(|i| vec![i.name.clone(), i.ifindex.to_string(), i.links.join(", ")])
        .collect();
    text.push_str(&table(&["INTERFACE", "IFINDEX", "LINKS"], &cells));
    text.push_str("\nmaps:\n");
    let cells: Vec<Vec<String>> = st
        .maps
        .iter()
        .map(|m| {
            vec![
                m.map.to_string(),
                m.entries.to_string(),
                m.capacity.to_string(),
                format!("{:.1}%", m.fill * 100.0),
            ]
        })
        .collect();
    text.push_str(&table(&["MAP", "ENTRIES", "CAPACITY", "FILL"], &cells));
    Ok(text)
}

/// GETs `http://{addr}{path}` and parses the body as JSON, whatever the status (a 503
/// `/healthz` still says why), within 3 s. For `lbproxy inspect status`.
fn get_json(addr: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    use http_body_util::BodyExt as _;
    let uri: http::Uri = format!("http://{addr}{path}").parse()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<bytes::Bytes>>();
        let fetch = async {
            let resp = client.get(uri).await?;
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(serde_json::from_slice(&body)?)
        };
        tokio::time::timeout(std::time::Duration::from_secs(3), fetch)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 3 s"))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let t = table(
            &["A", "BB"],
            &[
                vec!["long-cell".into(), "x".into()],
                vec!["s".into(), "y".into()],
            ],
        );
        assert_eq!(t, "A          BB\nlong-cell  x\ns          y\n");
    }

    #[test]
    fn filters_match_service_with_or_without_port_and_backend_with_or_without_port() {
        let f = Filter {
            service: Some("ns/a".into()),
            backend: Some("198.18.0.2".into()),
        };
        assert!(f.service_ok("ns/a") && f.service_ok("ns/a:http") && !f.service_ok("ns/ab:http"));
        assert!(f.backend_ok("198.18.0.2", 80) && !f.backend_ok("198.18.0.20", 80));
        let f = Filter {
            service: Some("ns/a:dns".into()),
            backend: Some("198.18.0.2:53".into()),
        };
        assert!(f.service_ok("ns/a:dns") && !f.service_ok("ns/a:http"));
        assert!(f.backend_ok("198.18.0.2", 53) && !f.backend_ok("198.18.0.2", 80));
    }

    #[test]
    fn a_row_longer_than_the_headers_does_not_panic() {
        let t = table(&["A"], &[vec!["x".into(), "y".into()]]);
        assert_eq!(t, "A\nx  y\n");
    }

    #[test]
    fn labels_split_into_service_and_port() {
        assert_eq!(split_label("ns/a:http"), ("ns/a".into(), "http".into()));
        assert_eq!(split_label("ns/a"), ("ns/a".into(), String::new()));
    }
}
