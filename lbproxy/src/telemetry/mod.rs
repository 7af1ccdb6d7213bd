//! What lbproxy says about itself: its log ([`logging`]) and its metrics ([`Metrics`], the
//! registry `/metrics` serves; [`crate::server`] serves it), the datapath's counters among
//! them ([`Datapath`]).

use std::time::SystemTime;

mod datapath;
pub mod logging;
mod metrics;
mod process;

pub use datapath::*;
pub use metrics::*;

/// The commit lbproxy was built from, or `unknown` (set by the build script).
pub const GIT_COMMIT: &str = env!("LBPROXY_GIT_COMMIT");

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
