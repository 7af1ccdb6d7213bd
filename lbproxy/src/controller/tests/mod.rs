//! The controller in process: a fake source (events sent on a channel, as the real sources
//! do), `MemMaps` in place of the pinned maps, and paused time for the loop's timers. No
//! privileges, no kernel.

use std::collections::BTreeMap;
use std::time::Duration;

use lbproxy_common::SlotKey;
use tokio::sync::mpsc;

use super::{Controller, Report, Timing};
use crate::model::{self, NamespacedName, Normalized};
use crate::program::mem::MemMaps;
use crate::server::Health;
use crate::source::{Kind, SourceEvent};
use crate::telemetry::Metrics;

mod cidrs;
mod contested;
mod reconcile;

use contested::{deleted, service_created};

const NODE: &str = "node-a";

fn timing() -> Timing {
    Timing {
        sync_period: Duration::from_secs(3600),
        min_sync_period: Duration::ZERO,
    }
}

fn controller(maps: MemMaps) -> Controller<MemMaps> {
    Controller::new(
        maps,
        Report::new(
            Health::new(Duration::from_secs(30)),
            std::sync::Arc::new(Metrics::new()),
            NODE.into(),
        ),
    )
}

fn id(name: &str) -> NamespacedName {
    NamespacedName {
        namespace: "shop".into(),
        name: name.into(),
    }
}

/// A Service event for `name` with one TCP port 80 on `vip`.
fn service(name: &str, vip: &str) -> SourceEvent {
    service_created(name, None, vip)
}

/// A slice event for service `name` with ready endpoints `ips` on port 8080.
fn slice(name: &str, ips: &[&str]) -> SourceEvent {
    let eps: Vec<String> = ips
        .iter()
        .map(|ip| format!("{{addresses: [{ip}], nodeName: {NODE}}}"))
        .collect();
    let yaml = format!(
        "metadata: {{name: {name}-a, namespace: shop, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{}]",
        eps.join(", ")
    );
    let k8s = crate::yaml::from_str(&yaml).unwrap();
    let Ok(Normalized::Proxied(s)) = model::slice_from_k8s(&k8s) else {
        panic!("{yaml} did not normalize");
    };
    SourceEvent::Slice {
        id: id(&format!("{name}-a")),
        slice: Some(s),
        trigger: None,
    }
}

/// A full list of every kind, as a watcher's first list or a manifest's first load.
fn full_list(objects: Vec<SourceEvent>) -> Vec<SourceEvent> {
    let mut out = vec![
        SourceEvent::Listing(Kind::Services),
        SourceEvent::Listing(Kind::Slices),
        SourceEvent::Listing(Kind::ServiceCidrs),
    ];
    out.extend(objects);
    out.extend(Kind::ALL.map(SourceEvent::Listed));
    out
}

/// What the datapath would see: each frontend (`vip:port`) and its backends (`ip:port`),
/// read from the in-memory maps only.
fn served(m: &MemMaps) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for (k, v) in &m.services {
        let mut backends: Vec<String> = (0..v.count)
            .map(|slot| {
                let b = &m.backends[&m.slots[&SlotKey {
                    svc_id: v.svc_id,
                    slot,
                }]];
                crate::desired::BackendAddr::from_value(b)
                    .unwrap()
                    .to_string()
            })
            .collect();
        backends.sort();
        let fe = crate::desired::Frontend::from_key(k).unwrap();
        out.insert(
            std::net::SocketAddr::new(fe.addr, fe.port).to_string(),
            backends,
        );
    }
    out
}

fn want(entries: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
    entries
        .iter()
        .map(|(fe, bes)| {
            (
                (*fe).to_string(),
                bes.iter().map(|b| (*b).to_string()).collect(),
            )
        })
        .collect()
}

/// Sends `events` on a channel and runs the controller's loop until the channel is closed.
async fn drive(ctl: &mut Controller<MemMaps>, events: Vec<SourceEvent>) {
    let (tx, mut rx) = mpsc::channel(1024);
    for ev in events {
        tx.send(ev).await.unwrap();
    }
    drop(tx);
    ctl.drive(&mut rx, timing(), std::future::pending()).await;
}

fn two_services() -> Vec<SourceEvent> {
    full_list(vec![
        service("web", "198.19.0.10"),
        slice("web", &["198.18.0.2", "198.18.0.3"]),
        service("db", "198.19.0.11"),
        slice("db", &["198.18.0.4"]),
    ])
}

