//! `LB_CONFIG_V1`: datapath settings the controller writes at start, one entry.

use crate::spec::{MapKind, MapSpec};

/// `DatapathConfig::flags`: redirect translated packets whose next hop is a local pod's
/// interface straight into that pod, skipping the node's routing and netfilter.
pub const CONFIG_F_STACK_BYPASS: u32 = 1;

/// The single value of `LB_CONFIG_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// `CONFIG_F_*` bits.
    pub flags: u32,
    pub _reserved: [u32; 3],
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 16);

/// An array of one entry, key 0.
pub const SPEC: MapSpec =
    MapSpec::of::<u32, DatapathConfig>("LB_CONFIG_V1", "config", MapKind::Array, 1);
