//! Flow table hygiene, in userspace: expired flows are deleted in batches, both halves at
//! once, by the state of both directions.
//!
//! Each half of a flow (`lbproxy_common::flows`) is its own entry with its own
//! `last_seen_ns`, written by the datapath with `bpf_ktime_get_coarse_ns`
//! (CLOCK_MONOTONIC_COARSE: the monotonic clock at tick resolution, without the cost of
//! reading the TSC on every packet). A flow is idle since the later of its halves' times, and
//! its timeout follows both halves' state:
//! - a RST either way, or a FIN both ways: closed (`tcp_closing`, 10 s);
//! - one FIN: half-closed, the other side may still send for as long as it likes
//!   (`tcp_half_closed`, kube-proxy's `conntrack.tcpCloseWaitTimeout`, 1 h; kubernetes#32551);
//! - otherwise by state: SYN_SENT, established, UDP, or SCTP (no state is kept of an SCTP
//!   association: its heartbeats keep an idle one's flow alive, docs/sctp.md).
//!
//! The collector compares against CLOCK_MONOTONIC, at most a tick ahead, so a controller
//! restart changes nothing: the first collection after a restart deletes only flows that
//! were already idle past their timeout.
//!
//! Under pressure (the table over 75% full) idle and half-open flows go first: SYN_SENT and
//! closed flows after 1 s, UDP after 5 s, while established and half-closed TCP keep their
//! timeouts. The kernel's LRU evicts only when the table is completely full;
//! `tcp_midstream_without_flow` and `flow_half_recreated` in `lbproxy inspect events` count
//! live flows it evicted anyway.

use std::path::Path;
use std::time::{Duration, Instant};

use super::flow_top::{FlowTally, SnatDest, TableFill};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::{
    Addr, FLOW_DIR_FORWARD, FLOW_F_FIN, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf, HAIRPIN_ADDR,
    IPPROTO_SCTP, IPPROTO_TCP, map_names,
};

/// Idle timeouts by state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_established: Duration,
    pub tcp_syn_sent: Duration,
    /// One FIN seen: the other direction may still be sending.
    pub tcp_half_closed: Duration,
    /// A RST, or FINs both ways.
    pub tcp_closing: Duration,
    pub udp: Duration,
    /// Any SCTP flow: the kernel conntrack's `sctp_timeout_established` default (210 s,
    /// what its documentation derives from the heartbeat interval, the path retransmissions
    /// and `rto_max`), which kube-proxy leaves to the kernel. Not shortened under pressure.
    pub sctp: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            // kube-proxy's conntrack.tcpEstablishedTimeout default.
            tcp_established: Duration::from_secs(24 * 3600),
            tcp_syn_sent: Duration::from_secs(30),
            // kube-proxy's conntrack.tcpCloseWaitTimeout default.
            tcp_half_closed: Duration::from_secs(3600),
            tcp_closing: Duration::from_secs(10),
            udp: Duration::from_secs(30),
            sctp: Duration::from_secs(210),
        }
    }
}

impl Timeouts {
    /// The timeouts used while the table is over 75% full.
    pub fn under_pressure(self) -> Self {
        Self {
            tcp_syn_sent: self.tcp_syn_sent.min(Duration::from_secs(1)),
            tcp_closing: self.tcp_closing.min(Duration::from_secs(1)),
            udp: self.udp.min(Duration::from_secs(5)),
            ..self
        }
    }

    /// The timeout of the flow whose halves are `half` (keyed `k`) and `partner` (`None`
    /// when it is missing).
    pub fn for_flow<A: Addr>(
        &self,
        k: &FlowKeyOf<A>,
        half: &FlowValueOf<A>,
        partner: Option<&FlowValueOf<A>>,
    ) -> Duration {
        if k.proto == IPPROTO_SCTP {
            return self.sctp;
        }
        if k.proto != IPPROTO_TCP {
            return self.udp;
        }
        let partner_flags = partner.map_or(0, |p| p.flags);
        if half.closed_with(partner_flags) {
            return self.tcp_closing;
        }
        if (half.flags | partner_flags) & FLOW_F_FIN != 0 {
            return self.tcp_half_closed;
        }
        // SYN_SENT until the backend answers; the datapath moves both halves on together.
        let syn_sent = half.state == FLOW_STATE_SYN_SENT
            && partner.is_none_or(|p| p.state == FLOW_STATE_SYN_SENT);
        if syn_sent {
            self.tcp_syn_sent
        } else {
            self.tcp_established
        }
    }
}

