//! North-south traffic on two nodes (issue 11, see north_south.rs): SNAT of traffic to a
//! backend on the other node: its port space, reuse, inspection, restarts, SIGKILL under
//! load, and the address it uses.

mod north_south_common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::multinode::{MultiNodeLab, NodeId};
use lbproxy_tests::lab::{tcp_request, wait_for};

use lbproxy_tests::lab::multinode::{
    WEB_BACKEND_TCP as BACKEND_TCP, WEB_BACKEND_UDP as BACKEND_UDP, WEB_CLUSTER_IP as CLUSTER_IP,
    WEB_EXTERNAL_IP as EXTERNAL_IP, WEB_LB_IP as LB_IP, WEB_NODE_PORT_TCP as NODE_PORT_TCP,
    WEB_NODE_PORT_UDP as NODE_PORT_UDP,
};

use north_south_common::*;

/// 400 concurrent connections from one client through nodeA's NodePort to the one backend
/// on nodeB: each gets its own SNAT port (the backend sees 400 distinct source ports of
/// nodeA's address), all at once.
#[test]
fn four_hundred_concurrent_connections_get_their_own_snat_ports() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let node_ip = s.lab.node(NodeId::A).ip;
    let mut conns = Vec::new();
    for i in 0..400 {
        let c = client
            .connect(node_ip, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}\n{}", s.logs()));
        conns.push(c);
    }
    let mut ports = std::collections::BTreeSet::new();
    for (i, c) in conns.iter_mut().enumerate() {
        let r = c
            .request()
            .unwrap_or_else(|e| panic!("request on connection #{i}: {e}\n{}", s.logs()));
        assert_eq!(r.backend, "b1");
        let (ip, port) = r.client_seen.rsplit_once(':').unwrap();
        assert_eq!(ip, node_ip.to_string(), "SNAT to nodeA's address");
        let port: u16 = port.parse().unwrap();
        assert!(
            (1024..=29_999).contains(&port),
            "SNAT port {port} outside the default range"
        );
        ports.insert(port);
    }
    assert_eq!(ports.len(), 400, "each connection its own SNAT port");
    // Every allocation is in the tries histogram, and in the default range of 28,976 ports
    // the client's own port (in the range) or the first random one is nearly always free.
    let count = metric_until(&s.lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
        v >= 400.0
    });
    let first = metric_until(
        &s.lab,
        NodeId::A,
        "lbproxy_snat_port_tries_bucket{le=\"2.0\"}",
        |v| v >= 390.0,
    );
    assert!(
        count.is_some_and(|c| c >= 400.0) && first.is_some_and(|f| f >= 390.0),
        "lbproxy_snat_port_tries: count {count:?} (want >= 400), within 2 tries {first:?} \
         (want >= 390)"
    );
}

