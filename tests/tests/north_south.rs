//! North-south traffic on two nodes (issue 11): NodePorts, externalIPs and load-balancer IPs
//! reached from a client outside the cluster, answered by a backend on the node it reached
//! (which sees the client's own address) or on the other node (which sees the node's
//! address: SNAT), with every reply coming from the address and port the client used.
//!
//! Each node runs its own lbproxy, started exactly as other harnesses start it:
//! `run --manifests FILE --pod-interfaces 'lxc*' --hostname-override nodeX
//! --nodeport-addresses 198.18.80.0/24 --bpffs-dir DIR --healthz-bind-address
//! 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249`.
//!
//! This suite: the frontends (NodePorts, externalIPs, LB IPs) through either node, in both
//! families, and `--nodeport-addresses`. The others: north_south_policy.rs (traffic
//! policies, source ranges), north_south_snat.rs, north_south_flows.rs (flows of a backend
//! that leaves, ICMP errors).

mod north_south_common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{
    MultiNodeLab, NodeId, WEB_EXTERNAL_IP6, WEB_LB_IP6, dual_stack_web_manifest,
};
use lbproxy_tests::lab::{Family, HEALTHZ_ADDR, Lbproxy, http_get, tcp_request, wait_for};

use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP, WEB_EXTERNAL_IP as EXTERNAL_IP,
    WEB_LB_IP as LB_IP, WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
    web_manifest,
};

use north_south_common::*;

lbproxy_tests::both_families!(node_port_external_ip_and_lb_ip_through_either_node);

/// externalTrafficPolicy: Cluster, in each family. From a client outside the cluster,
/// through either node: the NodePorts (TCP and UDP) on the node's address, the externalIP
/// and the load-balancer IP are answered by both backends, always from the address and port
/// the client used; the backend on the node reached sees the client's own address, the
/// other one sees that node's address (SNAT, with each family's own port space). Over IPv6
/// the Service is dual-stack, and its IPv4 NodePort answers too.
fn node_port_external_ip_and_lb_ip_through_either_node(family: Family) {
    let s = Setup::for_family(family, "Cluster");
    let client = s.lab.add_client("ext");
    let (client_ip, vips): (IpAddr, [IpAddr; 2]) = match family {
        Family::V4 => (client.ip.into(), [EXTERNAL_IP.into(), LB_IP.into()]),
        Family::V6 => (
            client.ip6.into(),
            [WEB_EXTERNAL_IP6.into(), WEB_LB_IP6.into()],
        ),
    };
    let node_addr = |via: NodeId| -> IpAddr {
        match family {
            Family::V4 => s.lab.node(via).ip.into(),
            Family::V6 => s.lab.node(via).ip6.into(),
        }
    };
    if family == Family::V6 {
        wait_served(&client, node_addr(NodeId::A), NODE_PORT_TCP);
    }
    let proto = |udp: bool| if udp { "UDP" } else { "TCP" };
    for via in NodeId::ALL {
        let node_ip = node_addr(via);
        for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
            let seen = requests(&client.netns, udp, node_ip, port, 24);
            let what = format!(
                "{} NodePort {} via {via}",
                proto(udp),
                SocketAddr::from((node_ip, port))
            );
            eprintln!("{what}: {seen:?}");
            assert_spread(&s, &what, &seen, via, client_ip);
        }
        match family {
            Family::V4 => client.route_via("198.19.0.0/16", s.lab.node(via)),
            Family::V6 => client.route_via6("fd00:c612:ffff::/64", s.lab.node(via)),
        }
        for vip in vips {
            for (udp, port) in [(false, 80), (true, 53)] {
                let seen = requests(&client.netns, udp, vip, port, 24);
                let what = format!("{} {} via {via}", proto(udp), SocketAddr::from((vip, port)));
                eprintln!("{what}: {seen:?}");
                assert_spread(&s, &what, &seen, via, client_ip);
            }
        }
    }
    if family == Family::V6 {
        // The IPv4 NodePort of the same Service, at the same time.
        let a = s.lab.node(NodeId::A).ip;
        let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 12);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "TCP {a}:{NODE_PORT_TCP}: {seen:?}"
        );
        assert_eq!(
            seen.by_backend.len(),
            2,
            "TCP {a}:{NODE_PORT_TCP}: both backends answer: {seen:?}"
        );
    }
}

