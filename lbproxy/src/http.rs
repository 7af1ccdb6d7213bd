//! Health and metrics endpoints, with kube-proxy's names and semantics.
//!
//! - `--healthz-bind-address`: `GET /healthz` and `/livez`. Both are 503 until the first full
//!   sync is in the maps.
//!   - `/healthz` (readiness, and what load balancers probe) then follows kube-proxy's rule:
//!     503 when a queued change has waited longer than twice the sync period without being
//!     written, or when this node is not eligible for traffic: its Node object is being
//!     deleted (or is gone), or carries the cluster autoscaler's
//!     `ToBeDeletedByClusterAutoscaler` taint. The JSON body has kube-proxy's keys
//!     (`lastUpdated`, `currentTime`, `nodeEligible`), then lbproxy's own.
//!   - `/livez` (liveness) ignores node eligibility, and only asks whether the controller's
//!     loop is still turning: a change that cannot be written (a full map, say) makes
//!     `/healthz` 503 but must not make the kubelet restart lbproxy on every node (kube-proxy's
//!     `/livez` fails for an overdue sync too).
//!   - Every answer is counted in `kubeproxy_proxy_healthz_total{code}` and
//!     `kubeproxy_proxy_livez_total{code}`.
//! - `--metrics-bind-address`: `GET /metrics` (OpenMetrics), `/proxyMode` (`ebpf`) and
//!   `/configz` (the running configuration as JSON, keyed by API group).

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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

/// The commit lbproxy was built from, or `unknown` (set by the build script).
pub const GIT_COMMIT: &str = env!("LBPROXY_GIT_COMMIT");

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

type FloatGauge = Gauge<f64, AtomicU64>;

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
    pub datapath_drops: Family<ReasonLabel, Counter>,
    pub datapath_delivered: Family<PathLabel, Counter>,
    pub attached_interfaces: Gauge,
    pub flow_gc_deleted: Counter,
    pub sock_destroyed: Counter,
    pub sock_events: Family<EventLabel, Counter>,
    pub snat_ports_max_ratio: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub snat_port_tries: SnatTries,
    pub frontends_not_served: Family<KindLabel, Gauge>,
    pub frontend_conflicts: Gauge,
    pub services_over_limit: Gauge,
    pub services_map_full: Gauge,
}

impl Metrics {
    fn new() -> Self {
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
        let datapath_drops = Family::<ReasonLabel, Counter>::default();
        r.register(
            "lbproxy_datapath_drops",
            "Packets the datapath dropped, by reason",
            datapath_drops.clone(),
        );
        let datapath_delivered = Family::<PathLabel, Counter>::default();
        r.register(
            "lbproxy_datapath_delivered_packets",
            "Translated packets by how they left the datapath: redirect_* went straight into the destination pod (stack bypass), stack_* through the node's stack, and why",
            datapath_delivered.clone(),
        );
        let attached_interfaces = Gauge::default();
        r.register(
            "lbproxy_attached_interfaces",
            "Pod interfaces with the datapath attached",
            attached_interfaces.clone(),
        );
        let sock_destroyed = Counter::default();
        r.register(
            "lbproxy_socket_lb_destroyed_sockets",
            "Node sockets that socket-level load balancing connected to a backend that then left, destroyed so their owners reconnect",
            sock_destroyed.clone(),
        );
        let sock_events = Family::<EventLabel, Counter>::default();
        r.register(
            "lbproxy_socket_lb_events",
            "What the socket-level programs did (connect/sendmsg translated or refused, recvmsg/getpeername restored, other network namespaces left alone)",
            sock_events.clone(),
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
        let snat_port_tries = SnatTries::default();
        r.register(
            "lbproxy_snat_port_tries",
            "Tries each successful SNAT port allocation took (the client's own port, then random, then linear); a shift to the higher buckets means a destination's port space is filling up",
            snat_port_tries.clone(),
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
        Self {
            services_over_limit,
            services_map_full,
            flow_gc_deleted,
            sock_destroyed,
            sock_events,
            snat_ports_max_ratio,
            snat_port_tries,
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
            datapath_drops,
            datapath_delivered,
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

/// The process metrics every Prometheus client exports (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, ...), read from procfs at each scrape.
#[derive(Debug)]
struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::registry::Unit;
        let Ok(me) = procfs::process::Process::myself() else {
            return Ok(());
        };
        let tps = procfs::ticks_per_second() as f64;
        let page = procfs::page_size() as f64;
        if let Ok(stat) = me.stat() {
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / tps);
            cpu.encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent in seconds",
                Some(&Unit::Seconds),
                cpu.metric_type(),
            )?)?;
            let rss = ConstGauge::new(stat.rss as f64 * page);
            rss.encode(encoder.encode_descriptor(
                "process_resident_memory",
                "Resident memory size in bytes",
                Some(&Unit::Bytes),
                rss.metric_type(),
            )?)?;
            let vsz = ConstGauge::new(stat.vsize as f64);
            vsz.encode(encoder.encode_descriptor(
                "process_virtual_memory",
                "Virtual memory size in bytes",
                Some(&Unit::Bytes),
                vsz.metric_type(),
            )?)?;
            if let Ok(boot) = procfs::boot_time_secs() {
                let start = ConstGauge::new(boot as f64 + stat.starttime as f64 / tps);
                start.encode(encoder.encode_descriptor(
                    "process_start_time",
                    "Start time of the process since unix epoch in seconds",
                    Some(&Unit::Seconds),
                    start.metric_type(),
                )?)?;
            }
        }
        if let Ok(n) = me.fd_count() {
            let fds = ConstGauge::new(n as i64);
            fds.encode(encoder.encode_descriptor(
                "process_open_fds",
                "Number of open file descriptors",
                None,
                fds.metric_type(),
            )?)?;
        }
        if let Ok(limits) = me.limits()
            && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
        {
            let max = ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX));
            max.encode(encoder.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                max.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Default)]
