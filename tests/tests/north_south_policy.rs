//! North-south traffic on two nodes (issue 11, see north_south.rs): `externalTrafficPolicy:
//! Local` and its healthCheckNodePort, `loadBalancerSourceRanges`, and pods reaching
//! Local-policy frontends.

mod north_south_common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::NodeId;
use lbproxy_tests::lab::{Family, tcp_request, udp_request, wait_for};

use lbproxy_tests::lab::multinode::{
    WEB_EXTERNAL_IP as EXTERNAL_IP, WEB_EXTERNAL_IP6 as EXTERNAL_IP6, WEB_LB_IP as LB_IP,
    WEB_LB_IP6 as LB_IP6, WEB_NODE_PORT_TCP as NODE_PORT_TCP, WEB_NODE_PORT_UDP as NODE_PORT_UDP,
};

use north_south_common::*;

lbproxy_tests::both_families!(
    external_traffic_policy_local_and_health_check_node_port,
    load_balancer_source_ranges_filter_the_lb_ip_only,
);

/// externalTrafficPolicy: Local with its only endpoint (a1) on nodeA, in each family (over
/// IPv6 the Service is dual-stack and every address below is the IPv6 one):
/// - through nodeA, a1 answers and sees the client's own address (no SNAT);
/// - through nodeB, which has no local endpoint, the traffic is dropped and counted
///   (`no_local_endpoint`), not answered: a TCP connect times out rather than being refused;
/// - the healthCheckNodePort says so on both nodes, with kube-proxy's body: 200 and one
///   local endpoint on nodeA, 503 and none on nodeB;
/// - with no endpoint at all, the client is rejected at once (connection refused).
fn external_traffic_policy_local_and_health_check_node_port(family: Family) {
    let extra = format!("healthCheckNodePort: {HC_PORT}");
    let s = Setup::for_family_with(family, "Local", false, &extra);
    let client = s.lab.add_client("ext");
    let (a, b, client_ip): (IpAddr, IpAddr, IpAddr) = match family {
        Family::V4 => (
            s.lab.node(NodeId::A).ip.into(),
            s.lab.node(NodeId::B).ip.into(),
            client.ip.into(),
        ),
        Family::V6 => (
            s.lab.node(NodeId::A).ip6.into(),
            s.lab.node(NodeId::B).ip6.into(),
            client.ip6.into(),
        ),
    };
    if family == Family::V6 {
        wait_served(&client, a, NODE_PORT_TCP);
    }
    for (udp, port) in [(false, NODE_PORT_TCP), (true, NODE_PORT_UDP)] {
        let seen = requests(&client.netns, udp, a, port, 12);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "via nodeA: {seen:?}\n{}",
            s.logs()
        );
        assert_eq!(
            seen.by_backend.get("a1").map(|e| e.0.clone()),
            Some(vec![client_ip.to_string()]),
            "only a1, seeing the client's own address: {seen:?}"
        );
        assert_eq!(seen.by_backend.len(), 1, "{seen:?}");
    }
    let before = s.lab.node(NodeId::B).drop_count("no_local_endpoint");
    let started = Instant::now();
    let r = tcp_request(&client.netns, b, NODE_PORT_TCP, Duration::from_millis(700));
    let e = r.expect_err("nodeB has no local endpoint: no answer");
    assert!(
        e.kind() == std::io::ErrorKind::TimedOut || e.kind() == std::io::ErrorKind::WouldBlock,
        "dropped, not refused: {e} after {:?}",
        started.elapsed()
    );
    let u = udp_request(
        &client.netns,
        b,
        NODE_PORT_UDP,
        Duration::from_millis(300),
        None,
    );
    assert!(u.is_err(), "UDP through nodeB is not answered: {u:?}");
    let dropped = s.lab.node(NodeId::B).drop_count("no_local_endpoint") - before;
    assert!(
        dropped >= 2,
        "no_local_endpoint counted on nodeB: {dropped}\n{}",
        s.logs()
    );

    for (node, ip, status, n) in [(NodeId::A, a, 200, 1), (NodeId::B, b, 503, 0)] {
        let r = lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((ip, HC_PORT)),
            "/any/path",
            Duration::from_secs(2),
        )
        .unwrap_or_else(|e| panic!("health check on {node}: {e}\n{}", s.logs()));
        assert_eq!(r.status, status, "health check on {node}: {}", r.body);
        let body: serde_json::Value = serde_json::from_str(r.body.trim())
            .unwrap_or_else(|e| panic!("health check body on {node} ({e}): {:?}", r.body));
        assert_eq!(
            body,
            serde_json::json!({
                "service": {"namespace": "default", "name": "web"},
                "localEndpoints": n,
                "serviceProxyHealthy": true
            }),
            "on {node}"
        );
    }

    // No endpoint at all: rejected at once.
    s.lab.write_manifest_text(&match family {
        Family::V4 => manifest_with(&s.lab, &[], "Local", &extra),
        Family::V6 => dual_stack_manifest_with(&s.lab, &[], "Local", &extra),
    });
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let started = Instant::now();
        match tcp_request(&client.netns, a, NODE_PORT_TCP, Duration::from_secs(1)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                assert!(started.elapsed() < Duration::from_millis(500));
                break;
            }
            other => assert!(
                Instant::now() < until,
                "no endpoint: want connection refused, got {other:?}\n{}",
                s.logs()
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // The change reached node A's health check too (a sync of the changed service only):
    // no local endpoint now, 503.
    let r = wait_for(Duration::from_secs(2), Duration::from_millis(50), || {
        lbproxy_tests::lab::http_get_full(
            &client.netns,
            SocketAddr::from((a, HC_PORT)),
            "/",
            Duration::from_secs(1),
        )
        .ok()
        .filter(|r| r.status == 503 && r.body.contains("\"localEndpoints\": 0"))
    });
    assert!(
        r.is_ok(),
        "health check on {} after its endpoint left: want 503 with localEndpoints 0\n{}",
        NodeId::A,
        s.logs()
    );
}

