//! Node state without root: views built from listings, programmed into memory.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lbproxy_common::{
    NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, NodeAddr, NodeIfOf, POD_IF_BRIDGE, POD_IF_VETH,
    PodAddr, PodIf, SrcCheck,
};

use super::desired::{self, NodeConfig, NodeState, pod_addrs_for};
use super::fixtures::link;
use super::maps::NodeMaps;
use super::maps::mem::Mem;
use super::programmer::NodeProgrammer;
use super::view::{NodeView, Role, src_check_for};
use crate::bpf::attach::Interface;
use crate::bpf::ifaces::Link;
use crate::config::NodePortAddresses;

const PORTS: (u16, u16) = (1024, 29_999);

fn globs() -> globset::GlobSet {
    let mut b = globset::GlobSetBuilder::new();
    b.add(globset::Glob::new("veth*").unwrap());
    b.build().unwrap()
}

fn config(npa: NodePortAddresses) -> NodeConfig {
    NodeConfig {
        node_port_addresses: npa,
        snat_port_range: PORTS,
    }
}

fn state(links: &[Link], npa: NodePortAddresses) -> NodeState {
    NodeState::of(&NodeView::new(links, &globs()), &config(npa))
}

fn v4(a: &str) -> [u8; 4] {
    a.parse::<std::net::Ipv4Addr>().unwrap().octets()
}

fn v6(a: &str) -> [u8; 16] {
    a.parse::<std::net::Ipv6Addr>().unwrap().octets()
}

fn ips(a: &[&str]) -> Vec<IpAddr> {
    a.iter().map(|a| a.parse().unwrap()).collect()
}

fn flags<A: Ord>(addrs: &BTreeMap<A, NodeAddr>) -> BTreeMap<&A, u32> {
    addrs.iter().map(|(a, v)| (a, v.flags)).collect()
}

const NP: u32 = NODE_ADDR_F_NODEPORT;
const SNAT: u32 = NODE_ADDR_F_SNAT;

/// A node with two uplinks (one dual-stack, one IPv4 only), loopback, a pod network bridge
/// and two pod interfaces on it.
fn node() -> Vec<Link> {
    vec![
        link(1, "lo").loopback().v4(&["127.0.0.1"]).done(),
        link(2, "eth0")
            .v4(&["10.0.0.5", "10.0.0.6"])
            .v6(&["2001:db8::5", "fd00::5"])
            .primary_v4("10.0.0.5")
            .primary_v6("2001:db8::5")
            .done(),
        link(3, "eth1").v4(&["192.168.1.5"]).done(),
        link(4, "cni0").bridge().v4(&["198.18.0.1"]).done(),
        link(5, "veth-a").veth().master(4).done(),
        link(6, "veth-b").veth().master(4).done(),
    ]
}

/// Each node interface is SNATed to its first address of each family; a pod's bridge,
/// loopback and pod interfaces are not node interfaces.
#[test]
fn snat_addresses_are_each_node_interfaces_first_address_per_family() {
    let links = node();
    let view = NodeView::new(&links, &globs());
    let roles: Vec<(&str, Role)> = view
        .roles
        .iter()
        .map(|(i, r)| (i.name.as_str(), *r))
        .collect();
    assert_eq!(
        roles,
        [
            ("eth0", Role::Node),
            ("eth1", Role::Node),
            ("veth-a", Role::Pod),
            ("veth-b", Role::Pod),
        ]
    );
    let s = state(&links, NodePortAddresses::All);
    let snat4: BTreeMap<u32, [u8; 4]> = s.v4.ifs.iter().map(|(i, v)| (*i, v.snat_addr)).collect();
    assert_eq!(snat4, [(2, v4("10.0.0.5")), (3, v4("192.168.1.5"))].into());
    let snat6: BTreeMap<u32, [u8; 16]> = s.v6.ifs.iter().map(|(i, v)| (*i, v.snat_addr)).collect();
    assert_eq!(snat6, [(2, v6("2001:db8::5"))].into());
    assert!(
        s.v4.ifs
            .values()
            .all(|v| (v.snat_port_min, v.snat_port_max) == PORTS)
    );
    // Every node address serves NodePorts by default; the SNAT addresses are flagged.
    assert_eq!(
        flags(&s.v4.addrs),
        [
            (&v4("10.0.0.5"), NP | SNAT),
            (&v4("10.0.0.6"), NP),
            (&v4("192.168.1.5"), NP | SNAT),
        ]
        .into()
    );
    assert_eq!(
        flags(&s.v6.addrs),
        [(&v6("2001:db8::5"), NP | SNAT), (&v6("fd00::5"), NP)].into()
    );
    assert_eq!(s.hc_addresses, None, "every address by default");
    assert_eq!(
        s.node_ips,
        ips(&[
            "10.0.0.5",
            "10.0.0.6",
            "192.168.1.5",
            "2001:db8::5",
            "fd00::5"
        ])
    );
}

