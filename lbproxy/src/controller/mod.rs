//! The sync loop: one model, fed by a source (manifests or the API server), written to the
//! maps as diffs.
//!
//! - A manifests reload replaces the model and programs the difference.
//! - A watch event updates one object of the model and marks its service dirty; a sync
//!   recomputes only dirty services, so one endpoint change costs the same at 10 or 10,000
//!   services. Events that arrive while a sync runs are coalesced into the next one, and
//!   `minSyncPeriod` spaces syncs out.
//! - Every `syncPeriod`, a full reconcile reads the maps back and repairs any drift (an entry
//!   deleted by hand with bpftool, say), and re-checks the interfaces.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use kube::runtime::watcher::Event;
use lbproxy_common::{DropReason, map_names};

use crate::bpf::{self, Attacher, Datapath, PinnedMaps};
use crate::desired::{self as dataplane, Frontend, FrontendSpec};
use crate::http::{self, Health};
use crate::model::{self, Model, NamespacedName, Normalized};
use crate::program::{self, Programmer};
use crate::source::kube::SourceEvent;
use crate::source::manifests;

type ApplyResult = Result<program::ApplyStats, (program::ApplyStats, Vec<program::MapWriteError>)>;

/// The EndpointSlice annotation kube-proxy measures programming latency from.
const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

pub struct Controller {
    pub dp: Datapath,
    pub maps: PinnedMaps,
    pub programmer: Programmer,
    pub attacher: Attacher,
    pub health: Health,
    pub node: String,
    node_uid: Option<String>,
    model: Model,
    /// The frontends each service currently owns.
    frontends_of: HashMap<NamespacedName, Vec<Frontend>>,
    dirty: BTreeSet<NamespacedName>,
    /// Re-lists in progress (between a watcher's Init and InitDone), already normalized so
    /// a big list never holds every raw object at once.
    relist_services: Option<Vec<(NamespacedName, Option<model::Service>)>>,
    relist_slices: Option<Vec<(NamespacedName, Option<model::EndpointSlice>)>>,
    /// Which watchers have completed their first list.
    pub listed: [bool; 3],
    /// Trigger times of slice changes not yet written.
    triggers: Vec<f64>,
    service_changes_pending: i64,
    endpoint_changes_pending: i64,
    /// A failure streak already reported with a Node Event.
    failing: bool,
    pub events: Option<kube::runtime::events::Recorder>,
    drops_seen: HashMap<u32, u64>,
    delivery_seen: HashMap<u32, u64>,
    pub capacities: Vec<(&'static str, i64)>,
    /// The manifests source has programmed its first model.
    manifests_synced: bool,
    /// The manifests source's reader, which keeps what each document parsed to.
    manifests: manifests::Loader,
}

impl Controller {
    pub fn new(
        dp: Datapath,
        maps: PinnedMaps,
        attacher: Attacher,
        health: Health,
        node: String,
    ) -> Self {
        let adopted = maps.read_programmed();
        if !adopted.frontends.is_empty() {
            tracing::info!(
                frontends = adopted.frontends.len(),
                backends = adopted.backends.len(),
                "adopting the state pinned by an earlier run"
            );
        }
        let capacities = map_names::PINNED
            .iter()
            .filter_map(|name| {
                let info = aya::maps::MapData::from_pin(dp.dir.join(name))
                    .and_then(|d| d.info())
                    .ok()?;
                Some((*name, i64::from(info.max_entries())))
            })
            .collect();
        Self {
            programmer: Programmer::adopt(adopted),
            dp,
            maps,
            attacher,
            health,
            node,
            node_uid: None,
            model: Model::default(),
            frontends_of: HashMap::new(),
            dirty: BTreeSet::new(),
            relist_services: None,
            relist_slices: None,
            listed: [false; 3],
            triggers: Vec::new(),
            service_changes_pending: 0,
            endpoint_changes_pending: 0,
            failing: false,
            events: None,
            drops_seen: HashMap::new(),
            delivery_seen: HashMap::new(),
            capacities,
            manifests_synced: false,
            manifests: manifests::Loader::default(),
        }
    }

