//! Everything under `deploy/` is a real, appliable object.
//!
//! - Every YAML document of every file under `deploy/` (recursively) parses as the typed
//!   object its `kind` names (k8s-openapi), and an unknown kind fails.
//! - k8s-openapi ignores unknown fields, so each typed object is serialized back and compared
//!   with the document: a field lost in the round trip is a typo, a field the round trip adds
//!   is a missing required field. Either fails, naming the file, the document and the path.
//! - A directory with a `kustomization.yaml` (the base `deploy/kubernetes`, the overlay
//!   `deploy/subset`) is checked as `kubectl kustomize` renders it, with the same checks.
//! - The lbproxy DaemonSet keeps its invariants (host network, no privileged container, exactly
//!   its capabilities, critical priority, probes, resources, only lbproxy's bpffs directory
//!   mounted, Linux nodes only, a pinned image, a ConfigMap whose name carries its content's
//!   hash, ...), and the ServiceAccount, RBAC and ConfigMap it names exist and fit it.
//! - The ConfigMap's `config.conf` is a KubeProxyConfiguration, then an
//!   LbproxyConfiguration. With `LBPROXY_BIN` set, the binary validates it too
//!   (`run --config FILE --validate-only`).
//! - `deploy/Dockerfile` installs what `cargo xtask setup` installs for building.
//!
//! Needs no root, no cluster and no lbproxy binary; it needs the kubectl that `cargo xtask
//! setup` installs (for kustomize), and fails saying so when it is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Pod, PodTemplateSpec, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const NAMESPACE: &str = "kube-system";
const DAEMONSET: &str = "lbproxy";
const CONTAINER: &str = "lbproxy";
/// No `SYS_RESOURCE`: lbproxy needs tcx (Linux 6.6+), and since 5.11 BPF memory is charged
/// to the memory cgroup, not RLIMIT_MEMLOCK.
const CAPABILITIES: [&str; 3] = ["BPF", "NET_ADMIN", "PERFMON"];
/// lbproxy's own directory of the host's bpffs: the only part of it the DaemonSet mounts.
const BPFFS_DIR: &str = "/sys/fs/bpf/lbproxy";
/// The config file's name, as in kube-proxy's ConfigMap.
const CONFIG_KEY: &str = "config.conf";
const HEALTHZ_PORT: i32 = 10256;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

// ---------------------------------------------------------------------------------------------
// Parsing every document, typed, with the round trip

/// One YAML document, as JSON, with the typed object's JSON after the round trip.
struct Doc {
    /// `deploy/x.yaml: document N (Kind ns/name)`, for messages.
    at: String,
    kind: String,
    /// The document as written (JSON form).
    original: Value,
}

impl Doc {
    fn name(&self) -> &str {
        self.original["metadata"]["name"].as_str().unwrap_or("")
    }

    fn namespace(&self) -> Option<&str> {
        self.original["metadata"]["namespace"].as_str()
    }

    /// The typed object. Only called on documents that already round-tripped cleanly.
    fn typed<T: DeserializeOwned>(&self) -> T {
        serde_json::from_value(self.original.clone()).unwrap_or_else(|e| panic!("{}: {e}", self.at))
    }
}

/// Deserializes a document (already read from YAML, duplicate keys refused) as `T` and
/// serializes it back to JSON.
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<Value, String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(&typed).map_err(|e| e.to_string())
}

type RoundTrip = fn(&Value) -> Result<Value, String>;

/// The kinds `deploy/` may hold. Anything else fails: add it here with its typed parse.
fn round_trip_for(api_version: &str, kind: &str) -> Option<RoundTrip> {
    // k8s-openapi checks apiVersion itself, so a wrong one fails with both values named.
    Some(match (api_version, kind) {
        (KIND_API_VERSION, "Cluster") => round_trip::<KindCluster>,
        (_, "Namespace") => round_trip::<Namespace>,
        (_, "ServiceAccount") => round_trip::<ServiceAccount>,
        (_, "ClusterRole") => round_trip::<ClusterRole>,
        (_, "ClusterRoleBinding") => round_trip::<ClusterRoleBinding>,
        (_, "Role") => round_trip::<Role>,
        (_, "RoleBinding") => round_trip::<RoleBinding>,
        (_, "ConfigMap") => round_trip::<ConfigMap>,
        (_, "DaemonSet") => round_trip::<DaemonSet>,
        (_, "Deployment") => round_trip::<Deployment>,
        (_, "Pod") => round_trip::<Pod>,
        (_, "Service") => round_trip::<Service>,
        (_, "EndpointSlice") => round_trip::<EndpointSlice>,
        _ => return None,
    })
}

