//! Attaching the programs to pod interfaces: one pinned tcx link per program and interface.
//!
//! Links live under `--bpffs-dir` as `links/<ifname>@<ifindex>:ingress|egress` (bpffs
//! refuses `.` in names, so a `.` in an interface name is stored as `%`). A pinned link keeps
//! its program attached after the controller exits; a new controller atomically swaps its
//! own program into the same link (`bpf_link_update`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::xdp::XdpLink;
use aya::programs::{SchedClassifier, TcAttachType, Xdp, XdpMode};
use globset::GlobSet;
use lbproxy_common::program_names;

use crate::config::{NodePortAddresses, XdpAcceleration};

use super::ifaces::Link;
pub use super::node::Role;
use super::node::{NodeConfig, NodeMaps, NodeProgrammer, NodeState, NodeView, Pinned, desired};
use super::{BpfError, Datapath, error_chain};

/// An interface in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interface {
    pub index: u32,
    pub name: String,
}

/// (pin suffix, program, attach point) for each direction of `role`.
fn directions(role: Role) -> [(&'static str, &'static str, TcAttachType); 2] {
    match role {
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

/// The pin suffix of a node interface's XDP link (`lb_xdp`, `--xdp-acceleration`).
pub const XDP_PIN: &str = "xdp";

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

/// The interface watcher's side: keeps the programs attached to exactly the pod interfaces
/// that exist and match the globs (and `lb_from_node`/`lb_to_node` to the node's own
/// interfaces, see [`Role`]), and has its [`NodeProgrammer`] keep the node maps at what the
/// listing implies ([`NodeState`]): `LB_PODIFS_V1` listing exactly the attached pod
/// interfaces (the stack bypass's redirect targets when it is on; north-south asks it
/// whether a backend is on this node), `LB_SRCCHECK_V1` saying, for each of them, which
/// interface the route to a packet's source must lead out of, `LB_PODADDRS_V1` the addresses
/// routed to each routed pod interface (the check's fast path), and the node interfaces and
/// addresses of both families.
pub struct Attacher {
    globs: GlobSet,
    config: NodeConfig,
    node: NodeProgrammer<Pinned>,
    /// The addresses health-check servers bind: the node-port addresses when
    /// `--nodeport-addresses` names CIDRs or `primary`, none (every address) by default.
    hc_addresses: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
    /// Every address of the node's own interfaces, IPv4 and IPv6, for the controller's model.
    node_ips: tokio::sync::watch::Sender<Vec<std::net::IpAddr>>,
    attached: BTreeSet<Interface>,
    /// Pinned interfaces the last listing did not show; forgotten if the next one does not
    /// either.
    absent: BTreeSet<Interface>,
    stack_bypass: bool,
    /// `--xdp-acceleration`, the node interfaces `lb_xdp` runs on, and those whose driver
    /// refused it under `best-effort` (said once, not tried again while they exist).
    xdp: XdpAcceleration,
    xdp_attached: BTreeSet<Interface>,
    xdp_refused: BTreeSet<Interface>,
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
            hc_addresses,
            globs,
            config: NodeConfig {
                node_port_addresses,
                snat_port_range,
            },
            node: NodeProgrammer::new(NodeMaps::open(&Pinned::new(dir))?),
            attached: BTreeSet::new(),
            absent: BTreeSet::new(),
            stack_bypass,
            xdp: XdpAcceleration::Disabled,
            xdp_attached: BTreeSet::new(),
            xdp_refused: BTreeSet::new(),
        })
    }

    /// Runs `lb_xdp` on the node interfaces as `xdp` says (`--xdp-acceleration`; without
    /// this, `disabled`).
    pub fn with_xdp(self, xdp: XdpAcceleration) -> Self {
        Self { xdp, ..self }
    }

    /// Whether an interface that refuses XDP stops lbproxy (`--xdp-acceleration native`).
    pub fn xdp_required(&self) -> bool {
        self.xdp == XdpAcceleration::Native
    }

    /// Keeps `lb_xdp` on node interface `iface` as `--xdp-acceleration` says: attached in
    /// native (driver) mode, or detached (`disabled`, also detaching what an earlier run
    /// attached). An interface that refuses it is an error under `native`
    /// ([`BpfError::XdpRefused`]); under `best-effort` it keeps the TC programs alone, said
    /// once.
    fn sync_xdp(&mut self, dp: &mut Datapath, iface: &Interface) -> Result<(), BpfError> {
        let pin = link_pin(&dp.dir, iface, XDP_PIN);
        if self.xdp == XdpAcceleration::Disabled {
            if pin.exists() {
                super::cleanup::detach_and_unpin(&pin)?;
                tracing::info!(interface = %iface.name, ifindex = iface.index, "XDP detached (xdpAcceleration: disabled)");
            }
            return Ok(());
        }
        if self.xdp_attached.contains(iface) || self.xdp_refused.contains(iface) {
            return Ok(());
        }
        match attach_xdp(dp, iface, &pin) {
            Ok(adopted) => {
                tracing::info!(interface = %iface.name, ifindex = iface.index, adopted, mode = "native", "XDP attached");
                self.xdp_attached.insert(iface.clone());
                Ok(())
            }
            Err(e) if self.xdp == XdpAcceleration::BestEffort => {
                tracing::warn!(
                    interface = %iface.name,
                    ifindex = iface.index,
                    reason = %super::error_chain(&e),
                    "XDP refused (xdpAcceleration: best-effort): this interface keeps the TC programs alone"
                );
                self.xdp_refused.insert(iface.clone());
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub fn attached(&self) -> &BTreeSet<Interface> {
        &self.attached
    }

    /// Attaches to new matching interfaces (adopting links an earlier run pinned), and
    /// forgets pins of interfaces that are gone. Returns one error per interface that could
    /// not be attached; the others are still attached.
    pub fn sync(&mut self, dp: &mut Datapath, present: &[Link]) -> Vec<BpfError> {
        let view = NodeView::new(present, &self.globs);
        let state = NodeState::of(&view, &self.config);
        let want: BTreeSet<Interface> = view.roles.keys().cloned().collect();
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
        self.xdp_attached.retain(|i| want.contains(i));
        self.xdp_refused.retain(|i| want.contains(i));
        // Source checks are written before the programs are attached, so no packet of a new
        // interface passes unchecked. Those of interfaces missing from one listing stay, as
        // their pins do.
        let keep: BTreeSet<u32> = self.absent.iter().map(|i| i.index).collect();
        let mut errors = self.node.program_pods(&state, &keep);
        // Node interfaces and addresses before the programs there, so a node interface's
        // first packet finds its SNAT address.
        self.publish(&state);
        if let Err(e) = self.node.program_node(&state) {
            errors.push(e);
        }
        for (iface, role) in &view.roles {
            if self.attached.contains(iface) {
                continue;
            }
            match attach_interface(dp, iface, *role) {
                Ok(adopted) => {
                    tracing::info!(
                        interface = %iface.name,
                        ifindex = iface.index,
                        ?role,
                        adopted,
                        "attached"
                    );
                    self.attached.insert(iface.clone());
                }
                Err(e) => errors.push(e),
            }
        }
        // XDP after the TC programs: what `lb_xdp` passes, `lb_from_node` must be there to
        // take.
        let nodes: Vec<Interface> = view
            .roles
            .iter()
            .filter(|(i, r)| **r == Role::Node && self.attached.contains(*i))
            .map(|(i, _)| i.clone())
            .collect();
        for iface in &nodes {
            if let Err(e) = self.sync_xdp(dp, iface) {
                errors.push(e);
            }
        }
        // The bypass itself is gated by its own flag; `LB_PODIFS_V1` is listed either way.
        let _ = self.stack_bypass;
        if let Err(e) = self
            .node
            .program_pod_ifs(&desired::pod_ifs(&view, &self.attached))
        {
            errors.push(e);
        }
        errors
    }

    /// Tells the controller the node's addresses, and the health-check servers theirs.
    fn publish(&self, state: &NodeState) {
        let ips = state.node_ips.clone();
        self.node_ips.send_if_modified(|v| {
            let changed = *v != ips;
            *v = ips;
            changed
        });
        if let Some(hc) = state.hc_addresses.clone() {
            self.hc_addresses.send_if_modified(|v| {
                let changed = *v != hc;
                *v = hc;
                changed
            });
        }
    }
}

/// Attaches both programs to one interface. Returns whether existing pinned links were
/// adopted (their program swapped atomically) rather than created.
fn attach_interface(dp: &mut Datapath, iface: &Interface, role: Role) -> Result<bool, BpfError> {
    let mut adopted = false;
    for (direction, prog_name, attach_type) in directions(role) {
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

/// Attaches `lb_xdp` to `iface` in native (driver) mode, pinned at `pin`; or, when an
/// earlier run's link is pinned there, swaps this run's program into it atomically. Returns
/// whether the link was adopted.
fn attach_xdp(dp: &mut Datapath, iface: &Interface, pin: &Path) -> Result<bool, BpfError> {
    let err =
        |step: String, source: Box<dyn std::error::Error + Send + Sync>| BpfError::XdpRefused {
            ifname: iface.name.clone(),
            ifindex: iface.index,
            step,
            source,
        };
    let name = program_names::XDP;
    let prog: &mut Xdp = dp
        .ebpf
        .program_mut(name)
        .ok_or_else(|| err(format!("program {name}"), "missing from the object".into()))?
        .try_into()
        .map_err(|e| err(format!("program {name}"), Box::new(e)))?;
    if pin.exists() {
        let replaced = PinnedLink::from_pin(pin)
            .map_err(|e| error_chain(&e))
            .and_then(|old| XdpLink::try_from(FdLink::from(old)).map_err(|e| error_chain(&e)))
            .and_then(|link| prog.attach_to_link(link).map_err(|e| error_chain(&e)));
        match replaced {
            Ok(id) => {
                drop(prog.take_link(id));
                return Ok(true);
            }
            Err(reason) => {
                tracing::warn!(pin = %pin.display(), %reason, "stale XDP link pin; attaching anew");
                let _ = std::fs::remove_file(pin);
            }
        }
    }
    let id = prog
        .attach_to_if_index(iface.index, XdpMode::Driver)
        .map_err(|e| err("attaching in native (driver) mode".into(), Box::new(e)))?;
    let link = prog
        .take_link(id)
        .map_err(|e| err("taking the link".into(), Box::new(e)))?;
    let fd: FdLink = link.try_into().map_err(|e| {
        err(
            "not a BPF link (the kernel attached it through netlink)".into(),
            Box::new(e),
        )
    })?;
    fd.pin(pin)
        .map_err(|e| err(format!("pinning {}", pin.display()), Box::new(e)))?;
    Ok(false)
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