/// `loadBalancerSourceRanges` apply to the load-balancer IP only: a client inside the range
/// reaches it (TCP and UDP), one outside is dropped and counted (`source_range_denied`),
/// and both reach the NodePort and the externalIP. Over IPv4, and over IPv6 (the dual-stack
/// `web`) with ranges of both families, as kube-proxy takes them: an IPv4 range and the
/// first client's IPv6 `/128`; each family's LB IP is filtered by that family's ranges, so
/// there the IPv4 LB IP refuses the first client, whose IPv4 address is outside the IPv4 one.
fn load_balancer_source_ranges_filter_the_lb_ip_only(family: Family) {
    let inside4 = Ipv4Addr::new(198, 18, 80, 100);
    let inside6 = Ipv6Addr::new(0xfd00, 0xc612, 0x80, 0, 0, 0, 0, 100);
    let ranges = match family {
        Family::V4 => format!("['{inside4}/32']"),
        Family::V6 => format!("['203.0.113.0/24', '{inside6}/128']"),
    };
    let s = Setup::for_family_with(
        family,
        "Cluster",
        true,
        &format!("loadBalancerSourceRanges: {ranges}"),
    );
    let ok = s.lab.add_client("ok");
    let other = s.lab.add_client("other");
    let node_a = s.lab.node(NodeId::A);
    let (inside, ok_ip, lb, external, a): (IpAddr, IpAddr, IpAddr, IpAddr, IpAddr) = match family {
        Family::V4 => (
            inside4.into(),
            ok.ip.into(),
            LB_IP.into(),
            EXTERNAL_IP.into(),
            node_a.ip.into(),
        ),
        Family::V6 => (
            inside6.into(),
            ok.ip6.into(),
            LB_IP6.into(),
            EXTERNAL_IP6.into(),
            node_a.ip6.into(),
        ),
    };
    assert_eq!(
        ok_ip, inside,
        "[{family}] the first client is the one in the range"
    );
    for c in [&ok, &other] {
        c.route_via("198.19.0.0/16", node_a);
        if family == Family::V6 {
            c.route_via6("fd00:c612:ffff::/64", node_a);
        }
    }
    wait_served(&ok, lb, 80);
    for (udp, port) in [(false, 80), (true, 53)] {
        let seen = requests(&ok.netns, udp, lb, port, 8);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty() && seen.replies() == 8,
            "[{family}] {} to {lb}:{port} from inside the range: {seen:?}\n{}",
            if udp { "UDP" } else { "TCP" },
            s.logs()
        );
    }
    let before = node_a.drop_count("source_range_denied");
    for (udp, port) in [(false, 80), (true, 53)] {
        let seen = requests(&other.netns, udp, lb, port, 2);
        assert_eq!(
            seen.replies(),
            0,
            "[{family}] {} to {lb}:{port}: outside the range the LB IP must not answer: \
             {seen:?}",
            if udp { "UDP" } else { "TCP" }
        );
    }
    let after = node_a.drop_count("source_range_denied");
    assert!(
        after >= before + 4,
        "[{family}] source_range_denied counted on nodeA ({before} -> {after})\n{}",
        s.logs()
    );
    for (addr, port) in [(a, NODE_PORT_TCP), (external, 80)] {
        let seen = requests(&other.netns, false, addr, port, 4);
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty() && seen.replies() == 4,
            "[{family}] the ranges do not apply to {addr}:{port}: {seen:?}"
        );
    }
    if family == Family::V6 {
        // The first client's IPv4 address is outside 203.0.113.0/24.
        let seen = requests(&ok.netns, false, LB_IP, 80, 2);
        assert_eq!(
            seen.replies(),
            0,
            "[{family}] {LB_IP}: the IPv4 LB IP is filtered by the IPv4 range, which does not \
             hold {}: {seen:?}",
            ok.ip
        );
    }
}

