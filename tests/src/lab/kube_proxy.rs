//! kube-proxy's rules for a few Services, rendered as kube-proxy 1.35 writes them and
//! installed into a lab namespace: iptables mode ([`iptables_restore_input`],
//! [`install_iptables`]) and nftables mode ([`nft_input`], [`install_nft`]), either family.
//!
//! Used by the lab test of lbproxy's takeover (`tests/tests/kube_proxy_rules.rs`: the rules
//! DNAT a pod's traffic, `lbproxy::takeover::kube_proxy::find` reports them, `remove` removes
//! them) and by xtask's benchmarks (`xtask/src/bench_datapath/rules.rs` renders its N services
//! through this module), so both see the same layout.
//!
//! The layouts follow kubernetes `pkg/proxy/iptables/proxier.go` (the jump rules of
//! `iptablesJumpChains` and the kubelet duplicates, `KUBE-SERVICES`, `KUBE-SVC-*`,
//! `KUBE-SEP-*` with `DNAT`, `KUBE-EXT-*`, `KUBE-NODEPORTS`, `KUBE-MARK-MASQ`,
//! `KUBE-POSTROUTING` with `MASQUERADE --random-fully`, `KUBE-FORWARD`,
//! `KUBE-PROXY-FIREWALL`, `KUBE-FIREWALL`'s anti-martian rule, the `KUBE-PROXY-CANARY`
//! chains of its monitor) and `pkg/proxy/nftables/proxier.go` with its `README.md` (table
//! `ip kube-proxy` / `ip6 kube-proxy`, the `service-ips` verdict map, `service-*` chains
//! with `numgen random mod K vmap`, `endpoint-*` chains with `dnat to`, `nodeport-ips` and
//! `service-nodeports`, `mark-for-masquerade` and `masquerading`). The text is written from
//! that description, not copied; chain hashes use FNV ([`hash16`]) instead of SHA-256, since
//! only the names' shape matters.
//!
//! IPv6: `/128` host matches, `[addr]:port` DNAT targets, table `ip6 kube-proxy` with
//! `ipv6_addr` keys and `ip6 daddr`, colons of endpoint chain names written as dots (nft
//! names cannot hold a colon).
//!
//! Check: `cargo test -p lbproxy-tests --lib kube_proxy` (shapes) and the lab test above
//! (the rules carry traffic).

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};

use super::Family;
use super::net::Proto;
use super::ns::{ns_command, output_result};

/// One service port, as kube-proxy sees it ("servicePortName" plus what it programs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub service: String,
    pub port_name: String,
    pub proto: Proto,
    /// The ClusterIP (of the family the rules are rendered for).
    pub vip: IpAddr,
    pub port: u16,
    pub node_port: Option<u16>,
    /// Endpoint address and target port.
    pub endpoints: Vec<(IpAddr, u16)>,
}

impl ServicePort {
    /// A `default/<service>:<port_name>` TCP or UDP port of `vip` without NodePort.
    pub fn new(
        service: &str,
        port_name: &str,
        proto: Proto,
        vip: IpAddr,
        port: u16,
        endpoints: &[(IpAddr, u16)],
    ) -> ServicePort {
        ServicePort {
            namespace: "default".into(),
            service: service.into(),
            port_name: port_name.into(),
            proto,
            vip,
            port,
            node_port: None,
            endpoints: endpoints.to_vec(),
        }
    }

    /// `ns/svc:port`, kube-proxy's servicePortName.
    fn spn(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.service, self.port_name)
    }

    fn proto(&self) -> &'static str {
        match self.proto {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// The node's side of kube-proxy's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeNet {
    /// `--cluster-cidr` of the family: traffic to a ClusterIP from outside it is masqueraded.
    pub cluster_cidr: String,
    /// The node addresses that accept NodePorts (`--nodeport-addresses`; nftables'
    /// `nodeport-ips`). Empty: iptables matches `--dst-type LOCAL`, as with the default.
    pub node_ips: Vec<IpAddr>,
}

/// The restore command of `family`'s default backend: `iptables-restore` or
/// `ip6tables-restore`.
pub fn restore_command(family: Family) -> &'static str {
    match family {
        Family::V4 => "iptables-restore",
        Family::V6 => "ip6tables-restore",
    }
}

