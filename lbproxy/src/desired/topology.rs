//! Topology-aware routing: which endpoints a `Cluster` traffic policy keeps for new flows on
//! this node, from the hints the EndpointSlice controller writes for `trafficDistribution`
//! (`PreferSameNode`, `PreferSameZone` and its old name `PreferClose`).
//!
//! As kube-proxy 1.35 (`pkg/proxy/topology.go`): the mode is chosen from the *ready*
//! endpoints of one family, and the fallback is in choosing the mode, so a mode always
//! leaves at least one ready endpoint. The controller does this; the datapath only sees the
//! chosen backends, so nothing is spent per packet.

use crate::model::Endpoint;

/// Which endpoints a `Cluster` policy keeps for new flows, from their hints
/// (`trafficDistribution`), and why hints that are present are not used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Topology {
    /// No hint, or a `Local` policy: every candidate endpoint.
    #[default]
    None,
    /// `PreferSameNode`: the ready endpoints whose `hints.forNodes` name this node.
    SameNode,
    /// `PreferSameZone` (and `PreferClose`): the ready endpoints whose `hints.forZones` name
    /// this node's zone.
    SameZone,
    /// Hints are present but not used: every ready endpoint, for this reason.
    Ignored(HintsIgnored),
}

/// Why an endpoint set's hints are present but not used, as kube-proxy logs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintsIgnored {
    /// Some ready endpoint has no zone hint (and the node hints do not apply).
    Incomplete,
    /// Every ready endpoint has a node hint, none names this node, and zone hints do not
    /// apply.
    NotForNode,
    /// Every ready endpoint has a zone hint and none names this node's zone.
    NotForZone,
    /// Every ready endpoint has a zone hint but this node has no
    /// `topology.kubernetes.io/zone` label.
    NoZoneLabel,
    /// The frontend's traffic policy is `Local`: hints do not apply (kube-proxy's local
    /// endpoints ignore them).
    LocalPolicy,
}

impl Topology {
    /// The mode's name as `trafficDistribution` spells it, empty for none.
    pub fn mode(self) -> &'static str {
        match self {
            Topology::SameNode => "PreferSameNode",
            Topology::SameZone => "PreferSameZone",
            Topology::None | Topology::Ignored(_) => "",
        }
    }
}

impl HintsIgnored {
    pub fn reason(self) -> &'static str {
        match self {
            HintsIgnored::Incomplete => "hints ignored: a ready endpoint has no zone hint",
            HintsIgnored::NotForNode => "hints ignored: no endpoint is hinted for this node",
            HintsIgnored::NotForZone => "hints ignored: no endpoint is hinted for this node's zone",
            HintsIgnored::NoZoneLabel => {
                "hints ignored: this node has no topology.kubernetes.io/zone label"
            }
            HintsIgnored::LocalPolicy => "hints ignored: the traffic policy is Local",
        }
    }
}

/// The topology mode of a `Cluster` policy from its ready endpoints' hints, as kube-proxy's
/// `topologyModeFromHints`: node hints when every ready endpoint has one and one names
/// `node`; else zone hints when every ready endpoint has one and one names `zone`; else
/// none. No ready endpoint: none.
pub fn topology<'a>(
    ready: impl IntoIterator<Item = &'a Endpoint>,
    node: &str,
    zone: Option<&str>,
) -> Topology {
    let (mut any, mut hinted) = (false, false);
    let (mut all_node, mut for_node) = (true, false);
    let (mut all_zone, mut for_zone) = (true, false);
    for ep in ready {
        any = true;
        hinted |= !ep.hints.is_empty();
        if ep.hints.for_nodes.is_empty() {
            all_node = false;
        } else if ep.hints.for_node(node) {
            for_node = true;
        }
        if ep.hints.for_zones.is_empty() {
            all_zone = false;
        } else if zone.is_some_and(|z| ep.hints.for_zone(z)) {
            for_zone = true;
        }
    }
    if !any || !hinted {
        return Topology::None;
    }
    if all_node && for_node {
        return Topology::SameNode;
    }
    if all_zone {
        if for_zone {
            return Topology::SameZone;
        }
        return Topology::Ignored(match zone {
            None => HintsIgnored::NoZoneLabel,
            Some(_) => HintsIgnored::NotForZone,
        });
    }
    Topology::Ignored(if all_node {
        HintsIgnored::NotForNode
    } else {
        HintsIgnored::Incomplete
    })
}

