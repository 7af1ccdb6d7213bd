//! The metrics copied from the datapath's per-CPU counter maps (by
//! `crate::bpf::spawn_counters`, every 2 s): drops, the events that are not drops, how
//! translated packets were delivered, what the socket-level programs did, and the tries of
//! SNAT port allocations.

use std::sync::{Arc, Mutex};

use lbproxy_common::DropReason;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: String,
}

/// A Service, all its ports together.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ServiceLabel {
    pub namespace: String,
    pub service: String,
}

/// A Service and a reason (`inspect drops`'s name of it).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceReasonLabel {
    pub namespace: String,
    pub service: String,
    pub reason: String,
}

impl ServiceLabel {
    /// The Service of a frontend's label (`namespace/name` or `namespace/name:port`).
    pub fn of(label: &str) -> ServiceLabel {
        let svc = label.split_once(':').map_or(label, |(s, _)| s);
        let (namespace, service) = svc.split_once('/').unwrap_or(("", svc));
        ServiceLabel {
            namespace: namespace.to_string(),
            service: service.to_string(),
        }
    }
}

/// The version from which the reasons of `lbproxy_datapath_drops_total` that are not drops
/// are deprecated (counted in `lbproxy_datapath_events_total` too); the next release drops
/// them.
const NOT_DROPS_DEPRECATED_SINCE: &str = "0.1.0";

/// The datapath's counter families. Label sets are fixed lists (`DropReason`,
/// `DatapathEvent`, `Delivery`, `SockEvent`).
pub struct Datapath {
    /// `lbproxy_datapath_drops_total{reason}`, from `LB_DROPS_V2`.
    pub drops: Family<ReasonLabel, Counter>,
    /// `lbproxy_datapath_events_total{event}`, from `LB_DPEVENTS_V1`.
    pub events: Family<EventLabel, Counter>,
    /// `lbproxy_datapath_delivered_packets_total{path}`, from `LB_DELIVERY_V1`.
    pub delivered: Family<PathLabel, Counter>,
    /// `lbproxy_socket_lb_events_total{event}`, from `LB_SOCKCNT_V1`.
    pub sock_events: Family<EventLabel, Counter>,
    /// `lbproxy_snat_port_tries`, from `LB_SNATTRIES_V1`.
    pub snat_port_tries: SnatTries,
    /// `lbproxy_service_new_flows_total{namespace,service}`, from `LB_SVCSTATS_V1`.
    pub service_new_flows: Family<ServiceLabel, Counter>,
    /// `lbproxy_service_rejects_total{namespace,service,reason}`, from `LB_SVCSTATS_V1`.
    pub service_rejects: Family<ServiceReasonLabel, Counter>,
    /// `lbproxy_service_drops_total{namespace,service,reason}`, from `LB_SVCSTATS_V1`.
    pub service_drops: Family<ServiceReasonLabel, Counter>,
    /// `lbproxy_service_active_flows{namespace,service}`, from each flow collection
    /// ([`ActiveFlows`]).
    pub service_active_flows: Family<ServiceLabel, prometheus_client::metrics::gauge::Gauge>,
}