/// A SNAT range of 4 ports: 4 connections to the remote backend hold them all, a 5th is
/// dropped and counted (`snat_no_port`), while a connection to the backend on the node
/// itself (no SNAT) still works.
#[test]
fn a_full_snat_range_drops_and_counts_while_local_backends_work() {
    let lab = MultiNodeLab::new();
    let a1 = lab.add_pod(NodeId::A, "a1");
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _servers = [
        a1.serve(&[BACKEND_TCP, BACKEND_UDP]),
        b1.serve(&[BACKEND_TCP, BACKEND_UDP]),
    ];
    // Two services: "web" only on b1 (remote from nodeA), "local" only on a1.
    let remote = manifest(&lab, &[&b1], "Cluster");
    let local = manifest(&lab, &[&a1], "Cluster")
        .replace("name: web,", "name: local,")
        .replace("service-name: web", "service-name: local")
        .replace("name: web-1", "name: local-1")
        .replace(&CLUSTER_IP.to_string(), "198.19.0.11")
        .replace(&EXTERNAL_IP.to_string(), "198.19.0.51")
        .replace(&LB_IP.to_string(), "198.19.0.61")
        .replace("nodePort: 30080", "nodePort: 30081")
        .replace("nodePort: 30053", "nodePort: 30054");
    lab.write_manifest_text(&format!("{remote}---\n{local}"));
    let lbs = lab.start_lbproxy_on_both(&["--snat-port-range", "20000-20003"], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let node_ip = lab.node(NodeId::A).ip;
    let mut held = Vec::new();
    for i in 0..4 {
        let mut c = client
            .connect(node_ip, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}\n{}", lbs[0].log()));
        let r = c.request().unwrap();
        assert_eq!(r.backend, "b1");
        held.push(c);
    }
    let drops = || lab.node(NodeId::A).drop_count("snat_no_port");
    let before = drops();
    let fifth = client.connect(node_ip, NODE_PORT_TCP, Duration::from_millis(1500));
    assert!(
        fifth.is_err(),
        "a 5th connection found no SNAT port and must not connect"
    );
    assert!(drops() > before, "snat_no_port counted");
    // The tries histogram: the 4 allocations that got a port, each within the 17 tries
    // there are (the client's ports are not in 20000-20003, so each starts at random and
    // the last ones need more tries); the failed ones are not in it.
    let count = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
        v >= 4.0
    });
    let sum = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_sum", |v| v >= 4.0);
    let within = metric_until(
        &lab,
        NodeId::A,
        "lbproxy_snat_port_tries_bucket{le=\"17.0\"}",
        |v| v >= 4.0,
    );
    assert!(
        count == Some(4.0) && within == Some(4.0) && sum.is_some_and(|s| (4.0..=68.0).contains(&s)),
        "lbproxy_snat_port_tries: count {count:?} (want 4), le=17 {within:?} (want 4), sum \
         {sum:?} (want 4..=68)\n{}",
        lbs[0].log()
    );
    let r = tcp_request(&client.netns, node_ip, 30081, TIMEOUT)
        .unwrap_or_else(|e| panic!("the local backend still answers: {e}\n{}", lbs[0].log()));
    assert_eq!(r.0.backend, "a1");
    // Closed flows give their ports back at once, as a closed conntrack entry's tuple may
    // be reused: once the 4 connections are closed (FINs both ways), new connections get
    // their ports long before the collector would remove the closed flows (10 s).
    drop(held);
    let reused = wait_for(Duration::from_secs(3), Duration::from_millis(100), || {
        let seen = requests(&client.netns, false, node_ip, NODE_PORT_TCP, 4);
        (seen.errors.is_empty() && seen.by_backend.get("b1").is_some_and(|e| e.1 == 4))
            .then_some(seen)
    });
    assert!(
        reused.is_ok(),
        "after the 4 connections closed, 4 new ones through the 4-port range: {:?}\n{}",
        requests(&client.netns, false, node_ip, NODE_PORT_TCP, 4),
        lbs[0].log()
    );
    assert_eq!(
        r.0.client_seen.rsplit_once(':').unwrap().0,
        client.ip.to_string()
    );
}