#[tokio::test(start_paused = true)]
async fn nothing_is_written_until_every_kind_is_listed_then_everything_is() {
    let mut ctl = controller(MemMaps::default());
    let mut events = two_services();
    let node_listed = events.pop();
    drive(&mut ctl, events).await;
    assert_eq!(
        ctl.maps().ops,
        0,
        "written before the Node list completed: {:?}",
        served(ctl.maps())
    );
    assert!(!ctl.ready());

    drive(&mut ctl, node_listed.into_iter().collect()).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"]),
            ("198.19.0.11:80", &["198.18.0.4:8080"]),
        ])
    );
    ctl.maps().check();
}

#[tokio::test(start_paused = true)]
async fn a_change_reprograms_only_its_service() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    let db_before = ctl
        .maps()
        .services
        .values()
        .map(|v| v.svc_id)
        .collect::<Vec<_>>();
    let ops = ctl.maps().ops;

    drive(&mut ctl, vec![slice("web", &["198.18.0.2", "198.18.0.5"])]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.5:8080"]),
            ("198.19.0.11:80", &["198.18.0.4:8080"]),
        ])
    );
    // Swap one backend: membership out and in, a backend in, the slot, the old backend out.
    let writes = ctl.maps().ops - ops;
    assert!(
        writes <= 5,
        "{writes} map operations for one endpoint change"
    );
    let db_after = ctl
        .maps()
        .services
        .values()
        .map(|v| v.svc_id)
        .collect::<Vec<_>>();
    assert_eq!(db_before, db_after, "service ids changed");
}

#[tokio::test(start_paused = true)]
async fn a_deleted_service_and_its_backends_leave_the_maps() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    drive(
        &mut ctl,
        vec![
            SourceEvent::Service {
                id: id("db"),
                service: None,
            },
            SourceEvent::Slice {
                id: id("db-a"),
                slice: None,
                trigger: None,
            },
        ],
    )
    .await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.2:8080", "198.18.0.3:8080"])])
    );
    assert_eq!(ctl.maps().backends.len(), 2, "{:?}", ctl.maps().backends);
    assert_eq!(ctl.maps().labels.len(), 1, "{:?}", ctl.maps().labels);
}

/// A watcher re-lists after `410 Gone`: objects deleted while it was away are simply not in
/// the new list, and must go; changed ones take their listed state.
#[tokio::test(start_paused = true)]
async fn a_relist_after_410_removes_what_is_no_longer_listed() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    drive(
        &mut ctl,
        vec![
            SourceEvent::Failed {
                source: "services",
                error: "410 Gone".into(),
            },
            SourceEvent::Listing(Kind::Services),
            service("web", "198.19.0.10"),
            SourceEvent::Listed(Kind::Services),
            SourceEvent::Listing(Kind::Slices),
            slice("web", &["198.18.0.3"]),
            SourceEvent::Listed(Kind::Slices),
        ],
    )
    .await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.3:8080"])])
    );
    ctl.maps().check();
}

/// A write the maps refuse leaves them consistent and the change pending; the loop retries
/// it a second later, and the retry writes it.
#[tokio::test(start_paused = true)]
async fn a_failed_write_is_retried_until_it_is_written() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    ctl.maps_mut().fail_at = Some(1);
    let started = tokio::time::Instant::now();
    let (tx, mut rx) = mpsc::channel(16);
    tx.send(slice("web", &["198.18.0.7"])).await.unwrap();
    // Keep the channel open past the first attempt, so the loop's own retry does the work.
    let run = ctl.drive(&mut rx, timing(), async {
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    run.await;
    drop(tx);
    assert!(
        ctl.maps().fail_at.is_none(),
        "the injected failure never fired"
    );
    assert!(!ctl.has_pending(), "the change is still pending after 5 s");
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("198.19.0.10:80", &["198.18.0.7:8080"]),
            ("198.19.0.11:80", &["198.18.0.4:8080"]),
        ])
    );
    ctl.maps().check();
    assert!(started.elapsed() >= Duration::from_secs(5));
}

/// A removal the maps refuse is retried by the loop like any failed write, though the
/// frontend has already left its service's claims: the retry removes it.
#[tokio::test(start_paused = true)]
async fn a_failed_removal_is_retried_by_the_next_sync() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    // The removal's first write (the service entry) is refused.
    ctl.maps_mut().fail_at = Some(0);
    let (tx, mut rx) = mpsc::channel(16);
    tx.send(deleted("web")).await.unwrap();
    // A syncPeriod of an hour: only the loop's retry can remove it.
    ctl.drive(&mut rx, timing(), async {
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    drop(tx);
    assert!(
        ctl.maps().fail_at.is_none(),
        "the injected failure never fired"
    );
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.11:80", &["198.18.0.4:8080"])])
    );
    ctl.maps().check();
}

