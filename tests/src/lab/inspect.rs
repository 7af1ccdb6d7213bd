//! `lbproxy inspect` over one node's pinned maps, for every lab: the one-node [`super::Lab`]
//! and each [`super::multinode::Node`] of the two-node lab read their datapath the same way,
//! so the readers (JSON, drop counters) are written once, here.
//!
//! The typed readers (`inspect_services`, `inspect_flows`, ...; feature `inspect-rows`) parse
//! the real command's `--json` output into the lbproxy crate's row types, [`rows`]: a test
//! reads fields by name, checked by the compiler, and a field the CLI stops printing fails
//! the parse. [`Inspect::inspect_json`] stays for dumps and for the tests of the JSON's
//! shape itself.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

#[cfg(feature = "inspect-rows")]
pub use ::lbproxy::cli::inspect::rows;
#[cfg(feature = "inspect-rows")]
use rows::{AffinityRow, BackendRow, Delivery, FlowRow, ServiceRow, SnatRow, Sockets};
use serde::de::DeserializeOwned;

use super::ns;

/// The datapath's events (`inspect events --json`, `lbproxy_datapath_events_total{event}`),
/// sorted: the drop reasons that were never drops, under the same names. For one release
/// each is counted as that deprecated drop reason too.
pub const DATAPATH_EVENTS: [&str; 6] = [
    "flow_half_recreated",
    "fragment_without_first",
    "l4_header_bad_passed",
    "stale_reply_removed",
    "tcp_midstream_without_flow",
    "tuple_clash_port_rewritten",
];

/// A node whose lbproxy pins its maps under [`Inspect::bpffs_dir`], inspected from its
/// network namespace.
pub trait Inspect {
    /// Runs `lbproxy ARGS` to completion in the node's network namespace.
    fn lbproxy_cmd(&self, args: &[&str]) -> Output;

    /// Where the node's lbproxy pins its maps (`--bpffs-dir`).
    fn bpffs_dir(&self) -> &Path;

    /// `lbproxy inspect WHAT --json --bpffs-dir DIR`, parsed as `T`. Panics on failure, or
    /// on output that is not a `T`.
    fn inspect_as<T: DeserializeOwned>(&self, what: &str) -> T {
        let dir = self.bpffs_dir().display().to_string();
        let out = self.lbproxy_cmd(&["inspect", what, "--json", "--bpffs-dir", &dir]);
        let text = ns::output_result(&format!("lbproxy inspect {what} --json"), out)
            .unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "lbproxy inspect {what} --json: bad JSON for a {} ({e}): {text}",
                std::any::type_name::<T>()
            )
        })
    }

    /// `lbproxy inspect WHAT --json --bpffs-dir DIR`, parsed. Panics on failure or bad JSON.
    fn inspect_json(&self, what: &str) -> serde_json::Value {
        self.inspect_as(what)
    }

    /// `lbproxy explain --bpffs-dir DIR --proto PROTO --src SRC --dst DST [--from node]
    /// -o json`, exactly as harnesses run it, parsed. Panics on failure or bad JSON.
    fn explain(
        &self,
        proto: &str,
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        from_node: bool,
    ) -> serde_json::Value {
        let dir = self.bpffs_dir().display().to_string();
        let (src, dst) = (src.to_string(), dst.to_string());
        let mut args = vec![
            "explain",
            "--bpffs-dir",
            &dir,
            "--proto",
            proto,
            "--src",
            &src,
            "--dst",
            &dst,
        ];
        if from_node {
            args.extend(["--from", "node"]);
        }
        args.extend(["-o", "json"]);
        let what = format!("lbproxy {}", args.join(" "));
        let text =
            ns::output_result(&what, self.lbproxy_cmd(&args)).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: bad JSON ({e}): {text}"))
    }

    /// `inspect services --json`: every frontend with its backends.
    #[cfg(feature = "inspect-rows")]
    fn inspect_services(&self) -> Vec<ServiceRow> {
        self.inspect_as("services")
    }

    /// `inspect backends --json`: every backend the maps know, by id.
    #[cfg(feature = "inspect-rows")]
    fn inspect_backends(&self) -> Vec<BackendRow> {
        self.inspect_as("backends")
    }

    /// `inspect flows --json`: one row per flow, both families.
    #[cfg(feature = "inspect-rows")]
    fn inspect_flows(&self) -> Vec<FlowRow> {
        self.inspect_as("flows")
    }

    /// `inspect delivery --json`: the stack bypass and its packet counters.
    #[cfg(feature = "inspect-rows")]
    fn inspect_delivery(&self) -> Delivery {
        self.inspect_as("delivery")
    }

    /// `inspect sockets --json`: socket-level load balancing and its event counters.
    #[cfg(feature = "inspect-rows")]
    fn inspect_sockets(&self) -> Sockets {
        self.inspect_as("sockets")
    }

    /// `inspect snat --json`: the SNAT port space per destination.
    #[cfg(feature = "inspect-rows")]
    fn inspect_snat(&self) -> Vec<SnatRow> {
        self.inspect_as("snat")
    }

    /// `inspect affinity --json`: each client's backend per service.
    #[cfg(feature = "inspect-rows")]
    fn inspect_affinity(&self) -> Vec<AffinityRow> {
        self.inspect_as("affinity")
    }

    /// Every datapath drop/reject counter (`inspect drops --json`) by reason.
    fn drop_counts(&self) -> BTreeMap<String, u64> {
        self.inspect_as("drops")
    }

    /// Every datapath event counter (`inspect events --json`: what the datapath did that is
    /// not a drop) by event.
    fn event_counts(&self) -> BTreeMap<String, u64> {
        self.inspect_as("events")
    }

    /// The datapath drop counter `reason` (0 when it never counted).
    fn drop_count(&self, reason: &str) -> u64 {
        self.drop_counts().get(reason).copied().unwrap_or(0)
    }

    /// The datapath event counter `event` (0 when it never counted).
    fn event_count(&self, event: &str) -> u64 {
        self.event_counts().get(event).copied().unwrap_or(0)
    }
}
