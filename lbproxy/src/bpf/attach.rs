//! Attaching the programs to pod interfaces: one pinned tcx link per program and interface.
//!
//! Links live under `--bpffs-dir` as `links/<ifname>@<ifindex>:ingress|egress` (bpffs
//! refuses `.` in names, so a `.` in an interface name is stored as `%`). A pinned link keeps
//! its program attached after the controller exits; a new controller atomically swaps its
//! own program into the same link (`bpf_link_update`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::{SchedClassifier, TcAttachType};
use globset::GlobSet;
use lbproxy_common::{
    NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, NodeAddr, NodeIf, NodeIf6, PodAddr, PodIf, SrcCheck,
    map_names, program_names,
};

use crate::config::NodePortAddresses;

use super::ifaces::Link;
use super::pinned::del_ok;
use super::{BpfError, Datapath, error_chain, open_pinned};

/// An interface in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interface {
    pub index: u32,
    pub name: String,
}

/// What an interface is to lbproxy, which picks its programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// The host side of a pod interface (matches `--pod-interfaces`).
    Pod,
    /// One of the node's own interfaces with an IPv4 address (an uplink): north-south
    /// traffic arrives and leaves here.
    Node,
}

impl Role {
    /// (pin suffix, program, attach point) for each direction.
    fn directions(self) -> [(&'static str, &'static str, TcAttachType); 2] {
        match self {
            Role::Pod => [
                ("ingress", program_names::FROM_POD, TcAttachType::Ingress),
                ("egress", program_names::TO_POD, TcAttachType::Egress),
            ],
            Role::Node => [
                (
                    "node-ingress",
                    program_names::FROM_NODE,
                    TcAttachType::Ingress,
                ),
                ("node-egress", program_names::TO_NODE, TcAttachType::Egress),
            ],
        }
    }
}

fn link_pin(dir: &Path, iface: &Interface, direction: &str) -> PathBuf {
    dir.join("links").join(format!(
        "{}@{}:{direction}",
        iface.name.replace('.', "%"),
        iface.index
    ))
}

/// Parses `<ifname>@<ifindex>:<direction>`.
fn parse_link_pin(file: &str) -> Option<(Interface, String)> {
    let (rest, direction) = file.rsplit_once(':')?;
    let (name, index) = rest.rsplit_once('@')?;
    Some((
        Interface {
            index: index.parse().ok()?,
            name: name.replace('%', "."),
        },
        direction.to_string(),
    ))
}

/// The interfaces that have pinned links under `dir`.
pub fn pinned_interfaces(dir: &Path) -> BTreeMap<Interface, Vec<PathBuf>> {
    let mut out: BTreeMap<Interface, Vec<PathBuf>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir.join("links")) else {
        return out;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        if let Some((iface, _)) = parse_link_pin(&file) {
            out.entry(iface).or_default().push(e.path());
        }
    }
    out
}

/// Keeps the programs attached to exactly the pod interfaces that exist and match the globs
/// (and `lb_from_node`/`lb_to_node` to the node's own interfaces, see [`Role`]),
/// `LB_PODIFS_V1` listing exactly the attached pod interfaces (the stack bypass's redirect
/// targets when it is on; north-south asks it whether a backend is on this node), and `LB_SRCCHECK_V1` saying, for each of them, which
/// interface the route to a packet's source must lead out of ([`src_check_for`]), and
/// `LB_PODADDRS_V1` the addresses routed to each routed pod interface (the check's fast path).
pub struct Attacher {
    globs: GlobSet,
    node_port_addresses: NodePortAddresses,
    snat_port_range: (u16, u16),
    node_ifs: BpfHashMap<MapData, u32, NodeIf>,
    node_addrs: BpfHashMap<MapData, [u8; 4], NodeAddr>,
    node_ifs6: BpfHashMap<MapData, u32, NodeIf6>,
    node_addrs6: BpfHashMap<MapData, [u8; 16], NodeAddr>,
    /// The node's primary address of each family as last logged (`nodePortAddresses:
    /// primary`); `None` before the first listing.
    primary: Option<Option<std::net::IpAddr>>,
    primary6: Option<Option<std::net::IpAddr>>,
    /// The addresses health-check servers bind: the node-port addresses when
    /// `--nodeport-addresses` names CIDRs or `primary`, none (every address) by default.
    hc_addresses: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
    /// Every address of the node's own interfaces, IPv4 and IPv6, for the controller's model.
    node_ips: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
    attached: BTreeSet<Interface>,
    /// Pinned interfaces the last listing did not show; forgotten if the next one does not
    /// either.
    absent: BTreeSet<Interface>,
    pod_ifs: BpfHashMap<MapData, u32, PodIf>,
    pod_addrs: BpfHashMap<MapData, [u8; 4], PodAddr>,
    src_checks: BpfHashMap<MapData, u32, SrcCheck>,
    /// Matching interfaces already logged as not source-checked, so each is logged once.
    unchecked: BTreeSet<u32>,
    stack_bypass: bool,
}

