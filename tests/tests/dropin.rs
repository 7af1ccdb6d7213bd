//! lbproxy as a drop-in for kube-proxy, against the test API server: kubeadm's kube-proxy
//! `config.conf` runs it unchanged; `/healthz` follows the Node's eligibility (deletion, the
//! `ToBeDeletedByClusterAutoscaler` taint) while `/livez` ignores it; every metric the
//! kubernetes-mixin "Proxy" dashboard queries is exported with kube-proxy's buckets; JSON
//! logs parse line by line; `/configz` and `--write-config-to` give the running
//! configuration; a change to the config file makes lbproxy exit, as kube-proxy does.

mod common;
mod kube_common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::lab::{HEALTHZ_ADDR, METRICS_ADDR, Shape, vip, wait_for};

const POLL: Duration = Duration::from_millis(50);
use serde_json::{Value, json};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn get_json(k: &Kube, addr: &str, path: &str) -> (u16, Value) {
    let r = http_get(k.lab.node_ns(), addr, path)
        .unwrap_or_else(|e| panic!("GET {path}: {e}\n{}", k.diag()));
    let v = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("GET {path}: body is not JSON ({e}): {:?}", r.body));
    (r.status, v)
}

fn scrape(k: &Kube) -> Scrape {
    let r = http_get(k.lab.node_ns(), METRICS_ADDR, "/metrics")
        .unwrap_or_else(|e| panic!("scrape: {e}\n{}", k.diag()));
    Scrape::parse(&r.body).unwrap_or_else(|e| panic!("/metrics: {e}\n{}", r.body))
}

/// A web service on the client's lab with one backend, and a request through it answered.
fn serve_web(k: &Kube) {
    let (svc, slice) = web_json("web", WEB_VIP, eps(&[k.pod("b1")]));
    k.api.apply_all([svc, slice]);
    let client = k.pod("client");
    let got = wait_for(APPLY, POLL, || {
        client
            .tcp_request(WEB_VIP, WEB_TCP, Duration::from_millis(300))
            .ok()
            .map(|(r, _)| r.backend)
    });
    assert_eq!(
        got.ok().map(|(b, _)| b).as_deref(),
        Some("b1"),
        "web not served\n{}",
        k.diag()
    );
}

/// kubeadm's kube-proxy ConfigMap `config.conf`, byte for byte, with the flags a DaemonSet
/// passes: lbproxy starts, warns about nothing, serves a service, and reports the file's
/// values in `/configz` (clusterCIDR, kubeconfig from the flag).
#[test]
fn kubeadm_config_conf_runs_unchanged() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    let conf = fixture("kubeadm-kube-proxy.conf");
    k.start_with(&["--config", conf.to_str().unwrap()]);
    k.expect_healthy(HEALTHY_WITHIN);
    serve_web(&k);
    let (code, z) = get_json(&k, METRICS_ADDR, "/configz");
    assert_eq!(code, 200);
    let kp = &z["kubeproxy.config.k8s.io"];
    assert_eq!(kp["clusterCIDR"], "10.244.0.0/16", "{z:#}");
    assert_eq!(kp["hostnameOverride"], NODE, "{z:#}");
    assert_eq!(
        kp["clientConnection"]["kubeconfig"],
        k.kubeconfig.display().to_string()
    );
    assert_eq!(kp["conntrack"]["tcpEstablishedTimeout"], "24h0m0s");
    assert_eq!(z["lbproxy.io"]["kind"], "LbproxyConfiguration");
    let log = k.lb().stderr();
    assert!(
        !log.contains("ignoring"),
        "kubeadm's file should warn about nothing:\n{log}"
    );
}