/// Every difference between a document and its typed round trip, as `path: what`.
/// A key written with no value (`key:`, null) counts as absent.
fn diff(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match (original, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (k, ov) in o {
                match t.get(k) {
                    _ if ov.is_null() => {}
                    None => out.push(format!(
                        "{}: unknown field, lost in the typed round trip (a typo?)",
                        join(k)
                    )),
                    Some(tv) => diff(ov, tv, &join(k), out),
                }
            }
            for (k, tv) in t {
                if o.get(k).is_none_or(Value::is_null) {
                    out.push(format!(
                        "{}: required field missing (the typed parse filled in {tv})",
                        join(k)
                    ));
                }
            }
        }
        (Value::Array(o), Value::Array(t)) if o.len() == t.len() => {
            for (i, (ov, tv)) in o.iter().zip(t).enumerate() {
                diff(ov, tv, &format!("{path}[{i}]"), out);
            }
        }
        _ if original == typed => {}
        // A quantity written as a number (`cpu: 1`) comes back as its string form.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        _ => out.push(format!(
            "{}: {original} became {typed} in the typed round trip",
            if path.is_empty() { "(document)" } else { path }
        )),
    }
}

/// Parses every document of one file. Returns the documents that round-tripped cleanly and
/// a message for every problem.
fn parse_file(rel: &str, text: &str) -> (Vec<Doc>, Vec<String>) {
    let (mut docs, mut problems) = (Vec::new(), Vec::new());
    // serde-saphyr refuses duplicate keys, which a JSON map would silently collapse.
    let values: Vec<Value> = match serde_saphyr::from_multiple(text) {
        Ok(v) => v,
        Err(e) => {
            problems.push(format!("{rel}: not valid YAML: {e}"));
            return (docs, problems);
        }
    };
    for (i, original) in values.into_iter().enumerate() {
        let n = i + 1;
        if original.is_null() {
            continue; // comments only
        }
        let (Some(api_version), Some(kind)) =
            (original["apiVersion"].as_str(), original["kind"].as_str())
        else {
            problems.push(format!("{rel}: document {n}: no apiVersion or kind"));
            continue;
        };
        let mut doc = Doc {
            at: String::new(),
            kind: kind.to_string(),
            original: original.clone(),
        };
        doc.at = match doc.namespace() {
            Some(ns) => format!("{rel}: document {n} ({kind} {ns}/{})", doc.name()),
            None => format!("{rel}: document {n} ({kind} {})", doc.name()),
        };
        let Some(parse) = round_trip_for(api_version, kind) else {
            problems.push(format!(
                "{}: unknown kind {api_version} {kind} (tests/tests/deploy_manifests.rs knows \
                 only the kinds deploy/ is expected to hold)",
                doc.at
            ));
            continue;
        };
        match parse(&original) {
            Err(e) => problems.push(format!("{}: does not parse as {kind}: {e}", doc.at)),
            Ok(typed) => {
                let mut diffs = Vec::new();
                diff(&original, &typed, "", &mut diffs);
                if diffs.is_empty() {
                    docs.push(doc);
                } else {
                    problems.extend(diffs.into_iter().map(|d| format!("{}: {d}", doc.at)));
                }
            }
        }
    }
    (docs, problems)
}

/// Plain manifest files under `dir`: YAML files, except those of a kustomization (checked
/// as kustomize renders them, [`kustomizations`]) and Prometheus rule files (not Kubernetes
/// objects; see [`PROMETHEUS_RULES`]).
fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    if dir.join("kustomization.yaml").exists() || dir.ends_with("prometheus") {
        return;
    }
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("readdir").path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
}

/// Every directory under `deploy/` holding a `kustomization.yaml`, repo-relative and sorted.
fn kustomizations() -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        if dir.join("kustomization.yaml").exists() {
            out.push(dir.strip_prefix(root).unwrap().display().to_string());
        }
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("readdir").path();
            if path.is_dir() {
                walk(&path, root, out);
            }
        }
    }
    let root = repo_root();
    let mut out = Vec::new();
    walk(&root.join("deploy"), &root, &mut out);
    out.sort();
    out
}

/// The kubectl `cargo xtask setup` installs (`LBPROXY_KUBECTL`, which `cargo xtask test`
/// sets, else the default target directory's). Panics when it is missing: rendering the
/// kustomizations is part of the check.
fn kubectl() -> PathBuf {
    let bin = std::env::var_os("LBPROXY_KUBECTL").map_or_else(
        || repo_root().join("target/tools/kubectl/bin/kubectl"),
        PathBuf::from,
    );
    assert!(
        bin.exists(),
        "kubectl not found at {} (set LBPROXY_KUBECTL, or run `cargo xtask setup`, which installs it there)",
        bin.display()
    );
    bin
}

/// `kubectl kustomize DIR`, as text; panics with kubectl's error.
fn render(dir: &Path) -> String {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("running kubectl kustomize {}: {e}", dir.display()));
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The base every other kustomization builds on; its objects are lbproxy's deployment.
const BASE: &str = "deploy/kubernetes";

