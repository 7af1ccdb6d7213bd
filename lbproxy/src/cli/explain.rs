//! `lbproxy explain`: where a packet of one 5-tuple goes, and why, against the live pinned
//! maps. It walks the stages of the hook the packet enters by (`--from`), from the same maps,
//! and says what each one decides: the frontend, its source ranges, a live flow, affinity,
//! the endpoints, the backend a new flow gets, SNAT or DSR, and the verdict.
//!
//! **Reads only.** The maps are opened from their pins and looked up; nothing is created,
//! written or deleted, and no program runs, so no counter moves.
//!
//! **One selection, not two.** A new flow's backend comes from the code the datapath runs:
//! `lbproxy_common::select` has the seeded 5-tuple hash, the jump hash over the slots, the
//! Maglev table position, the order between the two ([`select::backend_id`], behind the
//! [`SelectionMaps`] trait that the datapath implements over the kernel's maps and this module
//! over the pinned ones), and the answers for a frontend without endpoints. So the two cannot
//! drift; the lab tests (`tests/tests/explain.rs`) check that they agree with the backend
//! that really answers. Running the real program with `BPF_PROG_TEST_RUN` was the other way:
//! it would need a mode of the programs that writes nothing (flows, affinity, counters), a
//! branch in every stage, and still could not tell which stage decided what.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use anyhow::Context as _;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::select::{self, Refusal, SelectionMaps};
use lbproxy_common::{
    AffinityKeyOf, AffinityValue, BackendOf, CONFIG_F_DSR_TCP, CONFIG_F_DSR_UDP,
    CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_SERVICE_CIDRS, DatapathConfig, DropReason,
    FLOW_ADOPTED_CONNTRACK, FLOW_DIR_FORWARD, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf,
    IPPROTO_TCP, IPPROTO_UDP, MEMBER_SERVING, MaglevKey, MemberKey, NODE_ADDR_F_NODEPORT, NodeAddr,
    NodeIfOf, SCOPE_DEFAULT, SCOPE_INTERNAL, SVC_F_LOCAL_ONLY, SVC_F_MAGLEV, SVC_F_SOURCE_RANGES,
    SVC_F_SPLIT_SCOPE, SVC_KIND_CLUSTER_IP, ServiceKeyOf, ServiceValue, SlotKey, SrcRangeDataOf,
    map_names,
};
use serde::{Deserialize, Serialize};

use super::inspect::{Output, flows::FlowRow, table};
use crate::bpf::{PinnedMaps, open_pinned};
use crate::model::Protocol;

/// Where the packet enters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum From {
    /// A pod's interface (`lb_from_pod`): east-west, every frontend.
    #[default]
    Pod,
    /// One of the node's own interfaces (`lb_from_node`): north-south, every frontend but a
    /// ClusterIP.
    Node,
    /// A process on the node, at its socket (`connect4`/`connect6`).
    Host,
}

/// The protocol of the 5-tuple.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    fn number(self) -> u8 {
        match self {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
            Proto::Sctp => lbproxy_common::IPPROTO_SCTP,
        }
    }
}

/// What `explain -o json` prints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Explanation {
    /// `forward`, `reject`, `drop` or `pass`.
    pub verdict: String,
    /// For `reject` and `drop`: the reason, as `inspect drops` names it.
    pub reason: Option<String>,
    /// `namespace/name`, or null.
    pub service: Option<String>,
    /// The Service port's name, when it has one.
    pub port_name: Option<String>,
    /// The frontend found, e.g. `10.96.0.81:80/TCP`, or null.
    pub frontend: Option<String>,
    /// For `forward`: the backend (`IP:PORT`), the live flow's or the one a new flow gets;
    /// null when it cannot be known before the packet (a node process's socket).
    pub backend: Option<String>,
    /// Why that backend: `flow` (a live flow), `affinity` (the client's remembered choice),
    /// `maglev` or `slot` (a new flow's selection).
    pub chosen_by: Option<String>,
    /// The live flow on this 5-tuple, if any (as `inspect flows` prints it).
    pub flow: Option<FlowRow>,
    /// For `forward` to a new flow: `client` (the backend sees the client's address),
    /// `snat` (the node's), `dsr` (the client's, replies straight to it) or `hairpin`.
    pub source: Option<String>,
    /// Every endpoint of the frontend's Service (this node's members of it).
    pub endpoints: Vec<Endpoint>,
    /// What each stage decided, in order.
    pub steps: Vec<String>,
}