/// `/healthz` is 503 while the Node carries `ToBeDeletedByClusterAutoscaler` or is being
/// deleted or is gone, with `nodeEligible: false`; `/livez` stays 200 throughout; each answer
/// is counted by code.
#[test]
fn healthz_follows_node_eligibility_and_livez_ignores_it() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    k.start_healthy();
    let ns = k.lab.node_ns().to_string();
    let health = |path: &str| -> (u16, Value) {
        let r = http_get(&ns, HEALTHZ_ADDR, path).unwrap_or_else(|e| panic!("{path}: {e}"));
        (r.status, serde_json::from_str(&r.body).unwrap())
    };
    let (code, body) = health("/healthz");
    assert_eq!(code, 200, "{body}");
    for key in ["lastUpdated", "currentTime", "nodeEligible"] {
        assert!(body.get(key).is_some(), "/healthz body lacks {key}: {body}");
    }
    assert_eq!(body["nodeEligible"], true);
    assert!(
        body["currentTime"]
            .as_str()
            .is_some_and(|t| t.ends_with("+0000 UTC")),
        "currentTime in Go's time format: {body}"
    );

    let mut node = lbproxy_tests::apiserver::ApiServer::node(NODE);
    let expect = |k: &Kube, ctx: &str, want_healthz: u16, eligible: bool| {
        let started = Instant::now();
        let got = wait_for(APPLY, POLL, || {
            let (c, b) = health("/healthz");
            (c == want_healthz && b["nodeEligible"] == eligible).then_some(b)
        });
        let (b, _) = got.unwrap_or_else(|_| {
            panic!(
                "{ctx}: /healthz not {want_healthz} with nodeEligible {eligible} within {APPLY:?}: {:?}\n{}",
                health("/healthz"),
                k.diag()
            )
        });
        eprintln!(
            "{ctx}: /healthz {want_healthz} after {:?}: {b}",
            started.elapsed()
        );
        let (lc, lb) = health("/livez");
        assert_eq!(lc, 200, "{ctx}: /livez must ignore node eligibility: {lb}");
        assert!(lb.get("nodeEligible").is_none(), "{ctx}: /livez body {lb}");
    };

    node["spec"]["taints"] = json!([{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]);
    k.api.apply(node.clone());
    expect(&k, "tainted ToBeDeletedByClusterAutoscaler", 503, false);
    let (_, b) = health("/healthz");
    assert!(
        b["reason"]
            .as_str()
            .unwrap_or("")
            .contains("ToBeDeletedByClusterAutoscaler"),
        "{b}"
    );

    node["spec"]["taints"] =
        json!([{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]);
    k.api.apply(node.clone());
    expect(&k, "other taint only", 200, true);

    node["spec"]["taints"] = json!([]);
    node["metadata"]["deletionTimestamp"] = json!(lbproxy_tests::apiserver::rfc3339(
        std::time::SystemTime::now()
    ));
    node["metadata"]["finalizers"] = json!(["example.com/hold"]);
    k.api.apply(node.clone());
    expect(&k, "being deleted", 503, false);

    node["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("deletionTimestamp");
    k.api.apply(node.clone());
    expect(&k, "deletion cancelled", 200, true);

    assert!(k.api.delete("Node", "", NODE), "delete the Node");
    expect(&k, "deleted", 503, false);

    let sc = scrape(&k);
    assert!(sc.value("kubeproxy_proxy_healthz_total", &[("code", "503")]) >= 3.0);
    assert!(sc.value("kubeproxy_proxy_healthz_total", &[("code", "200")]) >= 2.0);
    assert!(sc.value("kubeproxy_proxy_livez_total", &[("code", "200")]) >= 5.0);
}

/// Every metric the kubernetes-mixin "Proxy" dashboard queries (but go_goroutines), with
/// kube-proxy's buckets, and the rest of kube-proxy's set.
#[test]
fn mixin_proxy_dashboard_metrics_are_exported() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    k.start_healthy();
    serve_web(&k);
    let sc = scrape(&k);
    let les = |name: &str| -> Vec<String> {
        let mut v: Vec<(f64, String)> = sc
            .samples
            .iter()
            .filter(|s| {
                s.name == format!("{name}_bucket")
                    && s.labels.get("ip_family").map(String::as_str) != Some("IPv6")
            })
            .filter_map(|s| {
                s.labels
                    .get("le")
                    .map(|l| (l.parse().unwrap_or(f64::INFINITY), l.clone()))
            })
            .collect();
        v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        v.dedup();
        v.into_iter().map(|(_, l)| l).collect()
    };
    let kube_proxy_sync: Vec<f64> = (0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect();
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    ] {
        let got: Vec<f64> = les(name)
            .iter()
            .filter(|l| *l != "+Inf")
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(got.len(), 15, "{name}: {got:?}");
        for (g, w) in got.iter().zip(&kube_proxy_sync) {
            assert!(
                (g - w).abs() < 1e-9,
                "{name}: buckets {got:?}, want {kube_proxy_sync:?}"
            );
        }
        assert!(
            sc.get(&format!("{name}_count"), &[("ip_family", "IPv4")])
                .is_some(),
            "{name}{{ip_family=\"IPv4\"}}"
        );
    }
    assert!(
        sc.value(
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            &[("ip_family", "IPv4")]
        ) >= 1.0
    );
    // One sync programs both families, so each family's series has seen it, as a
    // dual-stack kube-proxy's two proxiers each have their own.
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_network_programming_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    ] {
        let (v4, v6) = (
            sc.value(name, &[("ip_family", "IPv4")]),
            sc.value(name, &[("ip_family", "IPv6")]),
        );
        if !name.contains("programming") {
            assert!(v6 > 0.0, "{name}{{ip_family=\"IPv6\"}} is {v6}");
        }
        if name.ends_with("_count") {
            assert!((v4 - v6).abs() < 1e-9, "{name}: IPv4 {v4}, IPv6 {v6}");
        }
    }
    let prog = les("kubeproxy_network_programming_duration_seconds");
    assert_eq!(
        prog.len(),
        3 + 59 + 12 + 7 + 1,
        "network programming buckets: {prog:?}"
    );
    assert_eq!(&prog[..4], ["0.0", "0.25", "0.5", "1.0"], "{prog:?}");
    assert_eq!(prog[prog.len() - 2], "300.0", "{prog:?}");
    let host = k.api.addr().to_string();
    assert!(
        sc.value(
            "rest_client_requests_total",
            &[("code", "200"), ("method", "GET"), ("host", &host)]
        ) >= 3.0,
        "lists and watches of services, slices and the node"
    );
    assert!(
        sc.samples
            .iter()
            .any(|s| s.name == "rest_client_request_duration_seconds_bucket"
                && s.labels.get("verb").map(String::as_str) == Some("GET")
                && s.labels
                    .get("url")
                    .is_some_and(|u| u.ends_with("/api/v1/nodes"))),
        "rest_client_request_duration_seconds_bucket{{verb=\"GET\",url=.../api/v1/nodes}}"
    );
    assert!(sc.value("process_resident_memory_bytes", &[]) > 1e6);
    assert!(sc.value("process_cpu_seconds_total", &[]) > 0.0);
    assert!(sc.value("process_open_fds", &[]) > 3.0);
    assert!(sc.value("process_start_time_seconds", &[]) > 1.7e9);
    for policy in ["internal", "external"] {
        assert_eq!(
            sc.value(
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                &[("traffic_policy", policy), ("ip_family", "IPv4")]
            ),
            0.0
        );
    }
    assert_eq!(sc.value("lbproxy_build_info", &[]), 1.0);
    assert!(
        sc.samples
            .iter()
            .any(|s| s.name == "lbproxy_build_info" && s.labels.contains_key("commit"))
    );
    for name in [
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
    ] {
        assert!(sc.get(name, &[("ip_family", "IPv4")]).is_some(), "{name}");
    }

    // A service with internalTrafficPolicy Local and no endpoint on this node.
    let (mut svc, mut slice) = web_json("local", vip(41), eps(&[k.pod("b1")]));
    svc["spec"]["internalTrafficPolicy"] = json!("Local");
    slice["endpoints"][0]["nodeName"] = json!("another-node");
    k.api.apply_all([svc, slice]);
    let seen = wait_for(APPLY, POLL, || {
        (scrape(&k).value(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            &[("traffic_policy", "internal"), ("ip_family", "IPv4")],
        ) == 2.0)
            .then_some(())
    });
    assert!(
        seen.is_ok(),
        "no_local_endpoints_total{{internal, IPv4}} not 2 (TCP and UDP ports)"
    );
    // An IPv4-only service counts under IPv4 only.
    assert_eq!(
        scrape(&k).value(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            &[("traffic_policy", "internal"), ("ip_family", "IPv6")],
        ),
        0.0
    );
}

