//! Report: what the controller tells the world about its syncs.
//!
//! - kube-proxy's metrics (sync duration, change counters, network programming latency) and
//!   lbproxy's own (map fill, failures);
//! - `/healthz`'s state ([`Health`]);
//! - a Warning Event on this Node when the dataplane cannot be programmed, once per failure
//!   streak, and a log line with the cause of each of the first [`LOGGED_ERRORS`] failed
//!   writes of a sync (then a count of the rest);
//! - a Warning Event (`FrontendNotProgrammed`) on each Service a full map keeps from being
//!   programmed, once per failure streak of that Service, and one (`ServiceOverSlotLimit`)
//!   on each Service over the per-service slot limit, once per change of its numbers.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use lbproxy_common::{DatapathEvent, DropReason, map_names};

use crate::desired::Frontend;
use std::sync::Arc;

use crate::model::NamespacedName;
use crate::program::{ApplyStats, MapWriteError, Programmed};
use crate::server::Health;
use crate::telemetry::{self, Metrics};

/// A failed sync logs the cause of this many writes, then how many more failed.
pub const LOGGED_ERRORS: usize = 5;

/// Where and how the controller reports.
pub struct Report {
    pub health: Health,
    pub metrics: Arc<Metrics>,
    /// This node's name, for Events.
    pub node: String,
    pub node_uid: Option<String>,
    /// Posts Node Events (the kube source only).
    pub events: Option<kube::runtime::events::Recorder>,
    /// The capacity of each pinned map, by metric label.
    pub capacities: Vec<(&'static str, i64)>,
    /// A failure streak already reported with a Node Event.
    failing: bool,
    /// Services a full map keeps from being programmed, already told with an Event.
    map_full: BTreeSet<NamespacedName>,
    /// The Service Events' notes, recorded with or without a recorder, for tests.
    #[cfg(test)]
    pub service_events: Vec<(NamespacedName, String)>,
    /// Syncs recorded, for tests.
    #[cfg(test)]
    pub syncs: u64,
}

/// The outcome of one sync, as the reporter needs it.
pub struct Synced<'a> {
    pub what: &'a str,
    pub started: Instant,
    pub services: usize,
    pub slices: usize,
}

impl Synced<'_> {
    /// A sync of the whole model (kube-proxy's "full" sync); `changes` syncs only the
    /// services that changed (its "partial" one).
    pub fn full(&self) -> bool {
        self.what != "changes"
    }
}

impl Report {
    pub fn new(health: Health, metrics: Arc<Metrics>, node: String) -> Self {
        Self {
            health,
            metrics,
            node,
            node_uid: None,
            events: None,
            capacities: Vec::new(),
            failing: false,
            map_full: BTreeSet::new(),
            #[cfg(test)]
            service_events: Vec::new(),
            #[cfg(test)]
            syncs: 0,
        }
    }

    pub fn service_change(&self, pending: i64) {
        let m = &self.metrics;
        m.service_changes_total.inc();
        m.service_changes_pending.set(pending);
        self.queued();
    }

    pub fn endpoint_change(&self, pending: i64) {
        let m = &self.metrics;
        m.endpoint_changes_total.inc();
        m.endpoint_changes_pending.set(pending);
        self.queued();
    }

    /// A change was queued for the maps: `/healthz` starts its clock, the metric its timestamp.
    pub fn queued(&self) {
        self.health.queued();
        self.metrics.queued_now();
    }

    /// A source could not read what it watches.
    pub fn source_failed(&self, source: &str, error: &str) {
        tracing::warn!(
            source,
            "watching {source}: {error} (retrying with backoff; the last state keeps serving)"
        );
    }

    /// A source refused its input.
    pub fn source_rejected(&self, source: &str, error: &str) {
        self.metrics.sync_failures.inc();
        tracing::error!(
            source,
            "{source} rejected, keeping the last good state: {error}"
        );
    }

