//! The N services of the datapath benchmark, rendered three ways: kube-proxy's iptables-mode
//! ruleset, kube-proxy's nftables-mode ruleset, and Service/EndpointSlice manifests for
//! lbproxy.
//!
//! The layouts follow kube-proxy as described in kubernetes/kubernetes
//! `pkg/proxy/iptables/proxier.go` (chain names and rule shapes of `KUBE-SERVICES`,
//! `KUBE-SVC-*`, `KUBE-SEP-*`, `KUBE-MARK-MASQ`, `KUBE-POSTROUTING`, `KUBE-FORWARD`) and
//! `pkg/proxy/nftables/proxier.go` with its `README.md` (table `ip kube-proxy`, the
//! `service-ips` verdict map, `service-*` chains with `numgen random mod K vmap`, `endpoint-*`
//! chains with `dnat to`). The text here is written from that description, not copied.
//!
//! Either family: with IPv6 addresses the same layouts become what kube-proxy writes for its
//! IPv6 proxier: `ip6tables-restore` input (`/128` host matches, `[addr]:port` DNAT targets)
//! and the table `ip6 kube-proxy` (`ipv6_addr` keys, `ip6 daddr`, colons in endpoint chain
//! names written as dots, since nft names cannot hold a colon).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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

impl SvcPort {
    /// `default/svc:port`, kube-proxy's servicePortName.
    fn spn(&self) -> String {
        format!("default/{}:{}", self.svc, self.port_name)
    }
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

/// `addr/32` or `addr/128`: a host match.
fn host(a: IpAddr) -> String {
    format!("{a}/{}", if a.is_ipv6() { 128 } else { 32 })
}

/// `addr:port`, bracketed for IPv6, as DNAT targets are written.
fn addr_port(a: IpAddr, port: u16) -> String {
    match a {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
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

    /// The nftables family (also its address match keyword) and its address type.
    fn nft_family(&self) -> (&'static str, &'static str) {
        if self.v6 {
            ("ip6", "ipv6_addr")
        } else {
            ("ip", "ipv4_addr")
        }
    }

    /// The restore command for [`Services::iptables_full`]: `iptables-restore` or
    /// `ip6tables-restore`.
    pub fn iptables_restore(&self) -> &'static str {
        if self.v6 {
            "ip6tables-restore"
        } else {
            "iptables-restore"
        }
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

    // ---- iptables ----

    /// The whole ruleset for one `iptables-restore` (nat and filter tables, with the jumps
    /// from the built-in chains), as kube-proxy leaves a node after a full sync.
    pub fn iptables_full(&self) -> String {
        let mut out = String::new();
        out.push_str("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
        for c in [
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
        ] {
            writeln!(out, ":{c} - [0:0]").unwrap();
        }
        out.push_str(
            "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
             -A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n\
             -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
             -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
             -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
             -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
             -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
             -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A KUBE-FORWARD -m conntrack --ctstate INVALID -m comment --comment \"kubernetes forwarding rules\" -j DROP\n\
             -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
             -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
             COMMIT\n",
        );
        out.push_str(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
",
        );
        self.iptables_nat_body(&mut out);
        out
    }

    fn iptables_nat_body(&self, out: &mut String) {
        for c in [
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
        ] {
            writeln!(out, ":{c} - [0:0]").unwrap();
        }
        for p in &self.ports {
            writeln!(out, ":{} - [0:0]", ipt_svc(p)).unwrap();
            if p.node_port.is_some() {
                writeln!(out, ":{} - [0:0]", ipt_ext(p)).unwrap();
            }
            for e in &p.endpoints {
                writeln!(out, ":{} - [0:0]", ipt_sep(p, *e)).unwrap();
            }
        }
        out.push_str(
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n",
        );
        out.push_str(
            "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
             -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
             -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n\
             -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n",
        );
        let cidr = self.cluster_cidr();
        for p in &self.ports {
            let spn = p.spn();
            let svc = ipt_svc(p);
            writeln!(
                out,
                "-A KUBE-SERVICES -m comment --comment \"{spn} cluster IP\" -m {pr} -p {pr} -d {vip} --dport {port} -j {svc}",
                pr = p.proto,
                vip = host(p.vip),
                port = p.port
            )
            .unwrap();
            writeln!(
                out,
                "-A {svc} -m comment --comment \"{spn} cluster IP\" -m {pr} -p {pr} -d {vip} --dport {port} ! -s {cidr} -j KUBE-MARK-MASQ",
                pr = p.proto,
                vip = host(p.vip),
                port = p.port
            )
            .unwrap();
            let n = p.endpoints.len();
            for (i, e) in p.endpoints.iter().enumerate() {
                let sep = ipt_sep(p, *e);
                // Rule i of n jumps with probability 1/(n-i); the last one always.
                let stat = if i + 1 < n {
                    format!(
                        "-m statistic --mode random --probability {:.10} ",
                        1.0 / (n - i) as f64
                    )
                } else {
                    String::new()
                };
                writeln!(
                    out,
                    "-A {svc} -m comment --comment \"{spn} -> {e}:{t}\" {stat}-j {sep}",
                    t = p.target
                )
                .unwrap();
            }
            for e in &p.endpoints {
                let sep = ipt_sep(p, *e);
                writeln!(
                    out,
                    "-A {sep} -m comment --comment {spn} -s {} -j KUBE-MARK-MASQ",
                    host(*e)
                )
                .unwrap();
                writeln!(
                    out,
                    "-A {sep} -m comment --comment {spn} -m {pr} -p {pr} -j DNAT --to-destination {}",
                    addr_port(*e, p.target),
                    pr = p.proto,
                )
                .unwrap();
            }
        }
        // NodePorts: KUBE-NODEPORTS -> KUBE-EXT-* (masquerade, then the service chain).
        for p in &self.ports {
            let Some(np) = p.node_port else { continue };
            let ext = ipt_ext(p);
            writeln!(
                out,
                "-A KUBE-NODEPORTS -m comment --comment {spn} -m {pr} -p {pr} --dport {np} -j {ext}",
                spn = p.spn(),
                pr = p.proto
            )
            .unwrap();
            writeln!(
                out,
                "-A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ",
                spn = p.spn()
            )
            .unwrap();
            writeln!(out, "-A {ext} -j {}", ipt_svc(p)).unwrap();
        }
        out.push_str(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n",
        );
        out.push_str("COMMIT\n");
    }

    // ---- nftables ----

    /// The whole `ip kube-proxy` (or `ip6 kube-proxy`) table for one `nft -f`.
    pub fn nft_full(&self) -> String {
        let (fam, addr) = self.nft_family();
        let mut out = String::new();
        out.push_str(
            &"table ip kube-proxy {\n\
             \tcomment \"rules for kube-proxy\"\n\
             \tmap service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }\n\
             \tmap no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }\n\
             \tchain mark-for-masquerade { meta mark set meta mark or 0x4000 ; }\n\
             \tchain masquerading { meta mark & 0x4000 == 0 return ; meta mark set meta mark xor 0x4000 ; masquerade fully-random ; }\n\
             \tset nodeport-ips { type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }\n\
             \tmap service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }\n\
             \tchain services { ip daddr . meta l4proto . th dport vmap @service-ips ; ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports ; }\n\
             \tchain service-endpoints-check { ip daddr . meta l4proto . th dport vmap @no-endpoint-services ; }\n\
             \tchain filter-forward { type filter hook forward priority -110 ; policy accept ; ct state new jump service-endpoints-check ; }\n\
             \tchain filter-output { type filter hook output priority -110 ; policy accept ; ct state new jump service-endpoints-check ; }\n\
             \tchain nat-prerouting { type nat hook prerouting priority -100 ; policy accept ; jump services ; }\n\
             \tchain nat-output { type nat hook output priority -100 ; policy accept ; jump services ; }\n\
             \tchain nat-postrouting { type nat hook postrouting priority 100 ; policy accept ; jump masquerading ; }\n"
                .replace("table ip ", &format!("table {fam} "))
                .replace("ipv4_addr", addr)
                .replace("ip daddr", &format!("{fam} daddr")),
        );
        for p in &self.ports {
            for e in &p.endpoints {
                writeln!(
                    out,
                    "\tchain {} {{ {} }}",
                    nft_ep(p, *e),
                    nft_ep_rules(p, *e, fam)
                )
                .unwrap();
            }
            writeln!(
                out,
                "\tchain {} {{ {} }}",
                nft_svc(p),
                nft_svc_rules(p, fam, self.cluster_cidr())
            )
            .unwrap();
            if p.node_port.is_some() {
                writeln!(
                    out,
                    "\tchain {} {{ jump mark-for-masquerade ; goto {} ; }}",
                    nft_ext(p),
                    nft_svc(p)
                )
                .unwrap();
            }
        }
        out.push_str("}\n");
        if !self.node_ips.is_empty() {
            let ips: Vec<String> = self.node_ips.iter().map(ToString::to_string).collect();
            writeln!(
                out,
                "add element {fam} kube-proxy nodeport-ips {{ {} }}",
                ips.join(", ")
            )
            .unwrap();
        }
        for p in &self.ports {
            if let Some(np) = p.node_port {
                writeln!(
                    out,
                    "add element {fam} kube-proxy service-nodeports {{ {} . {np} : goto {} }}",
                    p.proto,
                    nft_ext(p)
                )
                .unwrap();
            }
        }
        // Elements in chunks, one transaction (the whole file is one).
        for chunk in self.ports.chunks(1000) {
            write!(out, "add element {fam} kube-proxy service-ips {{ ").unwrap();
            let elems: Vec<String> = chunk
                .iter()
                .map(|p| format!("{} . {} . {} : goto {}", p.vip, p.proto, p.port, nft_svc(p)))
                .collect();
            out.push_str(&elems.join(", "));
            out.push_str(" }\n");
        }
        out
    }

    /// An incremental update from `old` to `self`, as kube-proxy's nftables mode does on a
    /// partial sync: new endpoint chains added, changed service chains flushed and refilled,
    /// stale endpoint chains deleted, in one transaction.
    pub fn nft_incremental(&self, old: &Services) -> String {
        let (fam, _) = self.nft_family();
        let mut out = String::new();
        for (p, o) in self.ports.iter().zip(&old.ports) {
            if p.endpoints == o.endpoints {
                continue;
            }
            for e in p.endpoints.iter().filter(|e| !o.endpoints.contains(e)) {
                let c = nft_ep(p, *e);
                writeln!(out, "add chain {fam} kube-proxy {c}").unwrap();
                writeln!(out, "flush chain {fam} kube-proxy {c}").unwrap();
                add_rules(&mut out, fam, &c, &nft_ep_rules(p, *e, fam));
            }
            let c = nft_svc(p);
            writeln!(out, "flush chain {fam} kube-proxy {c}").unwrap();
            add_rules(
                &mut out,
                fam,
                &c,
                &nft_svc_rules(p, fam, self.cluster_cidr()),
            );
            for e in o.endpoints.iter().filter(|e| !p.endpoints.contains(e)) {
                writeln!(out, "delete chain {fam} kube-proxy {}", nft_ep(o, *e)).unwrap();
            }
        }
        out
    }
}

/// `add rule` lines for chain `c` of `<fam> kube-proxy`, one per rule of `rules` (a chain
/// body as `nft_*_rules` writes it: rules separated by ` ; `).
fn add_rules(out: &mut String, fam: &str, c: &str, rules: &str) {
    for r in rules.split(" ; ").filter(|r| !r.trim().is_empty()) {
        writeln!(
            out,
            "add rule {fam} kube-proxy {c} {}",
            r.trim_end_matches(" ;")
        )
        .unwrap();
    }
}

/// A kube-proxy-style chain hash: 16 characters of base32 over an FNV-1a digest (kube-proxy
/// uses SHA-256; only the shape of the name matters here).
pub(crate) fn hash16(key: &str) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let fnv = |salt: u8| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.bytes().chain([salt]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    };
    let bits = (u128::from(fnv(1)) << 64) | u128::from(fnv(2));
    (0..16)
        .map(|i| ALPHABET[((bits >> (i * 5)) & 31) as usize] as char)
        .collect()
}

fn ipt_svc(p: &SvcPort) -> String {
    format!("KUBE-SVC-{}", hash16(&format!("{}{}", p.spn(), p.proto)))
}

fn ipt_ext(p: &SvcPort) -> String {
    format!("KUBE-EXT-{}", hash16(&format!("{}{}", p.spn(), p.proto)))
}

/// `external-HASH8-default/svc/tcp/port`.
fn nft_ext(p: &SvcPort) -> String {
    let base = format!("default/{}/{}/{}", p.svc, p.proto, p.port_name);
    format!("external-{}-{base}", &hash16(&base)[..8])
}

fn ipt_sep(p: &SvcPort, e: IpAddr) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!("{}{}{e}:{}", p.spn(), p.proto, p.target))
    )
}

