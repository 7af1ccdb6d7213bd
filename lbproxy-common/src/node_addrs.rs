//! `LB_NODEADDRS_V1`: the node's addresses that serve NodePorts (`--nodeport-addresses`).
//!
//! A NodePort frontend is one entry in `LB_SERVICES_V2` with the address 0.0.0.0 (any node
//! address), so a node address that comes or goes changes one entry here, not one per
//! NodePort. A packet to a port with no exact frontend is looked up again as a NodePort
//! only when its destination is in this map.

use crate::spec::{MapKind, MapSpec};

/// Node addresses on one node.
pub const MAX_NODE_ADDRS: u32 = 1_024;

/// [`NodeAddr::flags`]: NodePorts are served on this address.
pub const NODE_ADDR_F_NODEPORT: u32 = 1;

/// Value of `LB_NODEADDRS_V1`, keyed by the address (`[u8; 4]`, network order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeAddr {
    /// `NODE_ADDR_F_*`.
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<NodeAddr>() == 4);

pub const SPEC: MapSpec = MapSpec::of::<[u8; 4], NodeAddr>(
    "LB_NODEADDRS_V1",
    "node_addrs",
    MapKind::Hash,
    MAX_NODE_ADDRS,
);