/// Every document of the plain files under `deploy/`, and those kustomize renders from
/// `kustomization` (the base, or one overlay); panics listing every problem in every file.
fn docs_with(kustomization: &str) -> Vec<Doc> {
    let root = repo_root();
    let mut files = Vec::new();
    yaml_files(&root.join("deploy"), &mut files);
    files.sort();
    assert!(!files.is_empty(), "no YAML files under deploy/");
    let mut sources: Vec<(String, String)> = files
        .iter()
        .map(|file| {
            let rel = file
                .strip_prefix(&root)
                .unwrap_or(file)
                .display()
                .to_string();
            let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{rel}: {e}"));
            (rel, text)
        })
        .collect();
    sources.push((
        format!("{kustomization} (kubectl kustomize)"),
        render(&repo_root().join(kustomization)),
    ));
    let (mut docs, mut problems) = (Vec::new(), Vec::new());
    for (rel, text) in &sources {
        let (d, p) = parse_file(rel, text);
        if d.is_empty() && p.is_empty() {
            problems.push(format!("{rel}: no documents"));
        }
        docs.extend(d);
        problems.extend(p);
    }
    assert!(
        problems.is_empty(),
        "{} problem(s) in deploy/:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
    docs
}

/// [`docs_with`] the base.
fn deploy_docs() -> Vec<Doc> {
    docs_with(BASE)
}

// ---------------------------------------------------------------------------------------------
// Schemas that k8s-openapi does not have

const KIND_API_VERSION: &str = "kind.x-k8s.io/v1alpha4";

/// The part of kind's v1alpha4 Cluster config that deploy/ uses; unknown fields fail by name.
/// Extend it when a file needs more of kind's schema.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KindCluster {
    api_version: String,
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    networking: Option<KindNetworking>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nodes: Option<Vec<KindNode>>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KindNetworking {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kube_proxy_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    disable_default_cni: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip_family: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod_subnet: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    service_subnet: Option<String>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KindNode {
    role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    image: Option<String>,
}

/// The second document of lbproxy's config file, LbproxyConfiguration, as agreed for
/// `lbproxy run --config` (the binary is the authority: with `LBPROXY_BIN` set it validates
/// the whole file itself). Unknown fields fail here too, by name, so a typo in the
/// ConfigMap is caught without the binary. Keep in step with the controller's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[expect(dead_code, reason = "the fields exist to be checked by name and type")]
struct LbproxyConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    pod_interfaces: Option<Vec<String>>,
    #[serde(default)]
    bpffs_dir: Option<String>,
    #[serde(default)]
    flow_map_size: Option<u64>,
    #[serde(default)]
    socket_lb: Option<String>,
    #[serde(default)]
    cgroup_root: Option<String>,
    #[serde(default)]
    stack_bypass: Option<bool>,
    #[serde(default)]
    takeover: Option<bool>,
    #[serde(default)]
    manifests: Option<String>,
    #[serde(default)]
    snat_port_range: Option<String>,
    #[serde(default)]
    tcp_syn_sent_timeout: Option<String>,
    #[serde(default)]
    lb_algorithm: Option<String>,
    #[serde(default)]
    maglev_table_size: Option<u32>,
    #[serde(default)]
    hash_seed_file: Option<String>,
    #[serde(default)]
    xdp_acceleration: Option<String>,
    #[serde(default)]
    load_balancer_mode: Option<String>,
    #[serde(default)]
    per_service_metrics: Option<bool>,
}

// ---------------------------------------------------------------------------------------------
// Invariants

fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> &'a Doc {
    let found: Vec<_> = docs
        .iter()
        .filter(|d| d.kind == kind && d.name() == name)
        .collect();
    match found[..] {
        [d] => d,
        [] => panic!("no {kind} named {name:?} under deploy/"),
        _ => panic!(
            "{} {kind}s named {name:?} under deploy/: {}",
            found.len(),
            found
                .iter()
                .map(|d| d.at.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Checks every DaemonSet must pass (lbproxy's and the cleanup one): node-level, not
/// privileged, only ever adding lbproxy's capabilities, selecting its own pods.
fn common_daemonset_problems(
    at: &str,
    template: &PodTemplateSpec,
    selector: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut p = Vec::new();
    let labels = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    for (k, v) in selector {
        if labels.get(k) != Some(v) {
            p.push(format!(
                "{at}: selector {k}={v} does not match the pod template's labels {labels:?}"
            ));
        }
    }
    let Some(spec) = &template.spec else {
        p.push(format!("{at}: no pod spec"));
        return p;
    };
    if spec.host_network != Some(true) {
        p.push(format!(
            "{at}: hostNetwork is {:?}, want true",
            spec.host_network
        ));
    }
    let allowed: BTreeSet<&str> = CAPABILITIES.into_iter().collect();
    let all = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers);
    for c in all {
        let sc = c.security_context.clone().unwrap_or_default();
        if sc.privileged == Some(true) {
            p.push(format!("{at}: container {} is privileged", c.name));
        }
        if sc.allow_privilege_escalation != Some(false) {
            p.push(format!(
                "{at}: container {}: allowPrivilegeEscalation is not false",
                c.name
            ));
        }
        let caps = sc.capabilities.unwrap_or_default();
        if !caps.drop.iter().flatten().any(|d| d == "ALL") {
            p.push(format!(
                "{at}: container {} does not drop ALL capabilities",
                c.name
            ));
        }
        for add in caps.add.iter().flatten() {
            if !allowed.contains(add.as_str()) {
                p.push(format!(
                    "{at}: container {} adds {add}, not one of {CAPABILITIES:?}",
                    c.name
                ));
            }
        }
    }
    p
}

fn lbproxy_container(ds: &DaemonSet) -> &Container {
    let spec = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    spec.containers
        .iter()
        .find(|c| c.name == CONTAINER)
        .unwrap_or_else(|| panic!("DaemonSet {DAEMONSET} has no container {CONTAINER:?}"))
}

fn http_get(probe: Option<&k8s_openapi::api::core::v1::Probe>) -> Option<(String, IntOrString)> {
    let get = probe?.http_get.as_ref()?;
    Some((get.path.clone().unwrap_or_default(), get.port.clone()))
}

/// `true` if `rules` grant `verb` on `resource` in API group `group`.
fn allows(rules: &[PolicyRule], group: &str, resource: &str, verb: &str) -> bool {
    let has = |list: &Option<Vec<String>>, want: &str| {
        list.iter().flatten().any(|x| x == want || x == "*")
    };
    rules.iter().any(|r| {
        has(&r.api_groups, group)
            && has(&r.resources, resource)
            && r.verbs.iter().any(|v| v == verb || v == "*")
    })
}

fn lbproxy_daemonset_problems(docs: &[Doc]) -> Vec<String> {
    let doc = find(docs, "DaemonSet", DAEMONSET);
    let at = doc.at.as_str();
    let ds: DaemonSet = doc.typed();
    let mut p = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            p.push(format!("{at}: {what}"));
        }
    };
    check(
        doc.namespace() == Some(NAMESPACE),
        format!("namespace is {:?}, want {NAMESPACE}", doc.namespace()),
    );
    let ds_spec = ds.spec.as_ref().expect("spec");
    let spec = ds_spec.template.spec.as_ref().expect("pod spec");

    let strategy = ds_spec.update_strategy.clone().unwrap_or_default();
    let max_unavailable = strategy.rolling_update.and_then(|r| r.max_unavailable);
    check(
        strategy.type_.as_deref() == Some("RollingUpdate")
            && max_unavailable == Some(IntOrString::Int(1)),
        format!(
            "updateStrategy is {:?} with maxUnavailable {max_unavailable:?}, want RollingUpdate with 1",
            strategy.type_
        ),
    );
    check(
        spec.priority_class_name.as_deref() == Some("system-node-critical"),
        format!(
            "priorityClassName is {:?}, want system-node-critical",
            spec.priority_class_name
        ),
    );
    // The proxy must not resolve names through the cluster DNS service it programs itself
    // (and serves to pods only): the node's resolver.
    check(
        spec.dns_policy.as_deref() == Some("Default"),
        format!(
            "dnsPolicy is {:?}, want Default (the node's resolver)",
            spec.dns_policy
        ),
    );
    check(
        spec.tolerations.iter().flatten().any(|t| {
            t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none()
        }),
        "no toleration `operator: Exists` (without key or effect) for every taint".into(),
    );
    check(
        spec.termination_grace_period_seconds == Some(30),
        format!(
            "terminationGracePeriodSeconds is {:?}, want 30",
            spec.termination_grace_period_seconds
        ),
    );
    let sa = spec.service_account_name.clone().unwrap_or_default();
    check(
        sa == "lbproxy",
        format!("serviceAccountName is {sa:?}, want lbproxy"),
    );

    let c = lbproxy_container(&ds);
    let sc = c.security_context.clone().unwrap_or_default();
    let added: BTreeSet<String> = sc
        .capabilities
        .and_then(|c| c.add)
        .unwrap_or_default()
        .into_iter()
        .collect();
    let want: BTreeSet<String> = CAPABILITIES.iter().map(|s| (*s).to_string()).collect();
    check(
        added == want,
        format!("capabilities.add is {added:?}, want exactly {want:?}"),
    );
    check(
        sc.read_only_root_filesystem == Some(true),
        "readOnlyRootFilesystem is not true".into(),
    );
    check(
        sc.run_as_user == Some(0),
        format!(
            "runAsUser is {:?}, want 0 (bpffs pins need root)",
            sc.run_as_user
        ),
    );

    let port = IntOrString::Int(HEALTHZ_PORT);
    let live = http_get(c.liveness_probe.as_ref());
    check(
        live == Some(("/livez".into(), port.clone())),
        format!("livenessProbe httpGet is {live:?}, want /livez on {HEALTHZ_PORT}"),
    );
    let ready = http_get(c.readiness_probe.as_ref());
    check(
        ready == Some(("/healthz".into(), port)),
        format!("readinessProbe httpGet is {ready:?}, want /healthz on {HEALTHZ_PORT}"),
    );

    let res = c.resources.clone().unwrap_or_default();
    let requests = res.requests.unwrap_or_default();
    check(
        requests.contains_key("cpu") && requests.contains_key("memory"),
        format!("resources.requests {requests:?} lacks cpu or memory"),
    );
    check(
        res.limits.unwrap_or_default().contains_key("memory"),
        "no memory limit".into(),
    );

    // Only lbproxy's directory of the host's bpffs, at the same path.
    let bpffs_volume = spec.volumes.iter().flatten().find(|v| {
        v.host_path
            .as_ref()
            .is_some_and(|h| h.path == BPFFS_DIR && h.type_.as_deref() == Some("DirectoryOrCreate"))
    });
    let bpffs_mounted = bpffs_volume.is_some_and(|v| {
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == v.name && m.mount_path == BPFFS_DIR && m.read_only != Some(true))
    });
    check(
        bpffs_mounted,
        format!(
            "the host's {BPFFS_DIR} (hostPath, DirectoryOrCreate) is not mounted read-write at {BPFFS_DIR}"
        ),
    );
    check(
        !spec.volumes.iter().flatten().any(|v| {
            v.host_path
                .as_ref()
                .is_some_and(|h| h.path.trim_end_matches('/') == "/sys/fs/bpf")
        }),
        "the whole of the host's /sys/fs/bpf is mounted; mount only lbproxy's directory".into(),
    );
    let os = spec
        .node_selector
        .as_ref()
        .and_then(|n| n.get("kubernetes.io/os"))
        .cloned();
    check(
        os.as_deref() == Some("linux"),
        format!("nodeSelector kubernetes.io/os is {os:?}, want linux"),
    );
    let image = c.image.clone().unwrap_or_default();
    let tag = image
        .rsplit_once('/')
        .map_or(image.as_str(), |(_, last)| last)
        .split_once(':')
        .map(|(_, t)| t);
    check(
        image.contains('@') || tag.is_some_and(|t| t != "latest"),
        format!("image {image:?} is not pinned (a tag other than latest, or a digest)"),
    );
    // kustomize's configMapGenerator: the ConfigMap's name carries a hash of its content,
    // so a changed config rolls the pods.
    let cm = spec
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.config_map.as_ref().map(|c| c.name.clone()))
        .unwrap_or_default();
    check(
        cm.strip_prefix("lbproxy-config-")
            .is_some_and(|h| !h.is_empty()),
        format!(
            "the config volume's ConfigMap is {cm:?}, not lbproxy-config-<content hash>: a config change would not roll the pods"
        ),
    );

    // NODE_NAME from the downward API, passed as --hostname-override.
    let env = c.env.clone().unwrap_or_default();
    let node_name = env.iter().find(|e| e.name == "NODE_NAME").and_then(|e| {
        e.value_from
            .as_ref()?
            .field_ref
            .as_ref()
            .map(|f| f.field_path.clone())
    });
    check(
        node_name.as_deref() == Some("spec.nodeName"),
        format!("env NODE_NAME comes from {node_name:?}, want fieldRef spec.nodeName"),
    );
    let args = c.args.clone().unwrap_or_default();
    check(
        args.first().map(String::as_str) == Some("run"),
        format!("args {args:?} do not start with `run`"),
    );
    check(
        args.iter().any(|a| a == "--hostname-override=$(NODE_NAME)"),
        format!("args {args:?} lack --hostname-override=$(NODE_NAME)"),
    );
    // Host-network pods are not served through ClusterIPs: the API server's real address.
    check(
        ["KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"]
            .iter()
            .all(|k| {
                env.iter()
                    .any(|e| e.name == *k && e.value.as_deref().is_some_and(|v| !v.is_empty()))
            }),
        "env lacks KUBERNETES_SERVICE_HOST/PORT (the API server's real address)".into(),
    );
    p
}