/// `--logging-format json -v 4`: every line on stderr is one JSON object with a level and a
/// message, the first says the version, commit and configuration; `/configz` serves the
/// configuration; `--write-config-to` writes a file that runs lbproxy to the same `/configz`;
/// changing the config file makes lbproxy exit, naming the file, with a JSON last line.
#[test]
fn json_logs_configz_write_config_to_and_config_changes() {
    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    let dir = k.lab.workdir().to_path_buf();
    let conf = dir.join("config.conf");
    std::fs::write(
        &conf,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         logging: {format: json, verbosity: 4}\nconntrack: {udpTimeout: 45s}\nipvs: {scheduler: rr}\n\
         ---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\nflowMapSize: 4096\n",
    )
    .unwrap();
    k.start_with(&["--config", conf.to_str().unwrap()]);
    k.expect_healthy(HEALTHY_WITHIN);
    serve_web(&k);
    let (code, z) = get_json(&k, METRICS_ADDR, "/configz");
    assert_eq!(code, 200);
    assert_eq!(
        z["kubeproxy.config.k8s.io"]["conntrack"]["udpTimeout"], "45s",
        "{z:#}"
    );
    assert_eq!(z["kubeproxy.config.k8s.io"]["logging"]["format"], "json");
    assert_eq!(z["lbproxy.io"]["flowMapSize"], 4096);

    // The same configuration written out and run again gives the same /configz.
    let written = dir.join("written.conf");
    let mut argv = k.args();
    argv.extend([
        "--config".into(),
        conf.display().to_string(),
        "--write-config-to".into(),
        written.display().to_string(),
    ]);
    let mut w = k.lab.start_lbproxy_argv(argv, &[]);
    let st = w
        .wait_exit(EXIT_WITHIN)
        .expect("--write-config-to did not exit");
    assert!(st.success(), "--write-config-to: {st:?}\n{}", w.log());
    let text = std::fs::read_to_string(&written).unwrap();
    assert!(text.contains("kind: LbproxyConfiguration"), "{text}");

    // Change the file: lbproxy exits, non-zero, saying why, as one JSON object.
    let before = k.lb().stderr_len();
    std::fs::write(
        &conf,
        std::fs::read_to_string(&conf)
            .unwrap()
            .replace("45s", "50s"),
    )
    .unwrap();
    let t0 = Instant::now();
    let st = k.lb().wait_exit(Duration::from_secs(10));
    let st = st.unwrap_or_else(|| {
        panic!(
            "lbproxy did not exit after its config changed\n{}",
            k.diag()
        )
    });
    eprintln!("exited {:?} after the config change: {st:?}", t0.elapsed());
    assert!(
        !st.success(),
        "a config change exits non-zero, as kube-proxy does"
    );
    let tail = k.lb().stderr_since(before);
    assert!(tail.contains("changed"), "{tail}");

    let log = k.lb().stderr();
    let mut lines = 0;
    let mut first = None;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line:?}"));
        assert!(
            v["level"].is_string() && v.get("message").is_some(),
            "{line}"
        );
        first.get_or_insert(v);
        lines += 1;
    }
    assert!(lines >= 5, "{lines} lines:\n{log}");
    let first = first.unwrap();
    assert_eq!(first["message"], "lbproxy starting", "{first}");
    assert!(
        first["commit"].is_string() && first["version"].is_string(),
        "{first}"
    );
    assert!(
        log.contains("ipvs.scheduler"),
        "the ignored field is named in a warning"
    );
    assert!(
        log.contains("\"level\":\"DEBUG\""),
        "-v 4 (logging.verbosity) gives lbproxy's debug lines"
    );
    assert!(log.lines().last().unwrap().contains("config"), "{log}");

    // Run from the written file: the same configuration.
    let mut argv = k.args();
    argv.extend(["--config".into(), written.display().to_string()]);
    k.lb = Some(k.lab.start_lbproxy_argv(argv, &[]));
    k.expect_healthy(HEALTHY_WITHIN);
    let (_, z2) = get_json(&k, METRICS_ADDR, "/configz");
    assert_eq!(z2, z, "/configz from the written file");
}