/// A restarted controller adopts what the maps hold: the same desired state writes
/// nothing, and ids (which flows refer to) are kept.
#[tokio::test(start_paused = true)]
async fn a_restart_adopts_the_maps_and_rewrites_nothing() {
    let mut first = controller(MemMaps::default());
    drive(&mut first, two_services()).await;
    let maps = first.maps().clone();
    let ids: Vec<u32> = maps.services.values().map(|v| v.svc_id).collect();
    let ops = maps.ops;

    let mut second = controller(maps);
    drive(&mut second, two_services()).await;
    assert_eq!(
        second.maps().ops,
        ops,
        "a restart with the same state wrote to the maps"
    );
    let ids_after: Vec<u32> = second.maps().services.values().map(|v| v.svc_id).collect();
    assert_eq!(ids, ids_after);

    // And it goes on from there: a new service gets an id no one had.
    drive(
        &mut second,
        vec![
            service("cache", "198.19.0.12"),
            slice("cache", &["198.18.0.9"]),
        ],
    )
    .await;
    let new_id = second
        .maps()
        .services
        .values()
        .map(|v| v.svc_id)
        .find(|i| !ids.contains(i));
    assert!(new_id.is_some(), "{:?}", second.maps().services);
}

/// Every service and backend id in the maps.
fn ids_in(m: &MemMaps) -> std::collections::BTreeSet<u32> {
    m.backends
        .keys()
        .copied()
        .chain(m.services.values().map(|v| v.svc_id))
        .chain(m.labels.keys().copied())
        .collect()
}

/// Ids freed before a restart are not handed out after it: flows in the (pinned, kept)
/// flow table may still hold them. Here `web`, whose ids are the highest, is deleted, then
/// lbproxy restarts over the same maps and a new service arrives.
#[tokio::test(start_paused = true)]
async fn ids_freed_before_a_restart_are_not_handed_out_after_it() {
    let mut first = controller(MemMaps::default());
    drive(&mut first, two_services()).await;
    let mut used = ids_in(first.maps());
    drive(&mut first, vec![deleted("web")]).await;
    assert_eq!(
        served(first.maps()),
        want(&[("198.19.0.11:80", &["198.18.0.4:8080"])])
    );
    assert!(ids_in(first.maps()).len() < used.len(), "nothing was freed");

    let mut maps = first.maps().clone();
    for restart in 0..3 {
        let mut ctl = controller(maps);
        let name = format!("new{restart}");
        let ips = [format!("198.18.1.{restart}"), format!("198.18.2.{restart}")];
        drive(
            &mut ctl,
            full_list(vec![
                service("db", "198.19.0.11"),
                slice("db", &["198.18.0.4"]),
                service(&name, "198.19.0.20"),
                slice(&name, &[&ips[0], &ips[1]]),
            ]),
        )
        .await;
        let now = ids_in(ctl.maps());
        let fe = crate::desired::Frontend {
            addr: std::net::Ipv4Addr::new(198, 19, 0, 20).into(),
            port: 80,
            proto: model::Protocol::Tcp,
            pods_only: false,
        };
        let v = ctl.maps().services[&fe.key()];
        let mut mine = vec![v.svc_id];
        mine.extend((0..v.count).map(|slot| {
            ctl.maps().slots[&SlotKey {
                svc_id: v.svc_id,
                slot,
            }]
        }));
        let reused: Vec<u32> = mine.iter().copied().filter(|i| used.contains(i)).collect();
        assert!(
            reused.is_empty(),
            "restart {restart}: ids {reused:?} handed out again (used before: {used:?})"
        );
        used.extend(now);
        // The new service goes again, freeing its ids before the next restart.
        drive(
            &mut ctl,
            vec![
                deleted(&name),
                SourceEvent::Slice {
                    id: id(&format!("{name}-a")),
                    slice: None,
                    trigger: None,
                },
            ],
        )
        .await;
        maps = ctl.maps().clone();
    }
}

/// Events that arrive together are written by one sync.
#[tokio::test(start_paused = true)]
async fn events_queued_together_are_one_sync() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    let before = ctl.report.syncs;
    drive(
        &mut ctl,
        vec![
            slice("web", &["198.18.0.2"]),
            slice("db", &["198.18.0.5"]),
            service("cache", "198.19.0.12"),
        ],
    )
    .await;
    assert_eq!(
        ctl.report.syncs - before,
        1,
        "syncs for one burst of events"
    );
}

/// The manifests source goes through the same path: its first load is a full list.
#[tokio::test(start_paused = true)]
async fn a_manifest_load_programs_like_a_watch() {
    let dir = std::env::temp_dir().join(format!("lbproxy-ctl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("web.yaml");
    std::fs::write(
        &file,
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.10, ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [198.18.0.2]}]\n",
    )
    .unwrap();
    let mut reader = crate::source::manifests::watch::Reader::default();
    let first = reader.load(&file, Vec::new()).expect("a first load event");
    std::fs::remove_dir_all(&dir).unwrap();
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, vec![first]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.2:8080"])])
    );
}