/// A pod on nodeB reaches nodeA's NodePort (nodeA load-balances it as traffic from outside)
/// and its own node's NodePort (its own node's pod interface translates it, without SNAT);
/// every reply comes from the address the pod used.
#[test]
fn pods_reach_node_ports_on_either_node() {
    let s = Setup::new("Cluster");
    let c = s.lab.add_pod(NodeId::B, "podclient");
    s.lab.wait_programs_on(&c, HEALTHY_WITHIN);
    for via in NodeId::ALL {
        let node_ip = s.lab.node(via).ip;
        for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
            let seen = requests(&c.netns, udp, node_ip, port, 24);
            let what = format!("pod on nodeB -> {node_ip}:{port}");
            eprintln!("{what}: {seen:?}");
            assert!(
                seen.errors.is_empty() && seen.wrong_source.is_empty(),
                "{what}: {seen:?}\n{}",
                s.logs()
            );
            assert_eq!(
                seen.by_backend.len(),
                2,
                "{what}: both backends answer: {seen:?}"
            );
        }
    }
}

/// A NodePort answered by backends on the node itself, for both pod-network shapes (one
/// node; the client is the lab's uplink namespace, outside the node): the backends see the
/// client's own address, and replies come from the NodePort. On a bridged pod network the
/// route to a local pod leads to the bridge, which must count as local (no SNAT), not as a
/// route elsewhere.
fn node_port_to_local_backends(shape: lbproxy_tests::lab::Shape) {
    use lbproxy_tests::lab::{Lab, UPLINK_NODE_ADDR, UPLINK_PEER_ADDR};
    let lab = Lab::new(shape);
    let b1 = lab.add_pod("b1");
    let b2 = lab.add_pod("b2");
    let _servers = [
        b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        b2.serve(&[BACKEND_TCP, BACKEND_UDP]),
    ];
    // The NodePorts of the LoadBalancer service the two-node tests use, over these two.
    lab.write_manifest_text(&web_manifest(
        &[(b1.ip, None), (b2.ip, None)],
        "Cluster",
        "",
    ));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
        let seen = requests(lab.uplink_ns(), udp, UPLINK_NODE_ADDR, port, 16);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "[{shape}] NodePort {port}: {seen:?}\n{}\n{}",
            lab.diagnostics(),
            lb.log()
        );
        assert_eq!(seen.by_backend.len(), 2, "[{shape}] both answer: {seen:?}");
        for (b, (saw, _)) in &seen.by_backend {
            assert_eq!(
                saw,
                &vec![UPLINK_PEER_ADDR.to_string()],
                "[{shape}] {b} sees the client's own address"
            );
        }
    }
}

mod node_port_to_local_backends {
    #[test]
    fn routed() {
        super::node_port_to_local_backends(lbproxy_tests::lab::Shape::Routed)
    }
    #[test]
    fn bridge() {
        super::node_port_to_local_backends(lbproxy_tests::lab::Shape::Bridge)
    }
}

lbproxy_tests::both_families!(node_port_addresses_primary_follows_the_default_route);

