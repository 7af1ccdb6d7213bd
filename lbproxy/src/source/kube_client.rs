//! The API client's tower layer: client-go's `rest_client_*` metrics, measured around every
//! request the kube client sends, and kube-proxy's client rate limit
//! (`clientConnection.qps`/`burst`, a rate limiter in front of each request).
//!
//! - `rest_client_requests_total{code,method,host}`: one per response (`code` is the status,
//!   or `<error>` when none came back).
//! - `rest_client_request_duration_seconds{verb,url}`: from the request until its response
//!   headers (a watch counts until its stream starts). The URL's namespace and object names
//!   are elided (`{namespace}`, `{name}`), so the label set stays bounded.

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabel {
    pub code: String,
    pub method: String,
    pub host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabel {
    pub verb: String,
    pub url: String,
}

/// client-go's buckets for `rest_client_request_duration_seconds`.
pub fn duration_buckets() -> Histogram {
    Histogram::new([
        0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
    ])
}

/// kube-proxy's `clientConnection.qps`/`burst` as a rate limiter (governor's GCRA: `qps`
/// requests a second, `burst` at once). `None` for a negative `qps` (the file's 0 is the
/// default, 5, by then): no limit.
fn limiter(qps: f32, burst: u32) -> Option<Arc<DefaultDirectRateLimiter>> {
    if qps <= 0.0 {
        return None;
    }
    let quota = Quota::with_period(Duration::from_secs_f64(1.0 / f64::from(qps)))?
        .allow_burst(NonZeroU32::new(burst.max(1))?);
    Some(Arc::new(RateLimiter::direct(quota)))
}

/// What the layer records into, and its limit.
#[derive(Clone, Debug)]
pub struct ClientMetrics {
    host: String,
    requests: Family<RequestLabel, Counter>,
    duration: Family<DurationLabel, Histogram, fn() -> Histogram>,
    limiter: Option<Arc<DefaultDirectRateLimiter>>,
}

impl ClientMetrics {
    pub fn new(
        cluster_url: &http::Uri,
        metrics: &crate::telemetry::Metrics,
        qps: f32,
        burst: u32,
    ) -> Self {
        let host = cluster_url
            .authority()
            .map_or_else(String::new, |a| a.to_string());
        Self {
            host,
            requests: metrics.rest_requests.clone(),
            duration: metrics.rest_duration.clone(),
            limiter: limiter(qps, burst),
        }
    }
}

impl<S> tower::Layer<S> for ClientMetrics {
    type Service = Measured<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Measured {
            inner,
            m: self.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Measured<S> {
    inner: S,
    m: ClientMetrics,
}

/// The path with namespace and object names replaced, as client-go's URL label does.
pub fn url_template(path: &str) -> String {
    let segs: Vec<&str> = path.split('/').collect();
    let mut out = Vec::with_capacity(segs.len());
    let mut i = 0;
    while i < segs.len() {
        out.push(segs[i].to_string());
        if segs[i] == "namespaces" && i + 1 < segs.len() {
            out.push("{namespace}".into());
            i += 1;
            // .../namespaces/NS/RESOURCE/NAME
            if i + 2 < segs.len() {
                out.push(segs[i + 1].to_string());
                out.push("{name}".into());
                i += 2;
            }
        } else if (segs[i] == "nodes" || segs[i] == "services" || segs[i] == "endpointslices")
            && i + 1 < segs.len()
            && !segs[i + 1].is_empty()
        {
            out.push("{name}".into());
            i += 1;
        }
        i += 1;
    }
    out.join("/")
}

/// Whether `uri` asks for a later page of a list (a non-empty `continue`). The rate limit
/// counts a paginated list once, at its first page. Start-up lists are one request per
/// resource (streamed, or from the watch cache in one response: `source::kube::stream_config`),
/// as kube-proxy's informers list, so its limit never paces a start-up; but a re-list after
/// `410 Gone` is consistent, in pages of 500, and pacing each page (5 a second by default)
/// took 40 s to list 50,000 Services.
fn continues_a_list(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|kv| kv.strip_prefix("continue=").is_some_and(|v| !v.is_empty()))
    })
}

impl<S, B, RB> tower::Service<http::Request<B>> for Measured<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = req.method().as_str().to_string();
        let url = format!("https://{}{}", self.m.host, url_template(req.uri().path()));
        let paced = !continues_a_list(req.uri());
        // The client's futures do nothing until polled: waiting before the first poll
        // delays the request itself.
        let request = self.inner.call(req);
        let m = self.m.clone();
        Box::pin(async move {
            if let Some(l) = m.limiter.as_ref().filter(|_| paced) {
                l.until_ready().await;
            }
            let started = Instant::now();
            let result = request.await;
            let code = match &result {
                Ok(resp) => resp.status().as_u16().to_string(),
                Err(_) => "<error>".to_string(),
            };
            m.duration
                .get_or_create(&DurationLabel {
                    verb: method.clone(),
                    url,
                })
                .observe(started.elapsed().as_secs_f64());
            m.requests
                .get_or_create(&RequestLabel {
                    code,
                    method,
                    host: m.host.clone(),
                })
                .inc();
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_names() {
        for (path, want) in [
            ("/api/v1/services", "/api/v1/services"),
            ("/api/v1/nodes", "/api/v1/nodes"),
            ("/api/v1/nodes/node-a", "/api/v1/nodes/{name}"),
            (
                "/apis/events.k8s.io/v1/namespaces/default/events",
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
            ),
            (
                "/apis/events.k8s.io/v1/namespaces/default/events/e1",
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events/{name}",
            ),
        ] {
            assert_eq!(url_template(path), want);
        }
    }

    #[test]
    fn the_limit_spaces_requests_after_the_burst() {
        use governor::clock::Clock as _;
        let l = limiter(10.0, 2).expect("a limit");
        assert!(l.check().is_ok());
        assert!(l.check().is_ok());
        let w = l
            .check()
            .expect_err("a third request at once is over the burst")
            .wait_time_from(governor::clock::DefaultClock::default().now());
        assert!(
            w > Duration::from_millis(80) && w <= Duration::from_millis(100),
            "{w:?}"
        );
        assert!(limiter(-1.0, 1).is_none(), "a negative qps is no limit");
        for (uri, later_page) in [
            ("/api/v1/services?limit=500", false),
            ("/api/v1/services?limit=500&continue=", false),
            ("/api/v1/services?limit=500&continue=eyJydiI6MX0", true),
            ("/api/v1/services?continue=abc&limit=500", true),
            ("/api/v1/services?watch=true&resourceVersion=7", false),
        ] {
            let uri: http::Uri = uri.parse().unwrap();
            assert_eq!(continues_a_list(&uri), later_page, "{uri}");
        }
    }
}