/// An endpoint of the frontend, as the maps hold it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Endpoint {
    /// `IP:PORT`: the endpoint's address and target port.
    pub address: String,
    pub backend_id: u32,
    /// `serving` (takes new flows on this node) or `draining` (terminating, or not chosen
    /// here by topology or traffic policy: keeps its flows, gets no new one).
    pub state: String,
    /// Its slot among the frontend's slots, when it has one.
    pub slot: Option<u32>,
    /// Whether this packet goes to it.
    pub selected: bool,
}

/// `lbproxy explain`'s arguments.
pub struct Args<'a> {
    pub bpffs_dir: &'a Path,
    pub proto: Proto,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub from: From,
    pub output: Output,
}

/// Runs `explain` and prints its answer.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let e = explain(args)?;
    let text = if args.output == Output::Table {
        render_text(&e)
    } else {
        args.output.encode(&e)?
    };
    print!("{text}");
    Ok(())
}

/// The answer for `args`, from the pinned maps under `args.bpffs_dir`.
pub fn explain(args: &Args) -> anyhow::Result<Explanation> {
    let maps = PinnedMaps::open(args.bpffs_dir).with_context(|| {
        format!(
            "reading the pinned maps under {} (is lbproxy running, or has it run, here?)",
            args.bpffs_dir.display()
        )
    })?;
    let ctx = Ctx::open(args.bpffs_dir, maps)?;
    match (args.src.ip(), args.dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Ok(walk::<[u8; 4]>(&ctx, args, s.octets(), d.octets())),
        (IpAddr::V6(s), IpAddr::V6(d)) => Ok(walk::<[u8; 16]>(&ctx, args, s.octets(), d.octets())),
        _ => anyhow::bail!(
            "--src {} and --dst {} are of different address families",
            args.src,
            args.dst
        ),
    }
}

/// The maps `explain` reads.
struct Ctx {
    maps: PinnedMaps,
    config: DatapathConfig,
    maglev_m: u32,
    slots: BpfHashMap<MapData, SlotKey, u32>,
    labels: BTreeMap<u32, String>,
    dir: std::path::PathBuf,
}

impl Ctx {
    fn open(dir: &Path, maps: PinnedMaps) -> anyhow::Result<Ctx> {
        let config = maps.config.get(&0, 0).context("reading LB_CONFIG_V1")?;
        let maglev_m = if dir.join(map_names::MAGLEV_CONFIG).exists() {
            let m: aya::maps::Array<MapData, lbproxy_common::MaglevConfig> =
                open_pinned(dir, map_names::MAGLEV_CONFIG, Map::Array)?;
            m.get(&0, 0).map_or(0, |c| c.m)
        } else {
            0
        };
        let slots = open_pinned(dir, map_names::SLOTS, Map::HashMap)?;
        let labels = maps.labels_by_id();
        Ok(Ctx {
            maps,
            config,
            maglev_m,
            slots,
            labels,
            dir: dir.to_path_buf(),
        })
    }

    fn is_member(&self, svc_id: u32, backend_id: u32) -> Option<u32> {
        self.maps
            .members
            .get(&MemberKey { svc_id, backend_id }, 0)
            .ok()
    }
}

/// The selection's map reads from the pinned maps: what `lb::select`'s `KernelMaps` reads
/// from the kernel's.
impl SelectionMaps for Ctx {
    fn maglev_backend(&self, svc_id: u32, hash: u64) -> u32 {
        if self.maglev_m == 0 {
            return 0;
        }
        let (chunk, pos) = lbproxy_common::maglev::position(hash, self.maglev_m);
        let Some(table) = self.maps.maglev.as_ref() else {
            return 0;
        };
        table
            .get(&MaglevKey { svc_id, chunk }, 0)
            .ok()
            .and_then(|c| c.backend_ids.get(select::maglev_index(pos)).copied())
            .unwrap_or(0)
    }

    fn slot_backend(&self, svc_id: u32, count: u32, hash: u64) -> u32 {
        let key = SlotKey {
            svc_id,
            slot: select::slot_of(hash, count),
        };
        self.slots.get(&key, 0).unwrap_or(0)
    }
}

