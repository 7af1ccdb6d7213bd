//! kube-proxy's `KubeProxyConfiguration` v1alpha1, typed: [`KubeProxyConfiguration`] is
//! the document as written (the blocks and fields lbproxy reads, each leaf a [`Field`]),
//! [`KubeProxyDoc`] the values lbproxy applies from it.

use std::time::Duration;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::*;

/// A leaf of kube-proxy's document: its value (`None` for kube-proxy's empty one: "use the
/// default"), or why what was written is not of the field's type.
///
/// Deserializing never fails on a leaf: the reason waits until [`Field::get`] names the
/// field, which [`KubeProxyConfiguration::applied`] does in one fixed order. So with several
/// wrong fields the one refused does not depend on the file's order, and a field lbproxy
/// never reads (an `iptables.syncPeriod` under a set `syncPeriod`) is never refused.
#[derive(Debug, Clone)]
pub struct Field<T>(Result<Option<T>, String>);

impl<T> Default for Field<T> {
    fn default() -> Self {
        Field(Ok(None))
    }
}

impl<'de, T: Leaf> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Value::deserialize(d).map(|v| Field(T::read(&v)))
    }
}

impl<T: Clone> Field<T> {
    /// The value, or the error naming `origin` and the dotted `path` of the field.
    pub fn get(&self, origin: &str, path: &str) -> Result<Option<T>, ConfigError> {
        self.0.clone().map_err(|reason| err(origin, path, reason))
    }
}

impl Field<String> {
    /// A duration, as written (it is parsed where it is resolved, by the parser the flag's
    /// goes through); `0s` and `0` are "not set", as in kube-proxy.
    pub fn duration(&self, origin: &str, path: &str) -> Result<Option<String>, ConfigError> {
        Ok(self
            .get(origin, path)?
            .filter(|s| parse_go_duration(s) != Some(Duration::ZERO)))
    }
}

/// What a [`Field`] holds, and how it is read from the YAML value.
pub trait Leaf: Sized {
    /// `Ok(None)` for the empty value, `Err` with the reason for a value of another type.
    fn read(v: &Value) -> Result<Option<Self>, String>;
}

/// A string, trimmed; `null` and `""` are "not set".
impl Leaf for String {
    fn read(v: &Value) -> Result<Option<Self>, String> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s.trim().to_string()).filter(|s| !s.is_empty())),
            other => Err(format!("{other} is not a string")),
        }
    }
}

/// A number; `null` is "not set" (0 is read as 0: the caller knows what it means).
impl Leaf for f64 {
    fn read(v: &Value) -> Result<Option<Self>, String> {
        match v {
            Value::Null => Ok(None),
            Value::Number(n) => Ok(n.as_f64()),
            other => Err(format!("{other} is not a number")),
        }
    }
}

/// A whole number; `null` is "not set".
impl Leaf for i64 {
    fn read(v: &Value) -> Result<Option<Self>, String> {
        match v {
            Value::Null => Ok(None),
            Value::Number(n) if n.as_i64().is_some() => Ok(n.as_i64()),
            other => Err(format!("{other} is not an integer")),
        }
    }
}

/// A list of strings; `null` and `[]` are "not set".
impl Leaf for Vec<String> {
    fn read(v: &Value) -> Result<Option<Self>, String> {
        match v {
            Value::Null => Ok(None),
            Value::Array(items) => {
                let out = items
                    .iter()
                    .map(|it| match it {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(format!("{other} is not a string")),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Some(out).filter(|v| !v.is_empty()))
            }
            other => Err(format!("{other} is not a list of strings")),
        }
    }
}

/// A block written as `null` is an empty one (every field "not set").
fn block<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// kube-proxy's document, as written: the fields lbproxy reads. The others (see
/// [`KUBE_PROXY_FIELDS`]) are checked by [`check_kube_fields`], which also makes sure each
/// block here is a mapping or `null`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub mode: Field<String>,
    #[serde(deserialize_with = "block")]
    pub client_connection: ClientConnection,
    pub hostname_override: Field<String>,
    pub bind_address: Field<String>,
    pub healthz_bind_address: Field<String>,
    pub metrics_bind_address: Field<String>,
    /// The short forms of `iptables.syncPeriod` and `.minSyncPeriod` (v1alpha2's place).
    pub sync_period: Field<String>,
    pub min_sync_period: Field<String>,
    #[serde(deserialize_with = "block")]
    pub iptables: SyncBlock,
    #[serde(deserialize_with = "block")]
    pub nftables: SyncBlock,
    pub config_sync_period: Field<String>,
    pub node_port_addresses: Field<Vec<String>>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Field<String>,
    #[serde(deserialize_with = "block")]
    pub conntrack: Conntrack,
    #[serde(deserialize_with = "block")]
    pub logging: Logging,
    pub detect_local_mode: Field<String>,
    #[serde(deserialize_with = "block")]
    pub detect_local: DetectLocal,
    pub oom_score_adj: Field<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Field<String>,
    pub qps: Field<f64>,
    pub burst: Field<i64>,
    pub content_type: Field<String>,
    pub accept_content_types: Field<String>,
}

