//! Health and metrics endpoints.
//!
//! - `--healthz-bind-address`: `GET /healthz` and `/livez`: 200 once the first full sync is in
//!   the maps, 503 before.
//! - `--metrics-bind-address`: `GET /metrics` (OpenMetrics) and `/proxyMode` (`ebpf`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What the endpoints report. Cheap to clone.
#[derive(Clone)]
pub struct Health {
    synced: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
}

pub struct Metrics {
    registry: Registry,
    pub syncs: Counter,
    pub sync_failures: Counter,
    pub last_sync_timestamp: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub frontends: Gauge,
    pub backends: Gauge,
    pub attached_interfaces: Gauge,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let syncs = Counter::default();
        let sync_failures = Counter::default();
        let last_sync_timestamp = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        let frontends = Gauge::default();
        let backends = Gauge::default();
        let attached_interfaces = Gauge::default();
        registry.register(
            "lbproxy_syncs",
            "Syncs of the model into the maps",
            syncs.clone(),
        );
        registry.register(
            "lbproxy_sync_failures",
            "Syncs that failed to read the source or write a map",
            sync_failures.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time the maps were successfully synced",
            last_sync_timestamp.clone(),
        );
        registry.register(
            "lbproxy_frontends",
            "Frontends programmed",
            frontends.clone(),
        );
        registry.register("lbproxy_backends", "Backends programmed", backends.clone());
        registry.register(
            "lbproxy_attached_interfaces",
            "Pod interfaces with the datapath attached",
            attached_interfaces.clone(),
        );
        Self {
            registry,
            syncs,
            sync_failures,
            last_sync_timestamp,
            frontends,
            backends,
            attached_interfaces,
        }
    }
}

impl Health {
    pub fn new() -> Self {
        Self {
            synced: Arc::new(AtomicBool::new(false)),
            metrics: Arc::new(Metrics::new()),
        }
    }

    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }
}

async fn healthz(State(h): State<Health>) -> impl IntoResponse {
    if h.synced.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the first sync is not in the maps yet\n",
        )
    }
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    let mut body = String::new();
    if encode(&mut body, &h.metrics.registry).is_err() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            String::new(),
        );
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

/// Binds both listeners (so a bad address fails at start) and serves them in the background.
pub async fn serve(
    health: Health,
    healthz_addr: SocketAddr,
    metrics_addr: SocketAddr,
) -> anyhow::Result<()> {
    let h = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .with_state(health.clone());
    let m = Router::new()
        .route("/metrics", get(metrics))
        .route("/proxyMode", get(|| async { "ebpf" }))
        .with_state(health);
    let hl = tokio::net::TcpListener::bind(healthz_addr)
        .await
        .map_err(|e| anyhow::anyhow!("--healthz-bind-address {healthz_addr}: {e}"))?;
    let ml = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-bind-address {metrics_addr}: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(hl, h).await {
            tracing::error!("healthz server stopped: {e}");
        }
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(ml, m).await {
            tracing::error!("metrics server stopped: {e}");
        }
    });
    Ok(())
}
