//! The controller in process, continued: frontends two Services claim (the older one wins,
//! whatever the order), services over a limit, failed syncs and their back-off.

use super::*;

/// A Service event for `shop/name` with one TCP port 80 on `vip`, created at `created`
/// (RFC 3339, or none).
pub(super) fn service_created(name: &str, created: Option<&str>, vip: &str) -> SourceEvent {
    let created = created.map_or(String::new(), |t| format!(", creationTimestamp: '{t}'"));
    let yaml = format!(
        "metadata: {{name: {name}, namespace: shop{created}}}\nspec: {{clusterIP: {vip}, ports: [{{name: http, port: 80}}]}}"
    );
    let k8s = crate::yaml::from_str(&yaml).unwrap();
    let Ok(Normalized::Proxied(s)) = model::service_from_k8s(&k8s) else {
        panic!("{yaml} did not normalize");
    };
    SourceEvent::Service {
        id: id(name),
        service: Some(s),
    }
}

pub(super) fn deleted(name: &str) -> SourceEvent {
    SourceEvent::Service {
        id: id(name),
        service: None,
    }
}

/// Two services on one VIP: `zold` (2020, backend .2) and `ayoung` (2024, backend .3). The
/// older wins although its name sorts last.
const OLD: &str = "2020-01-01T00:00:00Z";
const YOUNG: &str = "2024-01-01T00:00:00Z";
const VIP: &str = "198.19.0.10";

fn contested() -> Vec<SourceEvent> {
    vec![
        service_created("zold", Some(OLD), VIP),
        slice("zold", &["198.18.0.2"]),
        service_created("ayoung", Some(YOUNG), VIP),
        slice("ayoung", &["198.18.0.3"]),
    ]
}

/// The labels in the maps (which service each frontend was programmed from).
fn labels(m: &MemMaps) -> Vec<String> {
    m.labels.values().cloned().collect()
}

/// The older service gets a frontend two services claim, whatever the order the events
/// come in (in a list, or one by one after it), and a full relist agrees.
#[tokio::test(start_paused = true)]
async fn the_older_service_gets_a_contested_frontend_whatever_the_order() {
    let want_old = want(&[("198.19.0.10:80", &["198.18.0.2:8080"])]);
    let mut backward = contested();
    backward.reverse();
    for (what, events) in [("in order", contested()), ("reversed", backward)] {
        let mut ctl = controller(MemMaps::default());
        drive(&mut ctl, full_list(events)).await;
        assert_eq!(served(ctl.maps()), want_old, "{what}");
        assert_eq!(labels(ctl.maps()), vec!["shop/zold:http"], "{what}");
        assert_eq!(ctl.sync.conflicts(), 1, "{what}");
        ctl.maps().check();
    }

    // The younger listed first, the older arriving by event: it takes the frontend over.
    let mut forward = contested();
    let older = forward.drain(..2).collect::<Vec<_>>();
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, full_list(forward)).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.3:8080"])])
    );
    assert_eq!(ctl.sync.conflicts(), 0);
    drive(&mut ctl, older).await;
    assert_eq!(served(ctl.maps()), want_old);
    assert_eq!(labels(ctl.maps()), vec!["shop/zold:http"]);
    assert_eq!(ctl.sync.conflicts(), 1);
    ctl.maps().check();

    // The older listed first, the younger arriving by event: nothing changes hands.
    let mut first = contested();
    let younger = first.split_off(2);
    let mut other = controller(MemMaps::default());
    drive(&mut other, full_list(first)).await;
    let ops = other.maps().ops;
    drive(&mut other, younger).await;
    assert_eq!(served(other.maps()), want_old);
    assert_eq!(other.maps().ops, ops, "the younger claimant wrote");
    assert_eq!(other.sync.conflicts(), 1);

    // A full relist (and a reconcile) leaves it as the events did, writing nothing.
    let ops = ctl.maps().ops;
    drive(&mut ctl, full_list(contested())).await;
    assert!(ctl.reconcile());
    assert_eq!(served(ctl.maps()), want_old);
    assert_eq!(ctl.maps().ops, ops, "a relist of the same state wrote");
    assert_eq!(ctl.sync.conflicts(), 1);
}

/// A service with a creation time is older than one without (a manifest); between two
/// without, the first by namespace/name gets the frontend.
#[tokio::test(start_paused = true)]
async fn without_creation_times_the_first_name_gets_a_contested_frontend() {
    for (events, holder) in [
        (
            vec![
                service_created("a", None, VIP),
                service_created("b", None, VIP),
            ],
            "shop/a:http",
        ),
        (
            vec![
                service_created("a", None, VIP),
                service_created("b", Some(YOUNG), VIP),
            ],
            "shop/b:http",
        ),
    ] {
        let mut ctl = controller(MemMaps::default());
        drive(&mut ctl, full_list(events)).await;
        assert_eq!(labels(ctl.maps()), vec![holder]);
    }
}