/// A family's maps, as `explain` reads them (`lbproxy-ebpf`'s `Family`, read-only).
trait Fam: lbproxy_common::Addr {
    fn service(c: &Ctx, key: &ServiceKeyOf<Self>) -> Option<ServiceValue>;
    fn flow(c: &Ctx, key: &FlowKeyOf<Self>) -> Option<FlowValueOf<Self>>;
    fn flow_row(c: &Ctx, key: &FlowKeyOf<Self>, v: &FlowValueOf<Self>) -> FlowRow;
    fn backend(c: &Ctx, id: u32) -> Option<BackendOf<Self>>;
    fn affinity(c: &Ctx, key: &AffinityKeyOf<Self>) -> Option<AffinityValue>;
    fn in_source_ranges(c: &Ctx, svc_id: u32, src: Self) -> bool;
    /// `NODE_ADDR_F_*` of this node address, if it is one.
    fn node_addr(c: &Ctx, addr: Self) -> Option<u32>;
    /// The SNAT address and port range of node interface `ifindex`, if it is one.
    fn node_if(c: &Ctx, ifindex: u32) -> Option<NodeIfOf<Self>>;
}

macro_rules! fam {
    ($a:ty, $services:ident, $flows:ident, $backends:ident, $affinity:ident, $ranges:ident,
     $node_addrs:expr, $node_ifs:expr) => {
        impl Fam for $a {
            fn service(c: &Ctx, key: &ServiceKeyOf<Self>) -> Option<ServiceValue> {
                c.maps.$services.get(key, 0).ok()
            }
            fn flow(c: &Ctx, key: &FlowKeyOf<Self>) -> Option<FlowValueOf<Self>> {
                c.maps.$flows.get(key, 0).ok()
            }
            fn flow_row(c: &Ctx, key: &FlowKeyOf<Self>, v: &FlowValueOf<Self>) -> FlowRow {
                let now = crate::bpf::flow_gc::monotonic_ns();
                super::inspect::flows::row(&c.maps.$flows, key, v, &c.labels, now)
            }
            fn backend(c: &Ctx, id: u32) -> Option<BackendOf<Self>> {
                c.maps.$backends.get(&id, 0).ok()
            }
            fn affinity(c: &Ctx, key: &AffinityKeyOf<Self>) -> Option<AffinityValue> {
                c.maps.$affinity.get(key, 0).ok()
            }
            fn in_source_ranges(c: &Ctx, svc_id: u32, src: Self) -> bool {
                let bits = u8::try_from(std::mem::size_of::<Self>() * 8).unwrap_or(32);
                let key = aya::maps::lpm_trie::Key::new(
                    SrcRangeDataOf::<Self>::prefix_len(bits),
                    SrcRangeDataOf {
                        svc_id_be: svc_id.to_be_bytes(),
                        addr: src,
                    },
                );
                c.maps.$ranges.get(&key, 0).is_ok()
            }
            fn node_addr(c: &Ctx, addr: Self) -> Option<u32> {
                let m: BpfHashMap<MapData, Self, NodeAddr> =
                    open_pinned(&c.dir, $node_addrs, Map::HashMap).ok()?;
                m.get(&addr, 0).ok().map(|a| a.flags)
            }
            fn node_if(c: &Ctx, ifindex: u32) -> Option<NodeIfOf<Self>> {
                let m: BpfHashMap<MapData, u32, NodeIfOf<Self>> =
                    open_pinned(&c.dir, $node_ifs, Map::HashMap).ok()?;
                m.get(&ifindex, 0).ok()
            }
        }
    };
}

fam!(
    [u8; 4],
    services,
    flows,
    backends,
    affinity,
    src_ranges,
    map_names::NODE_ADDRS,
    map_names::NODE_IFS
);
fam!(
    [u8; 16],
    services6,
    flows6,
    backends6,
    affinity6,
    src_ranges6,
    map_names::NODE_ADDRS6,
    map_names::NODE_IFS6
);

/// What the walk found so far; turned into the [`Explanation`] at the end.
struct Walk {
    e: Explanation,
}

impl Walk {
    fn step(&mut self, s: impl Into<String>) {
        self.e.steps.push(s.into());
    }