/// The nftables family (also its address match keyword) and its address type.
fn nft_family(family: Family) -> (&'static str, &'static str) {
    match family {
        Family::V4 => ("ip", "ipv4_addr"),
        Family::V6 => ("ip6", "ipv6_addr"),
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

/// Panics unless every address of `ports` and `net` is of `family`.
fn check_family(family: Family, ports: &[ServicePort], net: &NodeNet) {
    let v6 = family == Family::V6;
    for p in ports {
        assert!(
            p.vip.is_ipv6() == v6 && p.endpoints.iter().all(|(e, _)| e.is_ipv6() == v6),
            "kube_proxy: {} has addresses outside {family}",
            p.spn()
        );
    }
    assert!(
        net.node_ips.iter().all(|a| a.is_ipv6() == v6),
        "kube_proxy: node addresses outside {family}"
    );
}

// ---- iptables ----

/// The filter table's jumps from built-in chains (`iptablesJumpChains`), then kubelet's
/// `KUBE-FIREWALL` jumps, which kube-proxy duplicates (`iptablesKubeletJumpChains`).
const FILTER_JUMPS: &str = "\
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
";

/// `KUBE-FORWARD`: drop conntrack-invalid packets, accept marked and established ones.
const KUBE_FORWARD: &str = "\
-A KUBE-FORWARD -m conntrack --ctstate INVALID -m comment --comment \"kubernetes forwarding rules\" -j DROP
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
";

/// The nat table's jumps from built-in chains and the masquerade machinery.
const NAT_FIXED: &str = "\
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
";

/// kube-proxy's whole iptables ruleset for `ports` (mangle, filter and nat tables, with the
/// jumps from the built-in chains), as it leaves a node after a full sync: input for one
/// `iptables-restore` (or `ip6tables-restore`). With `--noflush` it adds to what is there;
/// without, it replaces those three tables.
pub fn iptables_restore_input(family: Family, ports: &[ServicePort], net: &NodeNet) -> String {
    check_family(family, ports, net);
    let mut out = String::new();
    out.push_str(
        "*mangle\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n\
         :OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n",
    );
    out.push_str("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
        "KUBE-PROXY-CANARY",
    ] {
        writeln!(out, ":{c} - [0:0]").unwrap();
    }
    out.push_str(FILTER_JUMPS);
    out.push_str(KUBE_FORWARD);
    if family == Family::V4 {
        // Written when NodePorts are allowed on localhost (the IPv4 default), the same rule
        // as kubelet's.
        out.push_str(
            "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n",
        );
    }
    out.push_str("COMMIT\n");
    out.push_str(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n",
    );
    iptables_nat_body(family, ports, net, &mut out);
    out
}

fn iptables_nat_body(family: Family, ports: &[ServicePort], net: &NodeNet, out: &mut String) {
    for c in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-PROXY-CANARY",
    ] {
        writeln!(out, ":{c} - [0:0]").unwrap();
    }
    for p in ports {
        declare_service_chains(p, out);
    }
    out.push_str(NAT_FIXED);
    for p in ports {
        ipt_services_jump(p, out);
        ipt_service_rules(p, &net.cluster_cidr, out);
    }
    ipt_nodeports(family, ports, net, |_| true, out);
    out.push_str("COMMIT\n");
}

/// The `:CHAIN - [0:0]` lines of a service port's own chains (`KUBE-SVC-*`, `KUBE-EXT-*`,
/// `KUBE-SEP-*`).
fn declare_service_chains(p: &ServicePort, out: &mut String) {
    writeln!(out, ":{} - [0:0]", ipt_svc(p)).unwrap();
    if p.node_port.is_some() {
        writeln!(out, ":{} - [0:0]", ipt_ext(p)).unwrap();
    }
    for (e, t) in &p.endpoints {
        writeln!(out, ":{} - [0:0]", ipt_sep(p, *e, *t)).unwrap();
    }
}

/// `KUBE-NODEPORTS` -> `KUBE-EXT-*` for every port with a NodePort (the `KUBE-EXT-*` chain's
/// own rules only where `write_ext` says so), then `KUBE-SERVICES`' last rule.
fn ipt_nodeports(
    family: Family,
    ports: &[ServicePort],
    net: &NodeNet,
    write_ext: impl Fn(usize) -> bool,
    out: &mut String,
) {
    // NodePorts: KUBE-NODEPORTS -> KUBE-EXT-* (masquerade, then the service chain).
    for (i, p) in ports.iter().enumerate() {
        let Some(np) = p.node_port else { continue };
        let ext = ipt_ext(p);
        let spn = p.spn();
        writeln!(
            out,
            "-A KUBE-NODEPORTS -m comment --comment {spn} -m {pr} -p {pr} --dport {np} -j {ext}",
            pr = p.proto()
        )
        .unwrap();
        if !write_ext(i) {
            continue;
        }
        writeln!(
            out,
            "-A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ"
        )
        .unwrap();
        writeln!(out, "-A {ext} -j {}", ipt_svc(p)).unwrap();
    }
    let last = "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    if net.node_ips.is_empty() {
        let not_loopback = if family == Family::V6 {
            " ! -d ::1/128"
        } else {
            ""
        };
        writeln!(
            out,
            "-A KUBE-SERVICES {last} -m addrtype --dst-type LOCAL{not_loopback} -j KUBE-NODEPORTS"
        )
        .unwrap();
    } else {
        for ip in &net.node_ips {
            writeln!(
                out,
                "-A KUBE-SERVICES {last} -d {} -j KUBE-NODEPORTS",
                host(*ip)
            )
            .unwrap();
        }
    }
}

