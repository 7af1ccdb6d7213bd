//! `inspect flows`: both families' flow tables, one row per flow.

use crate::model::Protocol;
use std::collections::BTreeMap;
use std::net::SocketAddr;

use aya::maps::{HashMap as BpfHashMap, MapData};
use lbproxy_common::{Addr, FLOW_DIR_FORWARD, FlowKeyOf, FlowValueOf};
use serde::{Deserialize, Serialize};

use super::{Filter, Output, table};
use crate::bpf::PinnedMaps;

#[derive(Clone, Debug, Serialize, Deserialize)]
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
    /// A flow adopted from kube-proxy's conntrack entries whose entry still exists:
    /// `conntrack` (the entry translates it: without `--takeover`, or a flow lbproxy would
    /// not have made that way) or `handover` (during a takeover). Absent for lbproxy's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted: Option<String>,
    /// `dsr` for a flow dispatched with direct server return (`--load-balancer-mode`): on
    /// the node that received it, its packets went to the backend's node keeping the
    /// client's address; on the backend's node, its replies go straight to the client from
    /// the frontend. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<String>,
    pub age_seconds: f64,
    /// Since the later of the two halves was last used.
    pub idle_seconds: f64,
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

pub fn flows(maps: &PinnedMaps) -> Vec<FlowRow> {
    let labels: BTreeMap<u32, String> = maps.labels_by_id();
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
    map.iter()
        .flatten()
        .filter(|(k, _)| k.dir == FLOW_DIR_FORWARD)
        .map(|(k, v)| row(map, &k, &v, labels, now))
        .collect()
}

/// The row of the flow whose forward half is `k` -> `v` in `map` (its partner looked up
/// there), at monotonic time `now`: `inspect flows`'s and `explain`'s.
pub fn row<A: Addr>(
    map: &BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    k: &FlowKeyOf<A>,
    v: &FlowValueOf<A>,
    labels: &BTreeMap<u32, String>,
    now: u64,
) -> FlowRow
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let (k, v) = (*k, *v);
    let secs = |ns: u64| (now.saturating_sub(ns) as f64) / 1e9;
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
        snat: v
            .snat(&k)
            .then(|| SocketAddr::new(v.peer_addr.ip(), u16::from_be(v.peer_port_be)).to_string()),
        reply_half: partner.is_some(),
        adopted: match v.adopted {
            lbproxy_common::FLOW_ADOPTED_CONNTRACK => Some("conntrack".to_string()),
            lbproxy_common::FLOW_ADOPTED_HANDOVER => Some("handover".to_string()),
            _ => None,
        },
        dispatch: (v.dispatch == lbproxy_common::FLOW_DISPATCH_DSR).then(|| "dsr".to_string()),
        age_seconds: secs(v.created_ns),
        idle_seconds: secs(last_seen),
    }
}

/// `inspect flows`.
pub fn render(maps: &PinnedMaps, out: Output, filter: &Filter) -> anyhow::Result<String> {
    let mut rows = flows(maps);
    rows.retain(|r| filter.service_ok(&r.service) && filter.backend_addr_ok(&r.backend));
    Ok(if out.machine() {
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
                    match (&r.adopted, &r.dispatch, r.reply_half) {
                        (Some(a), _, _) => format!("{} ({a})", r.state),
                        (None, Some(d), _) => format!("{} ({d})", r.state),
                        (None, None, true) => r.state.clone(),
                        (None, None, false) => format!("{} (reply half missing)", r.state),
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
    })
}
