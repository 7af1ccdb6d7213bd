//! Flow table hygiene, in userspace: expired entries are deleted in batches, by state.
//!
//! Each direction of a flow is its own entry with its own `last_seen_ns`, written by the
//! datapath with `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC_COARSE: the monotonic clock at
//! tick resolution, without the cost of reading the TSC on every packet). The collector
//! compares against CLOCK_MONOTONIC, at most a tick ahead, so a controller restart changes
//! nothing: the first collection after a restart
//! deletes only entries that were already idle past their timeout.
//!
//! Under pressure (the table over 75% full) idle and half-open flows go first: SYN_SENT and
//! closing flows after 1 s, UDP after 5 s, while established TCP keeps its timeout. The kernel's
//! LRU evicts only when the table is completely full; `tcp_midstream_without_flow` in
//! `lbproxy inspect drops` counts live flows that were evicted anyway.

use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::{
    FLOW_STATE_CLOSING, FLOW_STATE_ESTABLISHED, FLOW_STATE_SYN_SENT, FlowKey, FlowValue,
    IPPROTO_TCP, map_names,
};

/// Idle timeouts by state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_established: Duration,
    pub tcp_syn_sent: Duration,
    pub tcp_closing: Duration,
    pub udp: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            // kube-proxy's conntrack.tcpEstablishedTimeout default.
            tcp_established: Duration::from_secs(24 * 3600),
            tcp_syn_sent: Duration::from_secs(30),
            tcp_closing: Duration::from_secs(10),
            udp: Duration::from_secs(30),
        }
    }
}

impl Timeouts {
    /// The timeouts used while the table is over 75% full.
    pub fn under_pressure(self) -> Self {
        Self {
            tcp_established: self.tcp_established,
            tcp_syn_sent: self.tcp_syn_sent.min(Duration::from_secs(1)),
            tcp_closing: self.tcp_closing.min(Duration::from_secs(1)),
            udp: self.udp.min(Duration::from_secs(5)),
        }
    }

    pub fn for_entry(&self, k: &FlowKey, v: &FlowValue) -> Duration {
        if k.proto != IPPROTO_TCP {
            return self.udp;
        }
        match v.state {
            FLOW_STATE_SYN_SENT => self.tcp_syn_sent,
            FLOW_STATE_CLOSING => self.tcp_closing,
            FLOW_STATE_ESTABLISHED => self.tcp_established,
            // Entries written before states were tracked: treat as established.
            _ => self.tcp_established,
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    pub scanned: usize,
    pub deleted: usize,
    pub under_pressure: bool,
    pub took: Duration,
}

/// Decides which entries of a snapshot are expired. Pure, for tests.
pub fn expired(entries: &[(FlowKey, FlowValue)], now_ns: u64, t: &Timeouts) -> Vec<FlowKey> {
    entries
        .iter()
        .filter(|(k, v)| {
            let idle = now_ns.saturating_sub(v.last_seen_ns);
            u128::from(idle) > t.for_entry(k, v).as_nanos()
        })
        .map(|(k, _)| *k)
        .collect()
}

/// One collection over the pinned flow map. Reads in batches of `batch` entries and deletes
/// what expired; the datapath keeps running on the same map throughout.
pub fn collect(dir: &Path, capacity: u32, t: Timeouts, batch: usize) -> anyhow::Result<GcStats> {
    let started = Instant::now();
    let mut flows: BpfHashMap<MapData, FlowKey, FlowValue> =
        crate::bpf::open_pinned(dir, map_names::FLOWS, Map::LruHashMap)?;
    let keys: Vec<FlowKey> = flows.keys().filter_map(Result::ok).collect();
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
    for chunk in keys.chunks(batch.max(1)) {
        let now = monotonic_ns();
        let snapshot: Vec<(FlowKey, FlowValue)> = chunk
            .iter()
            .filter_map(|k| flows.get(k, 0).ok().map(|v| (*k, v)))
            .collect();
        for k in expired(&snapshot, now, &t) {
            if flows.remove(&k).is_ok() {
                stats.deleted += 1;
            }
        }
        // Let the datapath's writers and the controller breathe between batches.
        std::thread::yield_now();
    }
    stats.took = started.elapsed();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbproxy_common::{FLOW_DIR_FORWARD, FLOW_STATE_NONE, IPPROTO_UDP};

    fn entry(proto: u8, state: u8, last_seen_s: u64) -> (FlowKey, FlowValue) {
        (
            FlowKey {
                src_addr: [198, 18, 0, 2],
                dst_addr: [198, 19, 0, 10],
                src_port_be: (last_seen_s as u16).to_be(),
                dst_port_be: 80u16.to_be(),
                proto,
                dir: FLOW_DIR_FORWARD,
                _pad: [0; 2],
            },
            FlowValue {
                nat_addr: [198, 18, 0, 3],
                nat_port_be: 8080u16.to_be(),
                state,
                _pad: 0,
                svc_id: 1,
                backend_id: 1,
                created_ns: 0,
                last_seen_ns: last_seen_s * 1_000_000_000,
            },
        )
    }

    #[test]
    fn timeouts_by_state() {
        let t = Timeouts::default();
        let now = 100_000 * 1_000_000_000;
        let e = [
            entry(IPPROTO_TCP, FLOW_STATE_ESTABLISHED, 100_000 - 3600), // idle 1h: kept
            entry(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 100_000 - 31),      // idle 31s: expired
            entry(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 100_000 - 5),       // kept
            entry(IPPROTO_TCP, FLOW_STATE_CLOSING, 100_000 - 11),       // expired
            entry(IPPROTO_UDP, FLOW_STATE_NONE, 100_000 - 31),          // expired
            entry(IPPROTO_UDP, FLOW_STATE_NONE, 100_000 - 29),          // kept
        ];
        let gone = expired(&e, now, &t);
        let ports: Vec<u16> = gone.iter().map(|k| u16::from_be(k.src_port_be)).collect();
        let p = |s: u64| (100_000 - s) as u16;
        assert_eq!(ports, vec![p(31), p(11), p(31)]);
    }

    #[test]
    fn pressure_takes_idle_and_half_open_before_established() {
        let t = Timeouts::default().under_pressure();
        let now = 100_000 * 1_000_000_000;
        let e = [
            entry(IPPROTO_TCP, FLOW_STATE_ESTABLISHED, 100_000 - 600), // kept
            entry(IPPROTO_TCP, FLOW_STATE_SYN_SENT, 100_000 - 2),      // expired
            entry(IPPROTO_UDP, FLOW_STATE_NONE, 100_000 - 6),          // expired
        ];
        assert_eq!(expired(&e, now, &t).len(), 2);
    }

    #[test]
    fn a_restart_does_not_make_live_flows_look_old() {
        // The collector uses the datapath's clock: an entry touched a second ago is a second
        // old whatever the controller's own uptime.
        let now = monotonic_ns();
        let e = [entry(
            IPPROTO_TCP,
            FLOW_STATE_SYN_SENT,
            now / 1_000_000_000 - 1,
        )];
        assert!(expired(&e, now, &Timeouts::default()).is_empty());
    }
}
