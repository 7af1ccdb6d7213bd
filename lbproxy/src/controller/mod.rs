//! The controller: one model, fed by a source, written to the maps as diffs.
//!
//! It is three parts with private state, each in its own module:
//! - [`ingest`]: source events into the model, marking the services they touch dirty;
//! - [`sync`]: the model into the maps, through the [`Maps`] trait (the pinned BPF maps in
//!   production, `MemMaps` in tests);
//! - [`report`]: metrics, `/healthz` state, logs and Node Events about the syncs.
//!
//! [`Controller::drive`] is the loop: events that arrive while a sync runs are coalesced
//! into the next one, `minSyncPeriod` spaces syncs out, a failed write is retried with
//! exponential backoff (1 s doubling to 30 s, back to 1 s after a sync that wrote
//! everything: a full map stays full until something changes, and retrying it every second
//! only fills the log), and every `syncPeriod` a full reconcile reads the maps back and repairs any drift.
//! That reconcile reads on another thread and then syncs every service again a slice at a
//! time ([`Pass`]), so change syncs go on meanwhile; only drift it finds is repaired by
//! the blocking [`Controller::reconcile`].
//! The manifests and the Kubernetes sources feed it the same [`SourceEvent`]s.

mod ingest;
pub mod report;
mod sync;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use tokio::time::Instant as Deadline;

use tokio::sync::mpsc;

pub use report::Report;

use crate::model::NamespacedName;
use crate::program::{ApplyStats, Maps};
use crate::source::SourceEvent;

use self::ingest::Ingest;
use self::report::Synced;
use self::sync::{ApplyResult, Sync};

/// How often the loop syncs.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Full reconcile of the maps against the model.
    pub sync_period: Duration,
    /// Minimum time between two syncs.
    pub min_sync_period: Duration,
}

/// A failed write is first retried after this long; each further failure doubles it.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The longest wait between two retries.
const RETRY_MAX: Duration = Duration::from_secs(30);

pub struct Controller<M: Maps> {
    /// This node's name, for node-local endpoints.
    node: String,
    ingest: Ingest,
    sync: Sync<M>,
    report: Report,
    /// The first full sync has run (successfully or not).
    first_sync_done: bool,
    last_sync: Option<Deadline>,
    /// The wait before the next retry of a failed sync.
    retry_after: Duration,
    /// The `healthCheckNodePort` servers, kept equal to the model after every sync, and the
    /// node-port addresses they bind (from the interface watcher).
    health_checks: Option<(
        crate::healthcheck::HealthCheckServers,
        tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>,
    )>,
    /// Health-check ports that failed to start at the last try, by (port, service): each is
    /// reported once per failure streak, not after every sync that retries it.
    health_check_failing: std::collections::BTreeSet<(u16, String)>,
    /// What the health-check servers should serve, by service: updated for the services a
    /// sync wrote (all of them on a full sync), so a sync of one change costs one service's
    /// look, not a scan of every service.
    health_check_wanted: BTreeMap<NamespacedName, (u16, crate::healthcheck::ServiceHealth)>,
    /// The socket reaper's cue (`bpf::sock::spawn_reaper`): moved on after every sync that
    /// deleted something from the maps (a backend may have left) or created a frontend (a
    /// node socket may be connected to its bare address), saying which.
    synced_deletes: Option<tokio::sync::watch::Sender<crate::bpf::sock::SyncCue>>,
    /// `health_check_wanted` changed since the servers were last brought in line with it.
    health_check_changed: bool,
    /// This node's addresses, from the interface watcher, for the model's `node_ips`.
    node_addresses: Option<tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>>,
    /// The periodic reconcile under way, if one is (see [`Pass`]).
    pass: Option<Pass>,
}

