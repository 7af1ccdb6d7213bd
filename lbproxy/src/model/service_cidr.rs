//! A ServiceCIDR (`networking.k8s.io/v1`, GA in Kubernetes 1.33) as the proxy sees it: the
//! ranges ClusterIPs are allocated from. Cluster-scoped: its id has an empty namespace.
//!
//! kube-proxy's nftables mode drops traffic to an address inside a ServiceCIDR that no
//! Service holds, and rejects traffic to a ClusterIP on a port no Service port defines;
//! `desired::service_cidrs` turns these ranges and the Services' ClusterIPs into the
//! datapath's entries.

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR as K8sServiceCidr;

use super::{Family, InvalidObject, NamespacedName, Normalized};

/// One ServiceCIDR: one range, or one per family for a dual-stack cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidr {
    /// Its name; the namespace is empty (a cluster-scoped object).
    pub id: NamespacedName,
    /// `spec.cidrs`: one or two prefixes, at most one per family, host bits zero.
    pub cidrs: Vec<IpNet>,
}

/// Validates and normalizes a ServiceCIDR, as the API server would have: `spec.cidrs` holds
/// one or two CIDRs of different families, each in canonical form (`10.96.0.0/16`, not
/// `10.96.0.1/16`). An error names the object and the field.
pub fn service_cidr_from_k8s(o: &K8sServiceCidr) -> Result<Normalized<ServiceCidr>, InvalidObject> {
    let name = o.metadata.name.clone().unwrap_or_default();
    let invalid = |reason: String| InvalidObject {
        kind: "ServiceCIDR",
        object: name.clone(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("metadata.name is missing".into()));
    }
    let given = o
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_ref())
        .filter(|c| !c.is_empty())
        .ok_or_else(|| invalid("spec.cidrs is missing or empty".into()))?;
    if given.len() > 2 {
        return Err(invalid(format!(
            "spec.cidrs has {} entries; at most two (one per family)",
            given.len()
        )));
    }
    let mut cidrs: Vec<IpNet> = Vec::with_capacity(given.len());
    for (i, s) in given.iter().enumerate() {
        let field = format!("spec.cidrs[{i}]");
        let net: IpNet = s
            .parse()
            .map_err(|_| invalid(format!("{field} {s:?} is not a valid CIDR")))?;
        if net.network() != net.addr() {
            return Err(invalid(format!(
                "{field} {s:?} has host bits set (the range is {})",
                net.trunc()
            )));
        }
        if let Some(other) = cidrs
            .iter()
            .find(|c| Family::of(&c.addr()) == Family::of(&net.addr()))
        {
            return Err(invalid(format!(
                "{field} {s:?} is a second {} range (with {other}); at most one per family",
                Family::of(&net.addr()).as_str()
            )));
        }
        cidrs.push(net);
    }
    Ok(Normalized::Proxied(ServiceCidr {
        id: NamespacedName {
            namespace: String::new(),
            name,
        },
        cidrs,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(name: &str, cidrs: &[&str]) -> K8sServiceCidr {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"cidrs": cidrs},
        }))
        .unwrap()
    }

    fn err(o: &K8sServiceCidr) -> String {
        match service_cidr_from_k8s(o) {
            Err(e) => e.to_string(),
            Ok(n) => panic!("accepted: {n:?}"),
        }
    }

    #[test]
    fn one_or_two_ranges_of_different_families() {
        let Ok(Normalized::Proxied(c)) =
            service_cidr_from_k8s(&cidr("kubernetes", &["10.96.0.0/16", "fd00:96::/108"]))
        else {
            panic!("refused");
        };
        assert_eq!(c.id.to_string(), "kubernetes");
        assert_eq!(
            c.cidrs,
            vec![
                "10.96.0.0/16".parse::<IpNet>().unwrap(),
                "fd00:96::/108".parse().unwrap()
            ]
        );
    }

    #[test]
    fn a_bad_range_is_named_with_its_field() {
        assert_eq!(
            err(&cidr("extra", &["10.96.0.0/16", "10.97.0/16"])),
            "ServiceCIDR extra: spec.cidrs[1] \"10.97.0/16\" is not a valid CIDR"
        );
        assert_eq!(
            err(&cidr("extra", &["10.96.0.1/16"])),
            "ServiceCIDR extra: spec.cidrs[0] \"10.96.0.1/16\" has host bits set (the range \
             is 10.96.0.0/16)"
        );
        assert_eq!(
            err(&cidr("extra", &["10.96.0.0/16", "10.97.0.0/16"])),
            "ServiceCIDR extra: spec.cidrs[1] \"10.97.0.0/16\" is a second IPv4 range (with \
             10.96.0.0/16); at most one per family"
        );
        assert_eq!(
            err(&cidr("extra", &[])),
            "ServiceCIDR extra: spec.cidrs is missing or empty"
        );
        assert_eq!(
            err(&cidr("extra", &["10.0.0.0/8", "fd00::/64", "10.1.0.0/16"])),
            "ServiceCIDR extra: spec.cidrs has 3 entries; at most two (one per family)"
        );
    }
}
