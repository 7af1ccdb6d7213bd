//! Checks of the two-node lab itself (`lab::multinode`); these need no lbproxy.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use lbproxy_tests::lab::multinode::{
    FABRIC_BRIDGE, MultiNodeLab, NODE_IF, NODEPORT_ADDRESSES, NodeId, POD_IF_GLOB,
};
use lbproxy_tests::lab::ns;

const T: Duration = Duration::from_secs(1);

fn links(ns_name: &str) -> Vec<String> {
    let out = ns::ns_run(ns_name, &["ip", "-o", "link", "show"]).unwrap();
    let mut v: Vec<String> = out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_owned())
        .collect();
    v.sort();
    v
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

/// A counter from `/proc/net/snmp` inside `ns`, e.g. `("Ip", "ForwDatagrams")`.
fn snmp(ns_name: &str, group: &str, field: &str) -> u64 {
    let text = ns::ns_run(ns_name, &["cat", "/proc/net/snmp"]).unwrap();
    let prefix = format!("{group}:");
    let mut rows = text.lines().filter(|l| l.starts_with(&prefix));
    let (names, values) = (rows.next().unwrap(), rows.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == field)
        .unwrap_or_else(|| panic!("no {group} {field} in /proc/net/snmp of {ns_name}"));
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

fn ip_of(seen: &str) -> Ipv4Addr {
    seen.parse::<SocketAddr>()
        .map(|a| match a.ip() {
            std::net::IpAddr::V4(ip) => ip,
            ip => panic!("not IPv4: {ip}"),
        })
        .unwrap_or_else(|e| panic!("bad client address {seen:?}: {e}"))
}

#[test]
fn topology_is_as_documented() {
    let lab = MultiNodeLab::new();
    let a0 = lab.add_pod(NodeId::A, "a0");
    let a1 = lab.add_pod(NodeId::A, "a1");
    let b0 = lab.add_pod(NodeId::B, "b0");
    let c0 = lab.add_client("c0");
    let c1 = lab.add_client("c1");

    assert_eq!(
        (a0.host_if.as_str(), a0.ip),
        ("lxc0", "198.18.1.2".parse().unwrap())
    );
    assert_eq!(
        (a1.host_if.as_str(), a1.ip),
        ("lxc1", "198.18.1.3".parse().unwrap())
    );
    assert_eq!(
        (b0.host_if.as_str(), b0.ip),
        ("lxc0", "198.18.2.2".parse().unwrap())
    );
    assert_eq!(c0.ip, "198.18.80.100".parse::<Ipv4Addr>().unwrap());
    assert_eq!(c1.ip, "198.18.80.101".parse::<Ipv4Addr>().unwrap());
    assert_eq!(lab.node_of("a1"), NodeId::A);
    assert_eq!(lab.node_of("b0"), NodeId::B);
    assert_eq!(lab.pods(NodeId::A).len(), 2);

    assert_eq!(
        links(lab.node_ns(NodeId::A)),
        sorted(&["lo", NODE_IF, "lxc0", "lxc1"])
    );
    assert_eq!(
        links(lab.node_ns(NodeId::B)),
        sorted(&["lo", NODE_IF, "lxc0"])
    );
    assert_eq!(
        links(lab.fabric_ns()),
        sorted(&["lo", FABRIC_BRIDGE, "nA", "nB", "c0", "c1"])
    );
    let ports = ns::ns_run(
        lab.fabric_ns(),
        &["ip", "-o", "link", "show", "master", FABRIC_BRIDGE],
    )
    .unwrap();
    for p in ["nA", "nB", "c0", "c1"] {
        assert!(
            ports.contains(&format!(" {p}@")),
            "{p} not in {FABRIC_BRIDGE}: {ports}"
        );
    }
    for p in [&a0, &b0] {
        assert_eq!(links(&p.netns), sorted(&["lo", "eth0"]), "{}", p.netns);
    }
    // The glob lbproxy gets matches only the pod interfaces.
    let prefix = POD_IF_GLOB.strip_suffix('*').unwrap();
    for id in NodeId::ALL {
        let matching: Vec<String> = links(lab.node_ns(id))
            .into_iter()
            .filter(|l| l.starts_with(prefix))
            .collect();
        let want: Vec<String> = lab.pods(id).into_iter().map(|p| p.host_if).collect();
        assert_eq!(matching, want, "{id}: interfaces matching {POD_IF_GLOB}");
    }

    for id in NodeId::ALL {
        let node = lab.node(id);
        let nsn = node.netns.as_str();
        let addr = ns::ns_run(nsn, &["ip", "-o", "-4", "addr", "show", "dev", NODE_IF]).unwrap();
        assert!(
            addr.contains(&format!("inet {}/24", node.ip)),
            "{id}: {addr}"
        );
        for (key, want) in [
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/conf/all/send_redirects", "0"),
            ("net/ipv4/conf/eth0/send_redirects", "0"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/eth0/rp_filter", "0"),
            ("net/ipv4/conf/lxc0/proxy_arp", "1"),
            ("net/ipv4/neigh/lxc0/proxy_delay", "0"),
        ] {
            assert_eq!(ns::sysctl_read(nsn, key).unwrap(), want, "{id}: {key}");
        }
        let routes = ns::ns_run(nsn, &["ip", "route"]).unwrap();
        let other = id.other();
        for want in [
            format!("default dev {NODE_IF}"),
            format!(
                "{} via {} dev {NODE_IF}",
                other.pod_cidr(),
                other.fabric_ip()
            ),
        ] {
            assert!(
                routes.lines().any(|l| l.trim().starts_with(&want)),
                "{id}: no `{want}` in\n{routes}"
            );
        }
        for p in lab.pods(id) {
            assert!(
                routes
                    .lines()
                    .any(|l| l.trim().starts_with(&format!("{} dev {}", p.ip, p.host_if))),
                "{id}: no /32 route for {}:\n{routes}",
                p.name
            );
        }
        let lo = ns::ns_run(nsn, &["ip", "-o", "link", "show", "dev", "lo"]).unwrap();
        assert!(lo.contains("UP"), "{id}: lo is down: {lo}");
    }

    // The command line contract other harnesses rely on.
    let args = lab.lbproxy_run_args(NodeId::B, &["--v", "2"]);
    let manifest = lab.manifest_path().display().to_string();
    let bpffs = format!("/sys/fs/bpf/lbproxy-test-{}-b", lab.id());
    assert_eq!(lab.node(NodeId::B).bpffs_dir, Path::new(&bpffs));
    // Issue 12's line: the node's clients run inside this cgroup2 group.
    let cgroup = lab.cgroup().display().to_string();
    assert!(
        lab.cgroup().join("cgroup.procs").is_file(),
        "--cgroup-root {cgroup} is not a cgroup2 group"
    );
    assert_eq!(
        args,
        [
            "run",
            "--manifests",
            manifest.as_str(),
            "--pod-interfaces",
            "lxc*",
            "--hostname-override",
            "nodeB",
            "--nodeport-addresses",
            "198.18.80.0/24",
            "--cgroup-root",
            cgroup.as_str(),
            "--bpffs-dir",
            bpffs.as_str(),
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--v",
            "2",
        ]
    );
    assert_eq!(NODEPORT_ADDRESSES, "198.18.80.0/24");
    let ep = lab.endpoint(&b0);
    assert_eq!(ep.node_name.as_deref(), Some("nodeB"));
    assert_eq!(ep.addresses, ["198.18.2.2"]);

    let d = lab.diagnostics();
    for want in [
        "nodeA",
        "nodeB",
        "pod a0 on nodeA",
        "client c1",
        "198.18.80.101/24",
    ] {
        assert!(d.contains(want), "diagnostics lack {want:?}:\n{d}");
    }
    assert_eq!(
        lab.node_run(
            NodeId::A,
            &["ip", "-o", "-4", "addr", "show", "dev", "lxc1"]
        )
        .unwrap(),
        "",
        "host-side pod interfaces carry no address"
    );
}

#[test]
fn pod_to_pod_across_nodes() {
    let lab = MultiNodeLab::new();
    let server = lab.add_pod(NodeId::A, "srv-a");
    let client = lab.add_pod(NodeId::B, "cli-b");
    let back = lab.add_pod(NodeId::B, "srv-b");
    let _s = server.serve(&[8080]);
    let _b = back.serve(&[9090]);
    let fail =
        |what: &str, e: std::io::Error| -> ! { panic!("{what}: {e}\n{}", lab.diagnostics()) };

    let (reply, peer) = client
        .tcp_request(server.ip, 8080, T)
        .unwrap_or_else(|e| fail("TCP nodeB pod -> nodeA pod", e));
    assert_eq!(reply.backend, "srv-a", "{reply}");
    assert_eq!(ip_of(&reply.client_seen), client.ip, "server saw {reply}");
    assert_eq!(peer, SocketAddr::from((server.ip, 8080)));

    let (reply, from) = client
        .udp_request(server.ip, 8080, T, Some(40001))
        .unwrap_or_else(|e| fail("UDP nodeB pod -> nodeA pod", e));
    assert_eq!(reply.backend, "srv-a", "{reply}");
    assert_eq!(reply.client_seen, format!("{}:40001", client.ip), "{reply}");
    assert_eq!(from, SocketAddr::from((server.ip, 8080)));

    // And back the other way, from nodeA's pod to a second pod on nodeB.
    let (reply, _) = server
        .tcp_request(back.ip, 9090, T)
        .unwrap_or_else(|e| fail("TCP nodeA pod -> nodeB pod", e));
    assert_eq!(reply.backend, "srv-b", "{reply}");
    assert_eq!(ip_of(&reply.client_seen), server.ip, "{reply}");

    // Same-node pod to pod too.
    let (reply, _) = client
        .udp_request(back.ip, 9090, T, None)
        .unwrap_or_else(|e| fail("UDP nodeB pod -> nodeB pod", e));
    assert_eq!(
        (reply.backend.as_str(), ip_of(&reply.client_seen)),
        ("srv-b", client.ip)
    );
}

#[test]
fn external_client_through_a_node() {
    let lab = MultiNodeLab::new();
    let pod = lab.add_pod(NodeId::B, "web-b");
    let _s = pod.serve(&[8080]);
    let client = lab.add_client("ext");
    let (a, b) = (lab.node(NodeId::A), lab.node(NodeId::B));
    let fail =
        |what: &str, e: std::io::Error| -> ! { panic!("{what}: {e}\n{}", lab.diagnostics()) };

    // Nothing beyond the fabric until the client is given a route.
    let err = client
        .tcp_request(pod.ip, 8080, T)
        .expect_err("client reached a pod without a route");
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    // The nodes themselves are on the fabric.
    for n in [a, b] {
        client
            .run(|| std::net::TcpStream::connect_timeout(&SocketAddr::from((n.ip, 9)), T))
            .map(drop)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .unwrap_or_else(|e| fail(&format!("client -> {}:9 (expect RST)", n.name), e));
    }

    client.route_to_pods(b);
    let (reply, peer) = client
        .tcp_request(pod.ip, 8080, T)
        .unwrap_or_else(|e| fail("TCP client -> nodeB pod via nodeB", e));
    assert_eq!(reply.backend, "web-b", "{reply}");
    assert_eq!(ip_of(&reply.client_seen), client.ip, "{reply}");
    assert_eq!(peer, SocketAddr::from((pod.ip, 8080)));
    let (reply, _) = client
        .udp_request(pod.ip, 8080, T, None)
        .unwrap_or_else(|e| fail("UDP client -> nodeB pod via nodeB", e));
    assert_eq!(
        (reply.backend.as_str(), ip_of(&reply.client_seen)),
        ("web-b", client.ip)
    );

    // Through the other node (as for an ExternalIP whose endpoint is elsewhere): nodeA
    // forwards out of the interface it received on and must not send redirects.
    client.route_via(&b.pod_cidr, a);
    let (fwd0, redir0) = (
        snmp(&a.netns, "Ip", "ForwDatagrams"),
        snmp(&a.netns, "Icmp", "OutRedirects"),
    );
    let (reply, _) = client
        .tcp_request(pod.ip, 8080, T)
        .unwrap_or_else(|e| fail("TCP client -> nodeB pod via nodeA", e));
    assert_eq!(
        (reply.backend.as_str(), ip_of(&reply.client_seen)),
        ("web-b", client.ip)
    );
    let fwd = snmp(&a.netns, "Ip", "ForwDatagrams") - fwd0;
    assert!(
        fwd >= 3,
        "nodeA forwarded only {fwd} packets: the route via nodeA was not used"
    );
    assert_eq!(
        snmp(&a.netns, "Icmp", "OutRedirects"),
        redir0,
        "nodeA sent ICMP redirects"
    );

    // VIP routes (ExternalIPs, LB IPs) go to the node given.
    client.route_via("198.19.0.0/16", b);
    let get = ns::ns_run(&client.netns, &["ip", "route", "get", "198.19.0.10"]).unwrap();
    assert!(get.contains(&format!("via {} dev eth0", b.ip)), "{get}");
}

#[test]
fn namespaces_removed_on_drop_even_on_panic() {
    fn names(lab: &MultiNodeLab) -> Vec<String> {
        let mut v = vec![lab.fabric_ns().to_owned()];
        v.extend(lab.nodes().iter().map(|n| n.netns.clone()));
        v.extend(
            NodeId::ALL
                .iter()
                .flat_map(|&n| lab.pods(n))
                .map(|p| p.netns),
        );
        v
    }
    let gone = |names: &[String]| {
        for n in names {
            assert!(
                !ns::netns_path(n).exists(),
                "{n} still in /run/netns after drop"
            );
        }
    };

    let lab = MultiNodeLab::new();
    lab.add_pod(NodeId::A, "p");
    lab.add_pod(NodeId::B, "q");
    let client = lab.add_client("c");
    let workdir = lab.workdir().to_owned();
    let mut all = names(&lab);
    all.push(client.netns.clone());
    assert_eq!(all.len(), 6);
    for n in &all {
        assert!(
            ns::netns_path(n).exists(),
            "{n} missing while the lab lives"
        );
        assert!(n.starts_with(&format!("lbt-{}-", lab.id())), "{n}");
    }
    assert!(all.iter().any(|n| n.ends_with("-nodeA")) && all.iter().any(|n| n.ends_with("-nodeB")));
    assert!(workdir.is_dir());
    drop(lab);
    gone(&all);
    assert!(!workdir.exists(), "work dir {} kept", workdir.display());

    // A test that panics halfway still leaves nothing behind.
    let (tx, rx) = std::sync::mpsc::channel();
    let r = std::panic::catch_unwind(|| {
        let lab = MultiNodeLab::new();
        lab.add_pod(NodeId::B, "r");
        let c = lab.add_client("d");
        let mut v = names(&lab);
        v.push(c.netns);
        tx.send((v, lab.workdir().to_owned())).unwrap();
        panic!("deliberate panic inside a multinode lab");
    });
    assert!(r.is_err());
    let (all, workdir) = rx.recv().unwrap();
    assert_eq!(all.len(), 5);
    gone(&all);
    // The work dir (logs, manifests) is kept for the post-mortem; remove it here.
    assert!(
        workdir.is_dir(),
        "work dir {} not kept on panic",
        workdir.display()
    );
    std::fs::remove_dir_all(&workdir).unwrap();
}
