//! The periodic reconcile without holding up change syncs (`Pass`): the read-back on
//! another thread, the comparison that leaves out what was written meanwhile, the blocking
//! repair when it finds drift, and the sweep of every service a slice at a time.

use std::time::Duration;

use tokio::sync::mpsc;

use super::*;

fn both() -> BTreeMap<String, Vec<String>> {
    want(&[
        ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]),
        ("198.19.0.11:80", &["198.18.0.4:8080"]),
    ])
}

/// A controller that programmed `events`.
async fn programmed(events: Vec<SourceEvent>) -> Controller<MemMaps> {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, events).await;
    ctl
}

/// A controller that programmed [`two_services`], one of whose service entries was then
/// deleted by hand.
async fn with_an_entry_deleted() -> Controller<MemMaps> {
    let mut ctl = programmed(two_services()).await;
    let key = *ctl.maps().services.keys().next().unwrap();
    ctl.maps_mut().services.remove(&key);
    assert_ne!(served(ctl.maps()), both());
    ctl
}

/// A read-back compared at once, nothing synced in between.
fn read_back_now(ctl: &mut Controller<MemMaps>) {
    let read = ctl.begin_reconcile().expect("MemMaps reads back");
    ctl.read_back_done(read());
}

/// The loop, with no event, for 3 s at a `syncPeriod` of 2 s: one periodic reconcile.
async fn one_sync_period(ctl: &mut Controller<MemMaps>) {
    let (_tx, mut rx) = mpsc::channel::<SourceEvent>(16);
    let timing = Timing {
        sync_period: Duration::from_secs(2),
        min_sync_period: Duration::ZERO,
    };
    ctl.drive(&mut rx, timing, tokio::time::sleep(Duration::from_secs(3)))
        .await;
}

/// Runs every step of a sweep that has started.
fn sweep_to_the_end(ctl: &mut Controller<MemMaps>) {
    let mut steps = 0;
    while ctl.sweeping() {
        ctl.sweep_step();
        steps += 1;
        assert!(steps < 10_000, "the sweep does not end");
    }
}

/// A change synced while the read-back runs changes entries the read saw before: they are
/// left out of the comparison, which finds no drift, and the sweep that follows writes
/// nothing. Compared whole, the read would be taken for drift.
#[tokio::test(start_paused = true)]
async fn a_change_synced_during_the_read_back_is_not_drift() {
    let mut ctl = programmed(two_services()).await;
    let read = ctl.begin_reconcile().expect("MemMaps reads back");
    // The read saw the maps as they were; web's endpoints change before it is compared.
    drive(&mut ctl, vec![slice("web", &["198.18.0.2", "198.18.0.5"])]).await;
    let changed = want(&[
        ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.5:8080"]),
        ("198.19.0.11:80", &["198.18.0.4:8080"]),
    ]);
    assert_eq!(served(ctl.maps()), changed);
    ctl.read_back_done(read());
    assert!(
        ctl.sweeping(),
        "the change made during the read was taken for drift"
    );
    let ops = ctl.maps().ops;
    sweep_to_the_end(&mut ctl);
    assert_eq!(
        ctl.maps().ops,
        ops,
        "the sweep wrote to maps that were right"
    );
    assert_eq!(served(ctl.maps()), changed);
    ctl.maps().check();
}

/// Two Services share a backend (one pod behind both). One of them changes during the
/// read-back: it leaves the shared backend, which the other still names, and gains a new
/// one. Only the changed Service was written; the other's entries and the shared backend's
/// are as written, so there is no drift, and the sweep writes nothing.
#[tokio::test(start_paused = true)]
async fn a_change_during_the_read_back_to_one_of_two_services_sharing_a_backend_is_not_drift() {
    let mut ctl = programmed(full_list(vec![
        service("web", "198.19.0.10"),
        slice("web", &["198.18.0.2", "198.18.0.3"]),
        service("db", "198.19.0.11"),
        slice("db", &["198.18.0.2", "198.18.0.4"]),
    ]))
    .await;
    let read = ctl.begin_reconcile().expect("MemMaps reads back");
    drive(&mut ctl, vec![slice("web", &["198.18.0.3", "198.18.0.5"])]).await;
    let changed = want(&[
        ("198.19.0.10:80", &["198.18.0.3:8080", "198.18.0.5:8080"]),
        ("198.19.0.11:80", &["198.18.0.2:8080", "198.18.0.4:8080"]),
    ]);
    assert_eq!(served(ctl.maps()), changed);
    ctl.read_back_done(read());
    assert!(
        ctl.sweeping(),
        "the change to one of the two Services was taken for drift"
    );
    let ops = ctl.maps().ops;
    sweep_to_the_end(&mut ctl);
    assert_eq!(
        ctl.maps().ops,
        ops,
        "the sweep wrote to maps that were right"
    );
    assert_eq!(served(ctl.maps()), changed);
    ctl.maps().check();
}