/// kube-proxy's partial sync from `old` to `new` (the same service ports, in the same order,
/// some with other endpoints), for `iptables-restore --noflush`: what kube-proxy writes since
/// `MinimizeIPTablesRestore` (on by default since 1.27, GA in 1.30). Every sync rewrites the
/// chains that list every service (filter `KUBE-SERVICES`, `KUBE-EXTERNAL-SERVICES`,
/// `KUBE-FORWARD`, `KUBE-NODEPORTS`, `KUBE-PROXY-FIREWALL`; nat `KUBE-SERVICES`,
/// `KUBE-NODEPORTS`, `KUBE-POSTROUTING`, `KUBE-MARK-MASQ`); only the services whose endpoints
/// changed get their `KUBE-SVC-*`/`KUBE-EXT-*`/`KUBE-SEP-*` chains written; the endpoint
/// chains that went are flushed (a chain line) and deleted (`-X`) in the same restore, as
/// kube-proxy does below 1,000 endpoints (above, in its "large cluster mode", it deletes
/// them at most once per `syncPeriod`, after an `iptables-save` of the nat table). The jumps from the built-in chains are not rewritten
/// (kube-proxy ensures them once, outside the restore).
pub fn iptables_partial_input(
    family: Family,
    old: &[ServicePort],
    new: &[ServicePort],
    net: &NodeNet,
) -> String {
    check_family(family, new, net);
    assert_eq!(old.len(), new.len(), "partial sync: the same service ports");
    let changed: Vec<bool> = new
        .iter()
        .zip(old)
        .map(|(n, o)| n.endpoints != o.endpoints || n.node_port != o.node_port)
        .collect();
    let mut out = String::new();
    out.push_str("*filter\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ] {
        writeln!(out, ":{c} - [0:0]").unwrap();
    }
    out.push_str(KUBE_FORWARD);
    out.push_str("COMMIT\n*nat\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        writeln!(out, ":{c} - [0:0]").unwrap();
    }
    let mut stale = Vec::new();
    for ((p, o), _) in new.iter().zip(old).zip(&changed).filter(|(_, c)| **c) {
        declare_service_chains(p, &mut out);
        for (e, t) in o.endpoints.iter().filter(|e| !p.endpoints.contains(e)) {
            stale.push(ipt_sep(o, *e, *t));
        }
    }
    // A stale chain gets a chain line (flushing it) before its `-X`, as kube-proxy writes
    // it; iptables-nft refuses the `-X` of a chain whose referrer is flushed in the same
    // restore otherwise (CHAIN_DEL: Device or resource busy).
    for c in &stale {
        writeln!(out, ":{c} - [0:0]").unwrap();
    }
    // NAT_FIXED without the built-in chains' jumps.
    for l in NAT_FIXED
        .lines()
        .filter(|l| !l.starts_with("-A PREROUTING") && !l.starts_with("-A OUTPUT"))
        .filter(|l| !l.starts_with("-A POSTROUTING"))
    {
        writeln!(out, "{l}").unwrap();
    }
    for (p, c) in new.iter().zip(&changed) {
        ipt_services_jump(p, &mut out);
        if *c {
            ipt_service_rules(p, &net.cluster_cidr, &mut out);
        }
    }
    ipt_nodeports(family, new, net, |i| changed[i], &mut out);
    for c in &stale {
        writeln!(out, "-X {c}").unwrap();
    }
    out.push_str("COMMIT\n");
    out
}

