//! `lbproxy run --config FILE` (KubeProxyConfiguration-style YAML) and its flags: invalid
//! values are refused, with and without `--validate-only`, by a non-zero exit and a message
//! naming the field and the value; a valid file validates and drives a real run; flags win
//! over the file; `KUBECONFIG` is honoured.

mod common;
mod kube_common;

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use common::*;
use kube_common::*;
use lbproxy_tests::lab::{Endpoint, HEALTHZ_ADDR, METRICS_ADDR, Shape};

/// How long an invalid configuration may take to be refused.
const REFUSE_WITHIN: Duration = Duration::from_secs(10);

fn write(k: &Kube, name: &str, text: &str) -> PathBuf {
    let p = k.lab.workdir().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A complete, valid file for this lab (every field the contract names).
fn valid_config(k: &Kube, hostname: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         clientConnection:\n  kubeconfig: {}\n\
         hostnameOverride: {hostname}\n\
         healthzBindAddress: {HEALTHZ_ADDR}\n\
         metricsBindAddress: {METRICS_ADDR}\n\
         syncPeriod: 30s\n\
         minSyncPeriod: 0s\n\
         mode: ebpf\n\
         ---\n\
         apiVersion: lbproxy.io/v1alpha1\n\
         kind: LbproxyConfiguration\n\
         podInterfaces:\n  - \"{}\"\n\
         bpffsDir: {}\n\
         flowMapSize: 262144\n",
        k.kubeconfig.display(),
        k.lab.pod_glob(),
        k.lab.bpffs_dir().display()
    )
}

