//! Shared pieces of the Kubernetes-API-source tests (`kube_source*.rs`, `metrics.rs`,
//! `config.rs`): a lab with an [`ApiServer`] in its node namespace, lbproxy started against
//! it, the programmed frontends as `lbproxy inspect services --json` reports them, an HTTP
//! GET that de-chunks, and a small OpenMetrics text parser.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lbproxy_tests::apiserver::{ApiServer, Request};
use lbproxy_tests::lab::{
    Backend, Endpoint, EndpointSlice, Inspect as _, Lab, Lbproxy, Manifest, Pod, Shape, run_in_ns,
};
use serde_json::Value;

use crate::common::{BACKEND_TCP, BACKEND_UDP, HEALTHY_WITHIN, WEB_TCP, WEB_UDP, web_objects};

/// The node name lbproxy is started with (`--hostname-override`); the lab's endpoints
/// default to `nodeName: lab-node`.
pub const NODE: &str = "lab-node";
/// The contract: a watch event is applied within 2 s. The assertions allow 250 ms on top for
/// the probe loop (each probe runs `lbproxy inspect`).
pub const APPLY: Duration = Duration::from_millis(2250);
/// Recovery that goes through kube-rs's default watcher backoff (0.8 s doubling up to 30 s,
/// with jitter): a re-list after 410 or after the API server was away. The bound is the
/// backoff's ceiling plus slack; the tests print the time it actually took.
pub const RECOVER: Duration = Duration::from_secs(35);

/// One programmed frontend: its service and its backends (`ip:port`, sorted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fe {
    pub service: String,
    pub backends: Vec<String>,
}

pub type Fes = BTreeMap<String, Fe>;

/// Builds an expected frontend map: `(frontend, service, backends)`.
pub fn fes(list: &[(&str, &str, &[&str])]) -> Fes {
    list.iter()
        .map(|(f, s, b)| {
            let mut b: Vec<String> = b.iter().map(|x| x.to_string()).collect();
            b.sort();
            (
                f.to_string(),
                Fe {
                    service: s.to_string(),
                    backends: b,
                },
            )
        })
        .collect()
}

/// The `web`-style frontends (TCP `vip:80` -> `:8080`, UDP `vip:53` -> `:5353`) of service
/// `default/<name>` over `ips`.
pub fn web_fes(name: &str, vip: Ipv4Addr, ips: &[Ipv4Addr]) -> Fes {
    let tcp: Vec<String> = ips.iter().map(|i| format!("{i}:{BACKEND_TCP}")).collect();
    let udp: Vec<String> = ips.iter().map(|i| format!("{i}:{BACKEND_UDP}")).collect();
    let tcp: Vec<&str> = tcp.iter().map(String::as_str).collect();
    let udp: Vec<&str> = udp.iter().map(String::as_str).collect();
    let svc = format!("default/{name}");
    fes(&[
        (&format!("{vip}:{WEB_TCP}/TCP"), &svc, &tcp),
        (&format!("{vip}:{WEB_UDP}/UDP"), &svc, &udp),
    ])
}

/// Merges frontend maps.
pub fn union(maps: impl IntoIterator<Item = Fes>) -> Fes {
    maps.into_iter().flatten().collect()
}

/// `lbproxy inspect services --json` as [`Fes`].
pub fn frontends(lab: &Lab) -> Fes {
    let mut out = Fes::new();
    for row in lab.inspect_services() {
        let b = super::common::row_backends(&row);
        out.insert(
            row.frontend,
            Fe {
                service: row.service,
                backends: b,
            },
        );
    }
    out
}

/// Drops frontends without backends (a service whose endpoints are all gone may be
/// programmed as a frontend with no backends, which rejects, or not at all).
pub fn with_backends(f: Fes) -> Fes {
    f.into_iter()
        .filter(|(_, v)| !v.backends.is_empty())
        .collect()
}

/// `(service JSON, slice JSON)` of the standard web service `name` on `vip` with one slice
/// `<name>-1` holding `endpoints` (see `common::web_objects`).
pub fn web_json(name: &str, vip: Ipv4Addr, endpoints: Vec<Endpoint>) -> (Value, Value) {
    let m: Manifest = web_objects(name, vip, endpoints);
    (m.objects[0].to_json(), m.objects[1].to_json())
}

