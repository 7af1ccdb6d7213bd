//! The ServiceCIDR semantics of kube-proxy's nftables mode, as entries of one longest-prefix
//! table per family: each ServiceCIDR's range says "unallocated: drop", each ClusterIP of a
//! proxied Service (its host prefix) says "allocated: reject a port no Service port
//! defines". The datapath consults the table only for traffic that missed every frontend.
//!
//! With no ServiceCIDR there is no entry at all: nothing changes (kube-proxy also rejects an
//! undefined port of a ClusterIP without ServiceCIDRs; lbproxy, as the issue asks, does not).

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::{Model, Service};

/// What an entry of the table says about the addresses it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CidrEntry {
    /// A ServiceCIDR: an address inside it that is no ClusterIP is unallocated (dropped).
    Range,
    /// An allocated ClusterIP (a host prefix): a port or protocol no Service port defines
    /// is rejected.
    Allocated,
}

/// The ServiceCIDRs' ranges in `model`, both families.
pub fn ranges(model: &Model) -> std::collections::BTreeSet<IpNet> {
    model
        .service_cidrs
        .values()
        .flat_map(|c| c.cidrs.iter().copied())
        .collect()
}

/// The ClusterIPs `svc` holds (one per family).
pub fn cluster_ips(svc: &Service) -> impl Iterator<Item = IpAddr> + '_ {
    svc.cluster_ips.iter().copied()
}

/// The host prefix of `ip` (`/32`, `/128`): a ClusterIP's own entry.
pub fn host(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

/// The whole table `model` asks for: nothing without a ServiceCIDR; else every range, and
/// every ClusterIP of every proxied Service (inside a range or not: kube-proxy's
/// `cluster-ips` set holds them all). A ClusterIP's entry wins over a range of the same
/// prefix.
pub fn entries(model: &Model) -> std::collections::BTreeMap<IpNet, CidrEntry> {
    let mut out = std::collections::BTreeMap::new();
    let ranges = ranges(model);
    if ranges.is_empty() {
        return out;
    }
    out.extend(ranges.into_iter().map(|r| (r, CidrEntry::Range)));
    for svc in model.services.values() {
        out.extend(cluster_ips(svc).map(|ip| (host(ip), CidrEntry::Allocated)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, ServiceCidr};

    fn svc(name: &str, ips: &[&str]) -> Service {
        let doc = serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"clusterIPs": ips, "ports": [{"port": 80}]},
        });
        match crate::model::service_from_k8s(&serde_json::from_value(doc).unwrap()).unwrap() {
            crate::model::Normalized::Proxied(s) => s,
            other => panic!("{other:?}"),
        }
    }

    fn cidr(name: &str, cidrs: &[&str]) -> (NamespacedName, ServiceCidr) {
        let id = NamespacedName {
            namespace: String::new(),
            name: name.into(),
        };
        let cidrs = cidrs.iter().map(|c| c.parse().unwrap()).collect();
        (id.clone(), ServiceCidr { id, cidrs })
    }

    fn show(m: &Model) -> Vec<String> {
        entries(m)
            .iter()
            .map(|(n, e)| format!("{n} {e:?}"))
            .collect()
    }

    #[test]
    fn without_a_service_cidr_there_is_no_entry() {
        let mut m = Model::default();
        let s = svc("web", &["198.19.0.10"]);
        m.set_service(&s.id.clone(), Some(s));
        assert!(show(&m).is_empty());
    }

    #[test]
    fn ranges_and_every_cluster_ip_of_both_families() {
        let mut m = Model::default();
        for s in [
            svc("web", &["198.19.0.10", "fd00:198:19::10"]),
            svc("outside", &["198.20.0.1"]),
        ] {
            m.set_service(&s.id.clone(), Some(s));
        }
        let (id, c) = cidr("kubernetes", &["198.19.0.0/16", "fd00:198:19::/112"]);
        m.set_service_cidr(&id, Some(c));
        let (id, c) = cidr("extra", &["198.19.0.10/32"]);
        m.set_service_cidr(&id, Some(c));
        assert_eq!(
            show(&m),
            [
                "198.19.0.0/16 Range",
                "198.19.0.10/32 Allocated",
                "198.20.0.1/32 Allocated",
                "fd00:198:19::/112 Range",
                "fd00:198:19::10/128 Allocated",
            ]
        );
    }
}