struct HealthState {
    /// The first full sync is in the maps.
    synced: bool,
    last_updated: Option<(Instant, f64)>,
    /// The controller's loop last went round.
    heartbeat: Option<Instant>,
    /// Oldest change queued and not yet written.
    queued_since: Option<Instant>,
    /// Why this node is not eligible for traffic (its Node object is being deleted, is gone,
    /// or is tainted `ToBeDeletedByClusterAutoscaler`); `None`: eligible. As in kube-proxy,
    /// a node is eligible until its Node object says otherwise.
    not_eligible: Option<String>,
}

/// What the endpoints report. Cheap to clone.
#[derive(Clone)]
pub struct Health {
    state: Arc<Mutex<HealthState>>,
    timeout: Duration,
    pub metrics: Arc<Metrics>,
}

impl Health {
    /// `sync_period`: a queued change older than twice this makes `/healthz` fail.
    pub fn new(sync_period: Duration) -> Self {
        Self {
            state: Arc::default(),
            timeout: sync_period * 2,
            metrics: Arc::new(Metrics::new()),
        }
    }

    /// A change was queued for the maps.
    pub fn queued(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.queued_since.is_none() {
            s.queued_since = Some(Instant::now());
        }
        let now = unix_now();
        for f in &FAMILIES {
            self.metrics.last_queued_timestamp.get_or_create(f).set(now);
        }
    }

    /// Everything queued so far is in the maps.
    pub fn updated(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.synced = true;
        s.queued_since = None;
        let now = unix_now();
        s.last_updated = Some((Instant::now(), now));
        for f in &FAMILIES {
            self.metrics.last_sync_timestamp.get_or_create(f).set(now);
        }
    }

    /// Whether this node takes traffic, from its Node object (`None`: it does; else why not).
    pub fn set_node_eligible(&self, not_eligible: Option<String>) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.not_eligible != not_eligible {
            match &not_eligible {
                Some(why) => tracing::warn!(
                    "this node is not eligible for traffic: {why}; /healthz answers 503"
                ),
                None => tracing::info!("this node is eligible for traffic again"),
            }
        }
        s.not_eligible = not_eligible;
    }

    /// The controller's loop went round (it does at least once per sync period).
    pub fn beat(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.heartbeat = Some(Instant::now());
    }

    /// `/livez`: (alive, JSON body). Alive once the first sync is in the maps, as long as the
    /// controller's loop went round within twice the sync period; queued changes that cannot
    /// be written do not matter here.
    fn report_live(&self) -> (bool, String) {
        let s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let beat = s.heartbeat.map(|b| b.elapsed());
        let stuck = beat.is_none_or(|b| b > self.timeout);
        let alive = s.synced && !stuck;
        let now = unix_now();
        let body = serde_json::json!({
            "lastUpdated": go_time(if alive { Some(now) } else { s.last_updated.map(|(_, t)| t) }),
            "currentTime": go_time(Some(now)),
            "lastUpdatedUnixSeconds": s.last_updated.map(|(_, t)| t),
            "secondsSinceLoop": beat.map(|b| b.as_secs_f64()),
            "alive": alive,
            "reason": if !s.synced { "the first sync is not in the maps yet" } else if stuck { "the controller loop has not run within 2x the sync period" } else { "ok" },
        });
        (alive, format!("{body}\n"))
    }

    /// Whether `/healthz` is 200 now (what the health-check servers report as
    /// `serviceProxyHealthy`).
    pub fn healthy(&self) -> bool {
        self.report().0
    }

    /// (healthy, JSON body).
    fn report(&self) -> (bool, String) {
        let s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let stale = s.queued_since.is_some_and(|q| q.elapsed() > self.timeout);
        let healthy = s.synced && !stale && s.not_eligible.is_none();
        let now = unix_now();
        let reason = if !s.synced {
            "the first sync is not in the maps yet".to_string()
        } else if stale {
            "queued changes not written within 2x the sync period".to_string()
        } else if let Some(why) = &s.not_eligible {
            format!("this node is not eligible for traffic: {why}")
        } else {
            "ok".to_string()
        };
        // kube-proxy's keys first. As kube-proxy, a healthy answer's lastUpdated is now; the
        // real time of the last sync is lastUpdatedUnixSeconds.
        let body = serde_json::json!({
            "lastUpdated": go_time(if healthy { Some(now) } else { s.last_updated.map(|(_, t)| t) }),
            "currentTime": go_time(Some(now)),
            "nodeEligible": s.not_eligible.is_none(),
            "lastUpdatedUnixSeconds": s.last_updated.map(|(_, t)| t),
            "secondsSinceUpdate": s.last_updated.map(|(i, _)| i.elapsed().as_secs_f64()),
            "queuedSecondsAgo": s.queued_since.map(|q| q.elapsed().as_secs_f64()),
            "healthy": healthy,
            "reason": reason,
        });
        (healthy, format!("{body}\n"))
    }
}