/// Ready endpoints for `pods` (nodeName `lab-node`, targetRef to the pod).
pub fn eps(pods: &[&Pod]) -> Vec<Endpoint> {
    pods.iter()
        .map(|p| Endpoint::ready(p.ip).pod(&p.name))
        .collect()
}

/// A lab whose node namespace holds an [`ApiServer`] (with Node `lab-node`), pods serving
/// TCP 8080 and UDP 5353, and (once [`Kube::start`]ed) lbproxy running against the server.
/// Field order is drop order: lbproxy first, the lab last.
pub struct Kube {
    pub lb: Option<Lbproxy>,
    pub servers: Vec<Backend>,
    pub api: ApiServer,
    pub kubeconfig: PathBuf,
    pub pods: Vec<Pod>,
    pub lab: Lab,
}

impl Kube {
    /// Lab of `shape` with pods `pods` (all serving), the API server and the Node object.
    pub fn new(shape: Shape, pods: &[&str]) -> Kube {
        let lab = Lab::new(shape);
        let pods: Vec<Pod> = pods.iter().map(|n| lab.add_pod(n)).collect();
        let servers = pods
            .iter()
            .filter(|p| p.name != "client")
            .map(|p| p.serve(&[BACKEND_TCP, BACKEND_UDP]))
            .collect();
        let api = ApiServer::start_in_ns(lab.node_ns());
        api.apply(ApiServer::node(NODE));
        let kubeconfig = api.write_kubeconfig(lab.workdir());
        Kube {
            lb: None,
            servers,
            api,
            kubeconfig,
            pods,
            lab,
        }
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn ip(&self, name: &str) -> Ipv4Addr {
        self.pod(name).ip
    }

    /// `lbproxy run` arguments: the lab's base arguments, `--kubeconfig`,
    /// `--hostname-override lab-node`.
    pub fn args(&self) -> Vec<String> {
        let mut a = self.lab.lbproxy_base_args();
        a.extend([
            "--kubeconfig".into(),
            self.kubeconfig.display().to_string(),
            "--hostname-override".into(),
            NODE.into(),
        ]);
        a
    }

    /// Starts lbproxy with [`Self::args`] plus `extra` (does not wait).
    pub fn start_with(&mut self, extra: &[&str]) -> &mut Lbproxy {
        let mut a = self.args();
        a.extend(extra.iter().map(|s| s.to_string()));
        self.lb = Some(self.lab.start_lbproxy_argv(a, &[]));
        self.lb.as_mut().unwrap()
    }

    /// Starts lbproxy and waits until /healthz is 200; returns the time that took.
    pub fn start_healthy(&mut self) -> Duration {
        self.start_with(&[]);
        let d = self.expect_healthy(HEALTHY_WITHIN);
        eprintln!("[{}] lbproxy healthy {d:?} after start", self.lab.shape());
        d
    }

    pub fn expect_healthy(&mut self, within: Duration) -> Duration {
        let r = self
            .lb
            .as_mut()
            .expect("lbproxy not started")
            .wait_healthy(within);
        r.unwrap_or_else(|e| panic!("{e}\n--- API requests ---\n{}", self.api.request_log()))
    }

    pub fn lb(&mut self) -> &mut Lbproxy {
        self.lb.as_mut().expect("lbproxy not started")
    }

    pub fn frontends(&self) -> Fes {
        frontends(&self.lab)
    }

    /// lbproxy's log tail and the API server's request log, for failure messages.
    pub fn diag(&self) -> String {
        let log = self.lb.as_ref().map(Lbproxy::log).unwrap_or_default();
        let reqs = self.api.request_log();
        let lines: Vec<&str> = reqs.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        format!(
            "{log}\n--- API requests (last 40 of {}) ---\n{tail}",
            lines.len()
        )
    }

    /// Polls `inspect services` (every 50 ms) until `f(frontends)` holds; returns the time
    /// it took, or panics after `within` with the last state and [`Self::diag`].
    pub fn wait_until(&self, ctx: &str, within: Duration, f: impl Fn(&Fes) -> bool) -> Duration {
        let start = Instant::now();
        loop {
            let got = self.frontends();
            if f(&got) {
                return start.elapsed();
            }
            if start.elapsed() >= within {
                panic!(
                    "[{}] {ctx}: not reached within {within:?}; last inspect:\n{got:#?}\n{}",
                    self.lab.shape(),
                    self.diag()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// [`Self::wait_until`] the frontends equal `want`.
    pub fn wait_fes(&self, ctx: &str, within: Duration, want: &Fes) -> Duration {
        let d = self.wait_until(ctx, within, |g| g == want);
        eprintln!("[{}] {ctx}: applied in {d:?}", self.lab.shape());
        d
    }

    /// [`Self::wait_until`] the frontends that have backends equal `want` (see
    /// [`with_backends`]).
    pub fn wait_fes_with_backends(&self, ctx: &str, within: Duration, want: &Fes) -> Duration {
        let d = self.wait_until(ctx, within, |g| with_backends(g.clone()) == *want);
        eprintln!("[{}] {ctx}: applied in {d:?}", self.lab.shape());
        d
    }

    /// Asserts the frontends stay equal to `want` for `dur`.
    pub fn assert_stays(&self, ctx: &str, dur: Duration, want: &Fes) {
        let start = Instant::now();
        while start.elapsed() < dur {
            let got = self.frontends();
            assert_eq!(
                &got,
                want,
                "[{}] {ctx}: state changed after {:?}\n{}",
                self.lab.shape(),
                start.elapsed(),
                self.diag()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until watches on services, endpointslices and nodes are open (answered and
    /// streaming), so that a change is delivered live.
    pub fn wait_watching(&self, within: Duration) {
        let start = Instant::now();
        for r in ["services", "endpointslices", "nodes"] {
            while self.api.open_watches(r).is_empty() {
                assert!(
                    start.elapsed() < within,
                    "no open watch on {r} after {within:?}\n{}",
                    self.diag()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// An HTTP response with a de-chunked body.
#[derive(Clone, Debug)]
pub struct Http {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Http {
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` from inside network namespace `ns` (2 s timeout), body de-chunked.
pub fn http_get(ns: &str, addr: &str, path: &str) -> Result<Http, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let raw = run_in_ns(ns, || -> std::io::Result<Vec<u8>> {
        let t = Duration::from_secs(2);
        let mut s = TcpStream::connect_timeout(&addr, t)?;
        s.set_read_timeout(Some(t))?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )?;
        let mut raw = Vec::new();
        if let Err(e) = s.read_to_end(&mut raw)
            && raw.is_empty()
        {
            return Err(e);
        }
        Ok(raw)
    })
    .map_err(|e| format!("GET http://{addr}{path}: {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET {path}: bad reply {text:?}"))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("GET {path}: bad status line in {text:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Ok(Http {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &str) -> Result<String, String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s
            .split_once("\r\n")
            .ok_or_else(|| format!("bad chunked body: {s:?}"))?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|e| format!("bad chunk size {size:?}: {e}"))?;
        if n == 0 {
            return Ok(out);
        }
        if rest.len() < n + 2 {
            return Err(format!("truncated chunk: {rest:?}"));
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// One sample of an OpenMetrics (or Prometheus) text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed exposition.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    pub samples: Vec<Sample>,
    /// `# TYPE` lines: metric family name -> type.
    pub types: BTreeMap<String, String>,
    /// True if the text ended with `# EOF` (required by OpenMetrics).
    pub eof: bool,
    pub text: String,
}

impl Scrape {
    /// Parses `name{k="v",...} value [timestamp] [# exemplar]` lines and `# TYPE` comments.
    pub fn parse(text: &str) -> Result<Scrape, String> {
        let mut sc = Scrape {
            text: text.to_owned(),
            ..Default::default()
        };
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if line == "# EOF" {
                sc.eof = true;
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut p = rest.split_whitespace();
                if let (Some(n), Some(t)) = (p.next(), p.next()) {
                    sc.types.insert(n.to_owned(), t.to_owned());
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let err = |m: &str| format!("line {}: {m}: {line:?}", i + 1);
            let name_end = line.find(['{', ' ']).ok_or_else(|| err("no value"))?;
            let name = line[..name_end].to_owned();
            let mut labels = BTreeMap::new();
            let mut rest = &line[name_end..];
            if let Some(r) = rest.strip_prefix('{') {
                let mut chars = r.char_indices().peekable();
                let mut end = None;
                loop {
                    // key
                    while chars.peek().is_some_and(|(_, c)| *c == ',' || *c == ' ') {
                        chars.next();
                    }
                    match chars.peek() {
                        Some((j, '}')) => {
                            end = Some(*j);
                            break;
                        }
                        None => break,
                        _ => {}
                    }
                    let mut key = String::new();
                    for (_, c) in chars.by_ref() {
                        if c == '=' {
                            break;
                        }
                        key.push(c);
                    }
                    if chars.next().map(|(_, c)| c) != Some('"') {
                        return Err(err("label value not quoted"));
                    }
                    let mut val = String::new();
                    let mut closed = false;
                    while let Some((_, c)) = chars.next() {
                        match c {
                            '\\' => match chars.next().map(|(_, c)| c) {
                                Some('n') => val.push('\n'),
                                Some(c) => val.push(c),
                                None => break,
                            },
                            '"' => {
                                closed = true;
                                break;
                            }
                            c => val.push(c),
                        }
                    }
                    if !closed {
                        return Err(err("unterminated label value"));
                    }
                    labels.insert(key.trim().to_owned(), val);
                }
                let end = end.ok_or_else(|| err("unterminated label set"))?;
                rest = &r[end + 1..];
            }
            let v = rest
                .split_whitespace()
                .next()
                .ok_or_else(|| err("no value"))?;
            let value = match v {
                "+Inf" | "Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                "NaN" => f64::NAN,
                v => v
                    .parse::<f64>()
                    .map_err(|e| err(&format!("bad value ({e})")))?,
            };
            sc.samples.push(Sample {
                name,
                labels,
                value,
            });
        }
        Ok(sc)
    }

    /// The value of the sample `name` whose labels include `labels`, if exactly one matches.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let m: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect();
        (m.len() == 1).then(|| m[0].value)
    }

    /// Like [`Self::get`] but panics with the exposition's matching lines.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| {
            let family = name
                .trim_end_matches("_total")
                .trim_end_matches("_count")
                .trim_end_matches("_sum")
                .trim_end_matches("_bucket");
            let near: Vec<&str> = self.text.lines().filter(|l| l.contains(family)).collect();
            panic!(
                "metric {name}{labels:?}: not exactly one sample; lines mentioning {family}:\n{}",
                near.join("\n")
            )
        })
    }

    /// Names of all samples.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.samples.iter().map(|s| s.name.as_str()).collect();
        v.dedup();
        v
    }
}

// ---- small fixtures of the Kubernetes source suites ----

pub fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n)
}

pub fn ready_ips(ips: &[Ipv4Addr]) -> Vec<Endpoint> {
    ips.iter().map(|i| Endpoint::ready(*i)).collect()
}

/// `endpoints` JSON for `ips` (ready, on lab-node).
pub fn eps_json(ips: &[Ipv4Addr]) -> Value {
    let s = EndpointSlice {
        endpoints: ready_ips(ips),
        ..EndpointSlice::new("x", "x")
    }
    .to_json();
    s["endpoints"].clone()
}

pub fn watches_since(reqs: &[Request], plural: &str) -> Vec<Request> {
    reqs.iter()
        .filter(|r| r.is_watch() && r.resource() == Some(plural))
        .cloned()
        .collect()
}

pub fn lists_since(reqs: &[Request], plural: &str) -> Vec<Request> {
    reqs.iter()
        .filter(|r| r.is_list() && r.resource() == Some(plural))
        .cloned()
        .collect()
}

#[cfg(test)]
mod parser_tests {
    use super::*;

    #[test]
    fn openmetrics_parser() {
        let t = "# HELP a_total x\n# TYPE a counter\na_total 3\nb{map=\"LB_X\",q=\"a\\\"b\"} 1.5e0\n\
                 h_bucket{le=\"+Inf\"} 4\nh_count 4 # {trace_id=\"1\"} 1\n# EOF\n";
        let s = Scrape::parse(t).unwrap();
        assert!(s.eof);
        assert_eq!(s.value("a_total", &[]), 3.0);
        assert_eq!(s.value("b", &[("map", "LB_X")]), 1.5);
        assert_eq!(s.samples[1].labels["q"], "a\"b");
        assert_eq!(s.value("h_bucket", &[("le", "+Inf")]), 4.0);
        assert_eq!(s.value("h_count", &[]), 4.0);
        assert_eq!(s.types["a"], "counter");
        assert_eq!(
            dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            "abcde"
        );
    }
}