    fn end(mut self, verdict: &str, reason: Option<DropReason>) -> Explanation {
        self.e.verdict = verdict.to_string();
        self.e.reason = reason.map(|r| r.label().to_string());
        let v = match reason {
            Some(r) => format!("verdict: {verdict} ({})", r.label()),
            None => format!("verdict: {verdict}"),
        };
        self.step(v);
        self.e
    }

    fn refuse(self, r: Refusal) -> Explanation {
        match r {
            Refusal::Drop(r) => self.end("drop", Some(r)),
            Refusal::Reject(r) => self.end("reject", Some(r)),
        }
    }
}

fn at<A: lbproxy_common::Addr>(addr: A, port_be: u16) -> String {
    SocketAddr::new(addr.ip(), u16::from_be(port_be)).to_string()
}

/// The walk through the stages of `args.from`'s hook, for family `A`.
fn walk<A: Fam>(c: &Ctx, args: &Args, src: A, dst: A) -> Explanation {
    let proto = args.proto.number();
    let proto_name = Protocol::from_number(proto).map_or("?", Protocol::as_str);
    let (sport_be, dport_be) = (args.src.port().to_be(), args.dst.port().to_be());
    let mut w = Walk {
        e: Explanation {
            verdict: String::new(),
            reason: None,
            service: None,
            port_name: None,
            frontend: None,
            backend: None,
            chosen_by: None,
            flow: None,
            source: None,
            endpoints: Vec::new(),
            steps: Vec::new(),
        },
    };
    let hook = match args.from {
        From::Pod => "lb_from_pod (a pod's interface)",
        From::Node => "lb_from_node (the node's own interface)",
        From::Host => "connect (a node process's socket)",
    };
    w.step(format!(
        "packet: {} -> {} {proto_name}, entering by {hook}",
        args.src, args.dst
    ));

    // Stage 1: the frontend.
    let Some((key, svc)) = frontend(c, args.from, dst, dport_be, proto, &mut w) else {
        return no_frontend(c, args.from, dst, proto, w);
    };
    let label = c.labels.get(&svc.svc_id).cloned().unwrap_or_default();
    let (service, port_name) = match label.rsplit_once(':') {
        Some((s, p)) => (s.to_string(), p.to_string()),
        None => (label.clone(), String::new()),
    };
    w.e.service = (!service.is_empty()).then(|| service.clone());
    w.e.port_name = (!port_name.is_empty()).then_some(port_name);
    w.e.frontend = Some(format!("{}/{proto_name}", at(dst, dport_be)));
    w.step(format!(
        "frontend: {} of {} (service id {}, {}{}{}{}), scope {}",
        w.e.frontend.as_deref().unwrap_or(""),
        if label.is_empty() { "?" } else { &label },
        svc.svc_id,
        kind_name(svc.kind),
        if key.addr == A::ZERO {
            ", NodePort at any node address"
        } else {
            ""
        },
        if svc.flags & SVC_F_LOCAL_ONLY != 0 {
            ", traffic policy Local"
        } else {
            ""
        },
        if svc.flags & SVC_F_MAGLEV != 0 {
            ", Maglev"
        } else {
            ""
        },
        if key.scope == SCOPE_INTERNAL {
            "internal (the pods' entry of an externalTrafficPolicy: Local frontend)"
        } else {
            "default"
        },
    ));
    w.e.endpoints = endpoints::<A>(c, svc.svc_id);
    w.step(format!(
        "endpoints: {} in the slots (serving here, after topology and traffic policy), {} in all",
        svc.count,
        w.e.endpoints.len()
    ));

    // Stage 1b: loadBalancerSourceRanges (not on the socket path).
    if args.from != From::Host && svc.flags & SVC_F_SOURCE_RANGES != 0 {
        if !A::in_source_ranges(c, svc.svc_id, src) {
            w.step(format!(
                "source ranges: {} is in none of the frontend's loadBalancerSourceRanges",
                src.ip()
            ));
            return w.end("drop", Some(DropReason::SourceRangeDenied));
        }
        w.step(format!(
            "source ranges: {} is in the frontend's loadBalancerSourceRanges",
            src.ip()
        ));
    }
    if args.from == From::Host {
        return host(c, &svc, dst, dport_be, proto, w);
    }
    if args.from == From::Pod {
        w.step(
            "source check: the datapath checks once per flow and interface that the source \
             is the pod's own address on the interface it came in on; explain does not know \
             the interface and assumes it passes",
        );
    }

    // Stage 3: the flow table.
    let fkey = FlowKeyOf {
        src_addr: src,
        dst_addr: dst,
        src_port_be: sport_be,
        dst_port_be: dport_be,
        proto,
        dir: FLOW_DIR_FORWARD,
        _pad: [0; 2],
    };
    if let Some(f) = A::flow(c, &fkey) {
        let row = A::flow_row(c, &fkey, &f);
        let live = f.adopted == FLOW_ADOPTED_CONNTRACK
            || (f.svc_id == svc.svc_id && c.is_member(svc.svc_id, f.backend_id).is_some());
        let rkey = fkey.partner(&f);
        let partner = A::flow(c, &rkey);
        let ours = partner.is_some_and(|r| fkey.pairs(&f, &r));
        w.e.flow = Some(row.clone());
        if live && (ours || partner.is_none()) {
            w.step(format!(
                "flow: live, {} ({}), to backend {} (id {}), {}",
                row.state,
                if ours {
                    "both halves"
                } else {
                    "reply half missing, the next packet recreates it"
                },
                row.backend,
                f.backend_id,
                if f.adopted == FLOW_ADOPTED_CONNTRACK {
                    "adopted from conntrack, whose entry translates it"
                } else {
                    "its backend still a member of the service"
                }
            ));
            if proto == IPPROTO_TCP && f.state == FLOW_STATE_SYN_SENT {
                w.step(
                    "flow: still SYN_SENT; a retransmitted SYN would start a new flow (the \
                     backend never answered)",
                );
            }
            w.e.backend = Some(at(f.nat_addr, f.nat_port_be));
            w.e.chosen_by = Some("flow".to_string());
            mark_selected(&mut w.e.endpoints, f.backend_id);
            return w.end("forward", None);
        }
        if !live {
            w.step(format!(
                "flow: stale, its backend {} (id {}) is no longer a member of the service",
                row.backend, f.backend_id
            ));
            if proto == IPPROTO_TCP {
                w.step(
                    "flow: a TCP segment other than a SYN is answered with a RST and the flow \
                     forgotten; a SYN starts a new flow",
                );
                return w.end("reject", Some(DropReason::BackendGoneReset));
            }
            w.step("flow: the datagram starts a new flow");
        } else {
            w.step(
                "flow: its reply tuple now belongs to another flow; the packet starts a new one",
            );
        }
    } else {
        w.step("flow: none on this 5-tuple; the packet starts a new flow");
    }
    if c.config.flags & CONFIG_F_NEW_TO_CONNTRACK != 0 {
        w.step("hand-back: new flows are left to conntrack (kube-proxy's rules), untranslated");
        return w.end("pass", None);
    }

    // Stage 2: select (affinity first).
    let chosen = match choose::<A>(c, &svc, src, dst, sport_be, dport_be, proto, &mut w) {
        Ok(c) => c,
        Err(r) => return w.refuse(r),
    };
    let (backend_id, backend, by) = chosen;
    w.e.backend = Some(at(backend.addr, backend.port_be));
    w.e.chosen_by = Some(by.to_string());
    mark_selected(&mut w.e.endpoints, backend_id);

    // The source the backend sees.
    let source = match args.from {
        From::Pod if backend.addr == src => {
            w.step("source: the client is its own backend: hairpin, source-NATed to the link-local hairpin address");
            "hairpin"
        }
        From::Pod => {
            w.step("source: the backend sees the pod's own address");
            "client"
        }
        From::Node => north_source::<A>(c, backend.addr, proto, &mut w),
        From::Host => unreachable!("the socket path returned above"),
    };
    w.e.source = Some(source.to_string());
    w.end("forward", None)
}

