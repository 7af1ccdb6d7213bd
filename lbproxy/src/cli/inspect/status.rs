//! `inspect status`: the controller's last sync (from its /healthz), the attached interfaces
//! and how full each map is.

use std::collections::BTreeMap;
use std::path::Path;

use lbproxy_common::map_names;
use serde::{Deserialize, Serialize};

use super::{Output, table};
use crate::bpf::PinnedMaps;

/// What `inspect status` shows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    /// The controller's /healthz body, or why it could not be read.
    pub controller: serde_json::Value,
    /// Seconds since the last sync that programmed the maps (from /healthz).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_age_seconds: Option<f64>,
    pub healthy: Option<bool>,
    /// Interfaces with lbproxy's pinned links, and the programs attached there.
    pub interfaces: Vec<InterfaceRow>,
    pub maps: Vec<MapFill>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InterfaceRow {
    pub name: String,
    pub ifindex: u32,
    pub links: Vec<String>,
    /// `native` when `lb_xdp` runs on this interface (`--xdp-acceleration`), else `none`.
    pub xdp: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MapFill {
    pub map: String,
    pub entries: u64,
    pub capacity: u32,
    pub fill: f64,
}

/// `inspect status`.
pub fn render(maps: &PinnedMaps, dir: &Path, out: Output, healthz: &str) -> anyhow::Result<String> {
    let (controller, healthy, age) = match get_json(healthz, "/healthz") {
        Ok(v) => {
            let healthy = v["healthy"].as_bool();
            let age = v["secondsSinceUpdate"].as_f64();
            (v, healthy, age)
        }
        Err(e) => (
            serde_json::json!({"error": format!("GET http://{healthz}/healthz: {e:#}")}),
            None,
            None,
        ),
    };
    let interfaces: Vec<InterfaceRow> = crate::bpf::attach::pinned_interfaces(dir)
        .into_iter()
        .map(|(iface, links)| {
            let links: Vec<String> = links
                .iter()
                .filter_map(|p| p.file_name().map(|f| f.to_string_lossy().to_string()))
                .collect();
            let xdp_pin = format!(":{}", crate::bpf::attach::XDP_PIN);
            InterfaceRow {
                name: iface.name.clone(),
                ifindex: iface.index,
                xdp: if links.iter().any(|l| l.ends_with(&xdp_pin)) {
                    "native".into()
                } else {
                    "none".into()
                },
                links,
            }
        })
        .collect();
    // The hash maps, whose entries come and go (arrays are always full).
    let counts: [(&'static str, usize); 12] = [
        (map_names::SERVICES, maps.services.keys().count()),
        (map_names::SLOTS, maps.slots.keys().count()),
        (map_names::BACKENDS, maps.backends.keys().count()),
        (map_names::MEMBERS, maps.members.keys().count()),
        (map_names::FLOWS, maps.flows.keys().count()),
        (map_names::AFFINITY, maps.affinity.keys().count()),
        (map_names::LABELS, maps.labels.keys().count()),
        (map_names::UNSERVED, maps.unserved.keys().count()),
        (map_names::POD_IFS, maps.pod_ifs.keys().count()),
        (map_names::NODE_IFS, maps.node_ifs.keys().count()),
        (map_names::SOCK_REV, maps.sock_rev.keys().count()),
        (map_names::SOCK_REV6, maps.sock_rev6.keys().count()),
    ];
    let capacities: BTreeMap<&str, i64> = crate::bpf::capacities(dir).into_iter().collect();
    let fills: Vec<MapFill> = counts
        .into_iter()
        .map(|(name, n)| {
            let capacity = capacities.get(name).copied().unwrap_or(0) as u32;
            MapFill {
                map: lbproxy_common::spec_by_name(name)
                    .map_or(name, |s| s.label)
                    .to_string(),
                entries: n as u64,
                capacity,
                fill: n as f64 / f64::from(capacity.max(1)),
            }
        })
        .collect();
    let st = Status {
        controller,
        sync_age_seconds: age,
        healthy,
        interfaces,
        maps: fills,
    };
    if out.machine() {
        return out.encode(&st);
    }
    let mut text = String::new();
    match (&st.healthy, st.sync_age_seconds) {
        (Some(h), Some(age)) => text.push_str(&format!(
            "controller: {} (last sync {age:.1}s ago; node eligible: {})\n",
            if *h { "healthy" } else { "UNHEALTHY" },
            st.controller["nodeEligible"]
        )),
        _ => text.push_str(&format!(
            "controller: not reachable ({})\n",
            st.controller["error"]
                .as_str()
                .unwrap_or("no sync time in /healthz")
        )),
    }
    text.push_str(&format!("\ninterfaces ({}):\n", st.interfaces.len()));
    let cells: Vec<Vec<String>> = st
        .interfaces
        .iter()
        .map(|i| {
            vec![
                i.name.clone(),
                i.ifindex.to_string(),
                i.xdp.clone(),
                i.links.join(", "),
            ]
        })
        .collect();
    text.push_str(&table(&["INTERFACE", "IFINDEX", "XDP", "LINKS"], &cells));
    text.push_str("\nmaps:\n");
    let cells: Vec<Vec<String>> = st
        .maps
        .iter()
        .map(|m| {
            vec![
                m.map.clone(),
                m.entries.to_string(),
                m.capacity.to_string(),
                format!("{:.1}%", m.fill * 100.0),
            ]
        })
        .collect();
    text.push_str(&table(&["MAP", "ENTRIES", "CAPACITY", "FILL"], &cells));
    Ok(text)
}

/// GETs `http://{addr}{path}` and parses the body as JSON, whatever the status (a 503
/// `/healthz` still says why), within 3 s. For `lbproxy inspect status`.
fn get_json(addr: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    use http_body_util::BodyExt as _;
    let uri: http::Uri = format!("http://{addr}{path}").parse()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<bytes::Bytes>>();
        let fetch = async {
            let resp = client.get(uri).await?;
            let body = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok(serde_json::from_slice(&body)?)
        };
        tokio::time::timeout(std::time::Duration::from_secs(3), fetch)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 3 s"))?
    })
}
