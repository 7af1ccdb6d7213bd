//! kube-proxy's rules in a lab node, and lbproxy's takeover finding and removing them
//! (`lbproxy::takeover::kube_proxy`), without lbproxy running.
//!
//! For each layout of `lbproxy_tests::lab::kube_proxy` (iptables mode through iptables-nft
//! and through iptables-legacy, nftables mode; IPv4 and IPv6), installed in the node
//! namespace beside kubelet's chains (`KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`, and
//! `KUBE-FIREWALL` in iptables mode):
//! - the rules carry a pod's traffic: TCP to the ClusterIP reaches both backends, UDP the
//!   one, and the backend sees the client's own address (no masquerade inside the cluster
//!   CIDR);
//! - `find()` in the node namespace reports exactly the chains the layout wrote (names and
//!   rule counts), the jump rules from the built-in chains, or the nft table, and nothing of
//!   the other backend or family;
//! - `remove()` removes all of it: `find()` then reports nothing, no `KUBE-` chain but
//!   kubelet's is left, kubelet's chains (and `KUBE-FIREWALL`'s jumps) are still there, and
//!   the ClusterIP no longer answers.
//!
//! A `kube-ipvs0` dummy link in the node namespace is reported as IPVS mode, and `remove()`
//! refuses it.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use lbproxy::takeover::kube_proxy::{
    self as kp, IpFamily, Iptables, IptablesBackend, IptablesTable, KubeProxyError, KubeProxyState,
};
use lbproxy_tests::lab::kube_proxy::{self as fixture, NodeNet, ServicePort};
use lbproxy_tests::lab::{Family, Lab, Pod, Proto, Shape, run_in_ns};

const T: Duration = Duration::from_secs(1);
const WEB_PORT: u16 = 80;
const DNS_PORT: u16 = 53;
const TARGET: u16 = 8080;

/// How kube-proxy's rules are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Iptables(IptablesBackend),
    Nft,
}

fn ip_family(f: Family) -> IpFamily {
    match f {
        Family::V4 => IpFamily::V4,
        Family::V6 => IpFamily::V6,
    }
}

fn addr(p: &Pod, f: Family) -> IpAddr {
    match f {
        Family::V4 => p.ip.into(),
        Family::V6 => p.ip6.expect("single-node lab pods are dual-stack").into(),
    }
}

fn vip(f: Family, n: u8) -> IpAddr {
    match f {
        Family::V4 => lbproxy_tests::lab::vip(n).into(),
        Family::V6 => format!("fd00:c613::{n:x}").parse().unwrap(),
    }
}

/// `iptables-nft-restore`, `ip6tables-legacy-save`, ...
fn tool(f: Family, b: IptablesBackend, what: &str) -> String {
    format!("{}-{b}-{what}", ip_family(f).iptables())
}

/// Two Services: `web` (TCP, a NodePort, endpoints b1 and b2) and `dns` (UDP, endpoint b1).
fn services(f: Family, b1: &Pod, b2: &Pod) -> (Vec<ServicePort>, NodeNet) {
    let mut web = ServicePort::new(
        "web",
        "http",
        Proto::Tcp,
        vip(f, 10),
        WEB_PORT,
        &[(addr(b1, f), TARGET), (addr(b2, f), TARGET)],
    );
    web.node_port = Some(30080);
    let dns = ServicePort::new(
        "dns",
        "dns",
        Proto::Udp,
        vip(f, 11),
        DNS_PORT,
        &[(addr(b1, f), TARGET)],
    );
    let net = NodeNet {
        cluster_cidr: match f {
            Family::V4 => "198.18.0.0/16",
            Family::V6 => "fd00:c612::/48",
        }
        .into(),
        node_ips: Vec::new(),
    };
    (vec![web, dns], net)
}