impl Datapath {
    /// The families, registered in `r`.
    pub fn register(r: &mut Registry) -> Self {
        let d = Self {
            drops: Family::default(),
            events: Family::default(),
            delivered: Family::default(),
            sock_events: Family::default(),
            snat_port_tries: SnatTries::default(),
            service_new_flows: Family::default(),
            service_rejects: Family::default(),
            service_drops: Family::default(),
            service_active_flows: Family::default(),
        };
        r.register(
            "lbproxy_service_new_flows",
            "New flows created for the Service's frontends, all ports, protocols and paths together (a pod's or an outside client's first packet, a node process's socket connected); off with --per-service-metrics=false",
            d.service_new_flows.clone(),
        );
        r.register(
            "lbproxy_service_rejects",
            "Packets to the Service's frontends answered with a TCP RST or an ICMP error instead of forwarded, by reason (as lbproxy inspect drops names it)",
            d.service_rejects.clone(),
        );
        r.register(
            "lbproxy_service_drops",
            "Packets to the Service's frontends dropped, by reason (e.g. no_local_endpoint, source_range_denied)",
            d.service_drops.clone(),
        );
        r.register(
            "lbproxy_service_active_flows",
            "Flows of the Service in the flow table, counted every 10 s",
            d.service_active_flows.clone(),
        );
        r.register("lbproxy_datapath_drops", drops_help(), d.drops.clone());
        r.register(
            "lbproxy_datapath_events",
            "What the datapath did that is worth counting and is not a drop, by event: a TCP segment without a flow sent to a newly selected backend, a flow half recreated, a source port rewritten for a tuple clash, a stale reply half removed, a later fragment without its first or a bad TCP/UDP header passed untouched",
            d.events.clone(),
        );
        r.register(
            "lbproxy_datapath_delivered_packets",
            "Translated packets by how they left the datapath: redirect_* went straight into the destination pod (stack bypass), stack_* through the node's stack, and why",
            d.delivered.clone(),
        );
        r.register(
            "lbproxy_socket_lb_events",
            "What the socket-level programs did (connect/sendmsg translated or refused, recvmsg/getpeername restored, other network namespaces left alone)",
            d.sock_events.clone(),
        );
        r.register(
            "lbproxy_snat_port_tries",
            "Tries each successful SNAT port allocation took (the client's own port, then random, then linear); a shift to the higher buckets means a destination's port space is filling up",
            d.snat_port_tries.clone(),
        );
        d
    }
}

/// `lbproxy_service_active_flows`, set from each flow collection (every 10 s): the flows
/// left in the table by service, summed over each Service's ports. A Service that has no
/// flow any more loses its series.
#[derive(Default)]
pub struct ActiveFlows {
    /// The Services whose gauge is set.
    set: std::collections::BTreeSet<ServiceLabel>,
}

impl ActiveFlows {
    /// Sets the gauges of `d` from `by_id` (flows by service id); `labels` gives each id's
    /// label, read only when there is a flow.
    pub fn set(
        &mut self,
        d: &Datapath,
        by_id: &std::collections::HashMap<u32, u64>,
        labels: &dyn Fn() -> std::collections::BTreeMap<u32, String>,
    ) {
        let names = if by_id.is_empty() {
            Default::default()
        } else {
            labels()
        };
        let mut now: std::collections::BTreeMap<ServiceLabel, i64> = Default::default();
        for (id, n) in by_id {
            if let Some(l) = names.get(id) {
                *now.entry(ServiceLabel::of(l)).or_default() +=
                    i64::try_from(*n).unwrap_or(i64::MAX);
            }
        }
        for gone in self.set.iter().filter(|l| !now.contains_key(*l)) {
            d.service_active_flows.remove(gone);
        }
        for (l, n) in &now {
            d.service_active_flows.get_or_create(l).set(*n);
        }
        self.set = now.into_keys().collect();
    }
}

/// The help of `lbproxy_datapath_drops`, prefixed as kube-proxy prefixes a deprecated
/// metric's ("(Deprecated since X) ..."), for the reasons that are not drops, which it names.
/// (The encoder ends the help with a period.)
fn drops_help() -> String {
    let not_drops: Vec<&str> = DropReason::ALL
        .iter()
        .filter(|r| !r.is_drop())
        .map(|r| r.label())
        .collect();
    format!(
        "(Deprecated since {NOT_DROPS_DEPRECATED_SINCE} for the reasons {}, which are not drops: \
         use lbproxy_datapath_events_total{{event}}; they leave this metric in the next release) \
         Packets the datapath dropped (or answered instead of forwarding), by reason",
        not_drops.join(", ")
    )
}

/// `lbproxy_snat_port_tries`: a histogram of the tries each successful SNAT port allocation
/// took, kept by the datapath (`LB_SNATTRIES_V1`, one count per try number) and copied
/// here whole on every read ([`SnatTries::set`]). Allocations that found no port are not in
/// it: they are `lbproxy_datapath_drops{reason="snat_no_port"}`.
#[derive(Clone, Debug, Default)]
pub struct SnatTries(Arc<Mutex<Vec<u64>>>);

/// The histogram's upper bounds, in tries (1 is the client's own port or the first random
/// one; 17 is the last try there is).
const SNAT_TRIES_BOUNDS: [u32; 6] = [1, 2, 4, 8, 16, lbproxy_common::snat_tries::MAX_SNAT_TRIES];

