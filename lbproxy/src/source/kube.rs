//! The Kubernetes API source: list+watch of Services, EndpointSlices (label
//! `kubernetes.io/service-name`), ServiceCIDRs (`networking.k8s.io/v1`; none on an API
//! server without them) and this node, with kube-rs watchers.
//!
//! A watcher re-lists after a `410 Gone` and resumes a broken watch from the last
//! resourceVersion; kube-rs's default backoff spaces out retries while the API server is away.
//! Each object is normalized here, as it arrives, into the model's types, and reaches the
//! controller as a [`SourceEvent`]; the controller owns the model. An invalid object is
//! logged with the field at fault and treated as not proxied.

use std::path::Path;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service as K8sService};
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR as K8sServiceCidr;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::mpsc;

use super::{Kind, SourceEvent};
use crate::model::{self, LABEL_SERVICE_NAME, NamespacedName, Normalized};

/// The EndpointSlice annotation kube-proxy measures programming latency from.
const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

pub use crate::model::{TO_BE_DELETED_TAINT, not_eligible, zone_of};

/// Builds a client from `--kubeconfig`, else `KUBECONFIG` / in-cluster (kube-rs's inference),
/// measured and rate-limited by [`super::kube_client`].
pub async fn client(
    kubeconfig: Option<&Path>,
    metrics: &crate::telemetry::Metrics,
    qps: f32,
    burst: u32,
) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| anyhow::anyhow!("kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no Kubernetes configuration: {e}. Pass --kubeconfig or --manifests, or run in a cluster"
            )
        })?,
    };
    let layer = super::kube_client::ClientMetrics::new(&config.cluster_url, metrics, qps, burst);
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        .build())
}

/// How long a source waits before looking again for a resource the API server does not
/// have (`optional` in [`spawn_watch`]).
const MISSING_RETRY: std::time::Duration = std::time::Duration::from_secs(300);

/// Watches `api`, sending each event through `wrap`. With `optional`, the resource may be
/// missing from the API server (ServiceCIDR before Kubernetes 1.33): a 404 is then an empty
/// list of that kind, logged once, and the source looks again every [`MISSING_RETRY`]
/// instead of retrying at the watcher's pace.
fn spawn_watch<K, F>(
    api: Api<K>,
    cfg: watcher::Config,
    name: &'static str,
    optional: Option<Kind>,
    tx: mpsc::Sender<SourceEvent>,
    wrap: F,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: Fn(Event<K>) -> SourceEvent + Send + 'static,
{
    tokio::spawn(async move {
        let mut missing = false;
        loop {
            let mut stream = watcher::watcher(api.clone(), cfg.clone())
                .default_backoff()
                .boxed();
            let mut absent: Option<&'static str> = None;
            while let Some(item) = stream.next().await {
                let (ev, relist) = match item {
                    Ok(ev) => {
                        missing = false;
                        (wrap(ev), false)
                    }
                    Err(e) if optional.is_some() && unavailable(&e).is_some() => {
                        absent = unavailable(&e);
                        break;
                    }
                    Err(e) => {
                        let gone = is_gone(&e);
                        (
                            SourceEvent::Failed {
                                source: name,
                                error: e.to_string(),
                            },
                            gone,
                        )
                    }
                };
                // Bounded: a big list waits for the controller instead of piling up raw
                // objects.
                if tx.send(ev).await.is_err() {
                    return;
                }
                if relist {
                    break;
                }
            }
            if let (Some(why), Some(kind)) = (absent, optional) {
                if !missing {
                    missing = true;
                    tracing::warn!(
                        resource = name,
                        "{name}: {why}; taken as none, looking again every {} s",
                        MISSING_RETRY.as_secs()
                    );
                    let empty = [SourceEvent::Listing(kind), SourceEvent::Listed(kind)];
                    for ev in empty {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                }
                tokio::time::sleep(MISSING_RETRY).await;
                continue;
            }
            // A 410 on the watch request itself: kube-rs would retry the same expired
            // resourceVersion forever, so start over with a fresh list, as client-go does.
            tracing::info!(resource = name, "resourceVersion expired (410); re-listing");
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    });
}

/// A watcher event in the source's terms: `Init`/`InitDone` frame a full list, and every
/// object is normalized (`delete` gives the same id with nothing).
fn translate<K>(kind: Kind, ev: Event<K>, object: impl Fn(&K, bool) -> SourceEvent) -> SourceEvent {
    match ev {
        Event::Init => SourceEvent::Listing(kind),
        Event::InitDone => SourceEvent::Listed(kind),
        Event::Apply(k) | Event::InitApply(k) => object(&k, true),
        Event::Delete(k) => object(&k, false),
    }
}

/// A Service as the model takes it; an invalid one is logged and not proxied.
fn service_event(svc: &K8sService, present: bool) -> SourceEvent {
    let id = NamespacedName::of(&svc.metadata);
    let service = if present {
        match model::service_from_k8s(svc) {
            Ok(Normalized::Proxied(s)) => Some(s),
            Ok(Normalized::Skipped(why)) => {
                tracing::debug!(service = %id, "not proxied: {why}");
                None
            }
            Err(e) => {
                tracing::warn!(service = %id, "ignoring {e}");
                None
            }
        }
    } else {
        None
    };
    SourceEvent::Service { id, service }
}

/// An EndpointSlice as the model takes it, with its trigger time.
fn slice_event(slice: &K8sEndpointSlice, present: bool) -> SourceEvent {
    let id = NamespacedName::of(&slice.metadata);
    if !present {
        return SourceEvent::Slice {
            id,
            slice: None,
            trigger: None,
        };
    }
    let trigger = slice
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TRIGGER_TIME))
        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        .map(|ts| ts.as_millisecond() as f64 / 1000.0);
    let slice = match model::slice_from_k8s(slice) {
        Ok(Normalized::Proxied(s)) => Some(s),
        Ok(Normalized::Skipped(_)) => None,
        Err(e) => {
            tracing::warn!(slice = %id, "ignoring {e}");
            None
        }
    };
    SourceEvent::Slice { id, slice, trigger }
}

/// Why an optional resource cannot be read, when the list or the watch was answered `404
/// Not Found` (the API server does not have it) or `403 Forbidden` (the ClusterRole does not
/// grant it: an RBAC from before the resource was used).
fn unavailable(e: &watcher::Error) -> Option<&'static str> {
    let (watcher::Error::InitialListFailed(kube::Error::Api(s))
    | watcher::Error::WatchStartFailed(kube::Error::Api(s))) = e
    else {
        return None;
    };
    match s.code {
        404 => Some("the API server does not have the resource (404; Kubernetes before 1.33?)"),
        403 => Some("forbidden (403): the ClusterRole must grant list and watch on it"),
        _ => None,
    }
}