/// `--config PATH` (or `--config=PATH`) from the container's args.
fn config_arg(args: &[String]) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        if a == "--config" {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix("--config=").map(str::to_string)
        }
    })
}

/// The ConfigMap key the container reads its `--config` from: (ConfigMap name, key).
fn config_source(ds: &DaemonSet) -> Result<(String, String), String> {
    let spec = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    let c = lbproxy_container(ds);
    let path = config_arg(c.args.as_deref().unwrap_or_default()).ok_or("no --config argument")?;
    for m in c.volume_mounts.iter().flatten() {
        let Some(key) = path.strip_prefix(&format!("{}/", m.mount_path.trim_end_matches('/')))
        else {
            continue;
        };
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .ok_or(format!("no volume {}", m.name))?;
        let cm = volume
            .config_map
            .as_ref()
            .ok_or(format!("--config {path} is not on a ConfigMap volume"))?;
        return Ok((cm.name.clone(), key.to_string()));
    }
    Err(format!("--config {path} is on no volume mount"))
}

/// Problems with the ConfigMap's config.conf, and its text.
fn config_problems(docs: &[Doc]) -> (Vec<String>, String) {
    let ds_doc = find(docs, "DaemonSet", DAEMONSET);
    let ds: DaemonSet = ds_doc.typed();
    let (cm_name, key) = config_source(&ds).unwrap_or_else(|e| panic!("{}: {e}", ds_doc.at));
    let cm_doc = find(docs, "ConfigMap", &cm_name);
    let cm: ConfigMap = cm_doc.typed();
    let at = format!("{}: {key}", cm_doc.at);
    let mut p = Vec::new();
    if cm_doc.namespace() != ds_doc.namespace() {
        p.push(format!(
            "{at}: not in the DaemonSet's namespace {:?}",
            ds_doc.namespace()
        ));
    }
    if key != CONFIG_KEY {
        p.push(format!(
            "{at}: the DaemonSet reads --config from key {key:?}; kube-proxy's ConfigMap calls it {CONFIG_KEY:?}"
        ));
    }
    let Some(text) = cm.data.unwrap_or_default().remove(&key) else {
        p.push(format!(
            "{at}: no such key (the DaemonSet reads --config from it)"
        ));
        return (p, String::new());
    };
    let docs: Vec<Value> = match serde_saphyr::from_multiple(&text) {
        Ok(v) => v,
        Err(e) => {
            p.push(format!("{at}: not YAML: {e}"));
            return (p, text);
        }
    };
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    let null = Value::Null;
    let value = docs.first().unwrap_or(&null);
    if value["apiVersion"].as_str() != Some("kubeproxy.config.k8s.io/v1alpha1")
        || value["kind"].as_str() != Some("KubeProxyConfiguration")
    {
        p.push(format!(
            "{at}: the first document's apiVersion/kind are {:?}/{:?}, want kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration",
            value["apiVersion"], value["kind"]
        ));
    }
    // lbproxy's own settings: the second document, whose unknown fields fail by name.
    let own = docs.get(1).unwrap_or(&null);
    if !own.is_null()
        && let Err(e) = serde_json::from_value::<LbproxyConfig>(own.clone())
    {
        p.push(format!("{at}: LbproxyConfiguration: {e}"));
    }
    if docs.len() > 2 {
        p.push(format!("{at}: {} documents; at most two", docs.len()));
    }
    if let Some(mode) = value["mode"]
        .as_str()
        .filter(|m| !["", "ebpf", "iptables", "nftables", "ipvs"].contains(m))
    {
        p.push(format!("{at}: mode {mode:?} is not one kube-proxy knows"));
    }
    // Fits the DaemonSet: pins in its bpffs mount, health on the probes' port.
    let dir = own["bpffsDir"].as_str().unwrap_or("/sys/fs/bpf/lbproxy");
    if dir != BPFFS_DIR {
        p.push(format!(
            "{at}: bpffsDir {dir:?} is not the mounted {BPFFS_DIR}"
        ));
    }
    // The socket-level programs need the host's cgroup2 root: inside the container,
    // /sys/fs/cgroup is only the container's own cgroup.
    let c = lbproxy_container(&ds);
    match own["cgroupRoot"].as_str() {
        Some(root) if root.starts_with("/sys/fs/cgroup") => p.push(format!(
            "{at}: cgroupRoot {root:?} is the container's own cgroup, not the host's"
        )),
        Some(root) => {
            let mounted = c.volume_mounts.iter().flatten().any(|m| {
                m.mount_path == root
                    && ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()).is_some_and(|s| {
                        s.volumes.iter().flatten().any(|v| {
                            v.name == m.name
                                && v.host_path.as_ref().is_some_and(|h| h.path.starts_with("/sys/fs/cgroup") || h.path.starts_with("/run/lbproxy/cgroupv2"))
                        })
                    })
            });
            if !mounted {
                p.push(format!(
                    "{at}: cgroupRoot {root:?} is not a mount of the host's cgroup2 hierarchy"
                ));
            }
        }
        None if own["socketLb"].as_str() != Some("off") => p.push(format!(
            "{at}: socket-level load balancing is on but cgroupRoot is not set to the host's cgroup2 mount"
        )),
        None => {}
    }
    if let Some(addr) = value["healthzBindAddress"].as_str()
        && !addr.ends_with(&format!(":{HEALTHZ_PORT}"))
    {
        p.push(format!(
            "{at}: healthzBindAddress {addr:?} is not on the probes' port {HEALTHZ_PORT}"
        ));
    }
    (p, text)
}