pub fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes into the zeroed struct.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// What one collection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    pub scanned: usize,
    pub deleted: usize,
    pub under_pressure: bool,
    pub took: Duration,
    /// The most SNAT ports in use towards one destination (SNAT address, backend address
    /// and port, protocol), counted from the reply halves of source-NATed flows.
    pub snat_ports_max: usize,
    /// The flows scanned (forward halves, before any was removed) by service and client,
    /// for the report of a filling table ([`super::flow_top`]).
    pub tally: FlowTally,
    /// The destination with [`GcStats::snat_ports_max`] ports in use, and its flows by
    /// service and client (from the reply halves, which keep the client's own address).
    pub snat_busiest: Option<SnatDest>,
    /// The flows left after the collection (forward halves), by service id: each Service's
    /// active flows (`lbproxy_service_active_flows`).
    pub live_by_service: std::collections::HashMap<u32, u64>,
}

impl GcStats {
    /// The fill of the `family` table of `capacity` entries this collection scanned.
    pub fn fill<'a>(&'a self, family: &'a str, capacity: u32) -> TableFill<'a> {
        TableFill {
            family,
            entries: self.scanned,
            capacity,
            deleted: self.deleted,
            tally: &self.tally,
            snat: self.snat_busiest.as_ref(),
        }
    }
}

/// One flow in a snapshot: a half (the forward one when both exist) and its partner.
#[derive(Clone, Copy, Debug)]
pub struct Flow<A: Addr = [u8; 4]> {
    pub key: FlowKeyOf<A>,
    pub value: FlowValueOf<A>,
    pub partner: Option<(FlowKeyOf<A>, FlowValueOf<A>)>,
}

/// Decides which flows of a snapshot are expired, and returns the keys to delete: both
/// halves of each. Pure, for tests.
pub fn expired<A: Addr>(flows: &[Flow<A>], now_ns: u64, t: &Timeouts) -> Vec<FlowKeyOf<A>> {
    let mut gone = Vec::new();
    for f in flows {
        let partner = f.partner.as_ref().map(|(_, v)| v);
        let last_seen = partner.map_or(f.value.last_seen_ns, |p| {
            p.last_seen_ns.max(f.value.last_seen_ns)
        });
        let idle = now_ns.saturating_sub(last_seen);
        if u128::from(idle) > t.for_flow(&f.key, &f.value, partner).as_nanos() {
            gone.push(f.key);
            gone.extend(f.partner.map(|(k, _)| k));
        }
    }
    gone
}

/// The flow `k` -> `v` is part of, as judged once: a reply half whose forward partner exists
/// is left to that partner (`None`). A partner that names another flow is not this one's.
fn flow_of<A: Addr>(
    flows: &BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    k: FlowKeyOf<A>,
    v: FlowValueOf<A>,
) -> Option<Flow<A>>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let pk = k.partner(&v);
    let partner = flows
        .get(&pk, 0)
        .ok()
        .filter(|pv| pk.partner(pv) == k)
        .map(|pv| (pk, pv));
    if k.dir != FLOW_DIR_FORWARD && partner.is_some() {
        return None;
    }
    Some(Flow {
        key: k,
        value: v,
        partner,
    })
}

/// One collection over the pinned IPv4 flow map: [`collect_family`] of `LB_FLOWS_V3`.
pub fn collect(dir: &Path, capacity: u32, t: Timeouts, batch: usize) -> anyhow::Result<GcStats> {
    collect_family::<[u8; 4]>(dir, map_names::FLOWS, capacity, t, batch)
}