impl Attacher {
    pub fn new(
        globs: GlobSet,
        dir: &Path,
        stack_bypass: bool,
        node_port_addresses: NodePortAddresses,
        snat_port_range: (u16, u16),
        hc_addresses: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
        node_ips: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
    ) -> Result<Self, BpfError> {
        Ok(Self {
            node_ips,
            primary: None,
            primary6: None,
            hc_addresses,
            globs,
            node_port_addresses,
            snat_port_range,
            node_ifs: open_pinned(dir, map_names::NODE_IFS, Map::HashMap)?,
            node_addrs: open_pinned(dir, map_names::NODE_ADDRS, Map::HashMap)?,
            node_ifs6: open_pinned(dir, map_names::NODE_IFS6, Map::HashMap)?,
            node_addrs6: open_pinned(dir, map_names::NODE_ADDRS6, Map::HashMap)?,
            attached: BTreeSet::new(),
            absent: BTreeSet::new(),
            pod_ifs: open_pinned(dir, map_names::POD_IFS, Map::HashMap)?,
            pod_addrs: open_pinned(dir, map_names::POD_ADDRS, Map::HashMap)?,
            src_checks: open_pinned(dir, map_names::SRC_CHECK, Map::HashMap)?,
            unchecked: BTreeSet::new(),
            stack_bypass,
        })
    }

    pub fn attached(&self) -> &BTreeSet<Interface> {
        &self.attached
    }