/// A SNAT range of 10 ports, 9 of them held by one client's connections through nodeA's
/// NodePort to the one backend, on nodeB: 90% of the range towards that destination. The
/// next collection (every 10 s) on nodeA logs it once, naming the destination, its share
/// of the range, and the Service and client of its flows with their counts
/// (docs/operations.md#who-fills-the-flow-table; the Node Event needs the Kubernetes API
/// source, which `flow_top.rs` tests for the flow table's own warning).
#[test]
fn a_filling_snat_range_names_its_service_and_client() {
    let lab = MultiNodeLab::new();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _server = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest_text(&manifest(&lab, &[&b1], "Cluster"));
    let lbs = lab.start_lbproxy_on_both(&["--snat-port-range", "20000-20009"], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let node_ip = lab.node(NodeId::A).ip;
    let said = || -> Vec<String> {
        lbs[0]
            .stderr()
            .lines()
            .filter(|l| l.contains("SNAT port space"))
            .map(str::to_string)
            .collect()
    };
    let _held: Vec<_> = (0..9)
        .map(|i| {
            client
                .connect(node_ip, NODE_PORT_TCP, TIMEOUT)
                .unwrap_or_else(|e| panic!("connection #{i}: {e}\n{}", lbs[0].log()))
        })
        .collect();
    let started = Instant::now();
    let want = format!(
        "SNAT port space 90% used towards {}:{BACKEND_TCP}/TCP from {node_ip} (9 of 10 ports): \
         top services default/web 9; top clients {} 9",
        b1.ip, client.ip
    );
    while said().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "no SNAT warning within 25 s\n{}",
            lbs[0].log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "said {:?} after the connections: {:?}",
        started.elapsed(),
        said()
    );
    assert!(
        said()[0].contains("WARN") && said()[0].contains(&want),
        "the warning is not {want:?}: {:?}",
        said()
    );
    // Once per crossing: a collection later (10 s), still one line.
    std::thread::sleep(Duration::from_secs(11));
    assert_eq!(said().len(), 1, "{:?}", said());
}

/// A client that reuses its source port right after closing (as a busy client does within
/// seconds) towards a source-NATed backend gets the same SNAT port again: the new flow
/// starts in its predecessor's halves instead of searching the range and allocating both
/// again. The backend sees nodeA's address and the same port both times, and the tries
/// histogram counts the reuse as one try.
#[test]
fn a_reused_client_port_keeps_its_snat_port() {
    use std::io::{BufRead as _, BufReader, Write as _};
    use std::net::SocketAddrV4;

    use lbproxy_tests::lab::connect::PendingConnect;
    let lab = MultiNodeLab::new();
    let b1 = lab.add_pod(NodeId::B, "b1");
    let _server = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest_text(&manifest(&lab, &[&b1], "Cluster"));
    let lbs = lab.start_lbproxy_on_both(&[], HEALTHY_WITHIN);
    let client = lab.add_client("ext");
    let node_ip = lab.node(NodeId::A).ip;
    let dst = SocketAddrV4::new(node_ip, NODE_PORT_TCP);
    // Outside the default SNAT range (1024-29999), so the first flow's port is a random one
    // of the range, not the client's own.
    const PORT: u16 = 40_123;
    let seen_from = |i: u32| -> String {
        let c = client
            .run(|| PendingConnect::start(PORT, dst))
            .unwrap_or_else(|e| panic!("connection {i} from :{PORT}: {e}"));
        c.wait_until(c.started + TIMEOUT)
            .unwrap_or_else(|e| panic!("connection {i} from :{PORT}: {e}\n{}", lbs[0].log()));
        let stream = c.into_stream(TIMEOUT);
        (&stream).write_all(b"hello\n").unwrap();
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("answer {i}: {e}\n{}", lbs[0].log()));
        // Closed with a RST (SO_LINGER 0), so the port is free at once.
        lbproxy_tests::lab::connect::reset_on_close(std::os::fd::AsRawFd::as_raw_fd(&stream))
            .unwrap();
        let (backend, seen) = line.trim_end().split_once(' ').expect("answer");
        assert_eq!(backend, "b1");
        seen.to_owned()
    };
    // (allocations, allocations of one try) on nodeA, once the count reaches `least`.
    let tries = |least: f64| {
        let count = metric_until(&lab, NodeId::A, "lbproxy_snat_port_tries_count", |v| {
            v >= least
        });
        let one = metric_until(
            &lab,
            NodeId::A,
            "lbproxy_snat_port_tries_bucket{le=\"1.0\"}",
            |_| true,
        );
        (count.unwrap_or(0.0), one.unwrap_or(0.0))
    };
    let first = seen_from(1);
    let before = tries(1.0);
    let second = seen_from(2);
    assert!(
        first.starts_with(&format!("{node_ip}:")),
        "b1 must see nodeA's address: {first}"
    );
    assert_eq!(
        second,
        first,
        "the same client port again got another SNAT port\n{}",
        lbs[0].log()
    );
    let after = tries(before.0 + 1.0);
    assert!(
        after == (before.0 + 1.0, before.1 + 1.0),
        "the reuse must count as one allocation of one try: (count, le=1) {before:?} -> {after:?}"
    );
}

