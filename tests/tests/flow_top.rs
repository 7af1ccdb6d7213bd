//! Who fills the flow table: `lbproxy inspect flows --top services|clients` counts the real
//! flows of both families by Service and by client with exact counts, and when the flow
//! table passes 80% of its capacity the controller says which Services and clients fill it,
//! in its log and in a Warning Event on its Node, once per crossing. The Kubernetes API
//! source (the test API server, for the Events), routed pods.

mod common;
mod kube_common;

use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::lab::inspect::rows::{FlowRow, TopClient, TopService};
use lbproxy_tests::lab::{Endpoint, Lab, Pod, Shape, vip};
use socket2::{Domain, Socket, Type};

/// `api`'s clusterIP.
fn api_vip() -> IpAddr {
    vip(11).into()
}

/// Services `web` (IPv4) and `api` (IPv4) on backend `backend`, and with `v6`, `web6` on
/// [`VIP6`] over its IPv6 address: two (or three) Services sharing one backend pod.
fn apply_services(k: &Kube, backend: &Pod, v6: bool) {
    let (web, web_slice) = web_json("web", WEB_VIP, eps(&[backend]));
    let (api, api_slice) = web_json("api", vip(11), eps(&[backend]));
    k.api.apply_all([web, web_slice, api, api_slice]);
    let mut want = 4;
    if v6 {
        let ep = Endpoint::ready(backend.ip6.expect("an IPv6 address")).pod(&backend.name);
        let m = web_objects("web6", VIP6, vec![ep]);
        k.api
            .apply_all([m.objects[0].to_json(), m.objects[1].to_json()]);
        want = 6;
    }
    k.wait_until("the services programmed", Duration::from_secs(10), |f| {
        with_backends(f.clone()).len() == want
    });
}

/// A listener on `pod`'s `[::]:8080` (both families) with room for `backlog` connections
/// it never accepts: the kernel completes their handshakes alone, so thousands of
/// connections cost no thread.
fn sink(pod: &Pod, backlog: i32) -> Socket {
    pod.run(|| {
        let s = Socket::new(Domain::IPV6, Type::STREAM, None).expect("socket");
        s.set_only_v6(false).expect("IPV6_V6ONLY off");
        s.set_reuse_address(true).expect("SO_REUSEADDR");
        let any = SocketAddr::from((Ipv6Addr::UNSPECIFIED, BACKEND_TCP));
        s.bind(&any.into()).expect("bind [::]:8080");
        s.listen(backlog).expect("listen");
        s
    })
}

/// `n` TCP connections from `pod` to `vip`:80, held open (established flows are not
/// collected).
fn open(pod: &Pod, vip: IpAddr, n: usize) -> Vec<TcpStream> {
    pod.run(|| {
        (0..n)
            .map(|i| {
                TcpStream::connect_timeout(&SocketAddr::new(vip, WEB_TCP), Duration::from_secs(3))
                    .unwrap_or_else(|e| panic!("{}: connection {i} to {vip}: {e}", pod.name))
            })
            .collect()
    })
}

