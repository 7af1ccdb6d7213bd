//! The Kubernetes API source: list+watch of Services, EndpointSlices (label
//! `kubernetes.io/service-name`) and this node, with kube-rs watchers.
//!
//! A watcher re-lists after a `410 Gone` and resumes a broken watch from the last
//! resourceVersion; kube-rs's default backoff spaces out retries while the API server is away.
//! Events go to the controller as [`SourceEvent`]s; the controller owns the model.

use std::path::Path;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Service as K8sService};
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::mpsc;

use crate::model::LABEL_SERVICE_NAME;

/// What a watcher reports. Objects are boxed: they differ a lot in size and only pass
/// through the channel once.
#[derive(Debug)]
pub enum SourceEvent {
    Service(Event<Box<K8sService>>),
    Slice(Event<Box<K8sEndpointSlice>>),
    Node(Event<Box<Node>>),
    /// A watch failed; kube-rs retries with backoff. Carries the resource and the error.
    WatchError(&'static str, String),
}

/// Builds a client from `--kubeconfig`, else `KUBECONFIG` / in-cluster (kube-rs's inference).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
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
    Ok(Client::try_from(config)?)
}

fn spawn_watch<K, F>(
    api: Api<K>,
    cfg: watcher::Config,
    name: &'static str,
    tx: mpsc::Sender<SourceEvent>,
    wrap: F,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: Fn(Event<K>) -> SourceEvent + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let mut stream = watcher::watcher(api.clone(), cfg.clone())
                .default_backoff()
                .boxed();
            while let Some(item) = stream.next().await {
                let (ev, relist) = match item {
                    Ok(ev) => (wrap(ev), false),
                    Err(e) => {
                        let gone = is_gone(&e);
                        (SourceEvent::WatchError(name, e.to_string()), gone)
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
            // A 410 on the watch request itself: kube-rs would retry the same expired
            // resourceVersion forever, so start over with a fresh list, as client-go does.
            tracing::info!(resource = name, "resourceVersion expired (410); re-listing");
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    });
}

fn boxed<K>(e: Event<K>) -> Event<Box<K>> {
    match e {
        Event::Apply(k) => Event::Apply(Box::new(k)),
        Event::Delete(k) => Event::Delete(Box::new(k)),
        Event::Init => Event::Init,
        Event::InitApply(k) => Event::InitApply(Box::new(k)),
        Event::InitDone => Event::InitDone,
    }
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

/// Starts the three watchers. Events arrive on the returned channel until it is dropped.
pub fn watch(client: &Client, node_name: &str) -> mpsc::Receiver<SourceEvent> {
    let (tx, rx) = mpsc::channel(256);
    spawn_watch(
        Api::<K8sService>::all(client.clone()),
        watcher::Config::default(),
        "services",
        tx.clone(),
        |e| SourceEvent::Service(boxed(e)),
    );
    spawn_watch(
        Api::<K8sEndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(LABEL_SERVICE_NAME),
        "endpointslices",
        tx.clone(),
        |e| SourceEvent::Slice(boxed(e)),
    );
    spawn_watch(
        Api::<Node>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        "nodes",
        tx,
        |e| SourceEvent::Node(boxed(e)),
    );
    rx
}