/// Deleting the service that lost a frontend writes nothing: the holder's entry, slots and
/// backends stay as they are.
#[tokio::test(start_paused = true)]
async fn deleting_the_loser_leaves_the_holders_frontend_untouched() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, full_list(contested())).await;
    let before = ctl.maps().clone();
    drive(
        &mut ctl,
        vec![
            deleted("ayoung"),
            SourceEvent::Slice {
                id: id("ayoung-a"),
                slice: None,
                trigger: None,
            },
        ],
    )
    .await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.2:8080"])])
    );
    assert_eq!(ctl.maps().ops, before.ops, "the loser's deletion wrote");
    assert_eq!(ctl.maps().services, before.services);
    assert_eq!(ctl.maps().backends, before.backends);
    assert_eq!(ctl.sync.conflicts(), 0);
}

/// Deleting the holder hands the frontend to the other claimant in the same sync, and a
/// full relist of what is left agrees.
#[tokio::test(start_paused = true)]
async fn deleting_the_holder_hands_the_frontend_over_in_the_same_sync() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, full_list(contested())).await;
    let syncs = ctl.report.syncs;
    drive(&mut ctl, vec![deleted("zold")]).await;
    assert_eq!(ctl.report.syncs - syncs, 1);
    let want_young = want(&[("198.19.0.10:80", &["198.18.0.3:8080"])]);
    assert_eq!(served(ctl.maps()), want_young);
    assert_eq!(labels(ctl.maps()), vec!["shop/ayoung:http"]);
    assert_eq!(ctl.maps().backends.len(), 1, "{:?}", ctl.maps().backends);
    assert_eq!(ctl.sync.conflicts(), 0);
    ctl.maps().check();

    let mut fresh = controller(MemMaps::default());
    let mut left = contested();
    left.remove(0);
    drive(&mut fresh, full_list(left)).await;
    assert_eq!(served(fresh.maps()), want_young);
    assert_eq!(labels(fresh.maps()), labels(ctl.maps()));
}

/// Runs the loop on `events` for `secs` seconds of (paused) time, the channel kept open so
/// that the loop's own retries run.
async fn drive_for(ctl: &mut Controller<MemMaps>, events: Vec<SourceEvent>, secs: u64) {
    let (tx, mut rx) = mpsc::channel(1024);
    for ev in events {
        tx.send(ev).await.unwrap();
    }
    ctl.drive(&mut rx, timing(), async {
        tokio::time::sleep(Duration::from_secs(secs)).await;
    })
    .await;
    drop(tx);
}

/// `n` endpoint addresses, all different.
fn many_ips(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("198.18.{}.{}", 100 + i / 250, 1 + i % 250))
        .collect()
}

/// A service whose frontends × endpoints exceed the per-service limit is not programmed at
/// all (its programmed frontend is removed), with a message naming it and the numbers; the
/// other service keeps being served, and the service comes back when it fits again.
#[tokio::test(start_paused = true)]
async fn a_service_over_the_slot_limit_is_not_programmed_and_the_others_are() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    let ips = many_ips(crate::controller::sync::MAX_SLOTS_PER_SERVICE + 1);
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    drive(&mut ctl, vec![slice("web", &ips)]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.11:80", &["198.18.0.4:8080"])])
    );
    ctl.maps().check();
    assert!(
        !ctl.has_pending(),
        "an over-limit service is not a failed write"
    );
    assert_eq!(
        ctl.sync.too_large().get(&id("web")).map(String::as_str),
        Some(
            "Service shop/web: 1 frontend × 32,769 endpoints = 32,769 backend slots, over \
             the per-service limit of 32,768; not programmed"
        )
    );
    assert_eq!(ctl.report.metrics.services_over_limit.get(), 1);
    // Told once (an Event on the Service when a recorder is configured), not every sync.
    drive(&mut ctl, vec![slice("web", &ips)]).await;
    let events: Vec<&NamespacedName> = ctl.report.service_events.iter().map(|e| &e.0).collect();
    assert_eq!(events, [&id("web")], "{:?}", ctl.report.service_events);

    drive(&mut ctl, vec![slice("web", &["198.18.0.2", "198.18.0.3"])]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]),
            ("198.19.0.11:80", &["198.18.0.4:8080"]),
        ])
    );
    assert!(ctl.sync.too_large().is_empty());
    assert_eq!(ctl.report.metrics.services_over_limit.get(), 0);
    // Not left behind in the backends map either.
    assert_eq!(ctl.maps().backends.len(), 3, "{:?}", ctl.maps().backends);
}