/// `iptables` and `nftables`: their sync periods.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SyncBlock {
    pub sync_period: Field<String>,
    pub min_sync_period: Field<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Conntrack {
    pub tcp_established_timeout: Field<String>,
    pub tcp_close_wait_timeout: Field<String>,
    pub udp_timeout: Field<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Logging {
    pub format: Field<String>,
    pub verbosity: Field<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DetectLocal {
    pub interface_name_prefix: Field<String>,
}

/// The fields of kube-proxy's document that lbproxy applies, their types checked (empty
/// values are `None`: kube-proxy's "use the default"). Durations, addresses and CIDRs are
/// as written: they are parsed where they are resolved, as the flags' are.
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

impl KubeProxyConfiguration {
    /// The values lbproxy applies, each field's type checked in this order.
    pub fn applied(&self, o: &str, mode: Option<&str>) -> Result<KubeProxyDoc, ConfigError> {
        let (c, t) = (&self.client_connection, &self.conntrack);
        Ok(KubeProxyDoc {
            kubeconfig: c.kubeconfig.get(o, "clientConnection.kubeconfig")?,
            qps: c.qps.get(o, "clientConnection.qps")?.filter(|q| *q != 0.0),
            burst: c
                .burst
                .get(o, "clientConnection.burst")?
                .filter(|b| *b != 0),
            hostname_override: self.hostname_override.get(o, "hostnameOverride")?,
            bind_address: self.bind_address.get(o, "bindAddress")?,
            healthz_bind_address: self.healthz_bind_address.get(o, "healthzBindAddress")?,
            metrics_bind_address: self.metrics_bind_address.get(o, "metricsBindAddress")?,
            sync_period: self.period(o, mode, ("syncPeriod", &self.sync_period), |b| {
                &b.sync_period
            })?,
            min_sync_period: self.period(
                o,
                mode,
                ("minSyncPeriod", &self.min_sync_period),
                |b| &b.min_sync_period,
            )?,
            config_sync_period: self.config_sync_period.duration(o, "configSyncPeriod")?,
            node_port_addresses: self.node_port_addresses.get(o, "nodePortAddresses")?,
            cluster_cidr: self.cluster_cidr.get(o, "clusterCIDR")?,
            tcp_established_timeout: t
                .tcp_established_timeout
                .duration(o, "conntrack.tcpEstablishedTimeout")?,
            tcp_close_wait_timeout: t
                .tcp_close_wait_timeout
                .duration(o, "conntrack.tcpCloseWaitTimeout")?,
            udp_timeout: t.udp_timeout.duration(o, "conntrack.udpTimeout")?,
            logging_format: self.logging.format.get(o, "logging.format")?,
            verbosity: self.logging.verbosity.get(o, "logging.verbosity")?,
            detect_local_mode: self.detect_local_mode.get(o, "detectLocalMode")?,
            interface_name_prefix: self
                .detect_local
                .interface_name_prefix
                .get(o, "detectLocal.interfaceNamePrefix")?,
            oom_score_adj: self.oom_score_adj.get(o, "oomScoreAdj")?,
        })
    }

    /// A sync period: the short form (`name` and its field), else the block of the
    /// configured mode, else the iptables block, else the nftables one (`of` the block).
    /// Only the fields up to the first set one are read.
    fn period(
        &self,
        o: &str,
        mode: Option<&str>,
        (name, short): (&str, &Field<String>),
        of: fn(&SyncBlock) -> &Field<String>,
    ) -> Result<Option<String>, ConfigError> {
        let (ipt, nft) = (("iptables", &self.iptables), ("nftables", &self.nftables));
        let blocks = if mode == Some("nftables") {
            [nft, ipt]
        } else {
            [ipt, nft]
        };
        if let Some(v) = short.duration(o, name)? {
            return Ok(Some(v));
        }
        for (block, b) in blocks {
            if let Some(v) = of(b).duration(o, &format!("{block}.{name}"))? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    /// What lbproxy ignores in the fields it reads: a `mode` other than `ebpf`, content
    /// types other than JSON.
    fn ignored_values(
        &self,
        o: &str,
        mode: Option<&str>,
        ignored: &mut Vec<String>,
    ) -> Result<(), ConfigError> {
        if let Some(m) = mode.filter(|m| *m != "ebpf") {
            ignored.insert(
                0,
                format!("mode: {m:?} (lbproxy is an eBPF proxy: it writes no iptables, ipvs or nftables rules)"),
            );
        }
        let c = &self.client_connection;
        for (path, field) in [
            ("clientConnection.contentType", &c.content_type),
            (
                "clientConnection.acceptContentTypes",
                &c.accept_content_types,
            ),
        ] {
            if let Some(ct) = field.get(o, path)?
                && ct.split(',').any(|t| t.trim() != "application/json")
            {
                ignored.push(format!(
                    "{path}: {ct:?} (lbproxy's client speaks application/json only)"
                ));
            }
        }
        Ok(())
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

/// Reads kube-proxy's document: its fields checked against v1alpha1's, what lbproxy ignores
/// added to `warnings`, and the values it applies.
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
    // Every block is a mapping or null now, and no leaf refuses a value: this cannot fail.
    let doc = KubeProxyConfiguration::deserialize(root)
        .map_err(|e| err(origin, "(document)", e.to_string()))?;
    let mode = doc.mode.get(origin, "mode")?;
    doc.ignored_values(origin, mode.as_deref(), &mut ignored)?;
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
    doc.applied(origin, mode.as_deref())
}