/// Stage 1: the frontend entry the packet is addressed to, as the hook's lookup finds it.
fn frontend<A: Fam>(
    c: &Ctx,
    from: From,
    dst: A,
    dport_be: u16,
    proto: u8,
    w: &mut Walk,
) -> Option<(ServiceKeyOf<A>, ServiceValue)> {
    let key = ServiceKeyOf {
        addr: dst,
        port_be: dport_be,
        proto,
        scope: SCOPE_DEFAULT,
    };
    let (key, svc) = match A::service(c, &key) {
        Some(svc) => (key, svc),
        None => {
            let flags = A::node_addr(c, dst).unwrap_or(0);
            if flags & NODE_ADDR_F_NODEPORT == 0 {
                w.step(format!(
                    "frontend: none at {}, and {} is not a NodePort address of this node",
                    at(dst, dport_be),
                    dst.ip()
                ));
                return None;
            }
            let key = ServiceKeyOf {
                addr: A::ZERO,
                ..key
            };
            let Some(svc) = A::service(c, &key) else {
                w.step(format!(
                    "frontend: none at {}, nor a NodePort on port {}",
                    at(dst, dport_be),
                    u16::from_be(dport_be)
                ));
                return None;
            };
            (key, svc)
        }
    };
    if from == From::Node && svc.kind == SVC_KIND_CLUSTER_IP {
        w.step(format!(
            "frontend: {} is a ClusterIP, served to pods and node processes only, not from \
             outside the node",
            at(dst, dport_be)
        ));
        return None;
    }
    // A split frontend's pods' (and node processes') entry.
    if from != From::Node && svc.flags & SVC_F_SPLIT_SCOPE != 0 {
        let ikey = ServiceKeyOf {
            scope: SCOPE_INTERNAL,
            ..key
        };
        if let Some(isvc) = A::service(c, &ikey) {
            return Some((ikey, isvc));
        }
    }
    Some((key, svc))
}

