//! The node's interfaces as the watcher listed them, and what each one is to lbproxy.

use std::collections::{BTreeMap, BTreeSet};

use globset::GlobSet;
use lbproxy_common::SrcCheck;

use crate::bpf::attach::Interface;
use crate::bpf::ifaces::Link;

/// What an interface is to lbproxy, which picks its programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// The host side of a pod interface (matches `--pod-interfaces`).
    Pod,
    /// One of the node's own interfaces with an IPv4 address (an uplink): north-south
    /// traffic arrives and leaves here.
    Node,
}

/// One listing of the interfaces, each that gets programs with its [`Role`].
pub struct NodeView<'a> {
    /// Every interface of the network namespace, as listed.
    pub links: &'a [Link],
    /// The interfaces that get programs.
    pub roles: BTreeMap<Interface, Role>,
}

impl<'a> NodeView<'a> {
    /// Pod interfaces (matching `pod_globs`), and the node's own interfaces with an IPv4 or
    /// global IPv6 address (not loopback, not a pod interface, not a bridge of pod
    /// interfaces, not enslaved to another device).
    pub fn new(links: &'a [Link], pod_globs: &GlobSet) -> Self {
        let mut roles = BTreeMap::new();
        let pod_masters: BTreeSet<u32> = links
            .iter()
            .filter(|l| pod_globs.is_match(&l.iface.name))
            .filter_map(|l| l.master)
            .collect();
        for l in links {
            if pod_globs.is_match(&l.iface.name) {
                roles.insert(l.iface.clone(), Role::Pod);
            } else if !l.is_loopback
                && (!l.v4.addrs.is_empty() || !l.v6.addrs.is_empty())
                && l.master.is_none()
                && !pod_masters.contains(&l.iface.index)
            {
                roles.insert(l.iface.clone(), Role::Node);
            }
        }
        Self { links, roles }
    }

    /// The interfaces of `role`.
    pub fn with_role(&self, role: Role) -> BTreeSet<Interface> {
        self.roles
            .iter()
            .filter(|(_, r)| **r == role)
            .map(|(i, _)| i.clone())
            .collect()
    }

    /// The listed links of `role`, in listing order.
    pub fn links_with_role(&self, role: Role) -> impl Iterator<Item = &'a Link> + '_ {
        self.links
            .iter()
            .filter(move |l| self.roles.get(&l.iface) == Some(&role))
    }

    /// Whether `index` is a Linux bridge of this listing.
    pub fn is_bridge(&self, index: u32) -> bool {
        self.links
            .iter()
            .any(|l| l.iface.index == index && l.is_bridge)
    }
}

/// The source check of pod interface `link` (`present` is every interface of the
/// namespace): the route to a packet's source must lead out of `link` itself when it has no
/// master (a routed pod network), or out of its bridge when it is a bridge port. `None` (not
/// checked) for a port of any other master (an Open vSwitch datapath, a VRF, a bond): the
/// route to its pod's addresses leads elsewhere, and a check would drop every packet.
pub fn src_check_for(link: &Link, present: &[Link]) -> Option<SrcCheck> {
    let expected = match link.master {
        None => link.iface.index,
        Some(m) if present.iter().any(|l| l.iface.index == m && l.is_bridge) => m,
        Some(_) => return None,
    };
    Some(SrcCheck {
        expected_ifindex: expected,
        _reserved: 0,
    })
}