/// An entry deleted by hand is drift: the read-back finds it, and the blocking reconcile
/// repairs it at once (no sweep).
#[tokio::test(start_paused = true)]
async fn drift_found_by_the_read_back_is_repaired() {
    let mut ctl = with_an_entry_deleted().await;
    read_back_now(&mut ctl);
    assert!(!ctl.sweeping(), "drift was not found");
    assert_eq!(served(ctl.maps()), both());
    ctl.maps().check();
}

/// The same through the loop: every `syncPeriod` it reads back on a blocking thread, and a
/// hand-deleted entry is back within a period.
#[tokio::test(start_paused = true)]
async fn the_loop_repairs_drift_every_sync_period() {
    let mut ctl = with_an_entry_deleted().await;
    one_sync_period(&mut ctl).await;
    assert_eq!(served(ctl.maps()), both());
}

/// The sweep syncs every service again through the change path: a service whose change
/// was never marked for a sync (a bug the full reconcile is there to catch) is written by
/// the next period's sweep, run by the loop between its other work.
#[tokio::test(start_paused = true)]
async fn the_sweep_writes_a_change_no_sync_was_marked_for() {
    let mut ctl = programmed(two_services()).await;
    // Into the model, with the dirty mark lost.
    let ev = slice("db", &["198.18.0.8"]);
    ctl.ingest.apply(ev, &mut ctl.report);
    ctl.ingest.dirty.clear();
    assert_eq!(served(ctl.maps()), both());
    one_sync_period(&mut ctl).await;
    assert!(!ctl.sweeping(), "the sweep did not end");
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]),
            ("198.19.0.11:80", &["198.18.0.8:8080"]),
        ])
    );
    ctl.maps().check();
}

/// A backend entry rewritten by hand to another address is drift of every frontend that
/// names it: found by the read-back, and repaired.
#[tokio::test(start_paused = true)]
async fn a_backend_entry_changed_by_hand_is_drift() {
    let mut ctl = programmed(two_services()).await;
    let (id, other) = {
        let m = ctl.maps();
        let id = *m.slots.values().next().unwrap();
        let other = *m
            .backends
            .values()
            .find(|b| **b != m.backends[&id])
            .unwrap();
        (id, other)
    };
    ctl.maps_mut().backends.insert(id, other);
    assert_ne!(served(ctl.maps()), both());
    read_back_now(&mut ctl);
    assert!(!ctl.sweeping(), "the changed backend entry was not found");
    assert_eq!(served(ctl.maps()), both());
    ctl.maps().check();
}

/// A frontend whose removal failed has left the claims. The change path retries it
/// (`a_failed_removal_is_retried_by_the_next_sync`); were that bookkeeping lost, the sweep
/// still removes what no service claims, as the full sync did.
#[tokio::test(start_paused = true)]
async fn the_sweep_removes_a_frontend_no_service_claims() {
    let mut ctl = programmed(two_services()).await;
    // The removal's first write (the service entry) is refused.
    ctl.maps_mut().fail_at = Some(0);
    drive(&mut ctl, vec![deleted("web")]).await;
    assert!(
        ctl.maps().fail_at.is_none(),
        "the injected failure never fired"
    );
    assert_eq!(
        served(ctl.maps()),
        both(),
        "the refused removal removed web"
    );
    ctl.sync.forget_unsettled();
    one_sync_period(&mut ctl).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.11:80", &["198.18.0.4:8080"])])
    );
    ctl.maps().check();
}

/// A frontend written during every read-back is never compared by them: after
/// `MAX_SKIPPED_READS` in a row, the reconcile is the blocking one, which compares it.
#[tokio::test(start_paused = true)]
async fn a_frontend_written_during_every_read_back_is_compared_the_blocking_way() {
    let mut ctl = programmed(two_services()).await;
    let max = crate::controller::sync::MAX_SKIPPED_READS;
    for i in 1..=max {
        let read = ctl.begin_reconcile().expect("MemMaps reads back");
        let ip = if i % 2 == 0 {
            "198.18.0.5"
        } else {
            "198.18.0.6"
        };
        drive(&mut ctl, vec![slice("web", &[ip])]).await;
        ctl.read_back_done(read());
        if i < max {
            assert!(ctl.sweeping(), "read-back {i} was not compared");
            sweep_to_the_end(&mut ctl);
        } else {
            assert!(!ctl.sweeping(), "read-back {i} left web out again");
        }
    }
}