    /// Attaches to new matching interfaces (adopting links an earlier run pinned), and
    /// forgets pins of interfaces that are gone. Returns one error per interface that could
    /// not be attached; the others are still attached.
    pub fn sync(&mut self, dp: &mut Datapath, present: &[Link]) -> Vec<BpfError> {
        let mut errors = Vec::new();
        let roles = self.roles(present);
        let want: BTreeSet<Interface> = roles.keys().cloned().collect();
        let pods: BTreeSet<Interface> = roles
            .iter()
            .filter(|(_, r)| **r == Role::Pod)
            .map(|(i, _)| i.clone())
            .collect();
        // Pins for interfaces that vanished (or were renamed, or left the globs): only once
        // two listings in a row miss them, so one incomplete netlink dump never detaches a
        // live pod's programs. (A deleted interface's links are detached by the kernel at
        // once; what waits is only the pins' removal.)
        let pinned = pinned_interfaces(&dp.dir);
        let (gone, absent) = vanished(pinned.keys(), &want, &self.absent);
        self.absent = absent;
        for iface in &gone {
            for p in &pinned[iface] {
                let _ = std::fs::remove_file(p);
            }
            if self.attached.remove(iface) {
                tracing::info!(interface = %iface.name, ifindex = iface.index, "interface gone; forgotten");
            }
        }
        self.attached
            .retain(|i| want.contains(i) || self.absent.contains(i));
        // Source checks are written before the programs are attached, so no packet of a new
        // interface passes unchecked. Those of interfaces missing from one listing stay, as
        // their pins do.
        let checks = self.src_checks_for(present, &pods);
        let keep: BTreeSet<u32> = self.absent.iter().map(|i| i.index).collect();
        if let Err(e) = self.sync_src_checks(&checks, &keep) {
            errors.push(e);
        }
        // The source check's fast path. An address missing here costs a FIB lookup, never
        // a drop, so these follow the routes as they are listed now.
        let addrs = pod_addrs_for(present, &checks);
        match sync_exact(&mut self.pod_addrs, map_names::POD_ADDRS, &addrs) {
            Ok(w) if !w.is_empty() => tracing::debug!(
                written = w.len(),
                addresses = addrs.len(),
                "pod addresses for the source check"
            ),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
        // Node interfaces and addresses before the programs there, so a node interface's
        // first packet finds its SNAT address.
        if let Err(e) = self.sync_node(present, &roles) {
            errors.push(e);
        }
        for (iface, role) in roles {
            if self.attached.contains(&iface) {
                continue;
            }
            match attach_interface(dp, &iface, role) {
                Ok(adopted) => {
                    tracing::info!(
                        interface = %iface.name,
                        ifindex = iface.index,
                        ?role,
                        adopted,
                        "attached"
                    );
                    self.attached.insert(iface);
                }
                Err(e) => errors.push(e),
            }
        }
        // Listed whether or not the bypass is on: `north` asks it whether a backend's route
        // leads into a pod of this node. The bypass itself is gated by its own flag.
        let _ = self.stack_bypass;
        let mut redirectable: BTreeMap<u32, PodIf> = present
            .iter()
            .filter(|l| pods.contains(&l.iface) && self.attached.contains(&l.iface))
            .filter_map(|l| Some((l.iface.index, PodIf { kind: l.peer_kind? })))
            .collect();
        // The bridges of pod interfaces: a local backend's route leads there.
        for l in present.iter().filter(|l| pods.contains(&l.iface)) {
            if let Some(m) = l.master
                && present.iter().any(|b| b.iface.index == m && b.is_bridge)
            {
                redirectable.insert(
                    m,
                    PodIf {
                        kind: lbproxy_common::POD_IF_BRIDGE,
                    },
                );
            }
        }
        if let Err(e) = sync_exact(&mut self.pod_ifs, map_names::POD_IFS, &redirectable) {
            errors.push(e);
        }
        errors
    }

    /// Which interfaces get programs, and which ones: pod interfaces (matching the globs),
    /// and the node's own interfaces with an IPv4 or global IPv6 address (not loopback, not
    /// a pod interface, not a bridge of pod interfaces, not enslaved to another device).
    fn roles(&self, present: &[Link]) -> BTreeMap<Interface, Role> {
        let mut out = BTreeMap::new();
        let pod_masters: BTreeSet<u32> = present
            .iter()
            .filter(|l| self.globs.is_match(&l.iface.name))
            .filter_map(|l| l.master)
            .collect();
        for l in present {
            if self.globs.is_match(&l.iface.name) {
                out.insert(l.iface.clone(), Role::Pod);
            } else if !l.is_loopback
                && (!l.ipv4.is_empty() || !l.ipv6.is_empty())
                && l.master.is_none()
                && !pod_masters.contains(&l.iface.index)
            {
                out.insert(l.iface.clone(), Role::Node);
            }
        }
        out
    }

    /// Makes `LB_NODEIFS_V1` list each node interface with its primary IPv4 address (the
    /// SNAT source of flows leaving by it), and `LB_NODEADDRS_V1` the node's addresses
    /// that serve NodePorts (`--nodeport-addresses`) and those SNAT addresses; likewise
    /// `LB_NODEIFS6_V1` and `LB_NODEADDR6_V1` with the global IPv6 addresses. Stale entries
    /// first.
    fn sync_node(
        &mut self,
        present: &[Link],
        roles: &BTreeMap<Interface, Role>,
    ) -> Result<(), BpfError> {
        let node_links: Vec<&Link> = present
            .iter()
            .filter(|l| roles.get(&l.iface) == Some(&Role::Node))
            .collect();
        let (min, max) = self.snat_port_range;
        let want_ifs: BTreeMap<u32, NodeIf> = node_links
            .iter()
            .filter_map(|l| {
                Some((
                    l.iface.index,
                    NodeIf {
                        snat_addr: l.ipv4.first()?.octets(),
                        snat_port_min: min,
                        snat_port_max: max,
                        _reserved: 0,
                    },
                ))
            })
            .collect();
        let mut want_addrs: BTreeMap<[u8; 4], NodeAddr> = BTreeMap::new();
        // The primary address counts only on a node interface (never a pod's).
        let primary = node_links
            .iter()
            .find_map(|l| l.primary_v4)
            .map(std::net::IpAddr::V4);
        if self.node_port_addresses == NodePortAddresses::Primary && self.primary != Some(primary) {
            match primary {
                Some(a) => {
                    tracing::info!(address = %a, "nodePortAddresses: primary is this address (the default route's)")
                }
                None => tracing::warn!(
                    "nodePortAddresses: primary: no IPv4 default route leaves by a node interface, so no address serves NodePorts until one does"
                ),
            }
            self.primary = Some(primary);
        }
        for a in node_links.iter().flat_map(|l| l.ipv4.iter()) {
            if self
                .node_port_addresses
                .contains(std::net::IpAddr::V4(*a), primary)
            {
                want_addrs.entry(a.octets()).or_default().flags |= NODE_ADDR_F_NODEPORT;
            }
        }
        for v in want_ifs.values() {
            want_addrs.entry(v.snat_addr).or_default().flags |= NODE_ADDR_F_SNAT;
        }
        let mut ips: Vec<std::net::IpAddr> = node_links
            .iter()
            .flat_map(|l| {
                l.ipv4
                    .iter()
                    .copied()
                    .map(std::net::IpAddr::from)
                    .chain(l.ipv6.iter().copied().map(std::net::IpAddr::from))
            })
            .collect();
        ips.sort();
        ips.dedup();
        self.node_ips.send_if_modified(|v| {
            let changed = *v != ips;
            *v = ips;
            changed
        });
        // IPv6: the same, over each node interface's global IPv6 addresses.
        let want_ifs6: BTreeMap<u32, NodeIf6> = node_links
            .iter()
            .filter_map(|l| {
                Some((
                    l.iface.index,
                    NodeIf6 {
                        snat_addr: l.ipv6.first()?.octets(),
                        snat_port_min: min,
                        snat_port_max: max,
                        _reserved: 0,
                    },
                ))
            })
            .collect();
        let primary6 = node_links
            .iter()
            .find_map(|l| l.primary_v6)
            .map(std::net::IpAddr::V6);
        if self.node_port_addresses == NodePortAddresses::Primary && self.primary6 != Some(primary6)
        {
            match primary6 {
                Some(a) => {
                    tracing::info!(address = %a, "nodePortAddresses: primary IPv6 is this address (the IPv6 default route's)")
                }
                None => tracing::info!(
                    "nodePortAddresses: primary: no IPv6 default route leaves by a node interface, so no IPv6 address serves NodePorts until one does"
                ),
            }
            self.primary6 = Some(primary6);
        }
        let mut want_addrs6: BTreeMap<[u8; 16], NodeAddr> = BTreeMap::new();
        for a in node_links.iter().flat_map(|l| l.ipv6.iter()) {
            if self
                .node_port_addresses
                .contains(std::net::IpAddr::V6(*a), primary6)
            {
                want_addrs6.entry(a.octets()).or_default().flags |= NODE_ADDR_F_NODEPORT;
            }
        }
        for v in want_ifs6.values() {
            want_addrs6.entry(v.snat_addr).or_default().flags |= NODE_ADDR_F_SNAT;
        }
        if self.node_port_addresses != NodePortAddresses::All {
            let v4 = want_addrs
                .iter()
                .map(|(a, v)| (std::net::IpAddr::from(*a), v));
            let v6 = want_addrs6
                .iter()
                .map(|(a, v)| (std::net::IpAddr::from(*a), v));
            let hc: Vec<std::net::IpAddr> = v4
                .chain(v6)
                .filter(|(_, v)| v.flags & NODE_ADDR_F_NODEPORT != 0)
                .map(|(a, _)| a)
                .collect();
            self.hc_addresses.send_if_modified(|v| {
                let changed = *v != hc;
                *v = hc;
                changed
            });
        }
        for (k, v) in sync_exact(&mut self.node_ifs, map_names::NODE_IFS, &want_ifs)? {
            tracing::info!(
                ifindex = k,
                snat_address = %std::net::Ipv4Addr::from(v.snat_addr),
                "node interface: flows to other nodes leaving by it are source-NATed to this address"
            );
        }
        for (k, v) in sync_exact(&mut self.node_addrs, map_names::NODE_ADDRS, &want_addrs)? {
            if v.flags & NODE_ADDR_F_NODEPORT != 0 {
                tracing::info!(address = %std::net::Ipv4Addr::from(k), "NodePorts served on this address");
            }
        }
        for (k, v) in sync_exact(&mut self.node_ifs6, map_names::NODE_IFS6, &want_ifs6)? {
            tracing::info!(
                ifindex = k,
                snat_address = %std::net::Ipv6Addr::from(v.snat_addr),
                "node interface: IPv6 flows to other nodes leaving by it are source-NATed to this address"
            );
        }
        for (k, v) in sync_exact(&mut self.node_addrs6, map_names::NODE_ADDRS6, &want_addrs6)? {
            if v.flags & NODE_ADDR_F_NODEPORT != 0 {
                tracing::info!(address = %std::net::Ipv6Addr::from(k), "NodePorts served on this IPv6 address");
            }
        }
        Ok(())
    }

    /// The source checks of the `want` interfaces, by ifindex; logs (once each) the ones that
    /// cannot be checked.
    fn src_checks_for(
        &mut self,
        present: &[Link],
        want: &BTreeSet<Interface>,
    ) -> BTreeMap<u32, SrcCheck> {
        let mut out = BTreeMap::new();
        for link in present.iter().filter(|l| want.contains(&l.iface)) {
            match src_check_for(link, present) {
                Some(c) => {
                    out.insert(link.iface.index, c);
                }
                None => {
                    if self.unchecked.insert(link.iface.index) {
                        tracing::info!(
                            interface = %link.iface.name,
                            ifindex = link.iface.index,
                            master = link.master,
                            "not source-checked: enslaved to a device that is not a bridge"
                        );
                    }
                }
            }
        }
        self.unchecked
            .retain(|i| want.iter().any(|w| w.index == *i));
        out
    }

    /// Makes `LB_SRCCHECK_V1` hold exactly `want`, apart from entries of `keep`: stale
    /// entries first, then new and changed ones. A write that fails does not stop the
    /// others; the first error is returned (the interface it concerns is then not checked
    /// until a later sync writes its entry).
    fn sync_src_checks(
        &mut self,
        want: &BTreeMap<u32, SrcCheck>,
        keep: &BTreeSet<u32>,
    ) -> Result<(), BpfError> {
        let err = |source| BpfError::Map {
            name: map_names::SRC_CHECK,
            path: PathBuf::from(map_names::SRC_CHECK),
            source,
        };
        let mut first = Ok(());
        let have: BTreeMap<u32, SrcCheck> = self.src_checks.iter().flatten().collect();
        for ifindex in have
            .keys()
            .filter(|i| !want.contains_key(i) && !keep.contains(i))
        {
            if let Err(e) = del_ok(self.src_checks.remove(ifindex)) {
                first = first.and(Err(err(e)));
            }
        }
        for (ifindex, v) in want {
            if have.get(ifindex) == Some(v) {
                continue;
            }
            match self.src_checks.insert(ifindex, v, 0) {
                Ok(()) => tracing::debug!(
                    ifindex,
                    expected = v.expected_ifindex,
                    "source check: the route to a packet's source must use this interface"
                ),
                Err(e) => first = first.and(Err(err(e))),
            }
        }
        first
    }
}

/// Makes the pinned hash map `map` (named `name`) hold exactly `want`: stale entries first
/// (so an interface or address that left is never used), then new and changed ones. Stops
/// at the first failed write. Returns the entries it wrote.
fn sync_exact<K, V>(
    map: &mut BpfHashMap<MapData, K, V>,
    name: &'static str,
    want: &BTreeMap<K, V>,
) -> Result<Vec<(K, V)>, BpfError>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    let err = |source| BpfError::Map {
        name,
        path: PathBuf::from(name),
        source,
    };
    let have: BTreeMap<K, V> = map.iter().flatten().collect();
    for k in have.keys().filter(|k| !want.contains_key(k)) {
        del_ok(map.remove(k)).map_err(err)?;
    }
    let mut written = Vec::new();
    for (k, v) in want {
        if have.get(k) != Some(v) {
            map.insert(k, v, 0).map_err(err)?;
            written.push((*k, *v));
        }
    }
    Ok(written)
}