    /// Records a sync that wrote everything (`triggers`: the trigger times it covered).
    pub fn sync_ok(&mut self, s: &Synced<'_>, stats: ApplyStats, triggers: &[f64]) {
        #[cfg(test)]
        {
            self.syncs += 1;
        }
        let m = &self.metrics;
        m.observe_sync(s.full(), s.started.elapsed().as_secs_f64());
        let now = telemetry::unix_now();
        for t in triggers {
            m.observe_programming((now - t).max(0.0));
        }
        m.service_changes_pending.set(0);
        m.endpoint_changes_pending.set(0);
        self.health.updated();
        m.synced_now();
        tracing::debug!(
            what = s.what,
            full = s.full(),
            took_us = u64::try_from(s.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            changed = stats.frontends_changed,
            "sync done"
        );
        if stats.frontends_changed > 0 {
            tracing::info!(
                what = s.what,
                services = s.services,
                slices = s.slices,
                changed = stats.frontends_changed,
                writes = stats.writes,
                deletes = stats.deletes,
                took_us = u64::try_from(s.started.elapsed().as_micros()).unwrap_or(u64::MAX),
                "synced"
            );
        }
        if self.failing {
            tracing::info!("the dataplane is programmed again");
        }
        self.failing = false;
    }

    /// Records a sync whose writes failed in part; the caller retries.
    pub fn sync_failed(&mut self, s: &Synced<'_>, errors: &[MapWriteError]) {
        #[cfg(test)]
        {
            self.syncs += 1;
        }
        let m = &self.metrics;
        m.observe_sync(s.full(), s.started.elapsed().as_secs_f64());
        m.sync_failures.inc();
        for e in errors.iter().take(LOGGED_ERRORS) {
            tracing::error!(
                map = e.map,
                op = e.op,
                entry = %e.entry,
                errno = e.errno().unwrap_or(0),
                cause = %e.cause,
                "map write failed (will retry): {}",
                crate::bpf::error_chain(e)
            );
        }
        if errors.len() > LOGGED_ERRORS {
            tracing::error!(
                more = errors.len() - LOGGED_ERRORS,
                "{} more map write(s) failed in this sync (not logged one by one)",
                errors.len() - LOGGED_ERRORS
            );
        }
        if !self.failing {
            self.failing = true;
            let first = errors
                .first()
                .map(|e| crate::bpf::error_chain(e))
                .unwrap_or_default();
            self.post_node_event(format!(
                "lbproxy could not program the dataplane ({} map write(s) failed; first: {first}); it retries",
                errors.len()
            ));
        }
    }

    fn post_node_event(&self, note: String) {
        self.post_node_event_as("DataplaneProgrammingFailed", note);
    }

    /// A health-check server (`healthCheckNodePort`) that could not be started: a log line
    /// and a Node Event with kube-proxy's reason; nothing else stops.
    pub fn health_check_failed(&self, failure: &crate::healthcheck::BindFailure) {
        let msg = crate::bpf::error_chain(failure);
        tracing::warn!(service = %failure.service(), port = failure.port(), "health check server: {msg}");
        self.post_node_event_as("FailedToStartServiceHealthcheck", msg);
    }

    fn post_node_event_as(&self, reason: &'static str, note: String) {
        let Some(recorder) = self.events.clone() else {
            return;
        };
        post_node_event(
            recorder,
            &self.node,
            self.node_uid.clone(),
            reason,
            "Sync",
            note,
        );
    }

    /// The services a full map kept from being programmed in the last sync, each with the
    /// first frontend that failed: a Warning Event on each that was not failing before. A
    /// service leaves the streak when a sync no longer fails it.
    pub fn map_full(&mut self, failing: &BTreeMap<NamespacedName, Frontend>) {
        for (svc, fe) in failing {
            if self.map_full.contains(svc) {
                continue;
            }
            let note = format!(
                "lbproxy could not program frontend {fe} of Service {svc} on node {}: map full \
                 (the node's maps are shared by every service); it retries",
                self.node
            );
            tracing::warn!(service = %svc, frontend = %fe, "{note}");
            #[cfg(test)]
            self.service_events.push((svc.clone(), note.clone()));
            self.post_service_event(svc, "FrontendNotProgrammed", note);
        }
        self.map_full = failing.keys().cloned().collect();
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics.services_map_full.set(as_i64(failing.len()));
    }

    /// How many services are over the per-service slot limit.
    pub fn over_limit(&self, n: usize) {
        self.metrics
            .services_over_limit
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A Service went over the per-service slot limit (`note` says by how much).
    pub fn too_large(&mut self, svc: &NamespacedName, note: String) {
        #[cfg(test)]
        self.service_events.push((svc.clone(), note.clone()));
        self.post_service_event(svc, "ServiceOverSlotLimit", note);
    }

    fn post_service_event(&self, svc: &NamespacedName, reason: &'static str, note: String) {
        let Some(recorder) = self.events.clone() else {
            return;
        };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(svc.namespace.clone()),
            name: Some(svc.name.clone()),
            ..Default::default()
        };
        tokio::spawn(async move {
            let ev = kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: reason.into(),
                note: Some(note),
                action: "Sync".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::warn!("could not post the Service event: {e}");
            }
        });
    }

