//! One IP family as the node maps see it: where its addresses are on a listed interface,
//! which maps hold them, and what is logged about them. Everything else about node state is
//! written once, generic over [`NodeFamily`].

use lbproxy_common::{Addr, NodeIfOf, family::V4, family::V6, map_names};

use super::desired::{FamilyState, NodeState};
use super::maps::{FamilyMaps, Key, NodeMaps, Store, Value};
use crate::bpf::ifaces::Link;

/// An IP family of the node maps: `[u8; 4]` (IPv4) or `[u8; 16]` (IPv6).
pub trait NodeFamily: Addr + Key {
    /// `NodeIfOf<Self>`, the node-interface map's value (named here so that its bounds
    /// travel with the family).
    type If: Value;
    /// The node-interface map (`LB_NODEIFS_V1`, `LB_NODEIFS6_V1`).
    const IFS_MAP: &'static str;
    /// The node-address map (`LB_NODEADDRS_V1`, `LB_NODEADDR6_V1`).
    const ADDRS_MAP: &'static str;
    /// Logged when an interface's SNAT address of this family is written.
    const SNAT_LOG: &'static str;
    /// Logged when an address that serves NodePorts is written.
    const NODEPORT_LOG: &'static str;

    /// A node interface's entry: SNAT to `snat`, on ports `min..=max`.
    fn node_if(snat: Self, ports: (u16, u16)) -> Self::If;
    /// The SNAT address of a node-interface entry.
    fn snat_of(v: &Self::If) -> Self;
    /// The interface's addresses of this family, in the kernel's order (primary first).
    fn link_addrs(l: &Link) -> Vec<Self>;
    /// The node's primary address of this family, when the default route leaves by `l`.
    fn link_primary(l: &Link) -> Option<Self>;
    /// This family's maps.
    fn maps<S: Store>(m: &mut NodeMaps<S>) -> &mut FamilyMaps<S, Self>;
    /// This family's part of a desired state.
    fn state(s: &NodeState) -> &FamilyState<Self>;
    /// Logs the node's new primary address of this family (`nodePortAddresses: primary`).
    fn log_primary(primary: Option<Self>);
}

fn node_if<A: Addr>(snat: A, (min, max): (u16, u16)) -> NodeIfOf<A> {
    NodeIfOf {
        snat_addr: snat,
        snat_port_min: min,
        snat_port_max: max,
        _reserved: 0,
    }
}

impl NodeFamily for V4 {
    type If = NodeIfOf<V4>;
    const IFS_MAP: &'static str = map_names::NODE_IFS;
    const ADDRS_MAP: &'static str = map_names::NODE_ADDRS;
    const SNAT_LOG: &'static str =
        "node interface: flows to other nodes leaving by it are source-NATed to this address";
    const NODEPORT_LOG: &'static str = "NodePorts served on this address";

    fn node_if(snat: Self, ports: (u16, u16)) -> Self::If {
        node_if(snat, ports)
    }
    fn snat_of(v: &Self::If) -> Self {
        v.snat_addr
    }
    fn link_addrs(l: &Link) -> Vec<Self> {
        l.v4.addrs.iter().map(|a| a.octets()).collect()
    }
    fn link_primary(l: &Link) -> Option<Self> {
        l.v4.primary.map(|a| a.octets())
    }
    fn maps<S: Store>(m: &mut NodeMaps<S>) -> &mut FamilyMaps<S, Self> {
        &mut m.v4
    }
    fn state(s: &NodeState) -> &FamilyState<Self> {
        &s.v4
    }
    fn log_primary(primary: Option<Self>) {
        match primary.map(Addr::ip) {
            Some(a) => {
                tracing::info!(address = %a, "nodePortAddresses: primary is this address (the default route's)");
            }
            None => tracing::warn!(
                "nodePortAddresses: primary: no IPv4 default route leaves by a node interface, so no address serves NodePorts until one does"
            ),
        }
    }
}

impl NodeFamily for V6 {
    type If = NodeIfOf<V6>;
    const IFS_MAP: &'static str = map_names::NODE_IFS6;
    const ADDRS_MAP: &'static str = map_names::NODE_ADDRS6;
    const SNAT_LOG: &'static str =
        "node interface: IPv6 flows to other nodes leaving by it are source-NATed to this address";
    const NODEPORT_LOG: &'static str = "NodePorts served on this IPv6 address";

    fn node_if(snat: Self, ports: (u16, u16)) -> Self::If {
        node_if(snat, ports)
    }
    fn snat_of(v: &Self::If) -> Self {
        v.snat_addr
    }
    fn link_addrs(l: &Link) -> Vec<Self> {
        l.v6.addrs.iter().map(|a| a.octets()).collect()
    }
    fn link_primary(l: &Link) -> Option<Self> {
        l.v6.primary.map(|a| a.octets())
    }
    fn maps<S: Store>(m: &mut NodeMaps<S>) -> &mut FamilyMaps<S, Self> {
        &mut m.v6
    }
    fn state(s: &NodeState) -> &FamilyState<Self> {
        &s.v6
    }
    fn log_primary(primary: Option<Self>) {
        match primary.map(Addr::ip) {
            Some(a) => {
                tracing::info!(address = %a, "nodePortAddresses: primary IPv6 is this address (the IPv6 default route's)");
            }
            None => tracing::info!(
                "nodePortAddresses: primary: no IPv6 default route leaves by a node interface, so no IPv6 address serves NodePorts until one does"
            ),
        }
    }
}