/// The periodic reconcile (`syncPeriod`), done without holding up change syncs:
/// 1. the maps are read back on another thread while syncs go on; the frontends a sync
///    writes meanwhile are left out of the comparison ([`Sync::drifted`]);
/// 2. drift found: the blocking [`Controller::reconcile`] (read again, adopt, program the
///    whole model) repairs it, as before;
/// 3. none: every service is synced again through the change path, a slice of
///    [`SWEEP_STEP`] at a time, with the loop free for events and change syncs in between.
///
/// At 10,000 Services and 100,000 endpoints the blocking reconcile held the loop for
/// 1.1-1.4 s every 30 s, and a change that came in then waited for it (`cargo xtask bench
/// churn --sustained`).
#[derive(Debug)]
struct Pass {
    started: Instant,
    /// How long the read-back took (on its thread) and the comparison (on the loop).
    read: Duration,
    compare: Duration,
    /// The services left to sync again, popped from the end.
    left: Vec<NamespacedName>,
    /// Past the read-back: sweeping.
    sweeping: bool,
    /// Time spent on the loop by the steps so far.
    busy: Duration,
    stats: ApplyStats,
    errors: Vec<crate::program::MapWriteError>,
    /// The frontends whose write failed, over the sweep's slices.
    failed: Vec<(crate::desired::Frontend, Option<i32>)>,
}

/// How long one step of a reconcile's sweep may hold the loop (it stops at the first
/// slice of services past it).
const SWEEP_STEP: Duration = Duration::from_millis(4);
/// Services synced between two looks at the clock.
const SWEEP_SLICE: usize = 32;

impl<M: Maps> Controller<M> {
    /// A controller over `maps`, adopting what they already hold.
    pub fn new(maps: M, report: Report) -> Self {
        let node = report.node.clone();
        let ctl = Self {
            node,
            ingest: Ingest::default(),
            sync: Sync::adopt(maps),
            report,
            first_sync_done: false,
            last_sync: None,
            retry_after: RETRY_AFTER,
            health_checks: None,
            health_check_failing: std::collections::BTreeSet::new(),
            health_check_wanted: BTreeMap::new(),
            health_check_changed: true,
            synced_deletes: None,
            node_addresses: None,
            pass: None,
        };
        ctl.report.programmed(ctl.sync.programmed());
        ctl
    }

    /// Runs the `healthCheckNodePort` servers of the services that ask for one, on the
    /// addresses `addresses` holds (none yet: every address).
    pub fn with_health_checks(
        mut self,
        addresses: tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>,
    ) -> Self {
        let health = self.report.health.clone();
        let servers = crate::healthcheck::HealthCheckServers::new(
            addresses.borrow().clone(),
            std::sync::Arc::new(move || health.healthy()),
        );
        self.health_checks = Some((servers, addresses));
        self
    }

    /// Builds a Maglev table of `m` entries with `seed` for every frontend
    /// (`--lb-algorithm maglev`).
    pub fn with_maglev(mut self, m: u32, seed: u64) -> Self {
        self.sync.use_maglev(m, seed);
        self
    }

    /// Moves `tx` on after every sync that deleted map entries or created a frontend.
    pub fn with_sync_notify(
        mut self,
        tx: tokio::sync::watch::Sender<crate::bpf::sock::SyncCue>,
    ) -> Self {
        self.synced_deletes = Some(tx);
        self
    }

    /// Follows this node's addresses as `addresses` sees them (the model's `node_ips`): a
    /// change re-syncs the services it concerns.
    pub fn with_node_addresses(
        mut self,
        addresses: tokio::sync::watch::Receiver<Vec<std::net::IpAddr>>,
    ) -> Self {
        let now = addresses.borrow().clone();
        self.ingest.model.set_node_ips(now);
        self.node_addresses = Some(addresses);
        self
    }

    /// Takes in this node's new addresses; the services they concern are marked dirty.
    /// Returns whether any is.
    fn on_node_addresses(&mut self, ips: Vec<std::net::IpAddr>) -> bool {
        let touched = self.ingest.model.set_node_ips(ips);
        if touched.is_empty() {
            return false;
        }
        tracing::info!(
            services = touched.len(),
            node_ips = ?self.ingest.model.node_ips,
            "node addresses changed: syncing the services with loadBalancerSourceRanges"
        );
        self.ingest.dirty.extend(touched);
        true
    }

