//! The two documents of a `--config` file (kube-proxy's KubeProxyConfiguration and
//! lbproxy's LbproxyConfiguration), read and checked field by field.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::*;

/// lbproxy's own document. Unknown fields are refused.
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LbproxyDoc {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub pod_interfaces: Option<Vec<String>>,
    pub bpffs_dir: Option<String>,
    pub flow_map_size: Option<u64>,
    pub stack_bypass: Option<bool>,
    pub manifests: Option<String>,
    pub snat_port_range: Option<String>,
    pub cgroup_root: Option<String>,
    pub socket_lb: Option<String>,
    /// How long an unanswered SYN keeps its flow (kube-proxy has no such field).
    pub tcp_syn_sent_timeout: Option<String>,
}

/// The fields of kube-proxy's document that lbproxy applies, as written (empty values are
/// `None`: kube-proxy's "use the default").
#[derive(Debug, Default, Clone)]
pub struct KubeProxyDoc {
    pub kubeconfig: Option<String>,
    pub qps: Option<f64>,
    pub burst: Option<i64>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub config_sync_period: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub cluster_cidr: Option<String>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub udp_timeout: Option<String>,
    pub logging_format: Option<String>,
    pub verbosity: Option<i64>,
    pub detect_local_mode: Option<String>,
    pub interface_name_prefix: Option<String>,
    pub oom_score_adj: Option<i64>,
}

/// Reads the values of kube-proxy's document, naming the dotted field in every error.
pub(crate) struct Doc<'a> {
    origin: &'a str,
    root: &'a Value,
}

impl Doc<'_> {
    fn at(&self, path: &str) -> Option<&Value> {
        path.split('.').try_fold(self.root, |v, k| v.get(k))
    }

    /// A string; `null` and `""` are "not set".
    fn string(&self, path: &str) -> Result<Option<String>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
            Some(other) => Err(err(self.origin, path, format!("{other} is not a string"))),
        }
    }

    /// A duration as a string; `0s` (and `0`) is "not set", as in kube-proxy.
    fn duration(&self, path: &str) -> Result<Option<String>, ConfigError> {
        Ok(self
            .string(path)?
            .filter(|s| parse_go_duration(s) != Some(Duration::ZERO)))
    }

    /// A number; `null` is "not set" (0 is returned as 0: the caller knows what it means).
    fn number(&self, path: &str) -> Result<Option<f64>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(err(self.origin, path, format!("{other} is not a number"))),
        }
    }

    fn integer(&self, path: &str) -> Result<Option<i64>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_i64().is_some() => Ok(n.as_i64()),
            Some(other) => Err(err(self.origin, path, format!("{other} is not an integer"))),
        }
    }

    /// A list of strings; `null` and `[]` are "not set".
    fn strings(&self, path: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.at(path) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => {
                let mut out = Vec::new();
                for it in items {
                    match it {
                        Value::String(s) => out.push(s.clone()),
                        other => {
                            return Err(err(self.origin, path, format!("{other} is not a string")));
                        }
                    }
                }
                Ok(Some(out).filter(|v| !v.is_empty()))
            }
            Some(other) => Err(err(
                self.origin,
                path,
                format!("{other} is not a list of strings"),
            )),
        }
    }
}

/// Whether a value is other than kube-proxy's empty one (`null`, `""`, `0`, `0s`, `false`,
/// `[]`, or a mapping of only such values).
pub(crate) fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => {
            let s = s.trim();
            !s.is_empty() && parse_go_duration(s) != Some(Duration::ZERO)
        }
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => m.values().any(is_set),
    }
}