fn rbac_problems(docs: &[Doc]) -> Vec<String> {
    let ds: DaemonSet = find(docs, "DaemonSet", DAEMONSET).typed();
    let sa = ds
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.service_account_name)
        .unwrap_or_default();
    let sa_doc = find(docs, "ServiceAccount", &sa);
    let mut p = Vec::new();
    if sa_doc.namespace() != Some(NAMESPACE) {
        p.push(format!("{}: not in {NAMESPACE}", sa_doc.at));
    }
    let bindings: Vec<ClusterRoleBinding> = docs
        .iter()
        .filter(|d| d.kind == "ClusterRoleBinding")
        .map(Doc::typed)
        .filter(|b: &ClusterRoleBinding| {
            b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == sa
                    && s.namespace.as_deref() == Some(NAMESPACE)
            })
        })
        .collect();
    let mut rules = Vec::new();
    for b in &bindings {
        if b.role_ref.kind == "ClusterRole" && b.role_ref.api_group == "rbac.authorization.k8s.io" {
            let role: ClusterRole = find(docs, "ClusterRole", &b.role_ref.name).typed();
            rules.extend(role.rules.unwrap_or_default());
        }
    }
    let needed = [
        ("", "services", &["get", "list", "watch"][..]),
        ("", "nodes", &["get", "list", "watch"][..]),
        (
            "discovery.k8s.io",
            "endpointslices",
            &["get", "list", "watch"][..],
        ),
        ("", "events", &["create", "patch"][..]),
        ("events.k8s.io", "events", &["create", "patch"][..]),
        ("networking.k8s.io", "servicecidrs", &["list", "watch"][..]),
    ];
    for (group, resource, verbs) in needed {
        for verb in verbs {
            if !allows(&rules, group, resource, verb) {
                p.push(format!(
                    "ServiceAccount {NAMESPACE}/{sa} may not {verb} {resource} (apiGroup {group:?}) through any ClusterRoleBinding"
                ));
            }
        }
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn every_deploy_manifest_parses_typed_and_round_trips() {
    let docs = deploy_docs();
    for kind in [
        "DaemonSet",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
    ] {
        assert!(
            docs.iter().any(|d| d.kind == kind),
            "no {kind} under deploy/"
        );
    }
    // deploy/examples/demo.yaml stays.
    assert!(
        docs.iter()
            .any(|d| d.at.starts_with("deploy/examples/demo.yaml:")),
        "deploy/examples/demo.yaml is gone"
    );
}

#[test]
fn every_daemonset_is_unprivileged_and_node_level() {
    let docs = deploy_docs();
    let mut p = Vec::new();
    for doc in docs.iter().filter(|d| d.kind == "DaemonSet") {
        let ds: DaemonSet = doc.typed();
        let spec = ds.spec.expect("spec");
        let selector = spec.selector.match_labels.unwrap_or_default();
        p.extend(common_daemonset_problems(
            &doc.at,
            &spec.template,
            &selector,
        ));
    }
    assert!(p.is_empty(), "{}", p.join("\n"));
}

/// Each overlay renders, keeps every invariant of the base, and the subset overlay runs
/// lbproxy only on nodes labelled for it.
#[test]
fn overlays_render_and_keep_the_invariants() {
    let overlays: Vec<String> = kustomizations().into_iter().filter(|k| k != BASE).collect();
    assert!(
        overlays.iter().any(|o| o == "deploy/subset"),
        "no deploy/subset overlay among {overlays:?}"
    );
    for overlay in &overlays {
        let docs = docs_with(overlay);
        let mut p = lbproxy_daemonset_problems(&docs);
        p.extend(rbac_problems(&docs));
        p.extend(config_problems(&docs).0);
        assert!(p.is_empty(), "{overlay}:\n{}", p.join("\n"));
        if overlay == "deploy/subset" {
            let ds: DaemonSet = find(&docs, "DaemonSet", DAEMONSET).typed();
            let sel = ds
                .spec
                .and_then(|s| s.template.spec)
                .and_then(|s| s.node_selector)
                .unwrap_or_default();
            assert_eq!(
                sel.get("lbproxy.io/enabled").map(String::as_str),
                Some("true"),
                "{overlay}: nodeSelector {sel:?}"
            );
            assert_eq!(
                sel.get("kubernetes.io/os").map(String::as_str),
                Some("linux"),
                "{overlay}: nodeSelector {sel:?}"
            );
        }
    }
}

/// A change of config.conf changes the ConfigMap's name, and so the DaemonSet's pod
/// template: the pods roll.
#[test]
fn a_config_change_rolls_the_pods() {
    let base = repo_root().join(BASE);
    let copy = std::env::temp_dir().join(format!("lbproxy-kustomize-{}", std::process::id()));
    std::fs::create_dir_all(&copy).expect("temp dir");
    for f in ["kustomization.yaml", "lbproxy.yaml", "config.conf"] {
        std::fs::copy(base.join(f), copy.join(f)).unwrap_or_else(|e| panic!("copy {f}: {e}"));
    }
    let name = |dir: &Path| {
        let (docs, p) = parse_file("rendered", &render(dir));
        assert!(p.is_empty(), "{p:?}");
        let ds: DaemonSet = find(&docs, "DaemonSet", DAEMONSET).typed();
        config_source(&ds).expect("config volume").0
    };
    let before = name(&copy);
    let mut conf = std::fs::read_to_string(copy.join("config.conf")).unwrap();
    conf = conf.replace("stackBypass: false", "stackBypass: true");
    std::fs::write(copy.join("config.conf"), conf).unwrap();
    let after = name(&copy);
    std::fs::remove_dir_all(&copy).ok();
    assert!(before.starts_with("lbproxy-config-"), "{before}");
    assert_ne!(
        before, after,
        "the ConfigMap's name did not change with its content"
    );
}

#[test]
fn lbproxy_daemonset_invariants() {
    let p = lbproxy_daemonset_problems(&deploy_docs());
    assert!(p.is_empty(), "{}", p.join("\n"));
}

#[test]
fn rbac_grants_what_lbproxy_reads_and_writes() {
    let p = rbac_problems(&deploy_docs());
    assert!(p.is_empty(), "{}", p.join("\n"));
}

#[test]
fn configmap_holds_a_kube_proxy_configuration() {
    let (p, text) = config_problems(&deploy_docs());
    assert!(p.is_empty(), "{}", p.join("\n"));

    // The binary is the authority on its own format.
    let Some(bin) = std::env::var_os("LBPROXY_BIN") else {
        eprintln!("LBPROXY_BIN not set: config.conf checked against the agreed schema only");
        return;
    };
    let dir = std::env::temp_dir().join(format!("lbproxy-deploy-manifests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("config.conf");
    std::fs::write(&file, &text).expect("write config.conf");
    let out = Command::new(&bin)
        .args(["run", "--config"])
        .arg(&file)
        .arg("--validate-only")
        .output();
    std::fs::remove_dir_all(&dir).ok();
    let out = out.unwrap_or_else(|e| panic!("running {}: {e}", Path::new(&bin).display()));
    assert!(
        out.status.success(),
        "`{} run --config <ConfigMap's config.conf> --validate-only` failed ({}):\n{}{}",
        Path::new(&bin).display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn kind_cluster_config_runs_without_kube_proxy() {
    let docs = deploy_docs();
    let clusters: Vec<_> = docs.iter().filter(|d| d.kind == "Cluster").collect();
    assert!(!clusters.is_empty(), "no kind Cluster config under deploy/");
    for doc in clusters {
        let c: KindCluster = doc.typed();
        let mode = c.networking.and_then(|n| n.kube_proxy_mode);
        assert_eq!(mode.as_deref(), Some("none"), "{}: kubeProxyMode", doc.at);
    }
}

/// `deploy/Dockerfile` builds the way `cargo xtask setup` sets a machine up: same LLVM major,
/// bpf-linker version and features, build packages, nightly with rust-src, and the rust
/// version the workspace asks for.
#[test]
fn dockerfile_matches_xtask_setup() {
    let root = repo_root();
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let setup = read("xtask/src/setup.rs");
    let dockerfile = read("deploy/Dockerfile");
    let workspace = read("Cargo.toml");

    let quoted_after = |text: &str, marker: &str| -> String {
        let rest =
            &text[text.find(marker).unwrap_or_else(|| panic!("no {marker:?}")) + marker.len()..];
        let rest = rest.trim_start_matches([' ', '=']).trim_start();
        let end = rest.find([';', '\n']).expect("end of line");
        rest[..end].trim().trim_matches('"').to_string()
    };
    let llvm = quoted_after(&setup, "pub const LLVM_MAJOR: u32");
    let linker = quoted_after(&setup, "pub const BPF_LINKER_VERSION: &str");
    let nightly = quoted_after(&setup, "pub const NIGHTLY: &str");
    let rust = quoted_after(&workspace, "rust-version");

    let mut missing = Vec::new();
    let mut want = |s: String| {
        if !dockerfile.contains(&s) {
            missing.push(s.trim_end().to_string());
        }
    };
    want(format!("FROM rust:{rust}-bookworm"));
    want(format!("ARG LLVM_MAJOR={llvm}\n"));
    want(format!("ARG BPF_LINKER_VERSION={linker}\n"));
    want(format!(
        "rustup toolchain install {nightly} --profile minimal --component rust-src"
    ));
    want("LLVM_PREFIX=/usr/lib/llvm-${LLVM_MAJOR} cargo install bpf-linker".into());
    want(
        "--version ${BPF_LINKER_VERSION} --no-default-features --features llvm-${LLVM_MAJOR}"
            .into(),
    );
    // The build half of APT_PACKAGES: the -dev packages.
    let apt = &setup[setup.find("APT_PACKAGES").expect("APT_PACKAGES")..];
    let apt = &apt[..apt.find("];").expect("end of APT_PACKAGES")];
    for pkg in apt
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|p| p.ends_with("-dev"))
    {
        want(pkg.replace(&format!("llvm-{llvm}-"), "llvm-${LLVM_MAJOR}-"));
    }
    want("cargo build --release --locked -p lbproxy".into());
    want("FROM debian:bookworm-slim".into());
    want("ENTRYPOINT [\"/usr/local/bin/lbproxy\"]".into());
    assert!(
        missing.is_empty(),
        "deploy/Dockerfile lacks, to match xtask/src/setup.rs:\n  {}",
        missing.join("\n  ")
    );
}

/// The checker itself: a typo, a missing required field, a wrong apiVersion, an unknown kind
/// and a duplicate key each fail, naming the document and the path.
#[test]
fn checker_catches_broken_manifests() {
    let good = "\
apiVersion: v1
kind: ServiceAccount
metadata:
  name: a
  namespace: kube-system
";
    let (docs, p) = parse_file("t.yaml", good);
    assert!(p.is_empty() && docs.len() == 1, "{p:?}");

    let cases: &[(&str, &str)] = &[
        (
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec:\n      hostNetwrok: true\n      containers: [{name: c, image: i}]\n",
            "t.yaml: document 1 (DaemonSet x): spec.template.spec.hostNetwrok: unknown field",
        ),
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  ports: [{port: 80, targetProt: 8080}]\n",
            "spec.ports[0].targetProt: unknown field",
        ),
        (
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template: {}\n",
            "spec.selector: required field missing",
        ),
        (
            "apiVersion: apps/v2\nkind: DaemonSet\nmetadata: {name: x}\n",
            "does not parse as DaemonSet",
        ),
        (
            "apiVersion: v1\nkind: Secret\nmetadata: {name: x}\n",
            "unknown kind v1 Secret",
        ),
        (
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: '1', a: '2'}\n",
            "not valid YAML",
        ),
        (
            "kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnetworking: {kubeProxyMod: none}\n",
            "unknown field `kubeProxyMod`",
        ),
    ];
    for (yaml, want) in cases {
        let text = format!("{good}---\n{yaml}");
        let (_, p) = parse_file("t.yaml", &text);
        let want = want.replace("document 1", "document 2");
        assert!(
            p.iter().any(|m| m.contains(&want)),
            "for\n{yaml}\nwanted a problem containing {want:?}, got {p:?}"
        );
    }
}