/// CIDRs pick the addresses that serve NodePorts per family: a family with no CIDR serves on
/// all of its addresses. SNAT addresses stay in the map, without the NodePort flag.
#[test]
fn nodeport_addresses_cidrs_per_family() {
    let links = node();
    let s = state(
        &links,
        NodePortAddresses::Cidrs(vec!["10.0.0.6/32".parse().unwrap()]),
    );
    assert_eq!(
        flags(&s.v4.addrs),
        [
            (&v4("10.0.0.5"), SNAT),
            (&v4("10.0.0.6"), NP),
            (&v4("192.168.1.5"), SNAT),
        ]
        .into()
    );
    assert_eq!(
        flags(&s.v6.addrs),
        [(&v6("2001:db8::5"), NP | SNAT), (&v6("fd00::5"), NP)].into(),
        "no IPv6 CIDR: every IPv6 address"
    );
    assert_eq!(
        s.hc_addresses,
        Some(ips(&["10.0.0.6", "2001:db8::5", "fd00::5"]))
    );

    let s = state(
        &links,
        NodePortAddresses::Cidrs(vec!["fd00::/8".parse().unwrap()]),
    );
    assert!(s.v4.addrs.values().all(|v| v.flags & NP != 0));
    assert_eq!(
        flags(&s.v6.addrs),
        [(&v6("2001:db8::5"), SNAT), (&v6("fd00::5"), NP)].into()
    );
}

/// `primary` serves NodePorts on the default route's source of each family only, and
/// follows the route when it moves: the old address loses the flag, the new one gains it,
/// and nothing else is written.
#[test]
fn nodeport_addresses_primary_follow_the_default_route_per_family() {
    let mut links = node();
    let s = state(&links, NodePortAddresses::Primary);
    assert!(s.follows_primary);
    assert_eq!(s.v4.primary, Some(v4("10.0.0.5")));
    assert_eq!(s.v6.primary, Some(v6("2001:db8::5")));
    assert_eq!(
        flags(&s.v4.addrs),
        [(&v4("10.0.0.5"), NP | SNAT), (&v4("192.168.1.5"), SNAT)].into(),
        "10.0.0.6, neither primary nor a SNAT address, is not a node address to the datapath"
    );
    assert_eq!(s.hc_addresses, Some(ips(&["10.0.0.5", "2001:db8::5"])));

    let mut p = NodeProgrammer::new(NodeMaps::mem());
    p.program_node(&s).unwrap();
    assert_eq!(p.maps.v4.addrs.entries, s.v4.addrs);
    assert_eq!(p.maps.v6.addrs.entries, s.v6.addrs);

    // The IPv4 default route moves to eth1, from a preferred source; the IPv6 one goes.
    links[1].v4.primary = None;
    links[1].v6.primary = None;
    links[2].v4.primary = Some("192.168.1.5".parse().unwrap());
    let s = state(&links, NodePortAddresses::Primary);
    assert_eq!(s.v4.primary, Some(v4("192.168.1.5")));
    assert_eq!(s.v6.primary, None);
    let before = p.maps.writes();
    p.program_node(&s).unwrap();
    assert_eq!(
        flags(&p.maps.v4.addrs.entries),
        [(&v4("10.0.0.5"), SNAT), (&v4("192.168.1.5"), NP | SNAT)].into()
    );
    assert_eq!(
        flags(&p.maps.v6.addrs.entries),
        [(&v6("2001:db8::5"), SNAT)].into(),
        "no IPv6 default route: no IPv6 address serves NodePorts"
    );
    assert_eq!(
        p.maps.writes() - before,
        3,
        "two flag changes and one removal"
    );
    assert_eq!(s.hc_addresses, Some(ips(&["192.168.1.5"])));

    // A primary address on a pod interface never counts.
    links[2].v4.primary = None;
    links[5].v4.primary = Some("198.18.0.9".parse().unwrap());
    assert_eq!(state(&links, NodePortAddresses::Primary).v4.primary, None);
}