/// A Service event from YAML `spec` (and `labels`) for `shop/name`.
fn service_yaml(name: &str, labels: &str, spec: &str) -> SourceEvent {
    let yaml =
        format!("metadata: {{name: {name}, namespace: shop, labels: {{{labels}}}}}\nspec: {spec}");
    let k8s = crate::yaml::from_str(&yaml).unwrap();
    let service = match model::service_from_k8s(&k8s) {
        Ok(Normalized::Proxied(s)) => Some(s),
        Ok(Normalized::Skipped(_)) => None,
        Err(e) => panic!("{yaml}: {e}"),
    };
    SourceEvent::Service {
        id: id(name),
        service,
    }
}

/// A controller that has listed `shop/web` with this spec and one endpoint, 198.18.0.2.
async fn web_from(spec: &str) -> Controller<MemMaps> {
    let mut ctl = controller(MemMaps::default());
    drive(
        &mut ctl,
        full_list(vec![
            service_yaml("web", "", spec),
            slice("web", &["198.18.0.2"]),
        ]),
    )
    .await;
    ctl
}

/// Frontends asked for but not served yet: (kind, port, label, reason), from the maps.
fn unserved(m: &MemMaps) -> Vec<(u8, u16, String, String)> {
    m.unserved
        .iter()
        .map(|(k, v)| {
            (
                k.kind,
                u16::from_be(k.port_be),
                crate::bpf::pinned::label_bytes(&v.label),
                crate::bpf::pinned::label_bytes(&v.reason),
            )
        })
        .collect()
}

/// SCTP frontends of every kind are programmed like TCP's (here without an SCTP endpoint:
/// no backend, so the datapath rejects), follow their service's changes and leave with
/// it; nothing is listed as not served.
#[tokio::test(start_paused = true)]
async fn sctp_frontends_are_programmed_and_follow_their_service() {
    let spec = "{type: NodePort, clusterIP: 198.19.0.10, externalIPs: [203.0.113.7], ports: [{name: http, port: 80, nodePort: 30080}, {name: sig, port: 99, protocol: SCTP, nodePort: 30099}]}";
    let mut ctl = web_from(spec).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("0.0.0.0:30080", &["198.18.0.2:8080"]),
            ("0.0.0.0:30099", &[]),
            ("198.19.0.10:80", &["198.18.0.2:8080"]),
            ("198.19.0.10:99", &[]),
            ("203.0.113.7:80", &["198.18.0.2:8080"]),
            ("203.0.113.7:99", &[]),
        ])
    );
    assert!(ctl.maps().unserved.is_empty(), "{:?}", unserved(ctl.maps()));

    // The external IP goes: the ClusterIP and NodePort SCTP frontends stay.
    let spec = "{type: NodePort, clusterIP: 198.19.0.10, ports: [{name: http, port: 80, nodePort: 30080}, {name: sig, port: 99, protocol: SCTP, nodePort: 30099}]}";
    drive(&mut ctl, vec![service_yaml("web", "", spec)]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[
            ("0.0.0.0:30080", &["198.18.0.2:8080"]),
            ("0.0.0.0:30099", &[]),
            ("198.19.0.10:80", &["198.18.0.2:8080"]),
            ("198.19.0.10:99", &[]),
        ])
    );

    // The service goes: nothing is left.
    drive(
        &mut ctl,
        vec![SourceEvent::Service {
            id: id("web"),
            service: None,
        }],
    )
    .await;
    assert!(ctl.maps().unserved.is_empty(), "{:?}", unserved(ctl.maps()));
    assert!(ctl.maps().services.is_empty());
}

/// kube-proxy does not proxy a Service labelled `service.kubernetes.io/headless`, whatever
/// its clusterIP; adding or removing the label takes effect at once.
#[tokio::test(start_paused = true)]
async fn the_headless_label_takes_effect_live() {
    let spec = "{clusterIP: 198.19.0.10, ports: [{name: http, port: 80}]}";
    let mut ctl = web_from(spec).await;
    assert_eq!(served(ctl.maps()).len(), 1);
    drive(
        &mut ctl,
        vec![service_yaml(
            "web",
            "service.kubernetes.io/headless: ''",
            spec,
        )],
    )
    .await;
    assert!(
        served(ctl.maps()).is_empty(),
        "labelled headless and still served: {:?}",
        served(ctl.maps())
    );
    drive(&mut ctl, vec![service_yaml("web", "", spec)]).await;
    assert_eq!(
        served(ctl.maps()),
        want(&[("198.19.0.10:80", &["198.18.0.2:8080"])])
    );
}
