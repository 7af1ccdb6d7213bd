//! `inspect sockets`: socket-level load balancing, its hooks, scope and counters.

use std::collections::BTreeMap;
use std::path::Path;

use super::{Output, table};
use crate::bpf::PinnedMaps;

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
        let v = serde_json::json!({
            "mode": scope,
            "netns_cookie": cfg.netns_cookie,
            "hooks": hooks,
            "translated_sockets": sockets,
            "events": counts.iter().copied().collect::<BTreeMap<_, _>>(),
        });
        return out.encode(&v);
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
