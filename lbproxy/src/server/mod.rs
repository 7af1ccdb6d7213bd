//! Health and metrics endpoints, with kube-proxy's names and semantics.
//!
//! - `--healthz-bind-address`: `GET /healthz` and `/livez`. Both are 503 until the first full
//!   sync is in the maps.
//!   - `/healthz` (readiness, and what load balancers probe) then follows kube-proxy's rule:
//!     503 when a queued change has waited longer than twice the sync period without being
//!     written, or when this node is not eligible for traffic: its Node object is being
//!     deleted (or is gone), or carries the cluster autoscaler's
//!     `ToBeDeletedByClusterAutoscaler` taint. The JSON body has kube-proxy's keys
//!     (`lastUpdated`, `currentTime`, `nodeEligible`), then lbproxy's own.
//!   - `/livez` (liveness) ignores node eligibility, and only asks whether the controller's
//!     loop is still turning: a change that cannot be written (a full map, say) makes
//!     `/healthz` 503 but must not make the kubelet restart lbproxy on every node (kube-proxy's
//!     `/livez` fails for an overdue sync too).
//!   - Every answer is counted in `kubeproxy_proxy_healthz_total{code}` and
//!     `kubeproxy_proxy_livez_total{code}`.
//! - `--metrics-bind-address`: `GET /metrics` (OpenMetrics), `/proxyMode` (`ebpf`) and
//!   `/configz` (the running configuration as JSON, keyed by API group).

mod health;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

pub use health::Health;

use crate::telemetry::{CodeLabel, Metrics};

/// What the endpoints answer from: the health state and the metric registry.
#[derive(Clone)]
struct Endpoints {
    health: Health,
    metrics: Arc<Metrics>,
}

async fn healthz(State(e): State<Endpoints>) -> impl IntoResponse {
    answer(&e.metrics.healthz_total, e.health.report())
}

async fn livez(State(e): State<Endpoints>) -> impl IntoResponse {
    answer(&e.metrics.livez_total, e.health.report_live())
}

fn answer(
    counter: &Family<CodeLabel, Counter>,
    (ok, body): (bool, String),
) -> axum::response::Response {
    let (code, label) = if ok {
        (StatusCode::OK, "200")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "503")
    };
    counter.get_or_create(&CodeLabel { code: label }).inc();
    (
        code,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

async fn metrics_text(State(e): State<Endpoints>) -> impl IntoResponse {
    let mut body = String::new();
    if e.metrics.encode(&mut body).is_err() {
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
    metrics: Arc<Metrics>,
    healthz_addr: SocketAddr,
    metrics_addr: SocketAddr,
    configz: serde_json::Value,
) -> anyhow::Result<()> {
    let endpoints = Endpoints { health, metrics };
    let h = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .with_state(endpoints.clone());
    let configz = Arc::new(format!("{configz:#}\n"));
    let m = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/proxyMode", get(|| async { "ebpf" }))
        .route(
            "/configz",
            get(move || {
                let body = configz.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "application/json")],
                        (*body).clone(),
                    )
                }
            }),
        )
        .with_state(endpoints);
    let hl = tokio::net::TcpListener::bind(healthz_addr)
        .await
        .map_err(|e| anyhow::anyhow!("healthzBindAddress {healthz_addr}: {e}"))?;
    let ml = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .map_err(|e| anyhow::anyhow!("metricsBindAddress {metrics_addr}: {e}"))?;
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