    /// Updates what the health-check servers should serve for the services `changed` (every
    /// service when `None`).
    fn want_health_checks(&mut self, changed: Option<&BTreeSet<NamespacedName>>) {
        if self.health_checks.is_none() {
            return;
        }
        let model = &self.ingest.model;
        let wanted = &mut self.health_check_wanted;
        let mut changed_any = false;
        match changed {
            None => {
                let all: BTreeMap<_, _> = crate::healthcheck::wanted(model, &self.node)
                    .into_iter()
                    .map(|(port, h)| (h.service.clone(), (port, h)))
                    .collect();
                changed_any = *wanted != all;
                *wanted = all;
            }
            Some(ids) => {
                for id in ids {
                    let now = crate::healthcheck::wanted_for(model, &self.node, id);
                    if wanted.get(id) != now.as_ref() {
                        changed_any = true;
                        match now {
                            Some(w) => wanted.insert(id.clone(), w),
                            None => wanted.remove(id),
                        };
                    }
                }
            }
        }
        self.health_check_changed |= changed_any;
    }

    /// Brings the health-check servers in line with `health_check_wanted` and the node-port
    /// addresses, when either changed or a port failed to start last time (it is tried
    /// again after every sync until it starts); a failure is reported once per streak.
    fn sync_health_checks(&mut self) {
        let Some((servers, addresses)) = &mut self.health_checks else {
            return;
        };
        let mut failures = Vec::new();
        let moved = addresses.has_changed().unwrap_or(false);
        if moved {
            let now = addresses.borrow_and_update().clone();
            failures.extend(servers.set_addresses(now));
        }
        if !(moved || self.health_check_changed || !self.health_check_failing.is_empty()) {
            return;
        }
        self.health_check_changed = false;
        failures.extend(servers.sync(self.health_check_wanted.values().cloned()));
        let now: std::collections::BTreeSet<(u16, String)> = failures
            .iter()
            .map(|f| (f.port(), f.service().to_string()))
            .collect();
        for f in &failures {
            if !self
                .health_check_failing
                .contains(&(f.port(), f.service().to_string()))
            {
                self.report.health_check_failed(f);
            }
        }
        self.health_check_failing = now;
    }

    #[cfg(test)]
    pub fn maps(&self) -> &M {
        self.sync.maps()
    }

    #[cfg(test)]
    pub fn maps_mut(&mut self) -> &mut M {
        self.sync.maps_mut()
    }

    /// Applies one source event to the model. Nothing is written until a sync.
    pub fn on_event(&mut self, ev: SourceEvent) {
        self.ingest.apply(ev, &mut self.report);
    }

    /// Every kind of object has been listed once.
    pub fn ready(&self) -> bool {
        self.ingest.ready()
    }

    /// Changes are waiting for a sync.
    pub fn has_pending(&self) -> bool {
        !self.ingest.dirty.is_empty() || self.ingest.cidrs_changed
    }

    /// Programs the whole model. On a failed write every service is retried by the next
    /// dirty sync.
    pub fn sync_all(&mut self, what: &str) -> bool {
        let started = Instant::now();
        self.ingest.dirty.clear();
        self.ingest.cidrs_changed = false;
        let result = self.sync.all(&self.ingest.model, &self.node);
        self.retry_all_if_failed(&result);
        self.want_health_checks(None);
        let ok = self.record(what, started, result);
        release_freed_memory();
        ok
    }

    /// Programs only the services changed since the last sync; on a failed write they stay
    /// pending.
    pub fn sync_dirty(&mut self) -> bool {
        if self.ingest.dirty.is_empty() && !self.ingest.cidrs_changed {
            return true;
        }
        let started = Instant::now();
        let dirty = std::mem::take(&mut self.ingest.dirty);
        // A change of the ServiceCIDRs alone: the tables are compared whole by the sync.
        self.ingest.cidrs_changed = false;
        let result = self.sync.services(&self.ingest.model, &self.node, &dirty);
        self.want_health_checks(Some(&dirty));
        if result.is_err() {
            self.ingest.dirty.extend(dirty);
            // The ServiceCIDR tables retry in full with the next sync.
            self.ingest.cidrs_changed = true;
        }
        self.record("changes", started, result)
    }

