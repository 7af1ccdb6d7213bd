//! `lbproxy inspect` over one node's pinned maps, for every lab: the one-node [`super::Lab`]
//! and each [`super::multinode::Node`] of the two-node lab read their datapath the same way,
//! so the readers (JSON, drop counters) are written once, here.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use super::ns;

/// A node whose lbproxy pins its maps under [`Inspect::bpffs_dir`], inspected from its
/// network namespace.
pub trait Inspect {
    /// Runs `lbproxy ARGS` to completion in the node's network namespace.
    fn lbproxy_cmd(&self, args: &[&str]) -> Output;

    /// Where the node's lbproxy pins its maps (`--bpffs-dir`).
    fn bpffs_dir(&self) -> &Path;

    /// `lbproxy inspect WHAT --json --bpffs-dir DIR`, parsed. Panics on failure or bad JSON.
    fn inspect_json(&self, what: &str) -> serde_json::Value {
        let dir = self.bpffs_dir().display().to_string();
        let out = self.lbproxy_cmd(&["inspect", what, "--json", "--bpffs-dir", &dir]);
        let text = ns::output_result(&format!("lbproxy inspect {what} --json"), out)
            .unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("lbproxy inspect {what} --json: bad JSON ({e}): {text}"))
    }

    /// Every datapath drop/reject counter (`inspect drops --json`) by reason.
    fn drop_counts(&self) -> BTreeMap<String, u64> {
        let v = self.inspect_json("drops");
        v.as_object()
            .unwrap_or_else(|| panic!("inspect drops --json: not an object: {v}"))
            .iter()
            .map(|(k, n)| {
                let n = n
                    .as_u64()
                    .unwrap_or_else(|| panic!("inspect drops --json: {k} = {n}"));
                (k.clone(), n)
            })
            .collect()
    }

    /// The datapath drop counter `reason` (0 when it never counted).
    fn drop_count(&self, reason: &str) -> u64 {
        self.inspect_json("drops")[reason].as_u64().unwrap_or(0)
    }
}