/// `lbproxy inspect snat` lists the destinations of source-NATed flows with their ports in
/// use out of the range, and `inspect flows` shows the source the backend sees.
#[test]
fn inspect_shows_snat_ports_per_destination() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let mut conns = Vec::new();
    for i in 0..5 {
        let mut c = client
            .connect(a, NODE_PORT_TCP, TIMEOUT)
            .unwrap_or_else(|e| panic!("connection #{i}: {e}"));
        c.request().unwrap();
        conns.push(c);
    }
    let snat = s.lab.node(NodeId::A).inspect_snat();
    let row = snat
        .iter()
        .find(|r| r.destination == format!("{}:{BACKEND_TCP}", s.b1.ip))
        .unwrap_or_else(|| panic!("b1 in inspect snat: {snat:#?}"));
    assert_eq!(row.snat_address, a.to_string(), "{row:#?}");
    assert_eq!(row.protocol, "TCP", "{row:#?}");
    assert!(row.ports_in_use >= 5, "{row:#?}");
    assert_eq!(row.range_size, 29_999 - 1024 + 1, "{row:#?}");
    let flows = s.lab.node(NodeId::A).inspect_flows();
    let client_prefix = format!("{}:", client.ip);
    let snat_prefix = format!("{a}:");
    let snated = flows
        .iter()
        .filter(|f| {
            f.client.starts_with(&client_prefix)
                && f.snat.as_ref().is_some_and(|x| x.starts_with(&snat_prefix))
        })
        .count();
    assert!(
        snated >= 5,
        "inspect flows shows the SNAT source: {flows:#?}"
    );
    drop(conns);
}

/// Restarting nodeA's lbproxy (SIGTERM, then a new run on the same pins) keeps an open
/// source-NATed connection through it working, with the same SNAT port: the flow and the
/// node's programs are adopted. New connections work too.
#[test]
fn restart_keeps_snat_flows() {
    let mut s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let mut conn = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
    let first = conn.request().unwrap();
    assert_eq!(first.backend, "b1");
    let mut old = s.lbs.remove(0);
    old.terminate(Duration::from_secs(5));
    let mut lb = s.lab.start_lbproxy(NodeId::A, &[]);
    lb.expect_healthy(HEALTHY_WITHIN);
    s.lbs.insert(0, lb);
    for i in 0..5 {
        let r = conn
            .request()
            .unwrap_or_else(|e| panic!("request {i} after the restart: {e}\n{}", s.logs()));
        assert_eq!(r.backend, "b1");
        assert_eq!(
            r.client_seen, first.client_seen,
            "the same SNAT source port"
        );
    }
    let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 8);
    assert!(seen.errors.is_empty(), "{seen:?}\n{}", s.logs());
}

