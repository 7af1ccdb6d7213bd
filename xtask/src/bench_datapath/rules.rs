//! The N services of the datapath benchmark, rendered three ways: kube-proxy's iptables-mode
//! ruleset, kube-proxy's nftables-mode ruleset, and Service/EndpointSlice manifests for
//! lbproxy.
//!
//! The two kube-proxy layouts are rendered by the lab's fixture
//! (`lbproxy_tests::lab::kube_proxy`, which documents them and what they follow in
//! kube-proxy's sources), so the benchmarks and the takeover test see the same rules; this
//! module only chooses the services, their addresses and the manifests.
//!
//! Either family: with IPv6 addresses the same layouts become what kube-proxy writes for its
//! IPv6 proxier.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lbproxy_tests::lab::kube_proxy;
use lbproxy_tests::lab::{Family, Proto};

/// The cluster CIDR kube-proxy would be given (`--cluster-cidr`): pods and the filler
/// endpoints. Traffic from outside it to a ClusterIP is marked for masquerade.
pub const CLUSTER_CIDR: &str = "198.18.0.0/16";
/// The IPv6 cluster CIDR: the lab's pods are `fd00:c612::/64`, the filler endpoints
/// `fd00:c612:0:40::/64`.
pub const CLUSTER_CIDR6: &str = "fd00:c612::/48";
/// Target service ports.
pub const TCP_PORT: u16 = 80;
pub const TCP_TARGET: u16 = 8080;
pub const UDP_PORT: u16 = 53;
pub const UDP_TARGET: u16 = 5353;
pub const IPERF_PORT: u16 = 5201;
/// The north-south benchmark's NodePorts: the target's TCP port and the iperf service.
pub const TCP_NODE_PORT: u16 = 30080;
pub const IPERF_NODE_PORT: u16 = 30201;

/// One service port, as kube-proxy sees it ("servicePortName").
#[derive(Clone, Debug)]
pub struct SvcPort {
    /// Service name (namespace "default").
    pub svc: String,
    pub port_name: &'static str,
    pub proto: &'static str,
    pub vip: IpAddr,
    pub port: u16,
    pub target: u16,
    pub endpoints: Vec<IpAddr>,
    /// Its NodePort, when the service is of type NodePort (the north-south benchmark).
    pub node_port: Option<u16>,
}

/// The N services. Service `target` (index N/2, in the middle) has a TCP and a UDP port over
/// the lab's backends; service `iperf` (next to it) has one TCP port with one backend (iperf3
/// needs its control and data connections on the same server); the others have one TCP port
/// with two endpoints that no packet ever reaches.
#[derive(Clone, Debug)]
pub struct Services {
    pub n: usize,
    pub ports: Vec<SvcPort>,
    /// The node addresses that serve NodePorts (nftables' `nodeport-ips`); empty without
    /// NodePorts.
    pub node_ips: Vec<IpAddr>,
    /// IPv6 services (the family of the addresses given to [`Services::new`]).
    pub v6: bool,
}

/// VIP of service `i`: 198.19.0.16 + i, or fd00:c613::10 + i for IPv6.
pub fn vip_of(i: usize, v6: bool) -> IpAddr {
    if v6 {
        Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0xc613, 0, 0, 0, 0, 0, 0x10)) + i as u128)
            .into()
    } else {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 16)) + i as u32).into()
    }
}

/// Filler endpoint `k` of service `i`: 198.18.64.0 + 2i + k, or fd00:c612:0:40:: + 2i + k
/// (inside the cluster CIDR, never a lab pod, never sent to).
fn filler_ep(i: usize, k: usize, v6: bool) -> IpAddr {
    let j = 2 * i + k;
    if v6 {
        Ipv6Addr::from(u128::from(Ipv6Addr::new(0xfd00, 0xc612, 0, 0x40, 0, 0, 0, 0)) + j as u128)
            .into()
    } else {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 64, 0)) + j as u32).into()
    }
}