/// A node with only IPv6 addresses on an uplink: it is a node interface, with an IPv6
/// SNAT address and no IPv4 entry; its addresses are the node's.
#[test]
fn ipv6_node_addresses() {
    let links = vec![
        link(1, "lo").loopback().v6(&["::1"]).done(),
        link(2, "eth0")
            .v6(&["2001:db8:1::5"])
            .primary_v6("2001:db8:1::5")
            .done(),
    ];
    let s = state(&links, NodePortAddresses::All);
    assert!(s.v4.ifs.is_empty() && s.v4.addrs.is_empty());
    assert_eq!(
        s.v6.ifs,
        [(
            2,
            NodeIfOf {
                snat_addr: v6("2001:db8:1::5"),
                snat_port_min: PORTS.0,
                snat_port_max: PORTS.1,
                _reserved: 0
            }
        )]
        .into()
    );
    assert_eq!(
        flags(&s.v6.addrs),
        [(&v6("2001:db8:1::5"), NP | SNAT)].into()
    );
    assert_eq!(s.node_ips, ips(&["2001:db8:1::5"]));

    let mut p = NodeProgrammer::new(NodeMaps::mem());
    p.program_node(&s).unwrap();
    assert_eq!(p.maps.v6.ifs.entries, s.v6.ifs);
    assert!(p.maps.v4.ifs.entries.is_empty());
}

/// Interfaces come and go: a new pod interface gets its source check and, once attached,
/// its `LB_PODIFS_V1` entry; a new uplink its SNAT address; a gone one loses them. A
/// listing that changes nothing writes nothing.
#[test]
fn interfaces_coming_and_going() {
    let mut p = NodeProgrammer::new(NodeMaps::mem());
    let mut attached = BTreeSet::new();
    let mut sync = |p: &mut NodeProgrammer<Mem>, links: &[Link], keep: &BTreeSet<u32>| {
        let view = NodeView::new(links, &globs());
        let s = NodeState::of(&view, &config(NodePortAddresses::All));
        let errors = p.program_pods(&s, keep);
        assert!(errors.is_empty(), "{errors:?}");
        p.program_node(&s).unwrap();
        attached = view.roles.keys().cloned().collect::<BTreeSet<Interface>>();
        p.program_pod_ifs(&desired::pod_ifs(&view, &attached))
            .unwrap();
    };
    let none = BTreeSet::new();
    let mut links = vec![
        link(2, "eth0").v4(&["10.0.0.5"]).done(),
        link(5, "veth-a").veth().routes(&["198.18.0.2"]).done(),
    ];
    sync(&mut p, &links, &none);
    let check = |i| SrcCheck {
        expected_ifindex: i,
        _reserved: 0,
    };
    assert_eq!(p.maps.src_checks.entries, [(5, check(5))].into());
    assert_eq!(
        p.maps.pod_addrs.entries,
        [(v4("198.18.0.2"), PodAddr { ifindex: 5 })].into()
    );
    assert_eq!(
        p.maps.pod_ifs.entries,
        [(5, PodIf { kind: POD_IF_VETH })].into()
    );
    assert_eq!(p.maps.v4.ifs.entries.keys().collect::<Vec<_>>(), [&2]);

    // Nothing changed: nothing written.
    let before = p.maps.writes();
    sync(&mut p, &links, &none);
    assert_eq!(p.maps.writes(), before);

    // A second pod and a second uplink come.
    links.push(link(6, "veth-b").veth().routes(&["198.18.0.3"]).done());
    links.push(link(3, "eth1").v4(&["192.168.1.5"]).done());
    sync(&mut p, &links, &none);
    assert_eq!(
        p.maps.src_checks.entries,
        [(5, check(5)), (6, check(6))].into()
    );
    assert_eq!(p.maps.pod_ifs.entries.keys().collect::<Vec<_>>(), [&5, &6]);
    assert_eq!(p.maps.v4.ifs.entries.keys().collect::<Vec<_>>(), [&2, &3]);
    assert_eq!(p.maps.pod_addrs.entries.len(), 2);

    // The first pod and the first uplink go. The pod's source check stays while its pins
    // do (`keep`: missing from one listing only); everything else of theirs goes.
    links.retain(|l| l.iface.index != 5 && l.iface.index != 2);
    sync(&mut p, &links, &[5].into());
    assert_eq!(
        p.maps.src_checks.entries,
        [(5, check(5)), (6, check(6))].into()
    );
    assert_eq!(p.maps.pod_ifs.entries.keys().collect::<Vec<_>>(), [&6]);
    assert_eq!(
        p.maps.pod_addrs.entries,
        [(v4("198.18.0.3"), PodAddr { ifindex: 6 })].into()
    );
    assert_eq!(p.maps.v4.ifs.entries.keys().collect::<Vec<_>>(), [&3]);
    assert_eq!(
        flags(&p.maps.v4.addrs.entries),
        [(&v4("192.168.1.5"), NP | SNAT)].into()
    );
    // Forgotten at the next listing.
    sync(&mut p, &links, &none);
    assert_eq!(p.maps.src_checks.entries, [(6, check(6))].into());
}

