//! `LB_NODEIFS_V1`: the node's own interfaces that north-south traffic uses (the uplinks, not
//! pod interfaces), by ifindex: the address a flow leaving through one is source-NATed to,
//! and the SNAT port range.
//!
//! Traffic from outside the node (to a NodePort, an externalIP or a load-balancer IP) whose
//! backend is on another node must come back through this node, so it leaves with the
//! address of the interface it leaves by (chosen per egress interface, as the stack's own
//! source address selection would, not one global address). The controller writes an entry
//! for every non-pod interface with an IPv4 address, before it attaches the programs there.
//!
//! `LB_NODEIFS6_V1` is the same for IPv6: the interface's IPv6 SNAT address (a global or
//! unique local one, never link-local), for every non-pod interface that has one.

use crate::{
    family::{V4, V6},
    spec::{MapKind, MapSpec},
};

/// Node interfaces on one node.
pub const MAX_NODE_IFS: u32 = 256;

/// The default SNAT port range's bounds when nothing else is free: kube-proxy's NodePort
/// range (30000-32767) and Linux's default ephemeral range (32768-60999) are left out, so
/// that a reply to a SNAT port can never be a reply to the node's own connection.
pub const DEFAULT_SNAT_PORT_MIN: u16 = 1024;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 29_999;

/// Value of `LB_NODEIFS_V1` (`LB_NODEIFS6_V1`), keyed by ifindex (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeIfOf<A> {
    /// The interface's primary address of the family: the source of SNATed flows leaving
    /// through it.
    pub snat_addr: A,
    /// The SNAT port range, inclusive, in host byte order (numbers the datapath computes
    /// with, not header fields).
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Zero; room for flags without a new layout.
    pub _reserved: u32,
}
/// An interface's IPv4 SNAT address and ports (`LB_NODEIFS_V1`).
pub type NodeIf = NodeIfOf<V4>;
/// An interface's IPv6 SNAT address and ports (`LB_NODEIFS6_V1`).
pub type NodeIf6 = NodeIfOf<V6>;
const _: () = assert!(core::mem::size_of::<NodeIf>() == 12);
const _: () = assert!(core::mem::size_of::<NodeIf6>() == 24);

pub const SPEC: MapSpec =
    MapSpec::of::<u32, NodeIf>("LB_NODEIFS_V1", "node_ifs", MapKind::Hash, MAX_NODE_IFS);
pub const SPEC6: MapSpec =
    MapSpec::of::<u32, NodeIf6>("LB_NODEIFS6_V1", "node_ifs6", MapKind::Hash, MAX_NODE_IFS);
