//! The metric registry: every family lbproxy exports on `/metrics`, with kube-proxy's names
//! and semantics where kube-proxy has the metric. Label sets are bounded (map names, drop
//! reasons and families are fixed lists).

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::datapath::Datapath;
use super::process::ProcessCollector;
use super::{GIT_COMMIT, unix_now};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: String,
}

impl MapLabel {
    /// The label of the map pinned as `name`: its name without the layout version, so a
    /// layout change does not break dashboards (`LB_SERVICES_V2` is `services`).
    pub fn of(name: &str) -> Self {
        Self {
            map: lbproxy_common::spec_by_name(name)
                .map_or(name, |spec| spec.label)
                .to_string(),
        }
    }
}

/// kube-proxy's `ip_family` label. A dual-stack kube-proxy runs one proxier per family,
/// each with its own sync series; lbproxy's one sync programs both families at once, so
/// each sync is observed in both families' series (the same duration), and the last-sync
/// and last-queued timestamps are set in both. The per-family counts
/// (`no_local_endpoints`) are counted per family.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FamilyLabel {
    pub ip_family: &'static str,
}

pub const IPV4: FamilyLabel = FamilyLabel { ip_family: "IPv4" };
pub const IPV6: FamilyLabel = FamilyLabel { ip_family: "IPv6" };
pub const FAMILIES: [FamilyLabel; 2] = [IPV4, IPV6];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub ip_family: &'static str,
    pub traffic_policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    pub version: &'static str,
    pub commit: &'static str,
}

/// kube-proxy's sync histograms' buckets: 1 ms doubling, 15 of them (to about 16 s).
fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network programming buckets: 0, 0.25 s, 0.5 s, every second to 59 s, every
/// 5 s to 115 s, every 30 s to 5 min.
fn programming_buckets() -> Histogram {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    Histogram::new(b)
}

type Histograms = Family<FamilyLabel, Histogram, fn() -> Histogram>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// A flow the takeover adopted from conntrack: `family` `ipv4`/`ipv6`, `protocol`
/// `tcp`/`udp`/`sctp`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TakeoverLabel {
    pub family: &'static str,
    pub protocol: &'static str,
}

/// Why a conntrack entry of kube-proxy's was left to conntrack.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TakeoverLeftLabel {
    pub reason: &'static str,
}

/// Every metric lbproxy exports. Label sets are bounded: map names and drop reasons are
/// fixed lists.
pub struct Metrics {
    registry: Registry,
    pub sync_duration: Histograms,
    pub sync_full_duration: Histograms,
    pub sync_partial_duration: Histograms,
    pub last_sync_timestamp: Family<FamilyLabel, FloatGauge>,
    pub last_queued_timestamp: Family<FamilyLabel, FloatGauge>,
    pub network_programming_duration: Histograms,
    pub no_local_endpoints: Family<PolicyLabel, Gauge>,
    pub healthz_total: Family<CodeLabel, Counter>,
    pub livez_total: Family<CodeLabel, Counter>,
    pub rest_requests: Family<crate::source::kube_client::RequestLabel, Counter>,
    pub rest_duration:
        Family<crate::source::kube_client::DurationLabel, Histogram, fn() -> Histogram>,
    pub service_changes_pending: Gauge,
    pub service_changes_total: Counter,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes_total: Counter,
    pub sync_failures: Counter,
    pub map_entries: Family<MapLabel, Gauge>,
    pub map_capacity: Family<MapLabel, Gauge>,
    /// The counters copied from the datapath's per-CPU maps.
    pub datapath: Datapath,
    pub attached_interfaces: Gauge,
    pub flow_gc_deleted: Counter,
    pub sock_destroyed: Counter,
    pub snat_ports_max_ratio: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub frontends_not_served: Family<KindLabel, Gauge>,
    pub frontend_conflicts: Gauge,
    pub services_over_limit: Gauge,
    pub services_map_full: Gauge,
    pub takeover_adopted: Family<TakeoverLabel, Counter>,
    pub takeover_left: Family<TakeoverLeftLabel, Counter>,
}

