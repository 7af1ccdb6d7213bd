//! What the node maps should hold for one [`NodeView`], worked out without touching them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lbproxy_common::{
    Addr, NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, NodeAddr, POD_IF_BRIDGE, PodAddr, PodIf,
    SrcCheck, family::V4, family::V6,
};

use super::family::NodeFamily;
use super::view::{NodeView, Role, src_check_for};
use crate::bpf::attach::Interface;
use crate::bpf::ifaces::Link;
use crate::config::NodePortAddresses;

/// The settings node state follows.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeConfig {
    /// `--nodeport-addresses`.
    pub node_port_addresses: NodePortAddresses,
    /// `--snat-port-range`, inclusive.
    pub snat_port_range: (u16, u16),
}

/// What one family's node maps should hold.
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyState<A: NodeFamily> {
    /// Each node interface with an address of the family, by ifindex, with its first address
    /// as the SNAT source of flows leaving by it.
    pub ifs: BTreeMap<u32, A::If>,
    /// The node interfaces' addresses that serve NodePorts, and the SNAT addresses.
    pub addrs: BTreeMap<A, NodeAddr>,
    /// The node's primary address of the family: where the default route leaves by a node
    /// interface (never a pod's).
    pub primary: Option<A>,
}

impl<A: NodeFamily> FamilyState<A> {
    fn of(node_links: &[&Link], cfg: &NodeConfig) -> Self {
        let ifs: BTreeMap<u32, A::If> = node_links
            .iter()
            .filter_map(|l| {
                let snat = *A::link_addrs(l).first()?;
                Some((l.iface.index, A::node_if(snat, cfg.snat_port_range)))
            })
            .collect();
        let primary = node_links.iter().find_map(|l| A::link_primary(l));
        let mut addrs: BTreeMap<A, NodeAddr> = BTreeMap::new();
        for a in node_links.iter().flat_map(|l| A::link_addrs(l)) {
            if cfg
                .node_port_addresses
                .contains(a.ip(), primary.map(Addr::ip))
            {
                addrs.entry(a).or_default().flags |= NODE_ADDR_F_NODEPORT;
            }
        }
        for v in ifs.values() {
            addrs.entry(A::snat_of(v)).or_default().flags |= NODE_ADDR_F_SNAT;
        }
        Self {
            ifs,
            addrs,
            primary,
        }
    }

    /// The addresses that serve NodePorts, in map order.
    fn node_port_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.addrs
            .iter()
            .filter(|(_, v)| v.flags & NODE_ADDR_F_NODEPORT != 0)
            .map(|(a, _)| a.ip())
    }
}

/// A pod interface whose packets' sources are not checked (see [`src_check_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unchecked {
    pub iface: Interface,
    pub master: Option<u32>,
}

/// What every node map should hold, and what the rest of lbproxy learns of the node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeState {
    /// NodePorts follow the node's primary address (`nodePortAddresses: primary`).
    pub follows_primary: bool,
    pub v4: FamilyState<V4>,
    pub v6: FamilyState<V6>,
    /// `LB_SRCCHECK_V1`: each checkable pod interface's check.
    pub src_checks: BTreeMap<u32, SrcCheck>,
    /// The pod interfaces that cannot be checked, in listing order.
    pub unchecked: Vec<Unchecked>,
    /// The ifindexes of every pod interface.
    pub pods: BTreeSet<u32>,
    /// `LB_PODADDRS_V1`: the source check's fast path.
    pub pod_addrs: BTreeMap<V4, PodAddr>,
    /// Every address of the node's own interfaces, both families, sorted: the model's
    /// `node_ips`.
    pub node_ips: Vec<IpAddr>,
    /// The addresses health-check servers bind: the node-port addresses when
    /// `--nodeport-addresses` names CIDRs or `primary`; `None` (every address) by default.
    pub hc_addresses: Option<Vec<IpAddr>>,
}

impl NodeState {
    pub fn of(view: &NodeView<'_>, cfg: &NodeConfig) -> Self {
        let node_links: Vec<&Link> = view.links_with_role(Role::Node).collect();
        let v4 = FamilyState::<V4>::of(&node_links, cfg);
        let v6 = FamilyState::<V6>::of(&node_links, cfg);
        let mut node_ips: Vec<IpAddr> = node_links
            .iter()
            .flat_map(|l| {
                l.v4.addrs
                    .iter()
                    .copied()
                    .map(IpAddr::from)
                    .chain(l.v6.addrs.iter().copied().map(IpAddr::from))
            })
            .collect();
        node_ips.sort();
        node_ips.dedup();
        let hc_addresses = (cfg.node_port_addresses != NodePortAddresses::All)
            .then(|| v4.node_port_ips().chain(v6.node_port_ips()).collect());
        let mut src_checks = BTreeMap::new();
        let mut unchecked = Vec::new();
        for link in view.links_with_role(Role::Pod) {
            match src_check_for(link, view.links) {
                Some(c) => {
                    src_checks.insert(link.iface.index, c);
                }
                None => unchecked.push(Unchecked {
                    iface: link.iface.clone(),
                    master: link.master,
                }),
            }
        }
        let pod_addrs = pod_addrs_for(view.links, &src_checks);
        Self {
            follows_primary: cfg.node_port_addresses == NodePortAddresses::Primary,
            v4,
            v6,
            src_checks,
            unchecked,
            pods: view.with_role(Role::Pod).iter().map(|i| i.index).collect(),
            pod_addrs,
            node_ips,
            hc_addresses,
        }
    }
}

/// The `LB_PODADDRS_V1` entries of the source-checked interfaces `checks`: the `/32` routes
/// out of each one checked against itself (a routed pod interface; a bridge port's checks
/// stay with the FIB).
pub fn pod_addrs_for(present: &[Link], checks: &BTreeMap<u32, SrcCheck>) -> BTreeMap<V4, PodAddr> {
    present
        .iter()
        .filter(|l| {
            checks
                .get(&l.iface.index)
                .is_some_and(|c| c.expected_ifindex == l.iface.index)
        })
        .flat_map(|l| {
            l.routes_v4.iter().map(|a| {
                (
                    a.octets(),
                    PodAddr {
                        ifindex: l.iface.index,
                    },
                )
            })
        })
        .collect()
}

/// `LB_PODIFS_V1`: the pod interfaces with programs `attached` whose peer the datapath may
/// redirect into, and the bridges of pod interfaces (a local backend's route leads there).
/// Listed whether or not the stack bypass is on: `north` asks it whether a backend's route
/// leads into a pod of this node.
pub fn pod_ifs(view: &NodeView<'_>, attached: &BTreeSet<Interface>) -> BTreeMap<u32, PodIf> {
    let mut out: BTreeMap<u32, PodIf> = view
        .links_with_role(Role::Pod)
        .filter(|l| attached.contains(&l.iface))
        .filter_map(|l| Some((l.iface.index, PodIf { kind: l.peer_kind? })))
        .collect();
    for l in view.links_with_role(Role::Pod) {
        if let Some(m) = l.master
            && view.is_bridge(m)
        {
            out.insert(
                m,
                PodIf {
                    kind: POD_IF_BRIDGE,
                },
            );
        }
    }
    out
}