/// `lbproxy inspect flows ARGS --bpffs-dir DIR`'s standard output; panics on failure.
fn inspect_flows(lab: &Lab, args: &[&str]) -> String {
    let dir = lab.bpffs_dir().display().to_string();
    let mut argv = vec!["inspect", "flows"];
    argv.extend(args);
    argv.extend(["--bpffs-dir", &dir]);
    let out = lab.lbproxy_cmd(&argv);
    assert!(
        out.status.success(),
        "lbproxy {argv:?}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Rows as `(name, flows, [(name, flows)])`.
type Ranked = Vec<(String, u64, Vec<(String, u64)>)>;

/// A service row as `(service, flows, [(client, flows)])`.
fn services(rows: &[TopService]) -> Ranked {
    rows.iter()
        .map(|s| {
            let cs = s
                .clients
                .iter()
                .map(|c| (c.client.clone(), c.flows))
                .collect();
            (s.service.clone(), s.flows, cs)
        })
        .collect()
}

/// A client row as `(client, flows, [(service, flows)])`.
fn clients(rows: &[TopClient]) -> Ranked {
    rows.iter()
        .map(|c| {
            let ss = c
                .services
                .iter()
                .map(|s| (s.service.clone(), s.flows))
                .collect();
            (c.client.clone(), c.flows, ss)
        })
        .collect()
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

/// Two IPv4 Services and an IPv6 one share backend `b1`; clients `c1` and `c2` hold
/// different numbers of connections to each. `--top services --json` ranks the Services by
/// their flows, exactly, each flow once over both families, `default/api` before
/// `default/web` at 5 each (ties by name), each with its clients; `--top clients` ranks the
/// client addresses; `--limit` cuts both; `--service` filters; the table says the total; the
/// plain listing is unchanged (12 rows); `--top` with another view is refused.
#[test]
fn top_services_and_clients_count_every_flow_once() {
    let mut k = Kube::new(Shape::Routed, &["c1", "c2"]);
    let b1 = k.lab.add_pod("b1");
    let _sink = sink(&b1, 64);
    k.start_healthy();
    apply_services(&k, &b1, true);
    let (c1, c2) = (k.pod("c1").clone(), k.pod("c2").clone());
    let c1v6 = c1.ip6.unwrap().to_string();
    let _held = [
        open(&c1, WEB_VIP.into(), 3),
        open(&c2, WEB_VIP.into(), 2),
        open(&c1, api_vip(), 1),
        open(&c2, api_vip(), 4),
        open(&c1, VIP6.into(), 2),
    ];
    let lab = &k.lab;

    let top: Vec<TopService> =
        serde_json::from_str(&inspect_flows(lab, &["--top", "services", "--json"])).unwrap();
    assert_eq!(
        services(&top),
        vec![
            (s("default/api"), 5, vec![(s(c2.ip), 4), (s(c1.ip), 1)]),
            (s("default/web"), 5, vec![(s(c1.ip), 3), (s(c2.ip), 2)]),
            (s("default/web6"), 2, vec![(c1v6.clone(), 2)]),
        ],
        "{}",
        k.diag()
    );
    let top: Vec<TopClient> =
        serde_json::from_str(&inspect_flows(lab, &["--top", "clients", "-o", "json"])).unwrap();
    assert_eq!(
        clients(&top),
        vec![
            (
                s(c2.ip),
                6,
                vec![(s("default/api"), 4), (s("default/web"), 2)]
            ),
            (
                s(c1.ip),
                4,
                vec![(s("default/web"), 3), (s("default/api"), 1)]
            ),
            (c1v6.clone(), 2, vec![(s("default/web6"), 2)]),
        ]
    );
    let top: Vec<TopService> = serde_json::from_str(&inspect_flows(
        lab,
        &["--top", "services", "--limit", "1", "--json"],
    ))
    .unwrap();
    assert_eq!(
        services(&top),
        vec![(s("default/api"), 5, vec![(s(c2.ip), 4)])]
    );
    let top: Vec<TopClient> = serde_json::from_str(&inspect_flows(
        lab,
        &["--top", "clients", "--service", "default/web", "--json"],
    ))
    .unwrap();
    assert_eq!(
        clients(&top),
        vec![
            (s(c1.ip), 3, vec![(s("default/web"), 3)]),
            (s(c2.ip), 2, vec![(s("default/web"), 2)]),
        ]
    );

    let table = inspect_flows(lab, &["--top", "services", "--limit", "2"]);
    eprintln!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("SERVICE") && lines[0].contains("TOP CLIENTS"));
    assert!(
        lines[1].starts_with("default/api") && lines[1].contains(&format!("{} 4", c2.ip)),
        "{table}"
    );
    assert!(lines[2].starts_with("default/web "), "{table}");
    assert_eq!(
        lines.last().copied(),
        Some("12 flows in all; 1 more services with 2 flows not shown (--limit)"),
        "{table}"
    );

    // The plain listing is what it was: one row per flow.
    let rows: Vec<FlowRow> = serde_json::from_str(&inspect_flows(lab, &["--json"])).unwrap();
    assert_eq!(rows.len(), 12, "{rows:#?}");
    let dir = lab.bpffs_dir().display().to_string();
    let out = lab.lbproxy_cmd(&[
        "inspect",
        "services",
        "--top",
        "services",
        "--bpffs-dir",
        &dir,
    ]);
    assert!(!out.status.success(), "--top with `inspect services`");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--top counts flows"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A flow table of 4096 entries; c1 holds 1,200 connections to `web` and c2 500 to `api`:
/// 3,400 entries, 83%. The next collection (every 10 s) logs, and posts as a Warning Event
/// `FlowTableFilling` on the Node, the fill and the top Services and clients with their
/// exact flows; the collection after says nothing more (once per crossing). Nothing is
/// said while the table is near empty.
#[test]
fn a_filling_flow_table_names_its_top_services_and_clients() {
    let mut k = Kube::new(Shape::Routed, &["c1", "c2"]);
    let b1 = k.lab.add_pod("b1");
    let _sink = sink(&b1, 4096);
    k.start_with(&["--flow-map-size", "4096"]);
    k.expect_healthy(HEALTHY_WITHIN);
    apply_services(&k, &b1, false);
    let (c1, c2) = (k.pod("c1").clone(), k.pod("c2").clone());
    let reported = |k: &mut Kube| {
        let log: Vec<String> = k
            .lb()
            .stderr()
            .lines()
            .filter(|l| l.contains("flow table") && l.contains("% full"))
            .map(str::to_string)
            .collect();
        let events: Vec<String> = k
            .api
            .events_posted()
            .iter()
            .filter(|e| e.method == "POST" && e.body["reason"] == "FlowTableFilling")
            .map(|e| {
                assert_eq!(e.regarding()["kind"], "Node", "{}", e.body);
                assert_eq!(e.regarding()["name"], NODE, "{}", e.body);
                assert_eq!(e.body["type"], "Warning", "{}", e.body);
                e.note().unwrap_or_default().to_string()
            })
            .collect();
        (log, events)
    };
    // The first collection ran at start, over an empty table.
    assert_eq!(reported(&mut k), (vec![], vec![]));

    let started = Instant::now();
    let _held = [open(&c1, WEB_VIP.into(), 1200), open(&c2, api_vip(), 500)];
    eprintln!("1,700 connections open in {:?}", started.elapsed());
    let want = format!(
        "IPv4 flow table 83% full (3,400 of 4,096 entries, 1,700 flows; the collector then \
         removed 0 expired): top services default/web 1,200, default/api 500; top clients {} \
         1,200, {} 500",
        c1.ip, c2.ip
    );
    let deadline = Instant::now() + Duration::from_secs(25);
    let (log, events) = loop {
        let (log, events) = reported(&mut k);
        if !log.is_empty() && !events.is_empty() {
            break (log, events);
        }
        assert!(
            Instant::now() < deadline,
            "no report of the flow table within 25 s (log {log:?}, events {events:?})\n{}",
            k.diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "reported {:?} after the connections: {}",
        started.elapsed(),
        log[0]
    );
    assert!(
        log[0].contains("WARN") && log[0].contains(&want),
        "the log line is not {want:?}: {log:?}"
    );
    assert_eq!(events, vec![want.clone()], "the Node Event's note");
    // `inspect flows --top` agrees.
    let top: Vec<TopService> =
        serde_json::from_str(&inspect_flows(&k.lab, &["--top", "services", "--json"])).unwrap();
    assert_eq!(
        services(&top),
        vec![
            (s("default/web"), 1200, vec![(s(c1.ip), 1200)]),
            (s("default/api"), 500, vec![(s(c2.ip), 500)]),
        ]
    );

    // Once per crossing: the next collection (still 83% full) says nothing new.
    let ticks = |k: &mut Kube| {
        k.lb()
            .stderr()
            .lines()
            .filter(|l| l.contains("flow gc") && l.contains("under_pressure=true"))
            .count()
    };
    let before = ticks(&mut k);
    let deadline = Instant::now() + Duration::from_secs(15);
    while ticks(&mut k) == before {
        assert!(
            Instant::now() < deadline,
            "no collection within 15 s\n{}",
            k.diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(500));
    let (log, events) = reported(&mut k);
    assert_eq!((log.len(), events.len()), (1, 1), "{log:?} {events:?}");
}