/// A packet to no frontend: inside a ServiceCIDR, rejected or dropped (pods and node
/// processes); otherwise not lbproxy's, it passes.
fn no_frontend<A: Fam>(c: &Ctx, from: From, dst: A, proto: u8, mut w: Walk) -> Explanation {
    if from != From::Node && c.config.flags & CONFIG_F_SERVICE_CIDRS != 0 {
        let kind = service_cidr(c, dst.ip());
        if let Some(r) = select::cidr_refusal(kind, proto) {
            w.step(format!(
                "service CIDR: {} is {}",
                dst.ip(),
                if kind == lbproxy_common::CIDR_ALLOCATED {
                    "an allocated ClusterIP, but no Service port is defined on this port"
                } else {
                    "inside a ServiceCIDR but not an allocated ClusterIP"
                }
            ));
            return w.refuse(r);
        }
    }
    w.step("not a frontend: the packet passes untouched");
    w.end("pass", None)
}

/// The longest ServiceCIDR entry holding `ip`: `CIDR_*`, or 0.
fn service_cidr(c: &Ctx, ip: IpAddr) -> u32 {
    c.maps
        .service_cidrs
        .read()
        .into_iter()
        .filter(|(net, _)| net.contains(&ip))
        .max_by_key(|(net, _)| net.prefix_len())
        .map_or(0, |(_, v)| v)
}

/// Stage 2 for a new flow: the client's remembered backend (session affinity), else the
/// selection. Returns the backend id, the backend and what chose it.
#[expect(clippy::too_many_arguments, reason = "the 5-tuple, as the datapath's")]
fn choose<A: Fam>(
    c: &Ctx,
    svc: &ServiceValue,
    src: A,
    dst: A,
    sport_be: u16,
    dport_be: u16,
    proto: u8,
    w: &mut Walk,
) -> Result<(u32, BackendOf<A>, &'static str), Refusal> {
    if svc.affinity_timeout_s != 0
        && let Some(kept) = affinity_kept::<A>(c, svc, src, w)
    {
        return Ok(kept);
    }
    if let Some(r) = select::no_endpoint(svc, proto) {
        w.step(match r {
            Refusal::Drop(_) => {
                "select: externalTrafficPolicy Local and no endpoint on this node: dropped, as kube-proxy drops it"
            }
            Refusal::Reject(_) => "select: no usable endpoint: answered at once",
        });
        return Err(r);
    }
    let hash = select::flow_hash(c.config.hash_seed(), src, dst, sport_be, dport_be, proto);
    let id = select::backend_id(c, svc, hash);
    let by = if svc.flags & SVC_F_MAGLEV != 0 && c.maglev_backend(svc.svc_id, hash) != 0 {
        w.step(format!(
            "select: Maglev entry {} of {} (the node's seeded 5-tuple hash)",
            hash % u64::from(c.maglev_m.max(1)),
            c.maglev_m
        ));
        "maglev"
    } else {
        w.step(format!(
            "select: slot {} of {} by jump hash (the node's seeded 5-tuple hash)",
            select::slot_of(hash, svc.count),
            svc.count
        ));
        "slot"
    };
    if id == 0 {
        return Err(Refusal::Drop(DropReason::SlotMissing));
    }
    let Some(b) = A::backend(c, id) else {
        return Err(Refusal::Drop(DropReason::BackendMissing));
    };
    w.step(format!(
        "select: backend {} (id {id})",
        at(b.addr, b.port_be)
    ));
    Ok((id, b, by))
}