    /// Reads the maps back and repairs anything that drifted from the model.
    pub fn reconcile(&mut self) -> bool {
        let started = Instant::now();
        self.ingest.dirty.clear();
        self.ingest.cidrs_changed = false;
        let result = self.sync.reconcile(&self.ingest.model, &self.node);
        self.retry_all_if_failed(&result);
        self.want_health_checks(None);
        self.record("reconcile", started, result)
    }

    /// Starts a periodic reconcile ([`Pass`]): returns the read-back to run on another
    /// thread, or `None` after doing the blocking [`Controller::reconcile`] instead (the
    /// maps cannot be read from another thread).
    pub fn begin_reconcile(&mut self) -> Option<crate::program::ReadBack> {
        let Some(read) = self.sync.start_read_back() else {
            self.reconcile();
            return None;
        };
        self.pass = Some(Pass {
            started: Instant::now(),
            read: Duration::ZERO,
            compare: Duration::ZERO,
            left: Vec::new(),
            sweeping: false,
            busy: Duration::ZERO,
            stats: ApplyStats::default(),
            errors: Vec::new(),
            failed: Vec::new(),
        });
        Some(read)
    }

    /// The read-back of [`Controller::begin_reconcile`] is done: compares it with what was
    /// written, and either repairs drift with the blocking reconcile or starts the sweep.
    pub fn read_back_done(&mut self, observed: Option<crate::program::Programmed>) {
        let Some(mut pass) = self.pass.take() else {
            self.sync.stop_read_back();
            return;
        };
        pass.read = pass.started.elapsed();
        let Some(observed) = observed else {
            self.sync.stop_read_back();
            self.reconcile();
            return;
        };
        let t = Instant::now();
        let Some(drifted) = self.sync.drifted(&observed) else {
            tracing::debug!("a full sync ran during the read-back: reconciling the blocking way");
            self.reconcile();
            return;
        };
        drop(observed);
        if !drifted.is_empty() {
            let named: Vec<String> = drifted.iter().take(5).map(ToString::to_string).collect();
            tracing::warn!(
                frontends = drifted.len(),
                first = %named.join(", "),
                "the maps drifted from the model at {} frontend{} (edited by hand?); \
                 repairing with a full reconcile",
                drifted.len(),
                if drifted.len() == 1 { "" } else { "s" }
            );
            self.reconcile();
            return;
        }
        let cidrs = self.sync.service_cidrs(&self.ingest.model);
        if cidrs.is_err() {
            self.ingest.cidrs_changed = true;
        }
        pass.add(cidrs);
        pass.left = self.ingest.model.services.keys().rev().cloned().collect();
        pass.sweeping = true;
        pass.compare = t.elapsed();
        pass.busy = pass.compare;
        self.pass = Some(pass);
    }

    /// Gives up a periodic reconcile whose read-back is in flight: the loop that holds
    /// the read ends. (A sweep under way goes on in the next loop.)
    fn abandon_pass(&mut self) {
        if self.pass.take().is_some() {
            self.sync.stop_read_back();
        }
    }

    /// A reconcile's sweep is under way.
    pub fn sweeping(&self) -> bool {
        self.pass.as_ref().is_some_and(|p| p.sweeping)
    }