/// Checks the keys of kube-proxy's document against [`KUBE_PROXY_FIELDS`]: lbproxy's own
/// fields are refused (they belong in the other document); fields lbproxy ignores that carry
/// a value go to `ignored`; fields v1alpha1 does not have go to `unknown`.
pub(crate) fn check_kube_fields(
    origin: &str,
    map: &serde_json::Map<String, Value>,
    prefix: &str,
    ignored: &mut Vec<String>,
    unknown: &mut Vec<String>,
) -> Result<(), ConfigError> {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let known = KUBE_PROXY_FIELDS
            .iter()
            .find(|(p, _)| *p == path)
            .map(|(_, u)| *u);
        match known {
            None if (prefix.is_empty() && LBPROXY_FIELDS.contains(&k.as_str()))
                || path == "conntrack.tcpSynSentTimeout" =>
            {
                return Err(err(
                    origin,
                    &path,
                    format!(
                        "is lbproxy's own field, not kube-proxy's: move it to the \
                         {LBPROXY_KIND} document (apiVersion: {LBPROXY_API_VERSION}){}",
                        if path.contains('.') {
                            format!(" as {k}")
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
            None => unknown.push(path),
            Some(Use::Block) => match v {
                Value::Object(m) => check_kube_fields(origin, m, &path, ignored, unknown)?,
                Value::Null => {}
                other => return Err(err(origin, &path, format!("{other} is not a mapping"))),
            },
            Some(Use::Ignored(why) | Use::Map(why)) => {
                if is_set(v) {
                    ignored.push(format!("{path} ({why})"));
                }
            }
            Some(Use::Applied | Use::NoEffect(_)) => {}
        }
    }
    Ok(())
}

/// Reads kube-proxy's document.
pub(crate) fn kube_doc(
    origin: &str,
    root: &Value,
    warnings: &mut Vec<String>,
) -> Result<KubeProxyDoc, ConfigError> {
    let Value::Object(map) = root else {
        return Err(err(origin, "(document)", "is not a mapping"));
    };
    let (mut ignored, mut unknown) = (Vec::new(), Vec::new());
    check_kube_fields(origin, map, "", &mut ignored, &mut unknown)?;
    let d = Doc { origin, root };
    let mode = d.string("mode")?;
    if let Some(m) = mode.as_deref().filter(|m| *m != "ebpf") {
        ignored.insert(
            0,
            format!("mode: {m:?} (lbproxy is an eBPF proxy: it writes no iptables, ipvs or nftables rules)"),
        );
    }
    for path in [
        "clientConnection.contentType",
        "clientConnection.acceptContentTypes",
    ] {
        if let Some(ct) = d.string(path)?
            && ct.split(',').any(|t| t.trim() != "application/json")
        {
            ignored.push(format!(
                "{path}: {ct:?} (lbproxy's client speaks application/json only)"
            ));
        }
    }
    if !ignored.is_empty() {
        warnings.push(format!(
            "{origin}: ignoring KubeProxyConfiguration fields lbproxy has no use for: {}",
            ignored.join("; ")
        ));
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "{origin}: ignoring fields KubeProxyConfiguration v1alpha1 does not have (as kube-proxy's lenient decoding does): {}",
            unknown.join(", ")
        ));
    }
    // The sync periods: the short form, else the block of the configured mode, else the
    // iptables block, else the nftables one.
    let mode_block = match mode.as_deref() {
        Some("nftables") => "nftables",
        _ => "iptables",
    };
    let other_block = if mode_block == "iptables" {
        "nftables"
    } else {
        "iptables"
    };
    let period = |field: &str| -> Result<Option<String>, ConfigError> {
        for path in [
            field.to_string(),
            format!("{mode_block}.{field}"),
            format!("{other_block}.{field}"),
        ] {
            if let Some(v) = d.duration(&path)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    };
    Ok(KubeProxyDoc {
        kubeconfig: d.string("clientConnection.kubeconfig")?,
        qps: d.number("clientConnection.qps")?.filter(|q| *q != 0.0),
        burst: d.integer("clientConnection.burst")?.filter(|b| *b != 0),
        hostname_override: d.string("hostnameOverride")?,
        bind_address: d.string("bindAddress")?,
        healthz_bind_address: d.string("healthzBindAddress")?,
        metrics_bind_address: d.string("metricsBindAddress")?,
        sync_period: period("syncPeriod")?,
        min_sync_period: period("minSyncPeriod")?,
        config_sync_period: d.duration("configSyncPeriod")?,
        node_port_addresses: d.strings("nodePortAddresses")?,
        cluster_cidr: d.string("clusterCIDR")?,
        tcp_established_timeout: d.duration("conntrack.tcpEstablishedTimeout")?,
        tcp_close_wait_timeout: d.duration("conntrack.tcpCloseWaitTimeout")?,
        udp_timeout: d.duration("conntrack.udpTimeout")?,
        logging_format: d.string("logging.format")?,
        verbosity: d.integer("logging.verbosity")?,
        detect_local_mode: d.string("detectLocalMode")?,
        interface_name_prefix: d.string("detectLocal.interfaceNamePrefix")?,
        oom_score_adj: d.integer("oomScoreAdj")?,
    })
}

/// Parses a config file's text: kube-proxy's document, lbproxy's, or both (YAML documents
/// separated by `---`). A document with neither `apiVersion` nor `kind` is kube-proxy's.
pub fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    let origin = path.display().to_string();
    // YAML 1.2 booleans only: `hostnameOverride: n` is the name "n", not false.
    let docs: Vec<Value> = crate::yaml::documents(text)
        .map_err(|e| err(&origin, "(file)", format!("not valid YAML: {e}")))?;
    let mut out = FileConfig::default();
    let (mut kube_seen, mut own_seen) = (false, false);
    for (i, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let which = format!("document {}", i + 1);
        let Value::Object(map) = &doc else {
            return Err(err(&origin, &which, "is not a mapping"));
        };
        let text_of = |k: &str| map.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let (api, kind) = (text_of("apiVersion"), text_of("kind"));
        if kind == LBPROXY_KIND || api == LBPROXY_API_VERSION {
            if api != LBPROXY_API_VERSION {
                return Err(err(
                    &origin,
                    "apiVersion",
                    format!("{api:?} is not {LBPROXY_API_VERSION} (kind {LBPROXY_KIND})"),
                ));
            }
            if kind != LBPROXY_KIND {
                return Err(err(
                    &origin,
                    "kind",
                    format!("{kind:?} is not {LBPROXY_KIND} (apiVersion {LBPROXY_API_VERSION})"),
                ));
            }
            if std::mem::replace(&mut own_seen, true) {
                return Err(err(
                    &origin,
                    &which,
                    format!("a second {LBPROXY_KIND} document"),
                ));
            }
            out.own = serde_json::from_value(doc).map_err(|e| {
                // serde names the unknown or mistyped field in its message.
                let msg = e.to_string();
                let field = msg
                    .split('`')
                    .nth(1)
                    .filter(|_| msg.starts_with("unknown field"))
                    .unwrap_or(LBPROXY_KIND)
                    .to_string();
                err(&origin, &field, msg)
            })?;
        } else if kind == KUBE_PROXY_KIND
            || api.starts_with("kubeproxy.config.k8s.io/")
            || (kind.is_empty() && api.is_empty())
        {
            if !api.is_empty() && api != KUBE_PROXY_API_VERSION {
                return Err(err(
                    &origin,
                    "apiVersion",
                    format!("{api:?} is not {KUBE_PROXY_API_VERSION}"),
                ));
            }
            if !kind.is_empty() && kind != KUBE_PROXY_KIND {
                return Err(err(
                    &origin,
                    "kind",
                    format!("{kind:?} is not {KUBE_PROXY_KIND}"),
                ));
            }
            if std::mem::replace(&mut kube_seen, true) {
                return Err(err(
                    &origin,
                    &which,
                    format!("a second {KUBE_PROXY_KIND} document"),
                ));
            }
            out.kube = kube_doc(&origin, &doc, &mut out.warnings)?;
        } else {
            return Err(err(
                &origin,
                "kind",
                format!(
                    "{kind:?} (apiVersion {api:?}) is neither {KUBE_PROXY_KIND} ({KUBE_PROXY_API_VERSION}) nor {LBPROXY_KIND} ({LBPROXY_API_VERSION})"
                ),
            ));
        }
    }
    Ok(out)
}
