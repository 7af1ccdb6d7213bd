//! `LB_NODEADDRS_V1`: the node's own addresses that the datapath treats specially: those that
//! serve NodePorts (`--nodeport-addresses`), and those flows are source-NATed to.
//!
//! A NodePort frontend is one entry in `LB_SERVICES_V2` with the address 0.0.0.0 (any node
//! address), so a node address that comes or goes changes one entry here, not one per
//! NodePort. A packet to a port with no exact frontend is looked up again as a NodePort
//! only when its destination is in this map.
//!
//! `LB_NODEADDR6_V1` is the same for the node's IPv6 addresses (keyed by `[u8; 16]`), with
//! the IPv6 NodePort entry at `::` in `LB_SERVICES6_V1`.

use crate::spec::{MapKind, MapSpec};

/// Node addresses on one node.
pub const MAX_NODE_ADDRS: u32 = 1_024;

/// [`NodeAddr::flags`]: NodePorts are served on this address.
pub const NODE_ADDR_F_NODEPORT: u32 = 1;
/// [`NodeAddr::flags`]: a node interface's SNAT address (`LB_NODEIFS_V1`). Only a packet
/// arriving from outside the node addressed to one of these can be the reply of a
/// source-NATed flow, so only those look the flow table up on the way in.
pub const NODE_ADDR_F_SNAT: u32 = 2;

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
pub const SPEC6: MapSpec = MapSpec::of::<[u8; 16], NodeAddr>(
    "LB_NODEADDR6_V1",
    "node_addrs6",
    MapKind::Hash,
    MAX_NODE_ADDRS,
);