    /// How many frontends more than one service claims.
    pub fn conflicts(&self, n: usize) {
        self.metrics
            .frontend_conflicts
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The frontends not served yet, by kind (`SVC_KIND_*`).
    pub fn unserved(&self, by_kind: &std::collections::BTreeMap<u8, usize>) {
        for kind in crate::desired::FrontendKind::ALL {
            let n = by_kind.get(&kind.number()).copied().unwrap_or(0);
            self.metrics
                .frontends_not_served
                .get_or_create(&telemetry::KindLabel {
                    kind: kind.label().to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Map fill as the controller wrote it: no syscalls, so it runs after every sync. The
    /// flow table's fill comes from the collector, which scans it anyway.
    pub fn programmed(&self, p: &Programmed) {
        let m = &self.metrics;
        let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let set = |map: &str, n: i64| {
            m.map_entries
                .get_or_create(&telemetry::MapLabel::of(map))
                .set(n);
        };
        let v6_frontends = p.frontends.keys().filter(|f| f.addr.is_ipv6()).count();
        let v6_backends = p.backends.values().filter(|b| b.addr.is_ipv6()).count();
        set(
            map_names::SERVICES,
            as_i64(p.frontends.len() - v6_frontends),
        );
        set(map_names::SERVICES6, as_i64(v6_frontends));
        set(map_names::LABELS, as_i64(p.frontends.len()));
        set(map_names::BACKENDS, as_i64(p.backends.len() - v6_backends));
        set(map_names::BACKENDS6, as_i64(v6_backends));
        set(
            map_names::SLOTS,
            as_i64(p.frontends.values().map(|f| f.slots.len()).sum()),
        );
        set(
            map_names::MEMBERS,
            as_i64(p.frontends.values().map(|f| f.members.len()).sum()),
        );
        set(map_names::DROPS, i64::from(DropReason::COUNT));
        set(map_names::DP_EVENTS, i64::from(DatapathEvent::COUNT));
        for (name, cap) in &self.capacities {
            m.map_capacity
                .get_or_create(&telemetry::MapLabel::of(name))
                .set(*cap);
        }
    }
}

/// Posts a Warning Event about Node `node` (its `uid` when known) in the background; a
/// failure to post is logged. `action` says what lbproxy was doing (`Sync`, `CollectFlows`).
pub fn post_node_event(
    recorder: kube::runtime::events::Recorder,
    node: &str,
    uid: Option<String>,
    reason: &'static str,
    action: &'static str,
    mut note: String,
) {
    // The API server refuses a note over 1 kB.
    if note.len() > 1024 {
        let mut end = 1021;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_string()),
        uid,
        ..Default::default()
    };
    tokio::spawn(async move {
        let ev = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&ev, &reference).await {
            tracing::warn!("could not post the Node event: {e}");
        }
    });
}