    /// One step of the sweep: services synced again through the change path for about
    /// [`SWEEP_STEP`]; a slice that fails is left to the change path's retries. The last
    /// step records the reconcile.
    pub fn sweep_step(&mut self) {
        let Some(mut pass) = self.pass.take() else {
            return;
        };
        let t = Instant::now();
        while !pass.left.is_empty() && t.elapsed() < SWEEP_STEP {
            let at = pass.left.len().saturating_sub(SWEEP_SLICE);
            let slice: BTreeSet<NamespacedName> = pass.left.drain(at..).collect();
            let result = self.sync.services(&self.ingest.model, &self.node, &slice);
            pass.failed.extend(self.sync.failed());
            if result.is_err() {
                self.ingest.dirty.extend(slice);
            }
            pass.add(result);
        }
        if pass.left.is_empty() {
            let result = self.sync.remove_unclaimed();
            pass.failed.extend(self.sync.failed());
            pass.add(result);
            self.sync.keep_failed(std::mem::take(&mut pass.failed));
        }
        pass.busy += t.elapsed();
        if !pass.left.is_empty() {
            self.pass = Some(pass);
            return;
        }
        self.want_health_checks(None);
        let program = pass.busy - pass.compare;
        tracing::debug!(
            read_ms = pass.read.as_millis() as u64,
            compare_ms = pass.compare.as_millis() as u64,
            program_ms = program.as_millis() as u64,
            wall_ms = pass.started.elapsed().as_millis() as u64,
            "reconcile: maps read back (on another thread), compared, every service synced again"
        );
        let result = if pass.errors.is_empty() {
            Ok(pass.stats)
        } else {
            Err((pass.stats, pass.errors))
        };
        // Timed as the loop's time in it, which is what holds change syncs up.
        let busy_since = Instant::now()
            .checked_sub(pass.busy)
            .unwrap_or(pass.started);
        self.record("reconcile", busy_since, result);
    }

    /// After a full sync that failed in part, every service is pending again: the next
    /// dirty sync retries them all (writing only what still differs).
    fn retry_all_if_failed(&mut self, result: &ApplyResult) {
        if result.is_err() {
            let all = self.ingest.model.services.keys().cloned();
            self.ingest.dirty.extend(all);
        }
    }

    fn record(&mut self, what: &str, started: Instant, result: ApplyResult) -> bool {
        let s = Synced {
            what,
            started,
            services: self.ingest.model.services.len(),
            slices: self.ingest.model.slice_count(),
        };
        let ok = match result {
            Ok(stats) => {
                if (stats.deletes > 0 || stats.frontends_created > 0)
                    && let Some(tx) = &self.synced_deletes
                {
                    tx.send_modify(|c| {
                        c.deletes += u64::from(stats.deletes > 0);
                        c.frontends += u64::from(stats.frontends_created > 0);
                    });
                }
                // A sweep's slices can succeed while changes wait for their own sync:
                // their latency is theirs to record.
                let triggers = if self.has_pending() {
                    Vec::new()
                } else {
                    self.ingest.written()
                };
                self.report.sync_ok(&s, stats, &triggers);
                self.retry_after = RETRY_AFTER;
                true
            }
            Err((_, errors)) => {
                self.report.sync_failed(&s, &errors);
                false
            }
        };
        self.report.programmed(self.sync.programmed());
        for (family, label) in [
            (crate::model::Family::V4, &crate::telemetry::IPV4),
            (crate::model::Family::V6, &crate::telemetry::IPV6),
        ] {
            let (internal, external) = crate::desired::endpoints::no_local_endpoints(
                &self.ingest.model,
                &self.node,
                family,
            );
            self.report
                .metrics
                .set_no_local_endpoints(label, internal, external);
        }
        self.sync_health_checks();
        self.report.unserved(&self.sync.unserved_by_kind());
        self.report.conflicts(self.sync.conflicts());
        self.report.map_full(&self.sync.map_full());
        self.report.over_limit(self.sync.too_large().len());
        for (svc, msg) in self.sync.take_too_large_news() {
            self.report.too_large(&svc, msg);
        }
        ok
    }

    /// The wait before retrying a failed sync, doubling it for the next failure.
    fn next_retry(&mut self) -> Duration {
        let wait = self.retry_after;
        self.retry_after = (wait * 2).min(RETRY_MAX);
        wait
    }

    /// After events were ingested: the first full sync once everything is listed, or else
    /// when the next sync of pending changes is due (`None`: nothing to do).
    fn after_events(&mut self, min_sync_period: Duration) -> Option<Deadline> {
        if !self.ready() {
            return None;
        }
        if !self.first_sync_done {
            self.first_sync_done = true;
            self.sync_all("initial list");
            self.last_sync = Some(Deadline::now());
        }
        self.has_pending().then(|| {
            self.last_sync
                .map_or_else(Deadline::now, |l| l + min_sync_period)
        })
    }