impl Metrics {
    // Over 120 lines: one registration after another, in the order /metrics shows them, kept
    // in one place so that a name can be found and compared with kube-proxy's at a glance.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let sync_duration = Histograms::new_with_constructor(sync_buckets as fn() -> Histogram);
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "How long one sync of the model into the BPF maps took (full and partial)",
            sync_duration.clone(),
        );
        let sync_full_duration =
            Histograms::new_with_constructor(sync_buckets as fn() -> Histogram);
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "How long one full sync took (at start, after a re-list, every syncPeriod's reconcile)",
            sync_full_duration.clone(),
        );
        let sync_partial_duration =
            Histograms::new_with_constructor(sync_buckets as fn() -> Histogram);
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "How long one partial sync (of the services that changed) took",
            sync_partial_duration.clone(),
        );
        let last_sync_timestamp = Family::<FamilyLabel, FloatGauge>::default();
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time the maps were successfully synced (Unix seconds)",
            last_sync_timestamp.clone(),
        );
        let last_queued_timestamp = Family::<FamilyLabel, FloatGauge>::default();
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a change was queued for the maps (Unix seconds)",
            last_queued_timestamp.clone(),
        );
        let network_programming_duration =
            Histograms::new_with_constructor(programming_buckets as fn() -> Histogram);
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "From an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time to the change being in the maps",
            network_programming_duration.clone(),
        );
        let no_local_endpoints = Family::<PolicyLabel, Gauge>::default();
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Service ports with a Local traffic policy and no endpoint on this node, by policy (internal, external), as of the last sync",
            no_local_endpoints.clone(),
        );
        // Present from the start, as kube-proxy's are.
        for family in FAMILIES {
            for policy in ["internal", "external"] {
                no_local_endpoints
                    .get_or_create(&PolicyLabel {
                        ip_family: family.ip_family,
                        traffic_policy: policy,
                    })
                    .set(0);
            }
        }
        let healthz_total = Family::<CodeLabel, Counter>::default();
        r.register(
            "kubeproxy_proxy_healthz",
            "/healthz answers, by HTTP status",
            healthz_total.clone(),
        );
        let livez_total = Family::<CodeLabel, Counter>::default();
        r.register(
            "kubeproxy_proxy_livez",
            "/livez answers, by HTTP status",
            livez_total.clone(),
        );
        let rest_requests = Family::<crate::source::kube_client::RequestLabel, Counter>::default();
        r.register(
            "rest_client_requests",
            "Requests to the API server, by status code (or <error>), method and host",
            rest_requests.clone(),
        );
        let rest_duration = Family::<_, _, fn() -> Histogram>::new_with_constructor(
            crate::source::kube_client::duration_buckets as fn() -> Histogram,
        );
        r.register(
            "rest_client_request_duration_seconds",
            "Time from a request to the API server until its response headers, by verb and URL (namespace and name elided)",
            rest_duration.clone(),
        );
        let build_info = Family::<BuildLabel, Gauge>::default();
        build_info
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION"),
                commit: GIT_COMMIT,
            })
            .set(1);
        r.register(
            "lbproxy_build_info",
            "1, labelled with the version and commit lbproxy was built from",
            build_info,
        );
        r.register_collector(Box::new(ProcessCollector));
        // Every series exists from the start, as kube-proxy's do.
        for h in [
            &sync_duration,
            &sync_full_duration,
            &sync_partial_duration,
            &network_programming_duration,
        ] {
            for f in &FAMILIES {
                drop(h.get_or_create(f));
            }
        }
        for f in &FAMILIES {
            drop(last_sync_timestamp.get_or_create(f));
            drop(last_queued_timestamp.get_or_create(f));
        }
        let service_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Service changes received and not yet synced",
            service_changes_pending.clone(),
        );
        let service_changes_total = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Service changes received",
            service_changes_total.clone(),
        );
        let endpoint_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "EndpointSlice changes received and not yet synced",
            endpoint_changes_pending.clone(),
        );
        let endpoint_changes_total = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "EndpointSlice changes received",
            endpoint_changes_total.clone(),
        );
        let sync_failures = Counter::default();
        r.register(
            "lbproxy_sync_failures",
            "Syncs that could not read the source or write a map",
            sync_failures.clone(),
        );
        let map_entries = Family::<MapLabel, Gauge>::default();
        r.register(
            "lbproxy_map_entries",
            "Entries in each BPF map",
            map_entries.clone(),
        );
        let map_capacity = Family::<MapLabel, Gauge>::default();
        r.register(
            "lbproxy_map_capacity",
            "Capacity (max_entries) of each BPF map",
            map_capacity.clone(),
        );
        let datapath = Datapath::register(&mut r);
        let attached_interfaces = Gauge::default();
        r.register(
            "lbproxy_attached_interfaces",
            "Pod interfaces with the datapath attached",
            attached_interfaces.clone(),
        );
        let sock_destroyed = Counter::default();
        r.register(
            "lbproxy_socket_lb_destroyed_sockets",
            "Node sockets destroyed so their owners reconnect: connected by socket-level load balancing to a backend that then left, or (UDP) connected to a frontend's address before the frontend existed",
            sock_destroyed.clone(),
        );
        let flow_gc_deleted = Counter::default();
        r.register(
            "lbproxy_flow_gc_deleted",
            "Flow entries the collector deleted after their idle timeout",
            flow_gc_deleted.clone(),
        );
        let snat_ports_max_ratio = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        r.register(
            "lbproxy_snat_ports_in_use_max_ratio",
            "The highest fraction of the SNAT port range in use towards one destination (SNAT address, backend, protocol), from the flow collector's last scan; alert at 0.8",
            snat_ports_max_ratio.clone(),
        );
        let frontends_not_served = Family::<KindLabel, Gauge>::default();
        r.register(
            "lbproxy_frontends_not_served",
            "Frontends that Services ask for and lbproxy does not serve yet, by kind (see `lbproxy inspect services`)",
            frontends_not_served.clone(),
        );
        let frontend_conflicts = Gauge::default();
        r.register(
            "lbproxy_frontend_conflicts",
            "Frontends (VIP:port/proto) that more than one Service claims; only the oldest is served",
            frontend_conflicts.clone(),
        );
        let services_over_limit = Gauge::default();
        r.register(
            "lbproxy_services_over_slot_limit",
            "Services not programmed because their frontends x endpoints exceed the per-service slot limit",
            services_over_limit.clone(),
        );
        let services_map_full = Gauge::default();
        r.register(
            "lbproxy_services_map_full",
            "Services with a frontend the last sync could not write because a map is full",
            services_map_full.clone(),
        );
        let takeover_adopted = Family::<TakeoverLabel, Counter>::default();
        r.register(
            "lbproxy_takeover_adopted_flows",
            "Flows adopted from kube-proxy's conntrack entries at start (--takeover)",
            takeover_adopted.clone(),
        );
        let takeover_left = Family::<TakeoverLeftLabel, Counter>::default();
        r.register(
            "lbproxy_takeover_left_flows",
            "kube-proxy's conntrack entries left to conntrack at start, by reason",
            takeover_left.clone(),
        );
        Self {
            takeover_adopted,
            takeover_left,
            services_over_limit,
            services_map_full,
            flow_gc_deleted,
            sock_destroyed,
            snat_ports_max_ratio,
            frontends_not_served,
            frontend_conflicts,
            registry: r,
            sync_duration,
            sync_full_duration,
            sync_partial_duration,
            last_sync_timestamp,
            last_queued_timestamp,
            network_programming_duration,
            no_local_endpoints,
            healthz_total,
            livez_total,
            rest_requests,
            rest_duration,
            service_changes_pending,
            service_changes_total,
            endpoint_changes_pending,
            endpoint_changes_total,
            sync_failures,
            map_entries,
            map_capacity,
            datapath,
            attached_interfaces,
        }
    }
}