/// The client's remembered backend for `svc`, if it is still within the timeout and
/// serving (`lb::affinity::kept`).
fn affinity_kept<A: Fam>(
    c: &Ctx,
    svc: &ServiceValue,
    client: A,
    w: &mut Walk,
) -> Option<(u32, BackendOf<A>, &'static str)> {
    let key = AffinityKeyOf {
        svc_id: svc.svc_id,
        client_addr: client,
    };
    let Some(entry) = A::affinity(c, &key) else {
        w.step(format!(
            "affinity: ClientIP ({} s), no choice remembered for {}",
            svc.affinity_timeout_s,
            client.ip()
        ));
        return None;
    };
    let age = crate::bpf::flow_gc::monotonic_ns().saturating_sub(entry.last_ns);
    let serving = c
        .is_member(svc.svc_id, entry.backend_id)
        .is_some_and(|m| m & MEMBER_SERVING != 0);
    if age > u64::from(svc.affinity_timeout_s) * 1_000_000_000 || !serving {
        w.step(format!(
            "affinity: ClientIP ({} s), {}'s remembered backend (id {}) is {}; selecting afresh",
            svc.affinity_timeout_s,
            client.ip(),
            entry.backend_id,
            if serving {
                "expired"
            } else {
                "no longer serving"
            }
        ));
        return None;
    }
    let b = A::backend(c, entry.backend_id)?;
    w.step(format!(
        "affinity: ClientIP ({} s), {} keeps backend {} (id {}), last chosen {:.1} s ago",
        svc.affinity_timeout_s,
        client.ip(),
        at(b.addr, b.port_be),
        entry.backend_id,
        age as f64 / 1e9
    ));
    Some((entry.backend_id, b, "affinity"))
}

/// North-south: the source a backend sees (`north::source_for`): the client's own when the
/// node routes the backend out of a pod interface, else the egress interface's SNAT address,
/// or the client's with direct server return where that is on for the protocol.
fn north_source<A: Fam>(c: &Ctx, backend: A, proto: u8, w: &mut Walk) -> &'static str {
    let oif = match route_oif(backend.ip()) {
        Ok(oif) => oif,
        Err(e) => {
            w.step(format!(
                "source: no route to the backend {}: {e:#}",
                backend.ip()
            ));
            return "unknown";
        }
    };
    if c.maps.pod_ifs.get(&oif, 0).is_ok() {
        w.step(format!(
            "source: the backend is on this node (routed out of pod interface {oif}): it sees \
             the client's own address"
        ));
        return "client";
    }
    let Some(nif) = A::node_if(c, oif) else {
        w.step(format!(
            "source: the backend is routed out of interface {oif}, neither a pod nor a node \
             interface lbproxy knows: dropped (north_south_no_route)"
        ));
        return "unknown";
    };
    let dsr_flag = if proto == IPPROTO_TCP {
        CONFIG_F_DSR_TCP
    } else if proto == IPPROTO_UDP {
        CONFIG_F_DSR_UDP
    } else {
        0
    };
    if dsr_flag != 0 && c.config.flags & dsr_flag != 0 {
        w.step(format!(
            "source: the backend is on another node (out of interface {oif}): direct server \
             return, it sees the client's own address and replies straight to it"
        ));
        return "dsr";
    }
    w.step(format!(
        "source: the backend is on another node (out of interface {oif}): source-NATed to {} \
         ports {}-{}",
        nif.snat_addr.ip(),
        nif.snat_port_min,
        nif.snat_port_max
    ));
    "snat"
}