/// Runs `lbproxy ARGS` in the node namespace until it exits (or [`REFUSE_WITHIN`] passes:
/// then it is killed and `None` returned); returns the status and stdout+stderr.
fn run(k: &Kube, args: Vec<String>) -> (Option<ExitStatus>, String) {
    let mut lb = k.lab.start_lbproxy_argv(args, &[]);
    let st = lb.wait_exit(REFUSE_WITHIN);
    if st.is_none() {
        lb.kill();
    }
    let out = format!("{}{}", lb.stdout(), lb.stderr());
    (st, out)
}

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Each invalid file is refused, with `--validate-only` and without, naming the field (and
/// the offending value, where there is one).
#[test]
fn invalid_config_files() {
    let k = Kube::new(Shape::Routed, &[]);
    let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
    let cases: &[(&str, String, &[&str])] = &[
        (
            "unknown field in lbproxy's document",
            format!(
                "{head}---\napiVersion: lbproxy.io/v1alpha1\nkind: LbproxyConfiguration\npodInterfcs: [x]\n"
            ),
            &["podInterfcs", "unknown field"],
        ),
        (
            "lbproxy's field in kube-proxy's document",
            format!("{head}podInterfaces: [x]\n"),
            &["podInterfaces", "LbproxyConfiguration"],
        ),
        (
            "bad duration",
            format!("{head}syncPeriod: thirty\n"),
            &["syncPeriod", "thirty"],
        ),
        (
            "bad minSyncPeriod",
            format!("{head}minSyncPeriod: soon\n"),
            &["minSyncPeriod", "soon"],
        ),
        (
            "bad healthz bind address",
            format!("{head}healthzBindAddress: not-an-address\n"),
            &["healthzBindAddress", "not-an-address"],
        ),
        (
            "metrics bind address with a bad port",
            format!("{head}metricsBindAddress: 127.0.0.1:http\n"),
            &["metricsBindAddress", "127.0.0.1:http"],
        ),
        (
            "bad logging format",
            format!("{head}logging: {{format: xml}}\n"),
            &["logging.format", "xml"],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (what, text, want)) in cases.iter().enumerate() {
        let path = write(&k, &format!("bad-{i}.yaml"), text);
        let path = path.display().to_string();
        // Only flags that none of the cases sets in the file (a flag would win over it).
        let kc = k.kubeconfig.display().to_string();
        let dir = k.lab.bpffs_dir().display().to_string();
        let with_base = args(&[
            "run",
            "--config",
            &path,
            "--kubeconfig",
            &kc,
            "--pod-interfaces",
            &k.lab.pod_glob(),
            "--bpffs-dir",
            &dir,
        ]);
        for (mode, argv) in [
            (
                "--validate-only",
                args(&["run", "--config", &path, "--validate-only"]),
            ),
            ("run", with_base),
        ] {
            let (st, out) = run(&k, argv);
            let ok_exit = st.is_some_and(|s| !s.success());
            let named = want.iter().all(|w| out.contains(w));
            if !ok_exit || !named {
                failures.push(format!(
                    "{what} [{mode}]: exit {st:?} (want non-zero within {REFUSE_WITHIN:?}), \
                     message names {want:?}: {named}\n  output: {}",
                    out.trim()
                        .lines()
                        .rev()
                        .take(3)
                        .collect::<Vec<_>>()
                        .join(" | ")
                ));
            } else {
                eprintln!(
                    "{what} [{mode}]: {}",
                    out.trim().lines().last().unwrap_or("")
                );
            }
        }
    }
    assert!(
        failures.is_empty(),
        "invalid configurations not refused properly:\n{}",
        failures.join("\n")
    );
}

/// Invalid flag values are refused naming the flag; a bad flag value is refused even when
/// the file is valid.
#[test]
fn invalid_flags() {
    let k = Kube::new(Shape::Routed, &[]);
    let good = write(&k, "good.yaml", &valid_config(&k, NODE))
        .display()
        .to_string();
    let cases: &[(&[&str], &[&str])] = &[
        (&["--sync-period", "thirty"], &["thirty"]),
        (&["--min-sync-period", "soon"], &["soon"]),
        (&["--healthz-bind-address", "nowhere"], &["nowhere"]),
        (
            &["--metrics-bind-address", "1.2.3.4:port"],
            &["1.2.3.4:port"],
        ),
    ];
    let mut failures = Vec::new();
    for (flags, want) in cases {
        let mut argv = args(&["run", "--config", &good, "--validate-only"]);
        argv.extend(args(flags));
        let (st, out) = run(&k, argv);
        let field = flags[0].trim_start_matches("--");
        let camel = {
            let mut c = String::new();
            let mut up = false;
            for ch in field.chars() {
                if ch == '-' {
                    up = true;
                } else if up {
                    c.push(ch.to_ascii_uppercase());
                    up = false;
                } else {
                    c.push(ch);
                }
            }
            c
        };
        let named =
            (out.contains(field) || out.contains(&camel)) && want.iter().all(|w| out.contains(w));
        if st.is_none_or(|s| s.success()) || !named {
            failures.push(format!(
                "{flags:?}: exit {st:?}, names {field}/{camel} and {want:?}: {named}\n  output: {}",
                out.trim()
                    .lines()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" | ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "invalid flags not refused properly:\n{}",
        failures.join("\n")
    );
}

/// A complete valid file, and valid duration flags (`30s`, `1m`, `500ms`), pass
/// `--validate-only` with exit 0.
#[test]
fn valid_config_validates() {
    let k = Kube::new(Shape::Routed, &[]);
    let good = write(&k, "good.yaml", &valid_config(&k, NODE))
        .display()
        .to_string();
    for extra in [
        &[][..],
        &["--sync-period", "1m", "--min-sync-period", "500ms"][..],
        &["--sync-period", "30s"][..],
    ] {
        let mut argv = args(&["run", "--config", &good, "--validate-only"]);
        argv.extend(args(extra));
        let (st, out) = run(&k, argv);
        assert!(
            st.is_some_and(|s| s.success()),
            "valid config {extra:?}: exit {st:?}\n{out}"
        );
    }
    // An empty mode is kube-proxy's default and valid too.
    let empty_mode = write(
        &k,
        "empty-mode.yaml",
        &valid_config(&k, NODE).replace("mode: ebpf", "mode: \"\""),
    );
    let (st, out) = run(
        &k,
        args(&[
            "run",
            "--config",
            &empty_mode.display().to_string(),
            "--validate-only",
        ]),
    );
    assert!(
        st.is_some_and(|s| s.success()),
        "mode \"\": exit {st:?}\n{out}"
    );
}

/// The file alone drives a real run (kubeconfig, hostname, addresses, interfaces, bpffs
/// dir); a flag overrides the file's hostname.
#[test]
fn config_file_drives_run_and_flags_win() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, vec![Endpoint::ready("198.18.0.3")]);
    k.api.apply_all([svc, s1]);
    let cfg = write(&k, "lbproxy.yaml", &valid_config(&k, "cfg-node"))
        .display()
        .to_string();
    k.lb = Some(
        k.lab
            .start_lbproxy_argv(args(&["run", "--config", &cfg]), &[]),
    );
    k.expect_healthy(HEALTHY_WITHIN);
    assert_eq!(
        k.frontends(),
        web_fes("web", WEB_VIP, &["198.18.0.3".parse().unwrap()]),
        "{}",
        k.diag()
    );
    let node_watch = |k: &Kube, from: usize| {
        k.api
            .wait_for_request(from, Duration::from_secs(10), |r| {
                r.resource() == Some("nodes")
            })
            .map(|r| r.param("fieldSelector").unwrap_or("").to_owned())
    };
    assert_eq!(
        node_watch(&k, 0).as_deref(),
        Some("metadata.name=cfg-node"),
        "hostnameOverride from the file\n{}",
        k.diag()
    );
    k.lb().terminate(EXIT_WITHIN);

    let mark = k.api.request_count();
    k.lb = Some(k.lab.start_lbproxy_argv(
        args(&["run", "--config", &cfg, "--hostname-override", "flag-node"]),
        &[],
    ));
    k.expect_healthy(HEALTHY_WITHIN);
    assert_eq!(
        node_watch(&k, mark).as_deref(),
        Some("metadata.name=flag-node"),
        "--hostname-override wins over the file\n{}",
        k.diag()
    );
}

/// Without `--kubeconfig`, `KUBECONFIG` is used.
#[test]
fn kubeconfig_from_env() {
    let mut k = Kube::new(Shape::Routed, &[]);
    let (svc, s1) = web_json("web", WEB_VIP, vec![Endpoint::ready("198.18.0.3")]);
    k.api.apply_all([svc, s1]);
    let mut argv = k.lab.lbproxy_base_args();
    argv.extend(args(&["--hostname-override", NODE]));
    let kc = k.kubeconfig.display().to_string();
    k.lb = Some(k.lab.start_lbproxy_argv(argv, &[("KUBECONFIG", &kc)]));
    k.expect_healthy(HEALTHY_WITHIN);
    assert_eq!(
        k.frontends(),
        web_fes("web", WEB_VIP, &["198.18.0.3".parse().unwrap()]),
        "{}",
        k.diag()
    );
}