/// A ServiceCIDR as the model takes it; an invalid one is logged and left out.
fn service_cidr_event(c: &K8sServiceCidr, present: bool) -> SourceEvent {
    let id = NamespacedName {
        namespace: String::new(),
        name: c.metadata.name.clone().unwrap_or_default(),
    };
    let cidr = if present {
        match model::service_cidr_from_k8s(c) {
            Ok(Normalized::Proxied(c)) => Some(c),
            Ok(Normalized::Skipped(_)) => None,
            Err(e) => {
                tracing::warn!(service_cidr = %id, "ignoring {e}");
                None
            }
        }
    } else {
        None
    };
    SourceEvent::ServiceCidr { id, cidr }
}

/// A `410 Gone` answered to the watch request itself (not as an ERROR event in the stream,
/// which kube-rs already turns into a re-list).
fn is_gone(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::WatchStartFailed(kube::Error::Api(s))
            | watcher::Error::WatchFailed(kube::Error::Api(s)) if s.code == 410
    )
}

/// Starts the four watchers. Their events go to `tx` until its receiver is dropped.
pub fn spawn(client: &Client, node_name: &str, tx: mpsc::Sender<SourceEvent>) {
    spawn_watch(
        Api::<K8sService>::all(client.clone()),
        watcher::Config::default(),
        "services",
        None,
        tx.clone(),
        |e| translate(Kind::Services, e, service_event),
    );
    spawn_watch(
        Api::<K8sEndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(LABEL_SERVICE_NAME),
        "endpointslices",
        None,
        tx.clone(),
        |e| translate(Kind::Slices, e, slice_event),
    );
    spawn_watch(
        Api::<K8sServiceCidr>::all(client.clone()),
        watcher::Config::default(),
        "servicecidrs",
        Some(Kind::ServiceCidrs),
        tx.clone(),
        |e| translate(Kind::ServiceCidrs, e, service_cidr_event),
    );
    spawn_watch(
        Api::<Node>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        "nodes",
        None,
        tx,
        |e| {
            translate(Kind::Node, e, |n: &Node, present| {
                if present {
                    SourceEvent::Node {
                        uid: n.metadata.uid.clone(),
                        not_eligible: not_eligible(n),
                        zone: zone_of(n),
                    }
                } else {
                    SourceEvent::Node {
                        uid: None,
                        not_eligible: Some("the Node was deleted".into()),
                        zone: None,
                    }
                }
            })
        },
    );
}