impl Metrics {
    /// One sync's duration: in the total, and in the full or the partial histogram.
    /// One sync programs both families: it is observed in each family's series.
    pub fn observe_sync(&self, full: bool, seconds: f64) {
        let which = if full {
            &self.sync_full_duration
        } else {
            &self.sync_partial_duration
        };
        for f in &FAMILIES {
            self.sync_duration.get_or_create(f).observe(seconds);
            which.get_or_create(f).observe(seconds);
        }
    }

    pub fn observe_programming(&self, seconds: f64) {
        for f in &FAMILIES {
            self.network_programming_duration
                .get_or_create(f)
                .observe(seconds);
        }
    }

    /// Service ports of `family` with a Local policy and no local endpoint of that family,
    /// as of the last sync.
    pub fn set_no_local_endpoints(&self, family: &FamilyLabel, internal: usize, external: usize) {
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.no_local_endpoints
                .get_or_create(&PolicyLabel {
                    ip_family: family.ip_family,
                    traffic_policy: policy,
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}

impl Metrics {
    /// The OpenMetrics text of every family, for `/metrics`.
    pub fn encode(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode(out, &self.registry)
    }

    /// A change was queued for the maps now (kube-proxy's last-queued timestamp).
    pub fn queued_now(&self) {
        let now = unix_now();
        for f in &FAMILIES {
            self.last_queued_timestamp.get_or_create(f).set(now);
        }
    }

    /// Everything queued so far is in the maps now (kube-proxy's last-sync timestamp).
    pub fn synced_now(&self) {
        let now = unix_now();
        for f in &FAMILIES {
            self.last_sync_timestamp.get_or_create(f).set(now);
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_kube_proxys() {
        let m = Metrics::new();
        m.endpoint_changes_total.inc();
        let mut body = String::new();
        m.encode(&mut body).unwrap();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_count",
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 1",
            "lbproxy_sync_failures_total",
        ] {
            assert!(body.contains(name), "{name} missing from:\n{body}");
        }
    }
}