/// The `LB_PODADDRS_V1` entries of the source-checked interfaces `checks`: the `/32` routes
/// out of each one checked against itself (a routed pod interface; a bridge port's checks
/// stay with the FIB).
fn pod_addrs_for(present: &[Link], checks: &BTreeMap<u32, SrcCheck>) -> BTreeMap<[u8; 4], PodAddr> {
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

/// Attaches both programs to one interface. Returns whether existing pinned links were
/// adopted (their program swapped atomically) rather than created.
fn attach_interface(dp: &mut Datapath, iface: &Interface, role: Role) -> Result<bool, BpfError> {
    let mut adopted = false;
    for (direction, prog_name, attach_type) in role.directions() {
        let err =
            |step: String, source: Box<dyn std::error::Error + Send + Sync>| BpfError::Attach {
                ifname: iface.name.clone(),
                ifindex: iface.index,
                direction,
                step,
                source,
            };
        let pin = link_pin(&dp.dir, iface, direction);
        let prog: &mut SchedClassifier = dp
            .ebpf
            .program_mut(prog_name)
            .ok_or_else(|| {
                err(
                    format!("program {prog_name}"),
                    "missing from the object".into(),
                )
            })?
            .try_into()
            .map_err(|e| err(format!("program {prog_name}"), Box::new(e)))?;
        if pin.exists() {
            let replaced = PinnedLink::from_pin(&pin)
                .map_err(|e| error_chain(&e))
                .and_then(|old| {
                    SchedClassifierLink::try_from(FdLink::from(old)).map_err(|e| error_chain(&e))
                })
                .and_then(|link| prog.attach_to_link(link).map_err(|e| error_chain(&e)));
            match replaced {
                Ok(id) => {
                    // The pin keeps the link; this process's fd can go.
                    drop(prog.take_link(id));
                    adopted = true;
                    continue;
                }
                Err(reason) => {
                    tracing::warn!(pin = %pin.display(), %reason, "stale link pin; attaching anew");
                    let _ = std::fs::remove_file(&pin);
                }
            }
        }
        let id = prog
            .attach_with_options(
                &iface.name,
                attach_type,
                TcAttachOptions::TcxOrder(LinkOrder::default()),
            )
            .map_err(|e| err("tcx attach".into(), Box::new(e)))?;
        let link = prog
            .take_link(id)
            .map_err(|e| err("taking the link".into(), Box::new(e)))?;
        let fd: FdLink = link
            .try_into()
            .map_err(|e| err("not a tcx link".into(), Box::new(e)))?;
        fd.pin(&pin)
            .map_err(|e| err(format!("pinning {}", pin.display()), Box::new(e)))?;
    }
    Ok(adopted)
}

/// Of the `pinned` interfaces not in `want`: those already missing from the previous listing
/// (`absent`), to forget now, and the ones missing for the first time, to remember.
fn vanished<'a>(
    pinned: impl Iterator<Item = &'a Interface>,
    want: &BTreeSet<Interface>,
    absent: &BTreeSet<Interface>,
) -> (Vec<Interface>, BTreeSet<Interface>) {
    let mut gone = Vec::new();
    let mut missing = BTreeSet::new();
    for iface in pinned.filter(|i| !want.contains(i)) {
        if absent.contains(iface) {
            gone.push(iface.clone());
        } else {
            missing.insert(iface.clone());
        }
    }
    (gone, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, master: Option<u32>, is_bridge: bool) -> Link {
        Link {
            iface: Interface {
                index,
                name: name.into(),
            },
            peer_kind: None,
            master,
            is_bridge,
            is_loopback: false,
            ipv4: Vec::new(),
            routes_v4: Vec::new(),
            primary_v4: None,
            ipv6: Vec::new(),
            primary_v6: None,
        }
    }

    /// A routed pod interface checks against itself, a bridge port against its bridge, and
    /// a port of another kind of master is not checked.
    #[test]
    fn src_check_expects_the_interface_or_its_bridge() {
        let present = [
            link(2, "cni0", None, true),
            link(3, "ovs-system", None, false),
            link(5, "cali1", None, false),
            link(6, "veth-br", Some(2), false),
            link(7, "veth-ovs", Some(3), false),
            link(8, "veth-lost", Some(99), false),
        ];
        let expected = |i: usize| src_check_for(&present[i], &present).map(|c| c.expected_ifindex);
        assert_eq!(expected(2), Some(5));
        assert_eq!(expected(3), Some(2));
        assert_eq!(expected(4), None);
        assert_eq!(expected(5), None, "a master missing from the listing");
    }

    #[test]
    fn link_pin_names_round_trip() {
        let i = Interface {
            index: 42,
            name: "cali.a@b".into(),
        };
        let p = link_pin(Path::new("/x"), &i, "ingress");
        let file = p.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(parse_link_pin(&file), Some((i, "ingress".to_string())));
    }

    /// The fast path lists the `/32` routes of routed pod interfaces only: not those of a
    /// bridge port (checked against its bridge), nor of an interface that is not checked.
    #[test]
    fn pod_addrs_are_the_routes_of_routed_pod_interfaces() {
        let a: std::net::Ipv4Addr = "198.18.0.2".parse().unwrap();
        let b: std::net::Ipv4Addr = "198.18.0.3".parse().unwrap();
        let c: std::net::Ipv4Addr = "198.18.0.4".parse().unwrap();
        let mut routed = link(5, "cali1", None, false);
        routed.routes_v4 = vec![a, b];
        let mut port = link(6, "veth-br", Some(2), false);
        port.routes_v4 = vec![c];
        let mut unchecked = link(7, "cali2", None, false);
        unchecked.routes_v4 = vec![c];
        let present = [link(2, "cni0", None, true), routed, port, unchecked];
        let checks: BTreeMap<u32, SrcCheck> = [5, 6]
            .into_iter()
            .filter_map(|i| {
                let l = present.iter().find(|l| l.iface.index == i)?;
                Some((i, src_check_for(l, &present)?))
            })
            .collect();
        let got = pod_addrs_for(&present, &checks);
        let want: BTreeMap<[u8; 4], PodAddr> = [a, b]
            .iter()
            .map(|x| (x.octets(), PodAddr { ifindex: 5 }))
            .collect();
        assert_eq!(got, want);
    }

    /// An interface missing from one listing keeps its pins (and so its programs); missing
    /// from two in a row, it is forgotten; seen again in between, it starts over.
    #[test]
    fn an_interface_is_forgotten_only_after_two_listings_miss_it() {
        let a = Interface {
            index: 5,
            name: "veth-a".into(),
        };
        let b = Interface {
            index: 6,
            name: "veth-b".into(),
        };
        let pinned = [a.clone(), b.clone()];
        let both: BTreeSet<Interface> = pinned.iter().cloned().collect();
        let only_b: BTreeSet<Interface> = [b.clone()].into_iter().collect();

        let (gone, absent) = vanished(pinned.iter(), &only_b, &BTreeSet::new());
        assert!(gone.is_empty(), "forgotten after one listing: {gone:?}");
        assert_eq!(absent, [a.clone()].into_iter().collect());

        // Seen again: nothing is remembered.
        let (gone, absent2) = vanished(pinned.iter(), &both, &absent);
        assert!(gone.is_empty() && absent2.is_empty());

        // Missing twice in a row: forgotten.
        let (gone, absent3) = vanished(pinned.iter(), &only_b, &absent);
        assert_eq!(gone, vec![a]);
        assert!(absent3.is_empty());
    }
}
