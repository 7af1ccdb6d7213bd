//! The two documents of a `--config` file, told apart by `apiVersion` and `kind`: lbproxy's
//! LbproxyConfiguration ([`LbproxyDoc`]) and kube-proxy's KubeProxyConfiguration (typed in
//! `kube_proxy.rs`).

use std::path::Path;

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
    pub takeover: Option<bool>,
    pub manifests: Option<String>,
    pub snat_port_range: Option<String>,
    pub cgroup_root: Option<String>,
    pub socket_lb: Option<String>,
    pub lb_algorithm: Option<String>,
    pub maglev_table_size: Option<u32>,
    pub hash_seed_file: Option<String>,
    pub xdp_acceleration: Option<String>,
    pub load_balancer_mode: Option<String>,
    pub per_service_metrics: Option<bool>,
    /// How long an unanswered SYN keeps its flow (kube-proxy has no such field).
    pub tcp_syn_sent_timeout: Option<String>,
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
