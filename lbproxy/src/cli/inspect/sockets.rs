//! `inspect sockets`: socket-level load balancing, its hooks, scope and counters.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Output, table};
use crate::bpf::PinnedMaps;

/// What `inspect sockets` shows. The fields are in the order of the JSON keys, which is
/// alphabetical: keep it so when adding one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sockets {
    /// What the socket hooks did, by event (`connect_translated`, `other_netns`, ...).
    pub events: BTreeMap<String, u64>,
    /// The pinned links of the hooks attached.
    pub hooks: Vec<String>,
    /// `off`, `host` (the node's own sockets) or `pods` (every network namespace's).
    pub mode: String,
    /// The node's network namespace cookie: in `host` mode, only its sockets are translated.
    pub netns_cookie: u64,
    /// Sockets remembered for recvmsg/getpeername.
    pub translated_sockets: usize,
}

/// `inspect sockets`.
pub fn render(maps: &PinnedMaps, dir: &Path, out: Output) -> anyhow::Result<String> {
    let cfg = maps.sock_config.get(&0, 0).unwrap_or_default();
    let on = cfg.flags & lbproxy_common::SOCK_F_ENABLED != 0;
    let scope = match (on, cfg.flags & lbproxy_common::SOCK_F_ALL_NETNS != 0) {
        (false, _) => "off",
        (true, false) => "host",
        (true, true) => "pods",
    };
    let hooks: Vec<String> = crate::bpf::sock::pinned_links(dir)
        .iter()
        .filter_map(|p| Some(p.file_name()?.to_string_lossy().to_string()))
        .collect();
    let sockets = maps.sock_rev.keys().flatten().count() + maps.sock_rev6.keys().flatten().count();
    let counts: Vec<(&'static str, u64)> = maps
        .sock_counts()
        .into_iter()
        .map(|(e, n)| (e.label(), n))
        .collect();
    if out.machine() {
        return out.encode(&Sockets {
            events: counts.iter().map(|&(e, n)| (e.to_string(), n)).collect(),
            hooks,
            mode: scope.to_string(),
            netns_cookie: cfg.netns_cookie,
            translated_sockets: sockets,
        });
    }
    let mut out = format!(
        "socket-level load balancing: {scope} (network namespace cookie {})
hooks attached: {}
sockets remembered (for recvmsg/getpeername): {sockets}

",
        cfg.netns_cookie,
        if hooks.is_empty() {
            "(none)".to_string()
        } else {
            hooks.join(", ")
        }
    );
    let cells: Vec<Vec<String>> = counts
        .iter()
        .map(|(e, n)| vec![e.to_string(), n.to_string()])
        .collect();
    out.push_str(&table(&["EVENT", "COUNT"], &cells));
    Ok(out)
}