/// As kube-proxy: `loadBalancerSourceRanges` that hold one of the node's addresses also
/// admit the load-balancer IP itself as a source (a load balancer that loops traffic back
/// keeps it); ranges that hold none do not. The client sends from the LB IP to the LB IP
/// through nodeA (the address on its loopback, a policy rule sending its own packets to it
/// out through nodeA, `accept_local` for the answer); the backend is on nodeA, so it sees
/// that source itself, and the answer comes back from the LB IP.
#[test]
fn source_ranges_holding_a_node_ip_admit_the_lb_ip_as_source() {
    let node_a = NodeId::A.fabric_ip();
    for (range, admitted) in [
        (format!("{node_a}/32"), true),
        ("198.18.80.250/32".to_string(), false),
    ] {
        let s = Setup::with(
            "Cluster",
            false,
            &format!("loadBalancerSourceRanges: ['{range}']"),
        );
        let client = s.lab.add_client("loop");
        let ns = client.netns.clone();
        let run = |argv: &[&str]| {
            lbproxy_tests::lab::ns::ns_run(&ns, argv)
                .unwrap_or_else(|e| panic!("{argv:?} in {ns}: {e}"));
        };
        let lb_ip = LB_IP.to_string();
        let via = s.lab.node(NodeId::A).ip.to_string();
        run(&["ip", "addr", "add", &format!("{lb_ip}/32"), "dev", "lo"]);
        // Its own packets to the LB IP leave through nodeA, from the LB IP; what arrives
        // on eth0 is delivered locally (the local table, moved behind that rule).
        run(&[
            "ip",
            "route",
            "add",
            &format!("{lb_ip}/32"),
            "via",
            &via,
            "dev",
            "eth0",
            "src",
            &lb_ip,
            "table",
            "200",
        ]);
        run(&[
            "ip", "rule", "add", "pref", "10", "iif", "lo", "to", &lb_ip, "lookup", "200",
        ]);
        run(&["ip", "rule", "add", "pref", "100", "lookup", "local"]);
        run(&["ip", "rule", "del", "pref", "0"]);
        for dev in ["all", "eth0"] {
            run(&[
                "sysctl",
                "-q",
                "-w",
                &format!("net.ipv4.conf.{dev}.accept_local=1"),
            ]);
        }
        // nodeA sends the answer for the LB IP back to the client.
        s.lab
            .node_run(
                NodeId::A,
                &[
                    "ip",
                    "route",
                    "add",
                    &format!("{lb_ip}/32"),
                    "via",
                    &client.ip.to_string(),
                    "dev",
                    "eth0",
                ],
            )
            .unwrap();
        let before = s.lab.node(NodeId::A).drop_count("source_range_denied");
        let r = udp_request(&ns, LB_IP, 53, Duration::from_millis(700), None);
        if admitted {
            let (reply, from) = r.unwrap_or_else(|e| {
                panic!("range {range}: the LB IP as source: {e}\n{}", s.logs())
            });
            assert_eq!(reply.backend, "a1");
            assert_eq!(
                from,
                SocketAddr::from((LB_IP, 53)),
                "answered from the LB IP"
            );
            assert!(
                reply.client_seen.starts_with(&format!("{lb_ip}:")),
                "the backend sees the LB IP as the source: {}",
                reply.client_seen
            );
            assert_eq!(
                s.lab.node(NodeId::A).drop_count("source_range_denied"),
                before
            );
        } else {
            assert!(
                r.is_err(),
                "range {range} holds no node IP: the LB IP as source is refused: {r:?}"
            );
            assert!(
                s.lab.node(NodeId::A).drop_count("source_range_denied") > before,
                "source_range_denied counted\n{}",
                s.logs()
            );
        }
    }
}