impl SnatTries {
    /// Replaces the counts with the datapath's: `by_tries[n]` allocations took `n` tries
    /// (index 0, the failures, is left out).
    pub fn set(&self, by_tries: Vec<u64>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = by_tries;
    }

    /// (sum of tries, count, per-bucket counts with +Inf last), as the encoder wants them.
    fn buckets(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let by = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let at = |n: u32| by.get(n as usize).copied().unwrap_or(0);
        let (mut sum, mut count) = (0u64, 0u64);
        let mut buckets = Vec::new();
        let mut lower = 1;
        for upper in SNAT_TRIES_BOUNDS {
            let mut in_bucket = 0;
            for n in lower..=upper {
                in_bucket += at(n);
                sum += u64::from(n) * at(n);
            }
            count += in_bucket;
            buckets.push((f64::from(upper), in_bucket));
            lower = upper + 1;
        }
        buckets.push((f64::INFINITY, 0));
        (sum as f64, count, buckets)
    }
}

impl prometheus_client::encoding::EncodeMetric for SnatTries {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.buckets();
        encoder
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        prometheus_client::metrics::MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use lbproxy_common::DatapathEvent;
    use prometheus_client::encoding::text::encode;

    use super::*;

    /// The SNAT tries histogram, as Prometheus text: each try count in its bucket, buckets
    /// cumulative, the sum in tries, failures (index 0) left out.
    #[test]
    fn snat_tries_histogram_encodes_the_datapath_counts() {
        let t = SnatTries::default();
        let mut by = vec![0u64; 18];
        by[0] = 7; // failures: not observations
        by[1] = 10;
        by[3] = 2; // le 4
        by[9] = 1; // le 16
        by[17] = 1; // le 17
        t.set(by);
        let mut r = Registry::default();
        r.register("snat_port_tries", "h", t);
        let mut out = String::new();
        encode(&mut out, &r).unwrap();
        for line in [
            "snat_port_tries_sum 42.0",
            "snat_port_tries_count 14",
            "snat_port_tries_bucket{le=\"1.0\"} 10",
            "snat_port_tries_bucket{le=\"2.0\"} 10",
            "snat_port_tries_bucket{le=\"4.0\"} 12",
            "snat_port_tries_bucket{le=\"8.0\"} 12",
            "snat_port_tries_bucket{le=\"16.0\"} 13",
            "snat_port_tries_bucket{le=\"17.0\"} 14",
            "snat_port_tries_bucket{le=\"+Inf\"} 14",
        ] {
            assert!(out.lines().any(|l| l == line), "want {line:?} in:\n{out}");
        }
        assert!(out.contains("# TYPE snat_port_tries histogram"), "{out}");
    }

    /// The events are their own metric, under the labels they had as drop reasons, and the
    /// drops' help marks exactly those reasons deprecated.
    #[test]
    fn events_have_their_metric_and_the_drops_help_marks_them_deprecated() {
        let mut r = Registry::default();
        let d = Datapath::register(&mut r);
        for e in DatapathEvent::ALL {
            d.events
                .get_or_create(&EventLabel {
                    event: e.label().to_string(),
                })
                .inc_by(u64::from(e as u32) + 1);
        }
        let mut out = String::new();
        encode(&mut out, &r).unwrap();
        assert!(
            out.contains("# TYPE lbproxy_datapath_events counter"),
            "{out}"
        );
        for (line, want) in [
            ("tcp_midstream_without_flow", 1),
            ("flow_half_recreated", 2),
            ("tuple_clash_port_rewritten", 3),
            ("stale_reply_removed", 4),
            ("fragment_without_first", 5),
            ("l4_header_bad_passed", 6),
        ] {
            let line = format!("lbproxy_datapath_events_total{{event=\"{line}\"}} {want}");
            assert!(out.lines().any(|l| l == line), "want {line:?} in:\n{out}");
        }
        let help = drops_help();
        let prefix = format!("(Deprecated since {NOT_DROPS_DEPRECATED_SINCE} for the reasons ");
        let deprecated = help
            .strip_prefix(&prefix)
            .unwrap()
            .split_once(')')
            .unwrap()
            .0;
        for r in DropReason::ALL {
            assert_eq!(
                deprecated.contains(r.label()),
                r.event().is_some(),
                "{r:?} in {help:?}"
            );
        }
    }
}