/// `KUBE-SERVICES`' rule for a service port: its ClusterIP and port to `KUBE-SVC-*`.
fn ipt_services_jump(p: &ServicePort, out: &mut String) {
    let spn = p.spn();
    let (pr, vip, port) = (p.proto(), host(p.vip), p.port);
    writeln!(
        out,
        "-A KUBE-SERVICES -m comment --comment \"{spn} cluster IP\" -m {pr} -p {pr} -d {vip} --dport {port} -j {}",
        ipt_svc(p)
    )
    .unwrap();
}

/// `KUBE-SVC-*` (masquerade from outside the cluster CIDR, then one `KUBE-SEP-*` at random)
/// -> `KUBE-SEP-*` (DNAT); [`ipt_services_jump`] writes the jump to it.
fn ipt_service_rules(p: &ServicePort, cidr: &str, out: &mut String) {
    let spn = p.spn();
    let svc = ipt_svc(p);
    let (pr, vip, port) = (p.proto(), host(p.vip), p.port);
    writeln!(
        out,
        "-A {svc} -m comment --comment \"{spn} cluster IP\" -m {pr} -p {pr} -d {vip} --dport {port} ! -s {cidr} -j KUBE-MARK-MASQ"
    )
    .unwrap();
    let n = p.endpoints.len();
    for (i, (e, t)) in p.endpoints.iter().enumerate() {
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
            "-A {svc} -m comment --comment \"{spn} -> {}\" {stat}-j {}",
            addr_port(*e, *t),
            ipt_sep(p, *e, *t)
        )
        .unwrap();
    }
    for (e, t) in &p.endpoints {
        let sep = ipt_sep(p, *e, *t);
        writeln!(
            out,
            "-A {sep} -m comment --comment {spn} -s {} -j KUBE-MARK-MASQ",
            host(*e)
        )
        .unwrap();
        writeln!(
            out,
            "-A {sep} -m comment --comment {spn} -m {pr} -p {pr} -j DNAT --to-destination {}",
            addr_port(*e, *t),
        )
        .unwrap();
    }
}

// ---- nftables ----

/// The fixed part of `table ip kube-proxy` (for IPv4; [`nft_input`] rewrites it for IPv6).
const NFT_TABLE_HEAD: &str = "table ip kube-proxy {
\tcomment \"rules for kube-proxy\"
\tmap service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }
\tmap no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }
\tchain mark-for-masquerade { meta mark set meta mark or 0x4000 ; }
\tchain masquerading { meta mark & 0x4000 == 0 return ; meta mark set meta mark xor 0x4000 ; masquerade fully-random ; }
\tset nodeport-ips { type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }
\tmap service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }
\tchain services { ip daddr . meta l4proto . th dport vmap @service-ips ; ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports ; }
\tchain service-endpoints-check { ip daddr . meta l4proto . th dport vmap @no-endpoint-services ; }
\tchain filter-forward { type filter hook forward priority -110 ; policy accept ; ct state new jump service-endpoints-check ; }
\tchain filter-output { type filter hook output priority -110 ; policy accept ; ct state new jump service-endpoints-check ; }
\tchain nat-prerouting { type nat hook prerouting priority -100 ; policy accept ; jump services ; }
\tchain nat-output { type nat hook output priority -100 ; policy accept ; jump services ; }
\tchain nat-postrouting { type nat hook postrouting priority 100 ; policy accept ; jump masquerading ; }
";