/// `--nodeport-addresses primary`, in each family: NodePorts are served on the node's
/// primary address of that family only, the one its default route prefers, and follow it
/// when the route changes. Node A gets a second address on its fabric interface; the second
/// address refuses the NodePort (the node's stack answers: nothing listens there); once the
/// default route prefers the second address, the two swap.
///
/// - IPv4: at first the default route has no preferred source, so the primary is the
///   interface's first address (the node's own), served as soon as lbproxy is healthy.
/// - IPv6 (the Service dual-stack): node A's IPv6 default route at first prefers its own
///   address. (The IPv4 NodePort keeps to the IPv4 primary, as before.)
fn node_port_addresses_primary_follows_the_default_route(family: Family) {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let node = lab.node(NodeId::A).clone();
    let run = |argv: &[&str]| {
        lab.node_run(NodeId::A, argv)
            .unwrap_or_else(|e| panic!("{argv:?} on nodeA: {e}"));
    };
    let (first, second, ip_family) = match family {
        Family::V4 => {
            lab.write_manifest_text(&manifest(&lab, &[&a1], "Cluster"));
            let second = Ipv4Addr::new(198, 18, 80, 201);
            run(&["ip", "addr", "add", &format!("{second}/24"), "dev", "eth0"]);
            (IpAddr::V4(node.ip), IpAddr::V4(second), "-4")
        }
        Family::V6 => {
            lab.write_manifest_text(&dual_stack_web_manifest(&lab, &[&a1], "Cluster", ""));
            let second = Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, 0x201);
            run(&[
                "ip",
                "addr",
                "add",
                &format!("{second}/64"),
                "dev",
                "eth0",
                "nodad",
            ]);
            (IpAddr::V6(node.ip6), IpAddr::V6(second), "-6")
        }
    };
    let default_from = |src: IpAddr| {
        run(&[
            "ip",
            ip_family,
            "route",
            "replace",
            "default",
            "dev",
            "eth0",
            "src",
            &src.to_string(),
        ]);
    };
    if family == Family::V6 {
        default_from(first);
    }
    let mut args = lab.lbproxy_run_args(NodeId::A, &[]);
    let at = args
        .iter()
        .position(|a| a == "--nodeport-addresses")
        .expect("the lab passes --nodeport-addresses");
    args[at + 1] = "primary".into();
    let mut lb = lab.start_lbproxy_argv(NodeId::A, args, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let logs = |lb: &Lbproxy| format!("{}\n--- lbproxy\n{}", lab.diagnostics(), lb.log());
    // Served on `on` by a1, from `on`; refused on `off`.
    let serves = |on: IpAddr, off: IpAddr| {
        let served = client.tcp_request(on, NODE_PORT_TCP, TIMEOUT);
        let refused = client.tcp_request(off, NODE_PORT_TCP, TIMEOUT);
        match (&served, &refused) {
            (Ok((reply, from)), Err(e))
                if reply.backend == "a1"
                    && *from == SocketAddr::from((on, NODE_PORT_TCP))
                    && e.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                Ok(())
            }
            _ => Err(format!("{on}: {served:?}; {off}: {refused:?}")),
        }
    };
    let within = |on, off| {
        wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
            serves(on, off).ok()
        })
    };
    match family {
        Family::V4 => serves(first, second).unwrap_or_else(|e| {
            panic!(
                "primary = the interface's first address: {e}\n{}",
                logs(&lb)
            )
        }),
        Family::V6 => assert!(
            within(first, second).is_ok(),
            "primary = the IPv6 default route's preferred source: {:?}\n{}",
            serves(first, second),
            logs(&lb)
        ),
    }
    default_from(second);
    assert!(
        within(second, first).is_ok(),
        "primary = the {family} default route's new preferred source, within 5 s: {:?}\n{}",
        serves(second, first),
        logs(&lb)
    );
    assert!(
        lb.log()
            .lines()
            .any(|l| l.contains("nodePortAddresses: primary") && l.contains(&second.to_string())),
        "the new primary {family} address is logged\n{}",
        lb.log()
    );
}

