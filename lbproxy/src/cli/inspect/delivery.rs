//! `inspect delivery`: the stack bypass, its interfaces, and how packets were delivered.

use super::{Output, table};
use crate::bpf::PinnedMaps;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What `inspect delivery` shows. The fields are in the order of the JSON keys, which is
/// alphabetical: keep it so when adding one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Delivery {
    /// Packets by how they were delivered (`redirect_to_backend`, `redirect_hairpin`, ...).
    pub packets: BTreeMap<String, u64>,
    /// The pod interfaces the bypass redirects into (none while it is off).
    pub redirect_interfaces: Vec<RedirectInterface>,
    pub stack_bypass: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RedirectInterface {
    pub ifindex: u32,
    /// `veth`, `netkit` or `unknown`.
    pub kind: String,
}

/// `inspect delivery`.
pub fn render(maps: &PinnedMaps, out: Output) -> anyhow::Result<String> {
    let bypass = maps.stack_bypass();
    // `LB_PODIFS_V1` lists the pod interfaces whether or not the bypass is on (north-south
    // asks it which backends are local); they are redirect targets only with the bypass.
    let mut ifs: Vec<(u32, &'static str)> = maps
        .pod_ifs
        .iter()
        .flatten()
        .filter(|(_, v)| bypass && v.kind != lbproxy_common::POD_IF_BRIDGE)
        .map(|(ifindex, v)| {
            let kind = match v.kind {
                lbproxy_common::POD_IF_VETH => "veth",
                lbproxy_common::POD_IF_NETKIT => "netkit",
                _ => "unknown",
            };
            (ifindex, kind)
        })
        .collect();
    ifs.sort_unstable();
    let counts: Vec<(&'static str, u64)> = maps
        .delivery_counts()
        .into_iter()
        .map(|(d, n)| (d.label(), n))
        .collect();
    if out.machine() {
        return out.encode(&Delivery {
            packets: counts.iter().map(|&(p, n)| (p.to_string(), n)).collect(),
            redirect_interfaces: ifs
                .iter()
                .map(|&(ifindex, kind)| RedirectInterface {
                    ifindex,
                    kind: kind.to_string(),
                })
                .collect(),
            stack_bypass: bypass,
        });
    }
    let mut out = format!(
        "stack bypass: {}\nredirect into: {}\n\n",
        if bypass { "on" } else { "off" },
        if ifs.is_empty() {
            "(no interface)".to_string()
        } else {
            ifs.iter()
                .map(|(i, k)| format!("ifindex {i} ({k})"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let cells: Vec<Vec<String>> = counts
        .iter()
        .map(|(p, n)| vec![(*p).to_string(), n.to_string()])
        .collect();
    out.push_str(&table(&["PATH", "PACKETS"], &cells));
    Ok(out)
}