impl Services {
    /// `n` ≥ 2 services; `members` are the target's endpoints, `iperf_backend` the iperf
    /// service's one endpoint.
    pub fn new(n: usize, members: &[IpAddr], iperf_backend: IpAddr) -> Services {
        assert!((2..=30_000).contains(&n), "services must be in 2..=30000");
        let v6 = iperf_backend.is_ipv6();
        assert!(
            members.iter().all(|m| m.is_ipv6() == v6),
            "services: endpoints of one family"
        );
        let t = Self::target_index(n);
        let mut ports = Vec::with_capacity(n + 1);
        for i in 0..n {
            if i == t {
                for (port_name, proto, port, target) in [
                    ("http", "tcp", TCP_PORT, TCP_TARGET),
                    ("dns", "udp", UDP_PORT, UDP_TARGET),
                ] {
                    ports.push(SvcPort {
                        svc: "target".into(),
                        port_name,
                        proto,
                        vip: vip_of(i, v6),
                        port,
                        target,
                        endpoints: members.to_vec(),
                        node_port: None,
                    });
                }
            } else if i == t + 1 {
                ports.push(SvcPort {
                    svc: "iperf".into(),
                    port_name: "iperf",
                    proto: "tcp",
                    vip: vip_of(i, v6),
                    port: IPERF_PORT,
                    target: IPERF_PORT,
                    endpoints: vec![iperf_backend],
                    node_port: None,
                });
            } else {
                ports.push(SvcPort {
                    svc: format!("svc-{i}"),
                    port_name: "http",
                    proto: "tcp",
                    vip: vip_of(i, v6),
                    port: TCP_PORT,
                    target: TCP_TARGET,
                    endpoints: vec![filler_ep(i, 0, v6), filler_ep(i, 1, v6)],
                    node_port: None,
                });
            }
        }
        Services {
            n,
            ports,
            node_ips: Vec::new(),
            v6,
        }
    }

    pub fn target_index(n: usize) -> usize {
        (n - 1) / 2
    }

    pub fn target_vip(&self) -> IpAddr {
        vip_of(Self::target_index(self.n), self.v6)
    }

    pub fn iperf_vip(&self) -> IpAddr {
        vip_of(Self::target_index(self.n) + 1, self.v6)
    }

