//! Desired state, part one: the frontends a service asks for, and what each should do.
//!
//! A frontend is VIP:port/proto. Its spec names the backends for new flows and the ones kept
//! only for flows already using them (see [`super::endpoints`]).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use lbproxy_common::{Backend, ServiceKey};

use super::endpoints::endpoint_set;
use crate::model::{EndpointAddr, Model, Protocol, Service};

/// A frontend the datapath serves: VIP:port/proto.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl Frontend {
    pub fn key(&self) -> ServiceKey {
        ServiceKey {
            addr: self.addr.octets(),
            port_be: self.port.to_be(),
            proto: self.proto.number(),
            scope: lbproxy_common::SCOPE_DEFAULT,
        }
    }

    pub fn from_key(k: &ServiceKey) -> Option<Self> {
        Some(Self {
            addr: Ipv4Addr::from(k.addr),
            port: u16::from_be(k.port_be),
            proto: Protocol::from_number(k.proto)?,
        })
    }
}

impl std::fmt::Display for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.proto.as_str())
    }
}

/// A backend address as the datapath sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: Protocol,
}

impl BackendAddr {
    pub fn value(&self) -> Backend {
        Backend {
            addr: self.addr.octets(),
            port_be: self.port.to_be(),
            proto: self.proto.number(),
            _pad: 0,
        }
    }

    pub fn from_value(b: &Backend) -> Option<Self> {
        Some(Self {
            addr: Ipv4Addr::from(b.addr),
            port: u16::from_be(b.port_be),
            proto: Protocol::from_number(b.proto)?,
        })
    }
}

impl std::fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.addr, self.port)
    }
}

/// What one frontend should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendSpec {
    /// `namespace/name:port-name`, stored for `lbproxy inspect`.
    pub label: String,
    /// Backends for new flows, in a stable order.
    pub backends: Vec<BackendAddr>,
    /// Backends still listed but not eligible for new flows (not ready, terminating). They
    /// stay in the backend map so flows already using them keep working.
    pub draining: Vec<BackendAddr>,
    /// Session affinity timeout in seconds, 0 for none.
    pub affinity_timeout_s: u32,
}

pub type Desired = BTreeMap<Frontend, FrontendSpec>;

/// The frontends of the whole model (the controller builds the same per service, with
/// [`desired_for`]).
#[cfg(test)]
pub fn desired(model: &Model, node: &str) -> Desired {
    let mut out = Desired::new();
    for svc in model.services.values() {
        out.extend(desired_for(model, svc, node));
    }
    out
}

/// The frontends of one service. Served today: IPv4 ClusterIPs, TCP and UDP. IPv6 and SCTP
/// stay in the model but are not programmed yet. `node` is this node's name, for
/// `internalTrafficPolicy: Local`.
pub fn desired_for(model: &Model, svc: &Service, node: &str) -> Vec<(Frontend, FrontendSpec)> {
    let mut out = Vec::new();
    for port in &svc.ports {
        if port.protocol == Protocol::Sctp {
            continue;
        }
        let v4 = |eps: Vec<EndpointAddr>| -> Vec<BackendAddr> {
            eps.into_iter()
                .filter_map(|ep| match ep.ip {
                    IpAddr::V4(addr) => Some(BackendAddr {
                        addr,
                        port: ep.port,
                        proto: port.protocol,
                    }),
                    IpAddr::V6(_) => None,
                })
                .collect()
        };
        let set = endpoint_set(model, svc, port, node, svc.internal_local);
        let backends = v4(set.serving);
        let draining = v4(set.draining);
        let label = if port.name.is_empty() {
            svc.id.to_string()
        } else {
            format!("{}:{}", svc.id, port.name)
        };
        for ip in &svc.cluster_ips {
            let IpAddr::V4(addr) = ip else { continue };
            out.push((
                Frontend {
                    addr: *addr,
                    port: port.port,
                    proto: port.protocol,
                },
                FrontendSpec {
                    label: label.clone(),
                    backends: backends.clone(),
                    draining: draining.clone(),
                    affinity_timeout_s: svc.affinity_timeout_s,
                },
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_of(text: &str) -> Model {
        use crate::source::manifests;
        manifests::parse(std::path::Path::new("x.yaml"), text)
            .unwrap()
            .model
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.10, ports: [{name: http, port: 80}]}\n";

    fn slice_with(endpoints: &str) -> String {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-a, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: {endpoints}\n"
        )
    }

    fn addrs(v: &[BackendAddr]) -> Vec<String> {
        v.iter().map(|b| b.addr.to_string()).collect()
    }

    #[test]
    fn terminating_serving_endpoints_are_the_fallback_when_none_is_ready() {
        let m = model_of(&format!(
            "{SVC}{}",
            slice_with(
                "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.3], conditions: {ready: false, serving: false, terminating: true}}, {addresses: [198.18.0.4], conditions: {ready: false, serving: true, terminating: false}}]"
            )
        ));
        let d = desired(&m, "n");
        let spec = d.values().next().unwrap();
        assert_eq!(addrs(&spec.backends), vec!["198.18.0.2"]);
        assert_eq!(addrs(&spec.draining), vec!["198.18.0.3", "198.18.0.4"]);
        // One ready endpoint: the terminating ones get no new connections.
        let m = model_of(&format!(
            "{SVC}{}",
            slice_with(
                "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.5]}]"
            )
        ));
        let d = desired(&m, "n");
        assert_eq!(
            addrs(&d.values().next().unwrap().backends),
            vec!["198.18.0.5"]
        );
    }

    #[test]
    fn internal_traffic_policy_local_uses_this_nodes_endpoints_only() {
        let svc = SVC.replace(
            "clusterIP: 198.19.0.10,",
            "clusterIP: 198.19.0.10, internalTrafficPolicy: Local,",
        );
        let m = model_of(&format!(
            "{svc}{}",
            slice_with(
                "[{addresses: [198.18.0.2], nodeName: a}, {addresses: [198.18.0.3], nodeName: b}]"
            )
        ));
        assert_eq!(
            addrs(&desired(&m, "a").values().next().unwrap().backends),
            vec!["198.18.0.2"]
        );
        assert!(
            desired(&m, "c")
                .values()
                .next()
                .unwrap()
                .backends
                .is_empty()
        );
    }

    #[test]
    fn desired_serves_ipv4_tcp_udp_only() {
        use crate::source::manifests;
        let text = r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
  - {name: sig, port: 99, protocol: SCTP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [198.18.0.2]}]
";
        let model = manifests::parse(std::path::Path::new("x.yaml"), text)
            .unwrap()
            .model;
        let d = desired(&model, "node-a");
        let keys: Vec<String> = d.keys().map(ToString::to_string).collect();
        assert_eq!(keys, vec!["198.19.0.10:53/UDP", "198.19.0.10:80/TCP"]);
        assert_eq!(d.values().next().unwrap().backends[0].port, 5353);
        assert_eq!(d.values().next().unwrap().label, "shop/web:dns");
    }
}