/// Whether `ep` serves new flows on this node under `mode` (kube-proxy's
/// `availableForTopology`; the fallback is in choosing the mode, not here).
pub(super) fn available(ep: &Endpoint, mode: Topology, node: &str, zone: Option<&str>) -> bool {
    match mode {
        Topology::SameNode => ep.hints.for_node(node),
        Topology::SameZone => zone.is_some_and(|z| ep.hints.for_zone(z)),
        Topology::None | Topology::Ignored(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Hints;

    /// An endpoint: ready or not, with zone and node hints ("" for none).
    fn ep(ready: bool, zones: &[&str], nodes: &[&str]) -> Endpoint {
        Endpoint {
            addresses: vec!["10.0.0.1".parse().unwrap()],
            ready,
            serving: ready,
            terminating: false,
            node_name: None,
            hints: Hints {
                for_zones: zones.iter().map(|z| z.to_string()).collect(),
                for_nodes: nodes.iter().map(|n| n.to_string()).collect(),
            },
        }
    }

    fn mode(eps: &[Endpoint], zone: Option<&str>) -> Topology {
        topology(eps.iter().filter(|e| e.ready), "node-a", zone)
    }

    #[test]
    fn zone_hints_apply_when_every_ready_endpoint_has_one_and_one_names_the_zone() {
        let eps = [ep(true, &["zone-a"], &[]), ep(true, &["zone-b"], &[])];
        assert_eq!(mode(&eps, Some("zone-a")), Topology::SameZone);
        assert!(available(
            &eps[0],
            Topology::SameZone,
            "node-a",
            Some("zone-a")
        ));
        assert!(!available(
            &eps[1],
            Topology::SameZone,
            "node-a",
            Some("zone-a")
        ));
    }

    #[test]
    fn an_endpoint_without_a_zone_hint_turns_zone_hints_off() {
        let eps = [ep(true, &["zone-a"], &[]), ep(true, &[], &[])];
        assert_eq!(
            mode(&eps, Some("zone-a")),
            Topology::Ignored(HintsIgnored::Incomplete)
        );
        // A not-ready endpoint does not count, with or without hints.
        let eps = [ep(true, &["zone-a"], &[]), ep(false, &[], &[])];
        assert_eq!(mode(&eps, Some("zone-a")), Topology::SameZone);
    }

    #[test]
    fn no_endpoint_for_this_zone_or_no_zone_label_turns_zone_hints_off() {
        let eps = [ep(true, &["zone-b"], &[]), ep(true, &["zone-c"], &[])];
        assert_eq!(
            mode(&eps, Some("zone-a")),
            Topology::Ignored(HintsIgnored::NotForZone)
        );
        assert_eq!(
            mode(&eps, None),
            Topology::Ignored(HintsIgnored::NoZoneLabel)
        );
    }

    #[test]
    fn node_hints_come_first_and_fall_back_to_zone_hints() {
        let eps = [
            ep(true, &["zone-a"], &["node-a"]),
            ep(true, &["zone-a"], &["node-b"]),
        ];
        assert_eq!(mode(&eps, Some("zone-a")), Topology::SameNode);
        assert!(available(&eps[0], Topology::SameNode, "node-a", None));
        assert!(!available(&eps[1], Topology::SameNode, "node-a", None));
        // Node names compare without case, as `Endpoint::on_node`.
        assert!(available(&eps[0], Topology::SameNode, "Node-A", None));
        let elsewhere = [
            ep(true, &["zone-a"], &["node-b"]),
            ep(true, &["zone-b"], &["node-c"]),
        ];
        assert_eq!(mode(&elsewhere, Some("zone-a")), Topology::SameZone);
        let only_nodes = [ep(true, &[], &["node-b"]), ep(true, &[], &["node-c"])];
        assert_eq!(
            mode(&only_nodes, Some("zone-a")),
            Topology::Ignored(HintsIgnored::NotForNode)
        );
        let some_nodes = [
            ep(true, &["zone-a"], &["node-a"]),
            ep(true, &["zone-a"], &[]),
        ];
        assert_eq!(mode(&some_nodes, Some("zone-a")), Topology::SameZone);
    }

    #[test]
    fn no_hint_or_no_ready_endpoint_is_no_topology() {
        assert_eq!(mode(&[ep(true, &[], &[])], Some("zone-a")), Topology::None);
        assert_eq!(
            mode(&[ep(false, &["zone-a"], &[])], Some("zone-a")),
            Topology::None
        );
        assert_eq!(mode(&[], None), Topology::None);
    }
}
