//! A stop-gap: `bpf::ifaces::spawn_attach` takes this handle, by this path, and reads only
//! its `metrics`. That file is being reshaped on another branch, so it is left untouched
//! here; once it takes an `Arc<Metrics>` itself, this module goes.

use std::sync::Arc;

use crate::telemetry::Metrics;

/// The metrics handle, under the name `bpf::ifaces::spawn_attach` still uses.
#[derive(Clone)]
pub struct Health {
    pub metrics: Arc<Metrics>,
}