/// Every `metric{label="value"}` selector in a PromQL expression: the metric names lbproxy
/// or kube-proxy export (by prefix), each with the exact-match labels it is selected by.
fn selectors(expr: &str) -> Vec<(String, Vec<(String, String)>)> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| is_ident(c)) {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        let name = &tail[..end];
        let mut after = &tail[end..];
        let ours = ["kubeproxy_", "lbproxy_", "rest_client_", "process_"]
            .iter()
            .any(|p| name.starts_with(p));
        let mut labels = Vec::new();
        if ours && after.starts_with('{') {
            let close = after.find('}').expect("unclosed {");
            for m in after[1..close].split(',') {
                if let Some((k, v)) = m.split_once("=\"")
                    && !k.ends_with('!')
                    && !k.ends_with('=')
                    && !v.starts_with('$')
                {
                    labels.push((k.trim().to_string(), v.trim_end_matches('"').to_string()));
                }
            }
            after = &after[close + 1..];
        }
        if ours {
            out.push((name.to_string(), labels));
        }
        rest = after;
    }
    out
}

/// The shipped alert rules and Grafana dashboard query only metrics (and exact label
/// values) a running lbproxy exports, and every rule is complete.
#[test]
fn shipped_alerts_and_dashboard_query_exported_metrics() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let rules_text = std::fs::read_to_string(root.join("deploy/prometheus/lbproxy-rules.yaml"))
        .expect("deploy/prometheus/lbproxy-rules.yaml");
    let rules: Value = serde_saphyr::from_str(&rules_text).expect("rules file is YAML");
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/lbproxy.json"))
            .expect("deploy/grafana/lbproxy.json"),
    )
    .expect("dashboard is JSON");
    let mut exprs: Vec<(String, String)> = Vec::new();
    let mut alerts = Vec::new();
    for g in rules["groups"].as_array().expect("groups") {
        for r in g["rules"].as_array().expect("rules") {
            let name = r["alert"]
                .as_str()
                .expect("every rule is an alert")
                .to_string();
            for key in ["expr", "for"] {
                assert!(r[key].is_string(), "{name}: no {key}");
            }
            assert!(r["labels"]["severity"].is_string(), "{name}: no severity");
            assert!(
                r["annotations"]["summary"].is_string(),
                "{name}: no summary"
            );
            exprs.push((name.clone(), r["expr"].as_str().unwrap().to_string()));
            alerts.push(name);
        }
    }
    for want in [
        "LbproxySyncOverdue",
        "LbproxySyncFailing",
        "LbproxyFlowTableFilling",
        "LbproxyFlowTablePressure",
        "LbproxySnatPortsHigh",
    ] {
        assert!(
            alerts.iter().any(|a| a == want),
            "no alert {want}: {alerts:?}"
        );
    }
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            exprs.push((
                format!("panel {:?}", p["title"]),
                t["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    for v in dash["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = v["query"].as_str() {
            exprs.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }

    let mut k = Kube::new(Shape::Routed, &["client", "b1"]);
    k.start_healthy();
    serve_web(&k);
    // The datapath counters are read every 2 s.
    std::thread::sleep(Duration::from_millis(2500));
    let sc = scrape(&k);
    let mut missing = Vec::new();
    let mut checked = 0;
    for (at, expr) in &exprs {
        for (name, labels) in selectors(expr) {
            checked += 1;
            let found = sc.samples.iter().any(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(k).map(String::as_str) == Some(v.as_str()))
            });
            if !found {
                missing.push(format!("{at}: {name}{labels:?}"));
            }
        }
    }
    assert!(
        checked >= 25,
        "only {checked} selectors found; is the parser broken?"
    );
    assert!(
        missing.is_empty(),
        "not exported by a running lbproxy:\n  {}",
        missing.join("\n  ")
    );
}