    /// kube-proxy's `--cluster-cidr` of this family.
    fn cluster_cidr(&self) -> &'static str {
        if self.v6 { CLUSTER_CIDR6 } else { CLUSTER_CIDR }
    }

    /// The restore command for [`Services::iptables_full`]: `iptables-restore` or
    /// `ip6tables-restore`.
    pub fn iptables_restore(&self) -> &'static str {
        kube_proxy::restore_command(self.family())
    }

    /// The same services with the target's endpoints replaced by `members`.
    pub fn with_target(&self, members: &[IpAddr]) -> Services {
        let mut s = self.clone();
        for p in &mut s.ports {
            if p.svc == "target" {
                p.endpoints = members.to_vec();
            }
        }
        s
    }

    /// The same services with NodePorts on the target's TCP port (`TCP_NODE_PORT`) and on
    /// the iperf service (`IPERF_NODE_PORT`), and `node_ips` as the addresses that serve
    /// them: the north-south benchmark's layout.
    pub fn with_node_ports(&self, node_ips: &[IpAddr]) -> Services {
        let mut s = self.clone();
        for p in &mut s.ports {
            p.node_port = match (p.svc.as_str(), p.proto) {
                ("target", "tcp") => Some(TCP_NODE_PORT),
                ("iperf", _) => Some(IPERF_NODE_PORT),
                _ => None,
            };
        }
        s.node_ips = node_ips.to_vec();
        s
    }

    /// Service and EndpointSlice YAML for lbproxy, with `type: NodePort` and the nodePort
    /// on the ports that have one.
    pub fn manifest_yaml(&self) -> String {
        let mut out = String::new();
        let mut i = 0;
        while i < self.ports.len() {
            let svc = &self.ports[i].svc;
            let group: Vec<&SvcPort> = self.ports[i..]
                .iter()
                .take_while(|p| &p.svc == svc)
                .collect();
            i += group.len();
            let node_port = group.iter().any(|p| p.node_port.is_some());
            writeln!(
                out,
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {svc}, namespace: default}}\nspec:\n  type: {}\n  clusterIP: {}\n  ipFamilies: [{}]\n  ports:",
                if node_port { "NodePort" } else { "ClusterIP" },
                group[0].vip,
                if self.v6 { "IPv6" } else { "IPv4" }
            )
            .unwrap();
            for p in &group {
                let np = p
                    .node_port
                    .map(|n| format!(", nodePort: {n}"))
                    .unwrap_or_default();
                writeln!(
                    out,
                    "  - {{name: {}, port: {}, protocol: {}, targetPort: {}{np}}}",
                    p.port_name,
                    p.port,
                    p.proto.to_uppercase(),
                    p.target
                )
                .unwrap();
            }
            writeln!(
                out,
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-1, namespace: default, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: {}\nports:",
                if self.v6 { "IPv6" } else { "IPv4" }
            )
            .unwrap();
            for p in &group {
                writeln!(
                    out,
                    "- {{name: {}, port: {}, protocol: {}}}",
                    p.port_name,
                    p.target,
                    p.proto.to_uppercase()
                )
                .unwrap();
            }
            out.push_str("endpoints:\n");
            for e in &group[0].endpoints {
                writeln!(out, "- {{addresses: ['{e}']}}").unwrap();
            }
        }
        out
    }

    /// These services as the lab's kube-proxy fixture takes them (namespace `default`).
    fn lab_ports(&self) -> Vec<kube_proxy::ServicePort> {
        self.ports
            .iter()
            .map(|p| kube_proxy::ServicePort {
                namespace: "default".into(),
                service: p.svc.clone(),
                port_name: p.port_name.into(),
                proto: if p.proto == "udp" {
                    Proto::Udp
                } else {
                    Proto::Tcp
                },
                vip: p.vip,
                port: p.port,
                node_port: p.node_port,
                endpoints: p.endpoints.iter().map(|e| (*e, p.target)).collect(),
            })
            .collect()
    }

    fn family(&self) -> Family {
        if self.v6 { Family::V6 } else { Family::V4 }
    }

    /// The node's side for kube-proxy: the cluster CIDR and, for nftables, the NodePort
    /// addresses. iptables gets none, so it keeps matching NodePorts by `--dst-type LOCAL`
    /// (kube-proxy's default) as this benchmark always did.
    fn node_net(&self, node_ips: bool) -> kube_proxy::NodeNet {
        kube_proxy::NodeNet {
            cluster_cidr: self.cluster_cidr().into(),
            node_ips: if node_ips {
                self.node_ips.clone()
            } else {
                Vec::new()
            },
        }
    }

    /// The whole ruleset for one `iptables-restore` (mangle, filter and nat tables, with
    /// the jumps from the built-in chains), as kube-proxy leaves a node after a full sync.
    pub fn iptables_full(&self) -> String {
        kube_proxy::iptables_restore_input(self.family(), &self.lab_ports(), &self.node_net(false))
    }

    /// The whole `ip kube-proxy` (or `ip6 kube-proxy`) table for one `nft -f`.
    pub fn nft_full(&self) -> String {
        kube_proxy::nft_input(self.family(), &self.lab_ports(), &self.node_net(true))
    }

    /// An incremental update from `old` to `self`, as kube-proxy's nftables mode does on a
    /// partial sync: new endpoint chains added, changed service chains flushed and refilled,
    /// stale endpoint chains deleted, in one transaction.
    pub fn nft_incremental(&self, old: &Services) -> String {
        kube_proxy::nft_incremental(
            self.family(),
            &old.lab_ports(),
            &self.lab_ports(),
            &self.node_net(true),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_in_the_middle_and_rules_shaped() {
        let m = [
            Ipv4Addr::new(198, 18, 0, 3).into(),
            Ipv4Addr::new(198, 18, 0, 4).into(),
        ];
        let s = Services::new(5, &m, m[0]);
        assert_eq!(s.target_vip(), vip_of(2, false));
        let ipt = s.iptables_full();
        assert!(ipt.contains("--probability 0.5000000000 -j KUBE-SEP-"));
        assert!(ipt.contains("-j DNAT --to-destination 198.18.0.4:8080"));
        let nft = s.nft_full();
        assert!(nft.contains("numgen random mod 2 vmap"));
        assert!(nft.contains("dnat to 198.18.0.3:5353"));
        let s2 = s.with_target(&[m[0]]);
        let inc = s2.nft_incremental(&s);
        assert!(inc.contains("delete chain ip kube-proxy endpoint-"));
        assert!(s.manifest_yaml().contains("name: target"));
    }

    /// The IPv6 layouts: ip6tables host matches and bracketed DNAT targets, table `ip6
    /// kube-proxy`, and endpoint chain names without colons.
    #[test]
    fn ipv6_rules_shaped() {
        let m: [IpAddr; 2] = [
            "fd00:c612::3".parse().unwrap(),
            "fd00:c612::4".parse().unwrap(),
        ];
        let s = Services::new(5, &m, m[0]);
        assert_eq!(s.target_vip(), "fd00:c613::12".parse::<IpAddr>().unwrap());
        assert_eq!(s.iptables_restore(), "ip6tables-restore");
        let ipt = s.iptables_full();
        assert!(ipt.contains("-d fd00:c613::12/128 --dport 80"), "{ipt}");
        assert!(ipt.contains("! -s fd00:c612::/48 -j KUBE-MARK-MASQ"));
        assert!(ipt.contains("-j DNAT --to-destination [fd00:c612::4]:8080"));
        assert!(!ipt.contains("/32"));
        let nft = s.nft_full();
        assert!(nft.starts_with("table ip6 kube-proxy {"));
        assert!(nft.contains("type ipv6_addr . inet_proto"));
        assert!(nft.contains("ip6 daddr . meta l4proto"));
        assert!(nft.contains("dnat to [fd00:c612::3]:5353"));
        assert!(nft.contains("__fd00.c612..3/5353"));
        assert!(!nft.contains("ip daddr") && !nft.contains("ipv4_addr"));
        let inc = s.with_target(&[m[0]]).nft_incremental(&s);
        assert!(inc.contains("delete chain ip6 kube-proxy endpoint-"));
        let yaml = s.manifest_yaml();
        assert!(yaml.contains("addressType: IPv6") && yaml.contains("ipFamilies: [IPv6]"));
    }
}