/// kube-proxy's whole `ip kube-proxy` (or `ip6 kube-proxy`) table for `ports`, for one
/// `nft -f`.
pub fn nft_input(family: Family, ports: &[ServicePort], net: &NodeNet) -> String {
    check_family(family, ports, net);
    let (fam, addr) = nft_family(family);
    let mut out = NFT_TABLE_HEAD
        .replace("table ip ", &format!("table {fam} "))
        .replace("ipv4_addr", addr)
        .replace("ip daddr", &format!("{fam} daddr"));
    for p in ports {
        for (e, t) in &p.endpoints {
            writeln!(
                out,
                "\tchain {} {{ {} }}",
                nft_ep(p, *e, *t),
                nft_ep_rules(p, *e, *t, fam)
            )
            .unwrap();
        }
        writeln!(
            out,
            "\tchain {} {{ {} }}",
            nft_svc(p),
            nft_svc_rules(p, fam, &net.cluster_cidr)
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
    if !net.node_ips.is_empty() {
        let ips: Vec<String> = net.node_ips.iter().map(ToString::to_string).collect();
        writeln!(
            out,
            "add element {fam} kube-proxy nodeport-ips {{ {} }}",
            ips.join(", ")
        )
        .unwrap();
    }
    for p in ports {
        if let Some(np) = p.node_port {
            writeln!(
                out,
                "add element {fam} kube-proxy service-nodeports {{ {} . {np} : goto {} }}",
                p.proto(),
                nft_ext(p)
            )
            .unwrap();
        }
    }
    // Elements in chunks, one transaction (the whole file is one).
    for chunk in ports.chunks(1000) {
        let elems: Vec<String> = chunk
            .iter()
            .map(|p| {
                format!(
                    "{} . {} . {} : goto {}",
                    p.vip,
                    p.proto(),
                    p.port,
                    nft_svc(p)
                )
            })
            .collect();
        writeln!(
            out,
            "add element {fam} kube-proxy service-ips {{ {} }}",
            elems.join(", ")
        )
        .unwrap();
    }
    out
}

/// An incremental update from `old` to `new` (the same service ports, in the same order,
/// with other endpoints), as kube-proxy's nftables mode does on a partial sync: new endpoint
/// chains added, changed service chains flushed and refilled, stale endpoint chains deleted,
/// in one transaction.
pub fn nft_incremental(
    family: Family,
    old: &[ServicePort],
    new: &[ServicePort],
    net: &NodeNet,
) -> String {
    check_family(family, new, net);
    let (fam, _) = nft_family(family);
    let mut out = String::new();
    for (p, o) in new.iter().zip(old) {
        if p.endpoints == o.endpoints {
            continue;
        }
        for (e, t) in p.endpoints.iter().filter(|e| !o.endpoints.contains(e)) {
            let c = nft_ep(p, *e, *t);
            writeln!(out, "add chain {fam} kube-proxy {c}").unwrap();
            writeln!(out, "flush chain {fam} kube-proxy {c}").unwrap();
            add_rules(&mut out, fam, &c, &nft_ep_rules(p, *e, *t, fam));
        }
        let c = nft_svc(p);
        writeln!(out, "flush chain {fam} kube-proxy {c}").unwrap();
        add_rules(&mut out, fam, &c, &nft_svc_rules(p, fam, &net.cluster_cidr));
        for (e, t) in o.endpoints.iter().filter(|e| !p.endpoints.contains(e)) {
            writeln!(out, "delete chain {fam} kube-proxy {}", nft_ep(o, *e, *t)).unwrap();
        }
    }
    out
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
pub fn hash16(key: &str) -> String {
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

/// The `KUBE-SERVICES`, `KUBE-SVC-*` and `KUBE-SEP-*` chains declared in an
/// `iptables-save` text: what a takeover must leave none of.
pub fn service_chains(save: &str) -> std::collections::BTreeSet<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| {
            *c == "KUBE-SERVICES" || c.starts_with("KUBE-SVC-") || c.starts_with("KUBE-SEP-")
        })
        .map(str::to_owned)
        .collect()
}

/// `KUBE-SVC-<hash>` of a service port.
pub fn ipt_svc(p: &ServicePort) -> String {
    format!("KUBE-SVC-{}", hash16(&format!("{}{}", p.spn(), p.proto())))
}

/// `KUBE-EXT-<hash>` of a service port with a NodePort.
pub fn ipt_ext(p: &ServicePort) -> String {
    format!("KUBE-EXT-{}", hash16(&format!("{}{}", p.spn(), p.proto())))
}

/// `KUBE-SEP-<hash>` of one endpoint of a service port.
pub fn ipt_sep(p: &ServicePort, e: IpAddr, target: u16) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!("{}{}{e}:{target}", p.spn(), p.proto()))
    )
}

/// `<ns>/<svc>/<proto>/<port>`, the nft chain names' base.
fn nft_base(p: &ServicePort) -> String {
    format!(
        "{}/{}/{}/{}",
        p.namespace,
        p.service,
        p.proto(),
        p.port_name
    )
}

/// `external-HASH8-ns/svc/tcp/port`.
fn nft_ext(p: &ServicePort) -> String {
    let base = nft_base(p);
    format!("external-{}-{base}", &hash16(&base)[..8])
}