/// kube-proxy's short-circuit of `externalTrafficPolicy: Local`: this node's pods reach the
/// service's external frontends (the NodePorts on their own node's address, the externalIP
/// and the load-balancer IP) with every endpoint and their own address, not only the
/// node's endpoints: from a pod on nodeB, which has no endpoint of its own, a1 on nodeA
/// answers, sees the pod's address, and the answer comes from the frontend; with b1 listed
/// as well, both answer. Outside clients through nodeB still get nodeB's endpoints only
/// (none at first: dropped and counted).
#[test]
fn pods_reach_local_policy_frontends_through_every_endpoint() {
    let s = Setup::with("Local", false, "");
    let pb = s.lab.add_pod(NodeId::B, "pb");
    s.lab.wait_programs_on(&pb, HEALTHY_WITHIN);
    let b = s.lab.node(NodeId::B).ip;
    let frontends = [
        (false, b, NODE_PORT_TCP),
        (true, b, NODE_PORT_UDP),
        (false, LB_IP, 80),
        (true, LB_IP, 53),
        (false, EXTERNAL_IP, 80),
    ];
    for (udp, addr, port) in frontends {
        let seen = requests(&pb.netns, udp, addr, port, 8);
        let what = format!(
            "pod on nodeB -> {addr}:{port} ({})",
            if udp { "UDP" } else { "TCP" }
        );
        assert!(
            seen.errors.is_empty() && seen.wrong_source.is_empty(),
            "{what}: {seen:?}\n{}",
            s.logs()
        );
        assert_eq!(
            seen.by_backend.get("a1"),
            Some(&(vec![pb.ip.to_string()], 8)),
            "{what}: a1 on nodeA answers every request and sees the pod's own address: \
             {seen:?}"
        );
    }
    // Outside traffic through nodeB keeps the Local policy: no endpoint there, dropped.
    let client = s.lab.add_client("ext");
    let before = s.lab.node(NodeId::B).drop_count("no_local_endpoint");
    let r = client.tcp_request(b, NODE_PORT_TCP, Duration::from_millis(700));
    assert!(
        r.is_err(),
        "outside -> nodeB's NodePort, no local endpoint: {r:?}"
    );
    assert!(s.lab.node(NodeId::B).drop_count("no_local_endpoint") > before);
    // Both endpoints listed: the pod gets both.
    s.lab
        .write_manifest_text(&manifest(&s.lab, &[&s.a1, &s.b1], "Local"));
    let both = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        let seen = requests(&pb.netns, false, b, NODE_PORT_TCP, 16);
        (seen.errors.is_empty() && seen.by_backend.len() == 2).then_some(seen)
    });
    assert!(
        both.is_ok(),
        "pod on nodeB -> nodeB's NodePort reaches a1 and b1 once both are listed\n{}",
        s.logs()
    );
}