/// nodeA's lbproxy killed with SIGKILL and started again at once (the same command line)
/// while an external client opens about 100 TCP connections and sends about 100 UDP
/// requests a second through nodeA's NodePorts, to a1 on nodeA and, source-NATed, to b1 on
/// nodeB: no request is lost (each must be answered from the NodePort within 1 s, which a
/// dropped SYN would not be), and a connection source-NATed to b1 before the kill keeps its
/// backend and its SNAT port through the restart.
#[test]
fn sigkill_under_node_port_load() {
    use lbproxy_tests::lab::paced::{SinceKill, failures, paced, show};
    use lbproxy_tests::lab::{tcp_request_here, udp_request_here};
    const LOAD_FOR: Duration = Duration::from_secs(8);
    const KILL_AT: Duration = Duration::from_secs(2);
    const TICK: Duration = Duration::from_millis(10);
    const T: Duration = Duration::from_secs(1);
    let mut s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    let a = s.lab.node(NodeId::A).ip;
    let (mut conn, seen_before) = loop {
        let mut c = client.connect(a, NODE_PORT_TCP, TIMEOUT).unwrap();
        let r = c.request().unwrap();
        if r.backend == "b1" {
            break (c, r.client_seen);
        }
    };
    // An answer from a1 or b1, from the NodePort the client used.
    let answered = |r: std::io::Result<(lbproxy_tests::lab::Reply, SocketAddr)>, port: u16| match r
    {
        Ok((reply, from)) if from == SocketAddr::from((a, port)) => Ok(reply.backend),
        Ok((reply, from)) => Err(format!("{} answered from {from}", reply.backend)),
        Err(e) => Err(e.to_string()),
    };
    let start = Instant::now();
    let lab = &s.lab;
    let lb = &mut s.lbs[0];
    // Killed and started again on this thread: the child dies with the thread that spawned
    // it (PR_SET_PDEATHSIG).
    let (tcp, udp, long, killed, lb2, healthy) = std::thread::scope(|sc| {
        let tcp = sc.spawn(|| {
            client.run(|| {
                paced(start, LOAD_FOR, TICK, || {
                    answered(tcp_request_here(a, NODE_PORT_TCP, T), NODE_PORT_TCP)
                })
            })
        });
        let udp = sc.spawn(|| {
            client.run(|| {
                paced(start, LOAD_FOR, TICK, || {
                    answered(udp_request_here(a, NODE_PORT_UDP, T, None), NODE_PORT_UDP)
                })
            })
        });
        let long = sc.spawn(|| {
            paced(start, LOAD_FOR, Duration::from_millis(200), || {
                conn.request()
                    .map(|r| format!("{} as {}", r.backend, r.client_seen))
                    .map_err(|e| e.to_string())
            })
        });
        std::thread::sleep((start + KILL_AT).saturating_duration_since(Instant::now()));
        lb.kill();
        let killed = start.elapsed();
        let mut lb2 = lab.start_lbproxy(NodeId::A, &[]);
        let healthy = lb2.wait_healthy(HEALTHY_WITHIN).map(|_| start.elapsed());
        (
            tcp.join().expect("TCP load"),
            udp.join().expect("UDP load"),
            long.join().expect("long-lived connection"),
            killed,
            lb2,
            healthy,
        )
    });
    let healthy_at = healthy.unwrap_or_else(|e| panic!("restart: {e}\n{}", lb2.log()));
    let backend = |b: &str| b == "a1" || b == "b1";
    let same = format!("b1 as {seen_before}");
    for (what, v, ok) in [
        (
            "new TCP connections",
            &tcp,
            &backend as &dyn Fn(&str) -> bool,
        ),
        ("UDP requests", &udp, &backend),
        (
            "the SNAT connection opened before the kill",
            &long,
            &|b: &str| b == same,
        ),
    ] {
        let failed = failures(v, ok);
        let after = v.iter().filter(|x| x.at >= healthy_at).count();
        eprintln!(
            "{what}: {} tried, {} failed, {after} after the new lbproxy was healthy ({})",
            v.len(),
            failed.len(),
            SinceKill(healthy_at, killed)
        );
        assert!(
            failed.is_empty(),
            "{what}: {} of {} failed (times relative to the SIGKILL; healthy again at {}):\n  \
             {}\n{}",
            failed.len(),
            v.len(),
            SinceKill(healthy_at, killed),
            show(&failed, killed),
            lb2.log()
        );
        assert!(after > 0, "{what}: nothing ran after the restart");
    }
    assert!(
        tcp.len() >= 400 && udp.len() >= 400,
        "the load did not run as planned: {} TCP, {} UDP (800 each scheduled)",
        tcp.len(),
        udp.len()
    );
    s.lbs[0] = lb2;
}