/// One collection over the pinned flow map `name` of one family (`LB_FLOWS_V3`,
/// `LB_FLOWS6_V1`). Reads in batches of `batch` entries and deletes the flows that expired,
/// both halves together; the datapath keeps running on the same map throughout.
pub fn collect_family<A: Addr>(
    dir: &Path,
    name: &'static str,
    capacity: u32,
    t: Timeouts,
    batch: usize,
) -> anyhow::Result<GcStats>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let started = Instant::now();
    let mut flows: BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>> =
        crate::bpf::open_pinned(dir, name, Map::LruHashMap)?;
    let keys: Vec<FlowKeyOf<A>> = flows.keys().filter_map(Result::ok).collect();
    // 75%, not nearer full: the kernel's LRU keeps per-CPU free lists and starts evicting
    // before every entry is in use, so a "full" table can count well under its capacity.
    let under_pressure = keys.len() as u64 * 4 > u64::from(capacity) * 3;
    let t = if under_pressure {
        t.under_pressure()
    } else {
        t
    };
    let mut stats = GcStats {
        scanned: keys.len(),
        under_pressure,
        ..Default::default()
    };
    let mut snat_in_use: std::collections::HashMap<(A, A, u16, u8), (usize, FlowTally)> =
        std::collections::HashMap::new();
    for chunk in keys.chunks(batch.max(1)) {
        let now = monotonic_ns();
        let snapshot: Vec<Flow<A>> = chunk
            .iter()
            .filter_map(|k| {
                let v = flows.get(k, 0).ok()?;
                // Each flow once, by its forward half: the client's own address is its source.
                if k.dir == FLOW_DIR_FORWARD {
                    stats.tally.add(v.svc_id, k.src_addr.ip());
                }
                // The node's SNAT port use; hairpin flows have a port space of their own.
                if k.dir != FLOW_DIR_FORWARD && v.snat(k) && !is_hairpin(&k.dst_addr) {
                    let (ports, tally) = snat_in_use
                        .entry((k.dst_addr, k.src_addr, k.src_port_be, k.proto))
                        .or_default();
                    *ports += 1;
                    tally.add(v.svc_id, v.peer_addr.ip());
                }
                flow_of(&flows, *k, v)
            })
            .collect();
        let gone = expired(&snapshot, now, &t);
        let removed: std::collections::HashSet<&FlowKeyOf<A>> = gone.iter().collect();
        for f in &snapshot {
            if f.key.dir == FLOW_DIR_FORWARD && !removed.contains(&f.key) {
                *stats.live_by_service.entry(f.value.svc_id).or_default() += 1;
            }
        }
        for k in &gone {
            if flows.remove(k).is_ok() {
                stats.deleted += 1;
            }
        }
        // Let the datapath's writers and the controller breathe between batches.
        std::thread::yield_now();
    }
    if let Some(((snat, backend, port_be, proto), (ports, tally))) =
        snat_in_use.into_iter().max_by_key(|(_, (ports, _))| *ports)
    {
        stats.snat_ports_max = ports;
        stats.snat_busiest = Some(SnatDest {
            snat: snat.ip(),
            backend: std::net::SocketAddr::new(backend.ip(), u16::from_be(port_be)),
            proto,
            ports,
            tally,
        });
    }
    stats.took = started.elapsed();
    Ok(stats)
}