/// A `healthCheckNodePort` that cannot be bound (another process holds it on nodeA's
/// address) is reported once, a log line naming the service and the port, not once per
/// sync that retries it; nothing else stops: the NodePort is served, nodeB's health check
/// answers, lbproxy stays healthy. Once the port is free, the next sync's retry starts the
/// server and it answers with a1 counted.
#[test]
fn a_health_check_port_that_cannot_be_bound_is_reported_once() {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let extra = format!("healthCheckNodePort: {HC_PORT}");
    lab.write_manifest_text(&manifest_with(&lab, &[&a1], "Local", &extra));
    let (a, b) = (lab.node(NodeId::A).ip, lab.node(NodeId::B).ip);
    let squatter = lbproxy_tests::lab::run_in_ns(lab.node_ns(NodeId::A), || {
        std::net::TcpListener::bind((a, HC_PORT))
    })
    .expect("bind the health-check port first");
    // Full syncs every second, each of which retries the port.
    let lbs = lab.start_lbproxy_on_both(&["--sync-period", "1s"], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    std::thread::sleep(Duration::from_secs(4));
    let failed_lines = |lb: &Lbproxy| {
        lb.log()
            .lines()
            .filter(|l| {
                l.contains("health check server")
                    && l.contains("default/web")
                    && l.contains(&HC_PORT.to_string())
            })
            .count()
    };
    assert_eq!(
        failed_lines(&lbs[0]),
        1,
        "the bind failure is logged once over about 4 syncs\n{}",
        lbs[0].log()
    );
    let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 4);
    assert!(
        seen.errors.is_empty() && seen.by_backend.contains_key("a1"),
        "the NodePort is still served: {seen:?}"
    );
    let hc = |ip: Ipv4Addr| {
        lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((ip, HC_PORT)),
            "/",
            Duration::from_secs(1),
        )
    };
    let on_b = hc(b);
    assert!(
        matches!(&on_b, Ok(r) if r.status == 503),
        "nodeB's health check answers (no local endpoint there): {on_b:?}"
    );
    assert!(
        matches!(
            http_get(
                lab.node_ns(NodeId::A),
                HEALTHZ_ADDR.parse().unwrap(),
                "/healthz"
            ),
            Ok(200)
        ),
        "nodeA's lbproxy stays healthy"
    );
    drop(squatter);
    let started = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        hc(a)
            .ok()
            .filter(|r| r.status == 200 && r.body.contains("\"localEndpoints\": 1"))
    });
    assert!(
        started.is_ok(),
        "once the port is free, nodeA's health check starts and counts a1: {:?}\n{}",
        hc(a),
        lbs[0].log()
    );
}

/// Load-balancer ingress entries with `ipMode: Proxy` (KEP-1860) or only a hostname program
/// nothing: nodeA does not answer for the Proxy-mode address, while the VIP-mode one is
/// served; `inspect services` lists neither the Proxy address nor the hostname.
#[test]
fn lb_ingress_with_ip_mode_proxy_or_a_hostname_programs_nothing() {
    let proxied = Ipv4Addr::new(198, 19, 0, 61);
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let _server = a1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let text = manifest(&lab, &[&a1], "Cluster").replace(
        &format!("ingress: [{{ip: {LB_IP}}}]"),
        &format!(
            "ingress: [{{ip: {LB_IP}}}, {{ip: {proxied}, ipMode: Proxy}}, {{hostname: lb.example}}]"
        ),
    );
    assert!(text.contains("ipMode: Proxy"), "{text}");
    lab.write_manifest_text(&text);
    let mut lb = lab.start_lbproxy(NodeId::A, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    client.route_via("198.19.0.0/16", lab.node(NodeId::A));
    let served = requests(&client.netns, false, LB_IP, 80, 4);
    assert!(
        served.errors.is_empty() && served.replies() == 4,
        "the VIP-mode LB IP is served: {served:?}\n{}",
        lb.log()
    );
    let r = tcp_request(&client.netns, proxied, 80, Duration::from_millis(700));
    assert!(
        r.is_err(),
        "the Proxy-mode LB IP is not served by lbproxy: {r:?}"
    );
    let services = lab.node(NodeId::A).inspect_json("services").to_string();
    assert!(
        services.contains(&LB_IP.to_string())
            && !services.contains(&proxied.to_string())
            && !services.contains("lb.example"),
        "inspect services lists only the VIP-mode LB IP: {services}"
    );
}