/// A node interface that appears while lbproxy runs gets the north-south programs, and
/// source NAT picks the address of the interface towards the backend, not one address for
/// the node: nodeA and nodeB get a second, direct link (198.18.81.0/24), and nodeA's route
/// to nodeB's pods moves onto it, so b1 sees nodeA's address on that link; once the link is
/// gone and the route is back on the fabric, b1 sees nodeA's fabric address again.
#[test]
fn snat_uses_the_address_of_the_interface_towards_the_backend() {
    let s = Setup::new("Cluster");
    let client = s.lab.add_client("ext");
    only_b1(&s, &client.netns);
    let a = s.lab.node(NodeId::A).ip;
    let (a2, b2) = ("198.18.81.1", "198.18.81.2");
    let b_ns = s.lab.node_ns(NodeId::B).to_owned();
    let pods_b = NodeId::B.pod_cidr();
    let sees = |want: &str| {
        let seen = requests(&client.netns, false, a, NODE_PORT_TCP, 4);
        (seen.errors.is_empty()
            && seen.by_backend.get("b1").map(|e| e.0.clone()) == Some(vec![want.to_string()]))
        .then_some(())
        .ok_or(seen)
    };
    sees(&a.to_string()).unwrap_or_else(|e| panic!("over the fabric: {e:?}\n{}", s.logs()));
    for argv in [
        vec![
            "ip", "link", "add", "eth1", "type", "veth", "peer", "name", "eth1", "netns", &b_ns,
        ],
        vec!["ip", "addr", "add", &format!("{a2}/24"), "dev", "eth1"],
        vec!["ip", "link", "set", "eth1", "up"],
    ] {
        s.lab.node_run(NodeId::A, &argv).unwrap();
    }
    for argv in [
        vec!["ip", "addr", "add", &format!("{b2}/24"), "dev", "eth1"],
        vec!["ip", "link", "set", "eth1", "up"],
    ] {
        s.lab.node_run(NodeId::B, &argv).unwrap();
    }
    for (node, ns) in [
        (NodeId::A, s.lab.node_ns(NodeId::A)),
        (NodeId::B, b_ns.as_str()),
    ] {
        for key in [
            "net/ipv4/conf/eth1/rp_filter",
            "net/ipv4/conf/eth1/send_redirects",
        ] {
            lbproxy_tests::lab::run_in_ns(ns, || std::fs::write(format!("/proc/sys/{key}"), "0"))
                .unwrap_or_else(|e| panic!("{node}: {key}: {e}"));
        }
    }
    s.lab
        .node_run(
            NodeId::A,
            &["ip", "route", "replace", &pods_b, "via", b2, "dev", "eth1"],
        )
        .unwrap();
    let moved = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        sees(a2).ok()
    });
    assert!(
        moved.is_ok(),
        "over the new link b1 sees nodeA's address on it ({a2}): {:?}\n{}",
        sees(a2),
        s.logs()
    );
    let on_eth1: Vec<String> = lbproxy_tests::lab::bpf::tcx_attachments(s.lab.node_ns(NodeId::A))
        .into_iter()
        .filter(|t| t.ifname == "eth1")
        .map(|t| t.prog_name)
        .collect();
    assert!(
        on_eth1.contains(&"lb_from_node".to_string())
            && on_eth1.contains(&"lb_to_node".to_string()),
        "the new node interface has the north-south programs: {on_eth1:?}"
    );
    s.lab
        .node_run(NodeId::A, &["ip", "link", "del", "eth1"])
        .unwrap();
    s.lab
        .node_run(
            NodeId::A,
            &[
                "ip",
                "route",
                "replace",
                &pods_b,
                "via",
                &NodeId::B.fabric_ip().to_string(),
                "dev",
                "eth0",
            ],
        )
        .unwrap();
    let back = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        sees(&a.to_string()).ok()
    });
    assert!(
        back.is_ok(),
        "back over the fabric: {:?}\n{}",
        sees(&a.to_string()),
        s.logs()
    );
}