/// `service-HASH8-default/svc/tcp/port`.
fn nft_svc(p: &SvcPort) -> String {
    let base = format!("default/{}/{}/{}", p.svc, p.proto, p.port_name);
    format!("service-{}-{base}", &hash16(&base)[..8])
}

/// `endpoint-HASH8-default/svc/tcp/port__IP/PORT`; an IPv6 address's colons become dots,
/// as kube-proxy writes them (a chain name cannot hold a colon).
fn nft_ep(p: &SvcPort, e: IpAddr) -> String {
    let ip = e.to_string().replace(':', ".");
    let base = format!(
        "default/{}/{}/{}__{ip}/{}",
        p.svc, p.proto, p.port_name, p.target
    );
    format!("endpoint-{}-{base}", &hash16(&base)[..8])
}

fn nft_ep_rules(p: &SvcPort, e: IpAddr, fam: &str) -> String {
    format!(
        "{fam} saddr {e} jump mark-for-masquerade ; meta l4proto {} dnat to {} ;",
        p.proto,
        addr_port(e, p.target)
    )
}

fn nft_svc_rules(p: &SvcPort, fam: &str, cidr: &str) -> String {
    let vmap: Vec<String> = p
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| format!("{i} : goto {}", nft_ep(p, *e)))
        .collect();
    format!(
        "{fam} daddr {} {} dport {} {fam} saddr != {cidr} jump mark-for-masquerade ; numgen random mod {} vmap {{ {} }} ;",
        p.vip,
        p.proto,
        p.port,
        p.endpoints.len(),
        vmap.join(", ")
    )
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