/// `service-HASH8-ns/svc/tcp/port`.
pub fn nft_svc(p: &ServicePort) -> String {
    let base = nft_base(p);
    format!("service-{}-{base}", &hash16(&base)[..8])
}

/// `endpoint-HASH8-ns/svc/tcp/port__IP/PORT`; an IPv6 address's colons become dots, as
/// kube-proxy writes them (a chain name cannot hold a colon).
pub fn nft_ep(p: &ServicePort, e: IpAddr, target: u16) -> String {
    let ip = e.to_string().replace(':', ".");
    let base = format!("{}__{ip}/{target}", nft_base(p));
    format!("endpoint-{}-{base}", &hash16(&base)[..8])
}

fn nft_ep_rules(p: &ServicePort, e: IpAddr, target: u16, fam: &str) -> String {
    format!(
        "{fam} saddr {e} jump mark-for-masquerade ; meta l4proto {} dnat to {} ;",
        p.proto(),
        addr_port(e, target)
    )
}

fn nft_svc_rules(p: &ServicePort, fam: &str, cidr: &str) -> String {
    let vmap: Vec<String> = p
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, (e, t))| format!("{i} : goto {}", nft_ep(p, *e, *t)))
        .collect();
    format!(
        "{fam} daddr {} {} dport {} {fam} saddr != {cidr} jump mark-for-masquerade ; numgen random mod {} vmap {{ {} }} ;",
        p.vip,
        p.proto(),
        p.port,
        p.endpoints.len(),
        vmap.join(", ")
    )
}

// ---- installing ----

/// Runs `cmd` with `input` on stdin; an error holding the command, its status and stderr.
fn pipe(mut cmd: Command, what: &str, input: &str) -> Result<(), String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())
        .map_err(|e| format!("{what}: writing its input: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{what}: {e}"))?;
    output_result(what, out).map(drop)
}

/// Installs [`iptables_restore_input`] in namespace `ns` with `restore` (`iptables-restore`,
/// `iptables-legacy-restore`, `ip6tables-nft-restore`, ...) and `--noflush`, so chains
/// already there (kubelet's) stay.
pub fn install_iptables_with(
    ns: &str,
    restore: &str,
    family: Family,
    ports: &[ServicePort],
    net: &NodeNet,
) -> Result<(), String> {
    let mut cmd = ns_command(ns, restore);
    cmd.arg("--noflush");
    pipe(
        cmd,
        &format!("[{ns}] {restore} --noflush"),
        &iptables_restore_input(family, ports, net),
    )
}

/// [`install_iptables_with`] the family's default `iptables-restore`.
pub fn install_iptables(
    ns: &str,
    family: Family,
    ports: &[ServicePort],
    net: &NodeNet,
) -> Result<(), String> {
    install_iptables_with(ns, restore_command(family), family, ports, net)
}

