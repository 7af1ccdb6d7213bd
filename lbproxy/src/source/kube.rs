//! The Kubernetes API source: list+watch of Services, EndpointSlices (label
//! `kubernetes.io/service-name`), ServiceCIDRs (`networking.k8s.io/v1`; none on an API
//! server without them) and this node, with kube-rs watchers.
//!
//! A watcher re-lists after a `410 Gone` and resumes a broken watch from the last
//! resourceVersion; kube-rs's default backoff spaces out retries while the API server is away.
//!
//! Start-up makes one request per resource whatever the cluster's size, as kube-proxy's
//! informers: a streaming list ([`stream_config`]: a watch that first sends every object),
//! or, where the API server refuses it, one list from its watch cache
//! ([`cache_list_config`]: `resourceVersion=0`). A re-list after `410 Gone` is a
//! consistent, paginated read ([`relist_config`]).
//! Each object is normalized here, as it arrives, into the model's types, and reaches the
//! controller as a [`SourceEvent`]; the controller owns the model. An invalid object is
//! logged with the field at fault and treated as not proxied.

use std::path::Path;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service as K8sService};
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR as K8sServiceCidr;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event, InitialListStrategy};
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

/// Watches `api` with `selectors` applied to [`stream_config`] (with `stream`) or
/// [`cache_list_config`], sending each event through `wrap`. A refused streaming list falls
/// back to the list from the cache, and a `410 Gone` re-lists with [`relist_config`]. With `optional`, the resource may be
/// missing from the API server (ServiceCIDR before Kubernetes 1.33): a 404 is then an empty
/// list of that kind, logged once, and the source looks again every [`MISSING_RETRY`]
/// instead of retrying at the watcher's pace.
fn spawn_watch<K, S, F>(
    api: Api<K>,
    selectors: S,
    stream: bool,
    name: &'static str,
    optional: Option<Kind>,
    tx: mpsc::Sender<SourceEvent>,
    wrap: F,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    S: Fn(watcher::Config) -> watcher::Config + Send + 'static,
    F: Fn(Event<K>) -> SourceEvent + Send + 'static,
{
    tokio::spawn(async move {
        let mut missing = false;
        // Streamed, or from the watch cache, until a 410 says our resourceVersion is gone;
        // consistent from then on (see `relist_config`).
        let mut cfg = selectors(if stream {
            stream_config()
        } else {
            cache_list_config()
        });
        loop {
            let mut stream = watcher::watcher(api.clone(), cfg.clone())
                .default_backoff()
                .boxed();
            let mut absent: Option<&'static str> = None;
            let mut refused = false;
            while let Some(item) = stream.next().await {
                let (ev, relist) = match item {
                    Ok(ev) => {
                        missing = false;
                        (wrap(ev), false)
                    }
                    Err(e)
                        if cfg.initial_list_strategy == InitialListStrategy::StreamingList
                            && watch_list_refused(&e) =>
                    {
                        tracing::info!(
                            resource = name,
                            "the API server refuses streaming lists ({e}); listing from its \
                             watch cache instead"
                        );
                        refused = true;
                        break;
                    }
                    Err(e) if optional.is_some() && unavailable(&e).is_some() => {
                        absent = unavailable(&e);
                        break;
                    }
                    Err(e) => {
                        let gone = is_gone(&e) || is_gone_event(&e);
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
            if refused {
                cfg = selectors(cache_list_config());
                continue;
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
            // A 410 in the stream (an ERROR event) would have kube-rs re-list by itself, but
            // from the watch cache; both re-list consistently instead.
            cfg = selectors(relist_config());
            tracing::info!(resource = name, "resourceVersion expired (410); re-listing");
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    });
}

/// How a watcher starts where the API server streams lists (KEP-3157, `WatchList`): one watch
/// with `sendInitialEvents=true` (`resourceVersion=0`, `resourceVersionMatch=NotOlderThan`)
/// that sends every object as `ADDED`, then a bookmark marking the end of the initial state,
/// then the changes. One request per resource, and each object is decoded and normalized as
/// it arrives: nothing holds the whole list (a list in one response is read, then decoded,
/// whole before its first object reaches the model: about 200 MiB more at 50,000 Services).
/// client-go's reflectors start this way where the `WatchListClient` gate is on, and fall
/// back to a list when the server refuses; [`spawn_watch`] does the same
/// ([`cache_list_config`]).
pub(crate) fn stream_config() -> watcher::Config {
    watcher::Config::default().streaming_lists()
}

/// How a watcher starts where the API server does not stream lists: one list from its watch
/// cache (`resourceVersion=0`, `resourceVersionMatch=NotOlderThan`), which answers in one
/// response and ignores `limit`, as kube-proxy's informers list without `WatchListClient`.
/// Either way start-up costs one request per resource whatever the cluster's size, and the
/// client's rate limit (5 a second, burst 10, as kube-proxy's) never paces it.
///
/// No `limit`: the watch cache ignores it anyway, and kube-rs leaves `resourceVersion=0` out
/// of a list request that has one (the list would then be a consistent read, in pages, each
/// page a request: 10 requests per resource at 5,000 objects).
pub(crate) fn cache_list_config() -> watcher::Config {
    let mut c = watcher::Config::default().any_semantic();
    c.page_size = None;
    c
}

/// Whether the API server streams lists, from its version (`/version`, one request): the
/// `sendInitialEvents` parameter exists from Kubernetes 1.27. An older server ignores it and
/// never sends the bookmark that ends the initial state, so the stream would never finish
/// listing; a newer one either streams or refuses (`422 Invalid` when its `WatchList` gate
/// is off: by default in 1.27-1.31 and again in 1.33), and a refusal falls back to the list.
/// An unknown version lists.
async fn streams_lists(client: &Client) -> bool {
    match client.apiserver_version().await {
        Ok(info) => {
            let num = |s: &str| {
                s.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse::<u32>()
                    .ok()
            };
            let stream = version_streams(num(&info.major), num(&info.minor));
            tracing::info!(
                version = %info.git_version,
                "start-up lists: {}",
                if stream {
                    "streamed (sendInitialEvents), or from the watch cache if refused"
                } else {
                    "from the watch cache (resourceVersion=0)"
                }
            );
            stream
        }
        Err(e) => {
            tracing::info!("API server version unknown ({e}); start-up lists from the watch cache");
            false
        }
    }
}

/// Kubernetes 1.27 or later (see [`streams_lists`]).
fn version_streams(major: Option<u32>, minor: Option<u32>) -> bool {
    matches!((major, minor), (Some(1), Some(m)) if m >= 27) || major.is_some_and(|m| m > 1)
}

/// The API server refused a streaming list: `422 Invalid` (the `WatchList` gate is off) or
/// `400 Bad Request` on the watch request itself.
fn watch_list_refused(e: &watcher::Error) -> bool {
    matches!(
        e,
        watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 422 || s.code == 400
    )
}

/// How a watcher re-lists after `410 Gone`: a consistent read (no `resourceVersion`), in
/// pages. The watch cache may be behind the resourceVersion that just expired (another API
/// server's cache, in an HA control plane), and a list from it could hand back an older
/// state than the one already applied; client-go's reflector re-lists consistently after an
/// expired resourceVersion for the same reason.
pub(crate) fn relist_config() -> watcher::Config {
    watcher::Config::default()
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

/// A `410 Gone` sent as an ERROR event in the watch stream (the real API server's way): kube-rs
/// re-lists by itself after it, but with the watcher's start-up list; [`spawn_watch`] starts
/// over with [`relist_config`] instead.
fn is_gone_event(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchError(s) if s.code == 410)
}

/// Starts the four watchers. Their events go to `tx` until its receiver is dropped.
pub fn spawn(client: &Client, node_name: &str, tx: mpsc::Sender<SourceEvent>) {
    let client = client.clone();
    let node_name = node_name.to_owned();
    tokio::spawn(async move {
        let stream = streams_lists(&client).await;
        spawn_all(&client, &node_name, stream, tx);
    });
}

/// The four watchers, streaming their start-up lists with `stream`.
fn spawn_all(client: &Client, node_name: &str, stream: bool, tx: mpsc::Sender<SourceEvent>) {
    spawn_watch(
        Api::<K8sService>::all(client.clone()),
        |c| c,
        stream,
        "services",
        None,
        tx.clone(),
        |e| translate(Kind::Services, e, service_event),
    );
    spawn_watch(
        Api::<K8sEndpointSlice>::all(client.clone()),
        |c| c.labels(LABEL_SERVICE_NAME),
        stream,
        "endpointslices",
        None,
        tx.clone(),
        |e| translate(Kind::Slices, e, slice_event),
    );
    spawn_watch(
        Api::<K8sServiceCidr>::all(client.clone()),
        |c| c,
        stream,
        "servicecidrs",
        Some(Kind::ServiceCidrs),
        tx.clone(),
        |e| translate(Kind::ServiceCidrs, e, service_cidr_event),
    );
    spawn_watch(
        Api::<Node>::all(client.clone()),
        {
            let field = format!("metadata.name={node_name}");
            move |c: watcher::Config| c.fields(&field)
        },
        stream,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Start-up streams (one watch per resource that sends the whole state first), or lists
    /// once from the watch cache; a re-list after 410 reads consistently, in pages.
    #[test]
    fn start_up_is_one_request_per_resource_and_relists_are_consistent() {
        let stream = stream_config();
        assert_eq!(
            stream.initial_list_strategy,
            InitialListStrategy::StreamingList
        );
        assert!(stream.bookmarks, "a streaming list needs bookmarks");
        let cache = cache_list_config();
        assert_eq!(cache.list_semantic, watcher::ListSemantic::Any);
        assert_eq!(cache.initial_list_strategy, InitialListStrategy::ListWatch);
        assert_eq!(
            cache.page_size, None,
            "kube-rs drops resourceVersion=0 from a list with a limit"
        );
        let relist = relist_config();
        assert_eq!(relist.list_semantic, watcher::ListSemantic::MostRecent);
        assert_eq!(relist.initial_list_strategy, InitialListStrategy::ListWatch);
        assert_eq!(
            relist.page_size,
            Some(500),
            "a consistent re-list is paginated"
        );
    }

    #[test]
    fn streaming_lists_from_kubernetes_1_27() {
        for (major, minor, want) in [
            (Some(1), Some(26), false),
            (Some(1), Some(27), true),
            (Some(1), Some(33), true),
            (Some(2), Some(0), true),
            (None, Some(33), false),
            (Some(1), None, false),
        ] {
            assert_eq!(version_streams(major, minor), want, "{major:?}.{minor:?}");
        }
    }
}
