//! The state `/healthz` and `/livez` report, with kube-proxy's rules (see [`crate::server`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::telemetry::unix_now;

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
    /// A step that must end before the node takes traffic (the takeover from kube-proxy):
    /// `/healthz` answers 503 with this reason until it is released.
    held: Option<String>,
}

/// What the endpoints report. Cheap to clone.
#[derive(Clone)]
pub struct Health {
    state: Arc<Mutex<HealthState>>,
    timeout: Duration,
}

impl Health {
    /// `sync_period`: a queued change older than twice this makes `/healthz` fail.
    pub fn new(sync_period: Duration) -> Self {
        Self {
            state: Arc::default(),
            timeout: sync_period * 2,
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
    }

    /// Everything queued so far is in the maps.
    pub fn updated(&self) {
        let mut s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.synced = true;
        s.queued_since = None;
        s.last_updated = Some((Instant::now(), unix_now()));
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

    /// Keeps `/healthz` at 503, with `why`, until [`Health::release`].
    pub fn hold(&self, why: &str) {
        self.lock().held = Some(why.to_string());
    }

    /// Ends a [`Health::hold`].
    pub fn release(&self) {
        self.lock().held = None;
    }

    /// Whether the first full sync is in the maps.
    pub fn synced(&self) -> bool {
        self.lock().synced
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
    pub(super) fn report_live(&self) -> (bool, String) {
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
    pub(super) fn report(&self) -> (bool, String) {
        let s = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let stale = s.queued_since.is_some_and(|q| q.elapsed() > self.timeout);
        let healthy = s.synced && !stale && s.not_eligible.is_none() && s.held.is_none();
        let now = unix_now();
        let reason = if !s.synced {
            "the first sync is not in the maps yet".to_string()
        } else if stale {
            "queued changes not written within 2x the sync period".to_string()
        } else if let Some(why) = &s.not_eligible {
            format!("this node is not eligible for traffic: {why}")
        } else if let Some(why) = &s.held {
            why.clone()
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