/// A map refusing a new key (E2BIG) fails the frontend that needed it, not the others
/// written in the same sync; its Service gets one Warning Event per failure streak, and
/// the write goes through once there is room.
#[tokio::test(start_paused = true)]
async fn a_full_map_fails_only_the_frontend_that_does_not_fit_and_tells_its_service() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    // Three backends, three slots, two services in the maps: room for one more of each.
    ctl.maps_mut().capacity = Some(4);
    // api (198.19.0.12, written first) needs two new backends; cart (198.19.0.13) reuses
    // web's backend address, so it needs no new backend.
    let more = vec![
        service("api", "198.19.0.12"),
        slice("api", &["198.18.0.9", "198.18.0.10"]),
        service("cart", "198.19.0.13"),
        slice("cart", &["198.18.0.2"]),
    ];
    drive(&mut ctl, more).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]),
            ("198.19.0.11:80", &["198.18.0.4:8080"]),
            ("198.19.0.13:80", &["198.18.0.2:8080"]),
        ])
    );
    ctl.maps().check();
    assert!(ctl.has_pending());
    let events = ctl.report.service_events.clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, id("api"));
    assert!(
        events[0]
            .1
            .contains("frontend 198.19.0.12:80/TCP of Service shop/api")
            && events[0].1.contains("map full"),
        "{}",
        events[0].1
    );
    assert_eq!(ctl.report.metrics.services_map_full.get(), 1);

    // Still full: the retry fails again, and the streak is not told twice.
    drive(&mut ctl, vec![slice("api", &["198.18.0.9", "198.18.0.10"])]).await;
    assert!(ctl.has_pending());
    assert_eq!(ctl.report.service_events.len(), 1);

    ctl.maps_mut().capacity = None;
    drive(&mut ctl, vec![slice("api", &["198.18.0.9", "198.18.0.10"])]).await;
    assert!(!ctl.has_pending());
    assert_eq!(
        served(ctl.maps()).get("198.19.0.12:80"),
        Some(&vec![
            "198.18.0.10:8080".to_string(),
            "198.18.0.9:8080".to_string()
        ])
    );
    assert_eq!(ctl.report.metrics.services_map_full.get(), 0);
}

/// A sync that keeps failing is retried after 1, 2, 4, 8, 16 then 30 s (not every second),
/// and a sync that writes everything resets the wait to 1 s.
#[tokio::test(start_paused = true)]
async fn failed_syncs_back_off_and_a_success_resets_the_wait() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    // No room for a new backend.
    ctl.maps_mut().capacity = Some(3);
    let before = ctl.report.syncs;
    drive_for(
        &mut ctl,
        vec![service("api", "198.19.0.12"), slice("api", &["198.18.0.9"])],
        62,
    )
    .await;
    // Attempts at 0, 1, 3, 7, 15, 31 and 61 s.
    assert_eq!(ctl.report.syncs - before, 7);
    assert!(ctl.has_pending());

    // Room again: the next attempt (here on the next change) writes it.
    ctl.maps_mut().capacity = None;
    let before = ctl.report.syncs;
    drive_for(&mut ctl, vec![slice("api", &["198.18.0.9"])], 30).await;
    assert_eq!(ctl.report.syncs - before, 1);
    assert!(!ctl.has_pending());
    assert!(served(ctl.maps()).contains_key("198.19.0.12:80"));

    // Full again: retried after 1 s again, not 30.
    ctl.maps_mut().capacity = Some(4);
    let before = ctl.report.syncs;
    drive_for(
        &mut ctl,
        vec![
            service("cart", "198.19.0.13"),
            slice("cart", &["198.18.0.20"]),
        ],
        4,
    )
    .await;
    // Attempts at 0, 1 and 3 s.
    assert_eq!(ctl.report.syncs - before, 3);
}

/// A buffer the log lines of one test go to.
#[derive(Clone, Default)]
struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A sync with many failed writes logs the first few with their cause and a count of the
/// rest, not one line per write.
#[test]
fn a_failed_sync_logs_its_first_errors_and_counts_the_rest() {
    let buf = LogBuf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let mut report = Report::new(
        Health::new(Duration::from_secs(30)),
        std::sync::Arc::new(Metrics::new()),
        NODE.into(),
    );
    let errors: Vec<_> = (0..12)
        .map(|_| crate::program::mem::map_full("slots"))
        .collect();
    let s = crate::controller::report::Synced {
        what: "changes",
        started: std::time::Instant::now(),
        services: 1,
        slices: 1,
    };
    tracing::subscriber::with_default(subscriber, || report.sync_failed(&s, &errors));
    let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    let per_write = out.matches("map write failed (will retry)").count();
    assert_eq!(per_write, crate::controller::report::LOGGED_ERRORS, "{out}");
    assert!(out.contains("map full (errno 7, E2BIG)"), "{out}");
    assert!(
        out.contains("7 more map write(s) failed in this sync"),
        "{out}"
    );
}