/// The interface the node's main routing decision sends `ip` out of (`ip route get`), as
/// the datapath's FIB lookup gives it.
fn route_oif(ip: IpAddr) -> anyhow::Result<u32> {
    use futures::TryStreamExt as _;
    use netlink_packet_route::AddressFamily;
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let (family, addr, len) = match ip {
            IpAddr::V4(a) => (AddressFamily::Inet, RouteAddress::Inet(a), 32),
            IpAddr::V6(a) => (AddressFamily::Inet6, RouteAddress::Inet6(a), 128),
        };
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        msg.header.destination_prefix_length = len;
        msg.attributes.push(RouteAttribute::Destination(addr));
        let mut routes = handle.route().get(msg).execute();
        while let Some(r) = routes.try_next().await? {
            if let Some(oif) = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            }) {
                return Ok(oif);
            }
        }
        anyhow::bail!("the kernel gave no route")
    })
}

/// The socket path (`connect4`/`connect6`): the backend is chosen by a hash of the socket's
/// cookie, unknown before the socket exists, unless session affinity keeps one (keyed by
/// the unspecified address: every process of the node is one client).
fn host<A: Fam>(
    c: &Ctx,
    svc: &ServiceValue,
    _dst: A,
    _dport_be: u16,
    _proto: u8,
    mut w: Walk,
) -> Explanation {
    if svc.count == 0 {
        w.step("select: no usable endpoint: connect() fails with ECONNREFUSED");
        return w.end("reject", Some(DropReason::NoBackend));
    }
    if svc.affinity_timeout_s != 0
        && let Some((id, b, by)) = affinity_kept::<A>(c, svc, A::ZERO, &mut w)
    {
        w.e.backend = Some(at(b.addr, b.port_be));
        w.e.chosen_by = Some(by.to_string());
        mark_selected(&mut w.e.endpoints, id);
        w.e.source = Some("client".to_string());
        return w.end("forward", None);
    }
    w.step(
        "select: by a hash of the socket's cookie and the frontend, over the slots: the \
         backend is known only once the socket exists (see inspect sockets)",
    );
    w.e.source = Some("client".to_string());
    w.end("forward", None)
}

/// Every member of service `svc_id`, with its state and slot.
fn endpoints<A: Fam>(c: &Ctx, svc_id: u32) -> Vec<Endpoint> {
    let slots: BTreeMap<u32, u32> = c
        .slots
        .iter()
        .flatten()
        .filter(|(k, _)| k.svc_id == svc_id)
        .map(|(k, id)| (id, k.slot))
        .collect();
    let mut out: Vec<Endpoint> = c
        .maps
        .members
        .iter()
        .flatten()
        .filter(|(k, _)| k.svc_id == svc_id)
        .filter_map(|(k, m)| {
            let b = A::backend(c, k.backend_id)?;
            Some(Endpoint {
                address: at(b.addr, b.port_be),
                backend_id: k.backend_id,
                state: if m & MEMBER_SERVING != 0 {
                    "serving"
                } else {
                    "draining"
                }
                .to_string(),
                slot: slots.get(&k.backend_id).copied(),
                selected: false,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        (a.slot.is_none(), a.slot, &a.address).cmp(&(b.slot.is_none(), b.slot, &b.address))
    });
    out
}

fn mark_selected(eps: &mut [Endpoint], backend_id: u32) {
    for e in eps {
        e.selected = e.backend_id == backend_id;
    }
}

fn kind_name(kind: u8) -> &'static str {
    match kind {
        lbproxy_common::SVC_KIND_CLUSTER_IP => "ClusterIP",
        lbproxy_common::SVC_KIND_NODE_PORT => "NodePort",
        lbproxy_common::SVC_KIND_EXTERNAL_IP => "externalIP",
        lbproxy_common::SVC_KIND_LOAD_BALANCER => "LoadBalancer IP",
        _ => "frontend",
    }
}

/// The answer for people: the steps, then the endpoints.
fn render_text(e: &Explanation) -> String {
    let mut out = String::new();
    for (i, s) in e.steps.iter().enumerate() {
        out.push_str(&format!("{:>2}. {s}\n", i + 1));
    }
    if !e.endpoints.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = e
            .endpoints
            .iter()
            .map(|p| {
                vec![
                    p.address.clone(),
                    p.backend_id.to_string(),
                    p.state.clone(),
                    p.slot.map_or("-".to_string(), |s| s.to_string()),
                    if p.selected { "<-" } else { "" }.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(
            &["ENDPOINT", "BACKEND ID", "STATE", "SLOT", "SELECTED"],
            &rows,
        ));
    }
    out
}