/// A Unix time as Go's `time.Time.String()` prints it (kube-proxy's body format), or the
/// zero time when there is none.
fn go_time(unix: Option<f64>) -> String {
    const ZERO: &str = "0001-01-01 00:00:00 +0000 UTC";
    let Some(t) = unix else {
        return ZERO.into();
    };
    let Ok(ts) = jiff::Timestamp::from_nanosecond((t * 1e9) as i128) else {
        return ZERO.into();
    };
    format!("{} +0000 UTC", ts.strftime("%Y-%m-%d %H:%M:%S%.f"))
}

async fn healthz(State(h): State<Health>) -> impl IntoResponse {
    answer(&h.metrics.healthz_total, h.report())
}

async fn livez(State(h): State<Health>) -> impl IntoResponse {
    answer(&h.metrics.livez_total, h.report_live())
}

fn answer(
    counter: &Family<CodeLabel, Counter>,
    (ok, body): (bool, String),
) -> axum::response::Response {
    let (code, label) = if ok {
        (StatusCode::OK, "200")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "503")
    };
    counter.get_or_create(&CodeLabel { code: label }).inc();
    (
        code,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    let mut body = String::new();
    if encode(&mut body, &h.metrics.registry).is_err() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            String::new(),
        );
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

/// Binds both listeners (so a bad address fails at start) and serves them in the background.
pub async fn serve(
    health: Health,
    healthz_addr: SocketAddr,
    metrics_addr: SocketAddr,
    configz: serde_json::Value,
) -> anyhow::Result<()> {
    let h = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .with_state(health.clone());
    let configz = Arc::new(format!("{configz:#}\n"));
    let m = Router::new()
        .route("/metrics", get(metrics))
        .route("/proxyMode", get(|| async { "ebpf" }))
        .route(
            "/configz",
            get(move || {
                let body = configz.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/json")],
                        (*body).clone(),
                    )
                }
            }),
        )
        .with_state(health);
    let hl = tokio::net::TcpListener::bind(healthz_addr)
        .await
        .map_err(|e| anyhow::anyhow!("healthzBindAddress {healthz_addr}: {e}"))?;
    let ml = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .map_err(|e| anyhow::anyhow!("metricsBindAddress {metrics_addr}: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(hl, h).await {
            tracing::error!("healthz server stopped: {e}");
        }
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(ml, m).await {
            tracing::error!("metrics server stopped: {e}");
        }
    });
    Ok(())
}

/// GETs `http://{addr}{path}` and parses the body as JSON, whatever the status (a 503
/// `/healthz` still says why), within 3 s. For `lbproxy inspect status`.
pub fn get_json(addr: &str, path: &str) -> anyhow::Result<serde_json::Value> {
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
        tokio::time::timeout(Duration::from_secs(3), fetch)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 3 s"))?
    })
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn health_follows_kube_proxy_rules() {
        let h = Health::new(Duration::from_millis(10));
        assert!(!h.report().0, "unhealthy before the first sync");
        h.updated();
        assert!(h.report().0);
        h.queued();
        assert!(h.report().0, "a fresh queued change is fine");
        std::thread::sleep(Duration::from_millis(30));
        let (ok, body) = h.report();
        assert!(
            !ok,
            "a change queued for more than 2x the sync period is not: {body}"
        );
        h.updated();
        assert!(h.report().0);
    }

    #[test]
    fn liveness_ignores_changes_that_cannot_be_written() {
        // Twice the sync period: 20 ms.
        let h = Health::new(Duration::from_millis(10));
        h.beat();
        assert!(!h.report_live().0, "alive before the first sync");
        h.updated();
        assert!(h.report_live().0);
        h.queued();
        std::thread::sleep(Duration::from_millis(30));
        h.beat();
        assert!(!h.report().0, "/healthz with a stale queued change");
        assert!(h.report_live().0, "/livez failed for a stale queued change");
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !h.report_live().0,
            "/livez alive with a loop that stopped turning"
        );
    }

    #[test]
    fn metric_names_are_kube_proxys() {
        let h = Health::new(Duration::from_secs(1));
        h.metrics.endpoint_changes_total.inc();
        let mut body = String::new();
        encode(&mut body, &h.metrics.registry).unwrap();
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