/// kubelet's chains, as kubelet 1.35 creates them with the node's iptables: the hint, the
/// canaries and, for IPv4 only, `KUBE-FIREWALL` with its anti-martian rule and jumps.
fn install_kubelet_chains(lab: &Lab, f: Family, restore: &str) {
    let mut input = String::from(
        "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n\
         *nat\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n\
         *filter\n:KUBE-KUBELET-CANARY - [0:0]\n",
    );
    if f == Family::V4 {
        input.push_str(
            ":KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A OUTPUT -j KUBE-FIREWALL\n",
        );
        input.push_str("-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n");
    }
    input.push_str("COMMIT\n");
    let mut cmd = lab.node_command(restore);
    cmd.arg("--noflush");
    let out = pipe_output(cmd, &input);
    assert!(
        out.status.success(),
        "{restore} --noflush (kubelet's chains): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn pipe_output(mut cmd: std::process::Command, input: &str) -> std::process::Output {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// The client's traffic to both ClusterIPs is DNATed to the backends, unmasqueraded.
fn assert_traffic_dnated(f: Family, client: &Pod, what: &str) {
    let t = client.tally(Proto::Tcp, vip(f, 10), WEB_PORT, 40, T);
    assert!(
        t.all_ok() && t.count("b1") > 0 && t.count("b2") > 0,
        "[{what}] TCP to the web ClusterIP through kube-proxy's rules: {t}"
    );
    let (reply, from) = client
        .tcp_request(vip(f, 10), WEB_PORT, T)
        .unwrap_or_else(|e| panic!("[{what}] TCP to the web ClusterIP: {e}"));
    assert_eq!(from, std::net::SocketAddr::new(vip(f, 10), WEB_PORT));
    let seen: std::net::SocketAddr = reply.client_seen.parse().unwrap();
    assert_eq!(
        seen.ip(),
        addr(client, f),
        "[{what}] the backend saw the client's own address"
    );
    let (reply, _) = client
        .udp_request(vip(f, 11), DNS_PORT, T, None)
        .unwrap_or_else(|e| panic!("[{what}] UDP to the dns ClusterIP: {e}"));
    assert_eq!(reply.backend, "b1", "[{what}] UDP answered by b1");
}

/// What `find()` should report for the iptables layout: each table's part, as the ownership
/// rules see the rendered input.
fn expected_tables(f: Family, b: IptablesBackend, input: &str) -> Vec<IptablesTable> {
    let tool = Iptables {
        family: ip_family(f),
        backend: b,
        save: tool(f, b, "save").into(),
        restore: tool(f, b, "restore").into(),
    };
    kp::parse_iptables_save(input)
        .unwrap()
        .iter()
        .filter_map(|t| IptablesTable::from_saved(&tool, t))
        .collect()
}

/// One table's part: its name, its chains with their rule counts, its number of jumps.
type TableRow = (String, BTreeSet<(String, usize)>, usize);

/// The parts per table, as a set (iptables-legacy-save and iptables-nft-save order tables
/// differently).
fn table_rows(tables: &[IptablesTable]) -> BTreeSet<TableRow> {
    tables
        .iter()
        .map(|t| {
            let chains = t.chains.iter().map(|c| (c.name.clone(), c.rules)).collect();
            (t.table.clone(), chains, t.jumps.len())
        })
        .collect()
}

fn find_in(lab: &Lab) -> KubeProxyState {
    run_in_ns(lab.node_ns(), kp::find).unwrap_or_else(|e| panic!("find() in the node: {e}"))
}

/// The `KUBE-` chains (`:NAME` declarations) of every table of one save command's output.
fn kube_chains(lab: &Lab, save: &str) -> BTreeSet<String> {
    let text = lab.node_run(&[save]).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with("KUBE-"))
        .map(str::to_owned)
        .collect()
}

fn layout(mode: Mode, f: Family) {
    let what = format!("{mode:?} {f}");
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let b2 = lab.add_pod("b2");
    let _s1 = b1.serve(&[TARGET]);
    let _s2 = b2.serve(&[TARGET]);
    let (ports, net) = services(f, &b1, &b2);

    // kubelet's chains go through the backend kube-proxy uses (nft in nftables mode).
    let kubelet_backend = match mode {
        Mode::Iptables(b) => b,
        Mode::Nft => IptablesBackend::Nft,
    };
    install_kubelet_chains(&lab, f, &tool(f, kubelet_backend, "restore"));
    match mode {
        Mode::Iptables(b) => {
            fixture::install_iptables_with(lab.node_ns(), &tool(f, b, "restore"), f, &ports, &net)
        }
        Mode::Nft => fixture::install_nft(lab.node_ns(), f, &ports, &net),
    }
    .unwrap_or_else(|e| panic!("[{what}] installing kube-proxy's rules: {e}"));

    assert_traffic_dnated(f, &client, &what);

    // find() reports exactly the layout.
    let state = find_in(&lab);
    assert!(!state.ipvs, "[{what}] no IPVS: {state:?}");
    match mode {
        Mode::Iptables(b) => {
            assert!(state.nft.is_empty(), "[{what}] no nft table: {state:?}");
            let want = expected_tables(f, b, &fixture::iptables_restore_input(f, &ports, &net));
            let (got, want_rows) = (table_rows(&state.iptables), table_rows(&want));
            assert_eq!(
                got.len(),
                3,
                "[{what}] mangle, filter and nat: {}",
                state.summary()
            );
            assert_eq!(got, want_rows, "[{what}] find(): {}", state.summary());
            for t in &state.iptables {
                assert_eq!(
                    (t.tool.family, t.tool.backend),
                    (ip_family(f), b),
                    "[{what}] found in {:?}",
                    t.tool
                );
                assert!(t.kept.is_empty(), "[{what}] nothing kept: {t:?}");
            }
            let nat = state.iptables.iter().find(|t| t.table == "nat").unwrap();
            let names: BTreeSet<&str> = nat.chains.iter().map(|c| c.name.as_str()).collect();
            for c in [
                fixture::ipt_svc(&ports[0]),
                fixture::ipt_ext(&ports[0]),
                fixture::ipt_sep(&ports[0], addr(&b2, f), TARGET),
                fixture::ipt_svc(&ports[1]),
            ] {
                assert!(
                    names.contains(c.as_str()),
                    "[{what}] nat has {c}: {names:?}"
                );
            }
            assert_eq!(
                state.iptables.iter().map(|t| t.jumps.len()).sum::<usize>(),
                12,
                "[{what}] 9 filter and 3 nat jumps from built-in chains"
            );
        }
        Mode::Nft => {
            assert!(
                state.iptables.is_empty(),
                "[{what}] kubelet's chains are not kube-proxy's: {}",
                state.summary()
            );
            assert_eq!(
                state.nft,
                [kp::NftTable {
                    family: ip_family(f),
                    name: "kube-proxy".into()
                }],
                "[{what}]"
            );
        }
    }
    let summary = state.summary();
    assert!(
        summary.starts_with("kube-proxy rules found") && !summary.contains('\n'),
        "{summary}"
    );

    // remove() leaves only kubelet's.
    let removed = run_in_ns(lab.node_ns(), || kp::remove(&state))
        .unwrap_or_else(|e| panic!("[{what}] remove(): {e}"));
    match mode {
        Mode::Iptables(_) => {
            let chains: usize = state.iptables.iter().map(|t| t.chains.len()).sum();
            assert_eq!(
                (
                    removed.tables,
                    removed.chains,
                    removed.jump_rules,
                    removed.nft_tables
                ),
                (3, chains, 12, 0),
                "[{what}] {removed:?}"
            );
        }
        Mode::Nft => assert_eq!(
            (removed.tables, removed.nft_tables),
            (0, 1),
            "[{what}] {removed:?}"
        ),
    }
    let after = find_in(&lab);
    assert!(
        after.is_empty(),
        "[{what}] after remove(): {}",
        after.summary()
    );
    let mut kubelet: BTreeSet<String> = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"]
        .map(str::to_owned)
        .into();
    // kubelet's KUBE-FIREWALL (IPv4), or kube-proxy's copy of it, which is left alone.
    if matches!(mode, Mode::Iptables(_)) || f == Family::V4 {
        kubelet.insert("KUBE-FIREWALL".into());
    }
    assert_eq!(
        kube_chains(&lab, &tool(f, kubelet_backend, "save")),
        kubelet,
        "[{what}] only kubelet's KUBE- chains are left"
    );
    if let Mode::Iptables(b) = mode {
        let filter = lab
            .node_run(&[&tool(f, b, "save"), "-t", "filter"])
            .unwrap();
        for chain in ["INPUT", "OUTPUT"] {
            assert!(
                filter.contains(&format!("-A {chain} -j KUBE-FIREWALL")),
                "[{what}] kubelet's {chain} -> KUBE-FIREWALL stays:\n{filter}"
            );
        }
        assert!(
            !filter.contains("-j KUBE-SERVICES") && !filter.contains("-j KUBE-PROXY-FIREWALL"),
            "[{what}] kube-proxy's jumps are gone:\n{filter}"
        );
    }
    let tables = lab.node_run(&["nft", "list", "tables"]).unwrap();
    assert!(
        !tables.contains("kube-proxy"),
        "[{what}] no kube-proxy nft table:\n{tables}"
    );
    assert!(
        client.tcp_request(vip(f, 10), WEB_PORT, T).is_err(),
        "[{what}] the ClusterIP answers no more without kube-proxy's rules"
    );
}

#[test]
fn iptables_nft_ipv4() {
    layout(Mode::Iptables(IptablesBackend::Nft), Family::V4);
}

#[test]
fn iptables_nft_ipv6() {
    layout(Mode::Iptables(IptablesBackend::Nft), Family::V6);
}

#[test]
fn iptables_legacy_ipv4() {
    layout(Mode::Iptables(IptablesBackend::Legacy), Family::V4);
}

#[test]
fn iptables_legacy_ipv6() {
    layout(Mode::Iptables(IptablesBackend::Legacy), Family::V6);
}

#[test]
fn nftables_ipv4() {
    layout(Mode::Nft, Family::V4);
}

#[test]
fn nftables_ipv6() {
    layout(Mode::Nft, Family::V6);
}

/// A `kube-ipvs0` link in the node namespace means IPVS mode: reported, and refused.
/// kube-proxy's is a dummy link; these hosts have no dummy module, and only the name
/// matters to `find()`, so the test makes a bridge.
#[test]
fn ipvs_link_is_reported_and_refused() {
    let lab = Lab::new(Shape::Routed);
    assert!(!find_in(&lab).ipvs, "no kube-ipvs0 yet");
    lab.node_run(&["ip", "link", "add", kp::IPVS_LINK, "type", "bridge"])
        .unwrap();
    let state = find_in(&lab);
    assert!(state.ipvs, "{state:?}");
    assert!(!state.is_empty());
    assert!(state.summary().contains("IPVS"), "{}", state.summary());
    let err = run_in_ns(lab.node_ns(), || kp::remove(&state)).unwrap_err();
    assert!(matches!(err, KubeProxyError::Ipvs), "{err}");
    assert!(err.to_string().contains(kp::IPVS_LINK), "{err}");
}