    pub fn has_pending(&self) -> bool {
        !self.dirty.is_empty()
    }

    fn record_result(&mut self, started: Instant, result: ApplyResult, what: &str) -> bool {
        let ok = self.record_result_inner(started, result, what);
        self.refresh_programmed_metrics();
        ok
    }

    fn record_result_inner(&mut self, started: Instant, result: ApplyResult, what: &str) -> bool {
        let m = &self.health.metrics;
        m.sync_duration.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(stats) => {
                let now = http::unix_now();
                for t in self.triggers.drain(..) {
                    m.network_programming_duration.observe((now - t).max(0.0));
                }
                self.service_changes_pending = 0;
                self.endpoint_changes_pending = 0;
                m.service_changes_pending.set(0);
                m.endpoint_changes_pending.set(0);
                self.health.updated();
                if stats.frontends_changed > 0 {
                    tracing::info!(
                        what,
                        services = self.model.services.len(),
                        slices = self.model.slice_count(),
                        changed = stats.frontends_changed,
                        writes = stats.writes,
                        deletes = stats.deletes,
                        took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                        "synced"
                    );
                }
                if self.failing {
                    tracing::info!("the dataplane is programmed again");
                }
                self.failing = false;
                true
            }
            Err((_, errors)) => {
                m.sync_failures.inc();
                let first = errors.first().map(ToString::to_string).unwrap_or_default();
                for e in &errors {
                    tracing::error!("map write failed (will retry): {e}");
                }
                if !self.failing {
                    self.failing = true;
                    self.post_node_event(format!(
                        "lbproxy could not program the dataplane ({} map write(s) failed; first: {first}); it retries",
                        errors.len()
                    ));
                }
                false
            }
        }
    }