    /// Runs the controller on `events` until `shutdown` completes or the source closes the
    /// channel (then pending changes are written first).
    pub async fn drive(
        &mut self,
        events: &mut mpsc::Receiver<SourceEvent>,
        timing: Timing,
        shutdown: impl Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut reconcile = tokio::time::interval(timing.sync_period);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        reconcile.tick().await;
        let sync_timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(sync_timer);
        let mut armed = false;
        let mut node_addresses = self.node_addresses.take();
        // A periodic reconcile's read-back, running on a blocking thread.
        let mut reading: Option<tokio::task::JoinHandle<Option<crate::program::Programmed>>> = None;
        loop {
            self.report.health.beat();
            let node_change = async {
                match node_addresses.as_mut() {
                    Some(rx) => rx.changed().await.map(|()| rx.borrow_and_update().clone()),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut shutdown => {
                    if reading.is_some() {
                        self.abandon_pass();
                    }
                    return;
                }
                change = node_change => {
                    match change {
                        // The watcher is gone (shutting down): nothing more to follow.
                        Err(_) => node_addresses = None,
                        Ok(ips) => {
                            if self.on_node_addresses(ips) && self.first_sync_done && !armed {
                                sync_timer.as_mut().reset(Deadline::now());
                                armed = true;
                            }
                        }
                    }
                }
                ev = events.recv() => {
                    let Some(ev) = ev else {
                        if self.ready() && self.first_sync_done {
                            self.sync_dirty();
                        }
                        if reading.is_some() {
                            self.abandon_pass();
                        }
                        return;
                    };
                    self.on_event(ev);
                    // Coalesce whatever else is already queued.
                    while let Ok(ev) = events.try_recv() {
                        self.on_event(ev);
                    }
                    if let Some(at) = self.after_events(timing.min_sync_period) && !armed {
                        sync_timer.as_mut().reset(at);
                        armed = true;
                    }
                }
                () = &mut sync_timer, if armed => {
                    armed = false;
                    self.sync_dirty();
                    self.last_sync = Some(Deadline::now());
                    if self.has_pending() {
                        // A failed write: retry, later each time it fails again.
                        let wait = self.next_retry();
                        sync_timer.as_mut().reset(Deadline::now() + wait);
                        armed = true;
                    }
                }
                observed = async { reading.as_mut().expect("checked").await }, if reading.is_some() => {
                    reading = None;
                    self.read_back_done(observed.ok().flatten());
                    if self.has_pending() && !armed {
                        let wait = self.next_retry();
                        sync_timer.as_mut().reset(Deadline::now() + wait);
                        armed = true;
                    }
                }
                // One step of a reconcile's sweep, after a yield so that whatever else is
                // ready (events, a change sync) goes first.
                () = tokio::task::yield_now(), if self.sweeping() => {
                    self.sweep_step();
                    if self.has_pending() && !armed {
                        let wait = self.next_retry();
                        sync_timer.as_mut().reset(Deadline::now() + wait);
                        armed = true;
                    }
                }
                _ = reconcile.tick() => {
                    if self.first_sync_done && self.pass.is_none() {
                        match self.begin_reconcile() {
                            Some(read) => reading = Some(tokio::task::spawn_blocking(read)),
                            None => {
                                self.last_sync = Some(Deadline::now());
                                if self.has_pending() && !armed {
                                    let wait = self.next_retry();
                                    sync_timer.as_mut().reset(Deadline::now() + wait);
                                    armed = true;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

impl Pass {
    /// Adds what one apply wrote, and its errors, to the pass's totals.
    fn add(&mut self, result: ApplyResult) {
        let (one, errors) = match result {
            Ok(one) => (one, Vec::new()),
            Err((one, errors)) => (one, errors),
        };
        self.stats.writes += one.writes;
        self.stats.deletes += one.deletes;
        self.stats.frontends_changed += one.frontends_changed;
        self.stats.frontends_created += one.frontends_created;
        self.errors.extend(errors);
    }
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