/// Installs [`nft_input`] in namespace `ns` (`nft -f -`).
pub fn install_nft(
    ns: &str,
    family: Family,
    ports: &[ServicePort],
    net: &NodeNet,
) -> Result<(), String> {
    let mut cmd = ns_command(ns, "nft");
    cmd.args(["-f", "-"]);
    pipe(
        cmd,
        &format!("[{ns}] nft -f -"),
        &nft_input(family, ports, net),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports(v6: bool) -> (Vec<ServicePort>, NodeNet) {
        let a = |s4: &str, s6: &str| -> IpAddr { if v6 { s6 } else { s4 }.parse().unwrap() };
        let mut web = ServicePort::new(
            "web",
            "http",
            Proto::Tcp,
            a("198.19.0.10", "fd00:c613::10"),
            80,
            &[
                (a("198.18.0.3", "fd00:c612::3"), 8080),
                (a("198.18.0.4", "fd00:c612::4"), 8081),
            ],
        );
        web.node_port = Some(30080);
        let dns = ServicePort::new(
            "dns",
            "dns",
            Proto::Udp,
            a("198.19.0.11", "fd00:c613::11"),
            53,
            &[(a("198.18.0.3", "fd00:c612::3"), 5353)],
        );
        let net = NodeNet {
            cluster_cidr: if v6 {
                "fd00:c612::/48"
            } else {
                "198.18.0.0/16"
            }
            .into(),
            node_ips: vec![],
        };
        (vec![web, dns], net)
    }

    /// The partial sync: every service's `KUBE-SERVICES` rule, only the changed service's
    /// own chains, `-X` of the endpoint chain that went, no jumps from built-in chains.
    #[test]
    fn iptables_partial_shape() {
        let (old, net) = ports(false);
        let mut new = old.clone();
        new[0].endpoints.remove(0);
        let ipt = iptables_partial_input(Family::V4, &old, &new, &net);
        assert!(!ipt.contains("-A PREROUTING") && !ipt.contains("-A OUTPUT"));
        assert!(
            ipt.contains("-A KUBE-SERVICES -m comment --comment \"default/dns:dns cluster IP\"")
        );
        assert!(ipt.contains(&format!("-j {}", ipt_svc(&new[1]))));
        assert!(
            !ipt.contains(&format!(":{} ", ipt_svc(&new[1]))),
            "unchanged: not flushed"
        );
        assert!(ipt.contains(&format!(":{} - [0:0]", ipt_svc(&new[0]))));
        assert!(ipt.contains(&format!(
            "-X {}",
            ipt_sep(&old[0], old[0].endpoints[0].0, 8080)
        )));
        assert!(!ipt.contains("DNAT --to-destination 198.18.0.3:8080"));
        assert!(ipt.contains("DNAT --to-destination 198.18.0.4:8081"));
        assert!(ipt.ends_with("COMMIT\n"));
    }

    #[test]
    fn iptables_shapes() {
        let (p, net) = ports(false);
        let ipt = iptables_restore_input(Family::V4, &p, &net);
        assert!(ipt.contains("--probability 0.5000000000 -j KUBE-SEP-"));
        assert!(ipt.contains("-j DNAT --to-destination 198.18.0.4:8081"));
        assert!(ipt.contains("-m udp -p udp -j DNAT --to-destination 198.18.0.3:5353"));
        assert!(ipt.contains("--dport 30080 -j KUBE-EXT-"));
        assert!(ipt.contains("-j MASQUERADE --random-fully"));
        assert!(ipt.contains("-A INPUT -j KUBE-FIREWALL"));
        assert!(ipt.contains("block incoming localnet connections"));
        assert!(ipt.contains("--dst-type LOCAL -j KUBE-NODEPORTS"));
        assert_eq!(ipt.matches("COMMIT").count(), 3);
        let (p6, net6) = ports(true);
        let ipt6 = iptables_restore_input(Family::V6, &p6, &net6);
        assert!(ipt6.contains("-d fd00:c613::10/128 --dport 80"), "{ipt6}");
        assert!(ipt6.contains("! -s fd00:c612::/48 -j KUBE-MARK-MASQ"));
        assert!(ipt6.contains("-j DNAT --to-destination [fd00:c612::4]:8081"));
        assert!(!ipt6.contains("/32") && !ipt6.contains("127.0.0.0"));
    }

    #[test]
    fn nft_shapes() {
        let (p, mut net) = ports(false);
        net.node_ips = vec!["198.18.255.1".parse().unwrap()];
        let nft = nft_input(Family::V4, &p, &net);
        assert!(nft.starts_with("table ip kube-proxy {"));
        assert!(nft.contains("numgen random mod 2 vmap"));
        assert!(nft.contains("dnat to 198.18.0.4:8081"));
        assert!(nft.contains("add element ip kube-proxy nodeport-ips { 198.18.255.1 }"));
        assert!(nft.contains("service-nodeports { tcp . 30080 : goto external-"));
        let (p6, net6) = ports(true);
        let nft6 = nft_input(Family::V6, &p6, &net6);
        assert!(nft6.starts_with("table ip6 kube-proxy {"));
        assert!(nft6.contains("type ipv6_addr . inet_proto"));
        assert!(nft6.contains("ip6 daddr . meta l4proto"));
        assert!(nft6.contains("dnat to [fd00:c612::3]:5353"));
        assert!(nft6.contains("__fd00.c612..3/5353"));
        assert!(!nft6.contains("ip daddr") && !nft6.contains("ipv4_addr"));
        let mut changed = p6.clone();
        changed[0].endpoints.pop();
        let inc = nft_incremental(Family::V6, &p6, &changed, &net6);
        assert!(inc.contains("delete chain ip6 kube-proxy endpoint-"));
    }

    #[test]
    #[should_panic(expected = "outside IPv6")]
    fn family_mismatch_panics() {
        let (p, net) = ports(false);
        iptables_restore_input(Family::V6, &p, &net);
    }
}