    fn post_node_event(&self, note: String) {
        let Some(recorder) = self.events.clone() else {
            return;
        };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node.clone()),
            uid: self.node_uid.clone(),
            ..Default::default()
        };
        tokio::spawn(async move {
            let ev = kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: "DataplaneProgrammingFailed".into(),
                note: Some(note),
                action: "Sync".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!("could not post the Node event: {e}");
            }
        });
    }

    /// Programs the whole model (manifest reloads, full reconciles).
    pub fn sync_all(&mut self, what: &str) -> bool {
        let started = Instant::now();
        let mut desired = dataplane::Desired::new();
        self.frontends_of.clear();
        for svc in self.model.services.values() {
            let fes = dataplane::desired_for(&self.model, svc, &self.node);
            self.frontends_of
                .insert(svc.id.clone(), fes.iter().map(|(f, _)| *f).collect());
            desired.extend(fes);
        }
        self.dirty.clear();
        let result = self.programmer.apply(&mut self.maps, &desired);
        let ok = self.record_result(started, result, what);
        release_freed_memory();
        ok
    }

    /// Programs only the services marked dirty.
    pub fn sync_dirty(&mut self) -> bool {
        if self.dirty.is_empty() {
            return true;
        }
        let started = Instant::now();
        let dirty: Vec<NamespacedName> = std::mem::take(&mut self.dirty).into_iter().collect();
        let mut upserts: Vec<(Frontend, FrontendSpec)> = Vec::new();
        let mut removed: Vec<Frontend> = Vec::new();
        for name in &dirty {
            let new: Vec<(Frontend, FrontendSpec)> = self
                .model
                .services
                .get(name)
                .map(|svc| dataplane::desired_for(&self.model, svc, &self.node))
                .unwrap_or_default();
            let new_fes: Vec<Frontend> = new.iter().map(|(f, _)| *f).collect();
            for old in self.frontends_of.get(name).into_iter().flatten() {
                if !new_fes.contains(old) {
                    removed.push(*old);
                }
            }
            if new_fes.is_empty() {
                self.frontends_of.remove(name);
            } else {
                self.frontends_of.insert(name.clone(), new_fes);
            }
            upserts.extend(new);
        }
        let result = self.programmer.apply_changes(
            &mut self.maps,
            upserts.iter().map(|(f, s)| (*f, s)),
            &removed,
        );
        let ok = result.is_ok();
        if !ok {
            // Retry these services on the next sync.
            self.dirty.extend(dirty);
        }
        self.record_result(started, result, "changes")
    }

    /// Reads the maps back and repairs anything that drifted from the model.
    pub fn reconcile(&mut self) -> bool {
        let observed = self.maps.read_programmed();
        let mut ours = self.programmer.programmed().clone();
        for f in ours.frontends.values_mut() {
            f.draining.clear();
        }
        if observed != ours {
            tracing::warn!("the maps drifted from the model (edited by hand?); repairing");
            self.programmer = Programmer::adopt(observed);
        }
        self.sync_all("reconcile")
    }

    /// Manifests source: reload and program. Bad input keeps the last good state.
    ///
    /// A reload yields the objects of the documents that changed, applied to the model like
    /// watch events: only the services they touch are reprogrammed, and the model is never
    /// rebuilt or compared whole. The full reconcile every syncPeriod still covers
    /// everything.
    pub fn load_manifests(&mut self, path: &Path) -> bool {
        let started = Instant::now();
        let change = match self.manifests.load(path) {
            Ok(c) => c,
            Err(e) => {
                self.health.metrics.sync_failures.inc();
                tracing::error!("manifests rejected, keeping the last good state: {e}");
                return false;
            }
        };
        tracing::debug!(
            pieces = change.pieces,
            parsed = change.parsed,
            took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            "manifests read"
        );
        for s in &change.skipped {
            tracing::debug!("not proxied: {s}");
        }
        for (id, svc) in change.services {
            self.apply_normalized_service(id, svc);
        }
        for (id, slice) in change.slices {
            self.apply_normalized_slice(&id, slice);
        }
        if !self.manifests_synced {
            self.health.queued();
            self.manifests_synced = self.sync_all("manifests");
            return self.manifests_synced;
        }
        if !self.has_pending() {
            return true;
        }
        self.health.queued();
        self.sync_dirty()
    }

    fn mark_service_change(&mut self) {
        self.service_changes_pending += 1;
        let m = &self.health.metrics;
        m.service_changes_total.inc();
        m.service_changes_pending.set(self.service_changes_pending);
        self.health.queued();
    }

    fn mark_endpoint_change(&mut self, slice: &K8sEndpointSlice, live: bool) {
        self.endpoint_changes_pending += 1;
        let m = &self.health.metrics;
        m.endpoint_changes_total.inc();
        m.endpoint_changes_pending
            .set(self.endpoint_changes_pending);
        self.health.queued();
        if live
            && let Some(t) = slice
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME))
            && let Ok(ts) = t.parse::<jiff::Timestamp>()
        {
            self.triggers.push(ts.as_millisecond() as f64 / 1000.0);
        }
    }

    fn normalize_service(
        svc: &k8s_openapi::api::core::v1::Service,
    ) -> (NamespacedName, Option<model::Service>) {
        let key = NamespacedName::of(&svc.metadata);
        let new = match model::service_from_k8s(svc) {
            Ok(Normalized::Proxied(s)) => Some(s),
            Ok(Normalized::Skipped(_)) => None,
            Err(e) => {
                tracing::warn!("ignoring {e}");
                None
            }
        };
        (key, new)
    }

    fn apply_service(&mut self, svc: &k8s_openapi::api::core::v1::Service) {
        let (key, new) = Self::normalize_service(svc);
        self.apply_normalized_service(key, new);
    }

    fn apply_normalized_service(&mut self, key: NamespacedName, new: Option<model::Service>) {
        if self.model.set_service(&key, new) {
            self.dirty.insert(key);
        }
    }

    fn delete_service(&mut self, svc: &k8s_openapi::api::core::v1::Service) {
        let key = NamespacedName::of(&svc.metadata);
        if self.model.services.remove(&key).is_some() {
            self.dirty.insert(key);
        }
    }

    fn normalize_slice(slice: &K8sEndpointSlice) -> (NamespacedName, Option<model::EndpointSlice>) {
        let key = NamespacedName::of(&slice.metadata);
        match model::slice_from_k8s(slice) {
            Ok(Normalized::Proxied(s)) => (key, Some(s)),
            Ok(Normalized::Skipped(_)) => (key, None),
            Err(e) => {
                tracing::warn!("ignoring {e}");
                (key, None)
            }
        }
    }

    fn apply_slice(&mut self, slice: &K8sEndpointSlice) {
        let (key, new) = Self::normalize_slice(slice);
        self.apply_normalized_slice(&key, new);
    }

    fn apply_normalized_slice(&mut self, key: &NamespacedName, new: Option<model::EndpointSlice>) {
        let touched = self.model.set_slice(key, new);
        self.dirty.extend(touched);
    }

    /// Applies one watch event to the model.
    pub fn on_source_event(&mut self, ev: SourceEvent) {
        match ev {
            SourceEvent::Service(e) => match e {
                Event::Apply(s) => {
                    self.mark_service_change();
                    self.apply_service(&s);
                }
                Event::Delete(s) => {
                    self.mark_service_change();
                    self.delete_service(&s);
                }
                Event::Init => self.relist_services = Some(Vec::new()),
                Event::InitApply(s) => self
                    .relist_services
                    .get_or_insert_default()
                    .push(Self::normalize_service(&s)),
                Event::InitDone => {
                    let list = self.relist_services.take().unwrap_or_default();
                    let keep: BTreeSet<NamespacedName> =
                        list.iter().map(|(k, _)| k.clone()).collect();
                    let gone: Vec<NamespacedName> = self
                        .model
                        .services
                        .keys()
                        .filter(|k| !keep.contains(k))
                        .cloned()
                        .collect();
                    for k in gone {
                        self.model.services.remove(&k);
                        self.dirty.insert(k);
                    }
                    for (k, s) in list {
                        self.apply_normalized_service(k, s);
                    }
                    if !self.dirty.is_empty() {
                        self.mark_service_change();
                    }
                    self.listed[0] = true;
                }
            },
            SourceEvent::Slice(e) => match e {
                Event::Apply(s) => {
                    self.mark_endpoint_change(&s, true);
                    self.apply_slice(&s);
                }
                Event::Delete(s) => {
                    self.mark_endpoint_change(&s, false);
                    if let Some(svc) = self.model.remove_slice(&NamespacedName::of(&s.metadata)) {
                        self.dirty.insert(svc);
                    }
                }
                Event::Init => self.relist_slices = Some(Vec::new()),
                Event::InitApply(s) => self
                    .relist_slices
                    .get_or_insert_default()
                    .push(Self::normalize_slice(&s)),
                Event::InitDone => {
                    let list = self.relist_slices.take().unwrap_or_default();
                    let keep: BTreeSet<NamespacedName> =
                        list.iter().map(|(k, _)| k.clone()).collect();
                    for k in self.model.slice_ids() {
                        if !keep.contains(&k)
                            && let Some(svc) = self.model.remove_slice(&k)
                        {
                            self.dirty.insert(svc);
                        }
                    }
                    let before = self.dirty.len();
                    for (k, s) in list {
                        self.apply_normalized_slice(&k, s);
                    }
                    if self.dirty.len() != before || !self.listed[1] {
                        self.endpoint_changes_pending += 1;
                        self.health.queued();
                    }
                    self.listed[1] = true;
                }
            },
            SourceEvent::Node(e) => match e {
                Event::Apply(n) | Event::InitApply(n) => self.on_node(&n),
                Event::InitDone => self.listed[2] = true,
                Event::Delete(_) | Event::Init => {}
            },
            SourceEvent::WatchError(what, e) => {
                tracing::warn!(
                    "watching {what}: {e} (retrying with backoff; the last state keeps serving)"
                );
            }
        }
    }

    fn on_node(&mut self, n: &Node) {
        self.node_uid = n.metadata.uid.clone();
    }

    pub async fn sync_interfaces(&mut self, handle: &rtnetlink::Handle) {
        match crate::bpf::ifaces::list(handle).await {
            Ok(list) => {
                for e in self.attacher.sync(&mut self.dp, &list) {
                    tracing::error!("attach failed (will retry): {}", bpf::error_chain(&e));
                }
                self.health
                    .metrics
                    .attached_interfaces
                    .set(i64::try_from(self.attacher.attached().len()).unwrap_or(i64::MAX));
            }
            Err(e) => tracing::error!("listing interfaces: {e}"),
        }
    }

    /// Refreshes the datapath-side metrics: map fill and drop counters.
    /// Map fill as the controller wrote it: no syscalls, so it runs after every sync. The
    /// flow table's fill comes from the collector, which scans it anyway.
    pub fn refresh_programmed_metrics(&self) {
        let m = &self.health.metrics;
        let p = self.programmer.programmed();
        let label = |map: &str| http::MapLabel {
            map: map.to_string(),
        };
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        m.map_entries
            .get_or_create(&label(map_names::SERVICES))
            .set(as_i64(p.frontends.len()));
        m.map_entries
            .get_or_create(&label(map_names::LABELS))
            .set(as_i64(p.frontends.len()));
        m.map_entries
            .get_or_create(&label(map_names::BACKENDS))
            .set(as_i64(p.backends.len()));
        m.map_entries
            .get_or_create(&label(map_names::SLOTS))
            .set(as_i64(p.frontends.values().map(|f| f.slots.len()).sum()));
        m.map_entries
            .get_or_create(&label(map_names::MEMBERS))
            .set(as_i64(p.frontends.values().map(|f| f.members.len()).sum()));
        m.map_entries
            .get_or_create(&label(map_names::DROPS))
            .set(i64::from(DropReason::COUNT));
        for (name, cap) in &self.capacities {
            m.map_capacity.get_or_create(&label(name)).set(*cap);
        }
    }

    /// The datapath's drop and delivery counters, read from the maps: on the periodic tick.
    pub fn refresh_drop_metrics(&mut self) {
        let m = &self.health.metrics;
        for (reason, n) in self.maps.drop_counts() {
            let c = m.datapath_drops.get_or_create(&http::ReasonLabel {
                reason: reason.label().to_string(),
            });
            advance(&c, self.drops_seen.entry(reason as u32).or_insert(0), n);
        }
        for (path, n) in self.maps.delivery_counts() {
            let c = m.datapath_delivered.get_or_create(&http::PathLabel {
                path: path.label().to_string(),
            });
            advance(&c, self.delivery_seen.entry(path as u32).or_insert(0), n);
        }
    }
}

/// Moves a Prometheus counter on by what a datapath counter gained since it was last read.
fn advance(counter: &prometheus_client::metrics::counter::Counter, seen: &mut u64, now: u64) {
    if now > *seen {
        counter.inc_by(now - *seen);
    }
    *seen = now;
}

/// Hands memory freed after a big sync (a full list's objects) back to the kernel. glibc
/// keeps freed heap in its arenas otherwise, and RSS would stay at the list's peak.
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free pages of the allocator's own heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// How the controller is fed.
pub enum Source {
    Manifests(PathBuf),
    Kube(tokio::sync::mpsc::Receiver<SourceEvent>),
}

/// Minimum spacing between syncs that `min_sync_period` asks for.
pub fn next_sync_at(last: Option<Instant>, min: Duration) -> Instant {
    last.map_or_else(Instant::now, |l| l + min)
}