/// A failed source-check write does not stop the others, and is retried by the next sync;
/// a failed node map write stops the node maps' sync there.
#[test]
fn failed_writes_are_reported_and_retried() {
    let links = vec![
        link(2, "eth0").v4(&["10.0.0.5"]).done(),
        link(5, "veth-a").veth().done(),
        link(6, "veth-b").veth().done(),
    ];
    let s = state(&links, NodePortAddresses::All);
    let mut p = NodeProgrammer::new(NodeMaps::mem());
    p.maps.src_checks.fail_next = true;
    p.maps.v4.ifs.fail_next = true;
    let errors = p.program_pods(&s, &BTreeSet::new());
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(p.maps.src_checks.entries.keys().collect::<Vec<_>>(), [&6]);
    let e = p.program_node(&s).unwrap_err();
    assert!(
        crate::bpf::error_chain(&e).starts_with("map LB_NODEIFS_V1 at LB_NODEIFS_V1: "),
        "{}",
        crate::bpf::error_chain(&e)
    );
    assert!(
        p.maps.v4.addrs.entries.is_empty(),
        "stopped at the failed write"
    );
    assert!(p.program_pods(&s, &BTreeSet::new()).is_empty());
    p.program_node(&s).unwrap();
    assert_eq!(p.maps.src_checks.entries.len(), 2);
    assert_eq!(p.maps.v4.ifs.entries.len(), 1);
    assert_eq!(p.maps.v4.addrs.entries.len(), 1);
}

/// A routed pod interface checks against itself, a bridge port against its bridge, and
/// a port of another kind of master is not checked.
#[test]
fn src_check_expects_the_interface_or_its_bridge() {
    let present = [
        link(2, "cni0").bridge().done(),
        link(3, "ovs-system").done(),
        link(5, "cali1").done(),
        link(6, "veth-br").master(2).done(),
        link(7, "veth-ovs").master(3).done(),
        link(8, "veth-lost").master(99).done(),
    ];
    let expected = |i: usize| src_check_for(&present[i], &present).map(|c| c.expected_ifindex);
    assert_eq!(expected(2), Some(5));
    assert_eq!(expected(3), Some(2));
    assert_eq!(expected(4), None);
    assert_eq!(expected(5), None, "a master missing from the listing");
}

/// The fast path lists the `/32` routes of routed pod interfaces only: not those of a
/// bridge port (checked against its bridge), nor of an interface that is not checked.
#[test]
fn pod_addrs_are_the_routes_of_routed_pod_interfaces() {
    let present = [
        link(2, "cni0").bridge().done(),
        link(5, "cali1")
            .routes(&["198.18.0.2", "198.18.0.3"])
            .done(),
        link(6, "veth-br").master(2).routes(&["198.18.0.4"]).done(),
        link(7, "cali2").routes(&["198.18.0.4"]).done(),
    ];
    let checks: BTreeMap<u32, SrcCheck> = [5, 6]
        .into_iter()
        .filter_map(|i| {
            let l = present.iter().find(|l| l.iface.index == i)?;
            Some((i, src_check_for(l, &present)?))
        })
        .collect();
    let want: BTreeMap<[u8; 4], PodAddr> = ["198.18.0.2", "198.18.0.3"]
        .iter()
        .map(|x| (v4(x), PodAddr { ifindex: 5 }))
        .collect();
    assert_eq!(pod_addrs_for(&present, &checks), want);
}

/// `LB_PODIFS_V1` lists the attached pod interfaces with a peer in a pod, and the bridges
/// of pod interfaces; the bridge's ports are not source-checked against themselves.
#[test]
fn pod_ifs_are_attached_pods_and_their_bridges() {
    let links = node();
    let view = NodeView::new(&links, &globs());
    let attached: BTreeSet<Interface> = view
        .roles
        .keys()
        .filter(|i| i.index != 6)
        .cloned()
        .collect();
    assert_eq!(
        desired::pod_ifs(&view, &attached),
        [
            (
                4,
                PodIf {
                    kind: POD_IF_BRIDGE
                }
            ),
            (5, PodIf { kind: POD_IF_VETH }),
        ]
        .into()
    );
    let s = NodeState::of(&view, &config(NodePortAddresses::All));
    assert!(s.src_checks.values().all(|c| c.expected_ifindex == 4));
    assert!(s.pod_addrs.is_empty());
}