/// Whether `addr` is the hairpin address (an IPv4 one: IPv6 has no hairpin flows yet).
fn is_hairpin<A: Addr>(addr: &A) -> bool {
    addr.ip() == std::net::IpAddr::from(HAIRPIN_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbproxy_common::{
        FLOW_DIR_REPLY, FLOW_F_RST, FLOW_STATE_ESTABLISHED, FLOW_STATE_NONE, FlowKey, FlowValue,
        IPPROTO_UDP,
    };

    const S: u64 = 1_000_000_000;
    const NOW: u64 = 100_000 * S;

    /// Both halves of a flow from client port `port`, last seen `idle_s` seconds ago (the
    /// reply half `reply_idle_s` ago), with `fwd_flags`/`reply_flags`.
    fn flow(
        proto: u8,
        state: u8,
        port: u16,
        idle_s: u64,
        reply_idle_s: u64,
        flags: (u8, u8),
    ) -> Flow {
        let key = FlowKey {
            src_addr: [198, 18, 0, 2],
            dst_addr: [198, 19, 0, 10],
            src_port_be: port.to_be(),
            dst_port_be: 80u16.to_be(),
            proto,
            dir: FLOW_DIR_FORWARD,
            _pad: [0; 2],
        };
        let value = FlowValue {
            nat_addr: [198, 18, 0, 3],
            nat_port_be: 8080u16.to_be(),
            peer_port_be: port.to_be(),
            state,
            flags: flags.0,
            _pad: [0; 2],
            svc_id: 1,
            backend_id: 1,
            ifindex: 0,
            _pad_a: [],
            created_ns: 0,
            last_seen_ns: NOW - idle_s * S,
            peer_addr: [198, 18, 0, 2],
            adopted: 0,
            dispatch: 0,
            _reserved: [0; 2],
            _pad_b: [],
        };
        let pk = key.partner(&value);
        let pv = FlowValue {
            nat_addr: key.dst_addr,
            nat_port_be: key.dst_port_be,
            flags: flags.1,
            last_seen_ns: NOW - reply_idle_s * S,
            ..value
        };
        assert_eq!(pk.dir, FLOW_DIR_REPLY);
        assert_eq!(pk.partner(&pv), key, "the halves name each other");
        Flow {
            key,
            value,
            partner: Some((pk, pv)),
        }
    }

    fn ports(gone: &[FlowKey]) -> Vec<u16> {
        gone.iter()
            .filter(|k| k.dir == FLOW_DIR_FORWARD)
            .map(|k| u16::from_be(k.src_port_be))
            .collect()
    }

    #[test]
    fn timeouts_by_state() {
        let t = Timeouts::default();
        let e = [
            flow(IPPROTO_TCP, FLOW_STATE_ESTABLISHED, 1, 3600, 3600, (0, 0)), // idle 1h: kept
            flow(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 2, 31, 31, (0, 0)),        // expired
            flow(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 3, 5, 5, (0, 0)),          // kept
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                4,
                11,
                11,
                (FLOW_F_FIN, FLOW_F_FIN),
            ), // closed: expired
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                5,
                11,
                11,
                (0, FLOW_F_RST),
            ), // reset: expired
            flow(IPPROTO_UDP, FLOW_STATE_NONE, 6, 31, 31, (0, 0)),            // expired
            flow(IPPROTO_UDP, FLOW_STATE_NONE, 7, 29, 29, (0, 0)),            // kept
            flow(IPPROTO_SCTP, FLOW_STATE_NONE, 8, 200, 200, (0, 0)),         // kept
            flow(IPPROTO_SCTP, FLOW_STATE_NONE, 9, 211, 211, (0, 0)),         // expired
        ];
        let gone = expired(&e, NOW, &t);
        assert_eq!(ports(&gone), vec![2, 4, 5, 6, 9]);
        assert_eq!(gone.len(), 10, "both halves of each expired flow go");
        // An SCTP association's heartbeats (every 30 s) keep its flow under pressure too.
        let p = Timeouts::default().under_pressure();
        assert_eq!(ports(&expired(&e[7..], NOW, &p)), vec![9]);
    }

    #[test]
    fn a_half_close_is_not_the_end_of_the_flow() {
        // kubernetes#32551: the client sent its FIN and waits for the rest of the answer.
        let t = Timeouts::default();
        let e = [
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                1,
                600,
                600,
                (FLOW_F_FIN, 0),
            ), // kept
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                2,
                600,
                600,
                (0, FLOW_F_FIN),
            ), // kept
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                3,
                3601,
                3601,
                (FLOW_F_FIN, 0),
            ), // expired
        ];
        assert_eq!(ports(&expired(&e, NOW, &t)), vec![3]);
    }

    #[test]
    fn a_flow_is_idle_since_its_later_half() {
        // A one-way UDP stream refreshes only its forward half; a download only its reply.
        let t = Timeouts::default();
        let e = [
            flow(IPPROTO_UDP, FLOW_STATE_NONE, 1, 1, 100, (0, 0)),
            flow(IPPROTO_UDP, FLOW_STATE_NONE, 2, 100, 1, (0, 0)),
        ];
        assert!(expired(&e, NOW, &t).is_empty());
    }

    #[test]
    fn an_orphan_half_is_judged_alone() {
        let t = Timeouts::default();
        let mut f = flow(IPPROTO_UDP, FLOW_STATE_NONE, 1, 31, 31, (0, 0));
        f.partner = None;
        assert_eq!(expired(&[f], NOW, &t), vec![f.key]);
    }

    #[test]
    fn pressure_takes_idle_and_half_open_before_established() {
        let t = Timeouts::default().under_pressure();
        let e = [
            flow(IPPROTO_TCP, FLOW_STATE_ESTABLISHED, 1, 600, 600, (0, 0)), // kept
            flow(
                IPPROTO_TCP,
                FLOW_STATE_ESTABLISHED,
                2,
                600,
                600,
                (FLOW_F_FIN, 0),
            ), // kept
            flow(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 3, 2, 2, (0, 0)),        // expired
            flow(IPPROTO_UDP, FLOW_STATE_NONE, 4, 6, 6, (0, 0)),            // expired
        ];
        assert_eq!(ports(&expired(&e, NOW, &t)), vec![3, 4]);
    }

    #[test]
    fn a_restart_does_not_make_live_flows_look_old() {
        // The collector uses the datapath's clock: an entry touched a second ago is a second
        // old whatever the controller's own uptime.
        let now = monotonic_ns();
        let mut f = flow(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 1, 0, 0, (0, 0));
        f.value.last_seen_ns = now - S;
        f.partner = None;
        assert!(expired(&[f], now, &Timeouts::default()).is_empty());
    }
}
