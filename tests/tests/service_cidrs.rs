//! ServiceCIDR semantics (issue 28 §2), kube-proxy's nftables mode: traffic from a pod or a
//! node process to an address inside a ServiceCIDR that no Service holds is dropped at the
//! node; traffic to an allocated ClusterIP on a port no Service port defines is refused at
//! once; without a ServiceCIDR nothing changes. Real `lbproxy run --manifests`, real
//! sockets, both pod-network shapes and both families.
//!
//! The lab's uplink leads nowhere, so each test makes the unallocated address
//! ([`UNALLOCATED`]) real beyond it: the uplink namespace holds it (on `lo`) and listens on
//! it, TCP and UDP, counting what arrives; for IPv6 the uplink gets addresses and the node a
//! route to the VIP range through it. What leaves by the uplink is what that listener sees.
//!
//! 1. [`unallocated_address_dropped_at_the_node`]: with the ServiceCIDR, a pod's TCP connect
//!    and UDP datagrams to the unallocated address never reach the uplink's listener
//!    (without the feature they do, and the connect succeeds), `service_cidr_unallocated`
//!    counts them in `inspect drops` and in the metric; a node process's connect fails at
//!    once with EPERM (without the feature it reaches the listener).
//! 2. [`undefined_port_refused_at_once`]: a TCP connect to `web`'s ClusterIP on a port it
//!    does not define gets ECONNREFUSED (a RST) within 0.5 s, and a connected UDP socket
//!    gets ECONNREFUSED (ICMP port unreachable) within 0.5 s, counted; a node process's
//!    connect gets ECONNREFUSED too; the defined ports still serve (without the feature the
//!    packets leave by the uplink and time out).
//! 3. [`without_a_service_cidr_nothing_changes`]: before a ServiceCIDR is written, and
//!    again after it is removed, the unallocated address is reached through the uplink and
//!    an undefined port of a ClusterIP is not refused.

mod common;

use std::io::{self, Read as _, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::cgroup::{HostClient, Mode, Requests};
use lbproxy_tests::lab::{
    Backend, Family, Inspect as _, Lab, Lbproxy, METRICS_ADDR, Pod, Proto, Shape, UPLINK_IF,
    http_get_full, ns_run, run_in_ns, wait_for,
};

both_shapes_and_families!(
    unallocated_address_dropped_at_the_node,
    undefined_port_refused_at_once,
    without_a_service_cidr_nothing_changes,
);

/// The VIP number of the address inside the ServiceCIDR that no Service holds.
const UNALLOCATED: u8 = 99;
/// A port `web` does not define, TCP and UDP.
const UNDEFINED_PORT: u16 = 81;
/// The contract: an undefined port is refused this fast.
const REFUSED_WITHIN: Duration = Duration::from_millis(500);
/// How long a probe that must not be answered waits.
const SILENT: Duration = Duration::from_millis(600);
const EPERM: i32 = 1;
const ECONNREFUSED: i32 = 111;

/// The ServiceCIDR of the lab's VIPs, in both families.
fn service_cidr_yaml() -> String {
    "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\n\
     spec:\n  cidrs: [198.19.0.0/16, 'fd00:c612:ffff::/112']\n"
        .to_string()
}

/// `web` over `backend` in `family`, with the ServiceCIDR when `with_cidr`.
fn write_manifest(lab: &Lab, family: Family, backend: &Pod, with_cidr: bool) {
    let mut text = web_objects("web", web_vip(family), ready_in(family, &[backend])).to_yaml();
    if with_cidr {
        text.push_str("---\n");
        text.push_str(&service_cidr_yaml());
    }
    lab.write_manifest_text(&text);
}

/// What arrived beyond the uplink: connections accepted and datagrams received on the
/// unallocated address (each datagram echoed, each connection answered `uplink\n`).
struct Beyond {
    tcp: Arc<AtomicUsize>,
    udp: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Beyond {
    fn counts(&self) -> (usize, usize) {
        (
            self.tcp.load(Ordering::SeqCst),
            self.udp.load(Ordering::SeqCst),
        )
    }
}

impl Drop for Beyond {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn ip(ns: &str, args: &str) {
    let argv: Vec<&str> = std::iter::once("ip").chain(args.split(' ')).collect();
    ns_run(ns, &argv).unwrap_or_else(|e| panic!("{e}"));
}

/// Makes `addr` a real host beyond the node's uplink, listening on TCP `WEB_TCP` and UDP
/// `WEB_UDP`, with a route back to the pods.
fn beyond_uplink(lab: &Lab, addr: IpAddr) -> Beyond {
    let (node, up) = (lab.node_ns(), lab.uplink_ns());
    match addr {
        IpAddr::V4(a) => {
            ip(up, &format!("addr add {a}/32 dev lo"));
            ip(up, "route add 198.18.0.0/24 via 198.18.255.1");
        }
        IpAddr::V6(a) => {
            ip(
                node,
                &format!("-6 addr add fd00:c612:fffe::1/64 dev {UPLINK_IF} nodad"),
            );
            ip(up, "-6 addr add fd00:c612:fffe::2/64 dev eth0 nodad");
            // `nodad`: an address added without it is tentative until the kernel's DAD work
            // runs, even on `lo`, and a bind to it meanwhile fails (EADDRNOTAVAIL; seen once
            // with two labs sharing the cores).
            ip(up, &format!("-6 addr add {a}/128 dev lo nodad"));
            ip(up, "-6 route add fd00:c612::/64 via fd00:c612:fffe::1");
            ip(
                node,
                "-6 route add fd00:c612:ffff::/64 via fd00:c612:fffe::2",
            );
        }
    }
    let (tcp, udp) = run_in_ns(up, || {
        let t = TcpListener::bind((addr, WEB_TCP)).expect("bind beyond the uplink (TCP)");
        let u = UdpSocket::bind((addr, WEB_UDP)).expect("bind beyond the uplink (UDP)");
        (t, u)
    });
    let mut b = Beyond {
        tcp: Arc::default(),
        udp: Arc::default(),
        stop: Arc::default(),
        threads: Vec::new(),
    };
    tcp.set_nonblocking(true).unwrap();
    udp.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let (count, stop) = (b.tcp.clone(), b.stop.clone());
    let t1 = std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            match tcp.accept() {
                Ok((mut s, _)) => {
                    count.fetch_add(1, Ordering::SeqCst);
                    let _ = s.write_all(b"uplink\n");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    let (count, stop) = (b.udp.clone(), b.stop.clone());
    let t2 = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while !stop.load(Ordering::SeqCst) {
            if let Ok((n, from)) = udp.recv_from(&mut buf) {
                count.fetch_add(1, Ordering::SeqCst);
                let _ = udp.send_to(&buf[..n], from);
            }
        }
    });
    b.threads = vec![t1, t2];
    b
}

/// From `client`: a TCP connect to `addr:tcp_port` and a connected UDP socket's datagram to
/// `addr:udp_port`, each waiting `wait` for its answer: what each got, and how long it took.
type Probe = (Result<(), io::ErrorKind>, Duration);
fn probe(client: &Pod, addr: IpAddr, ports: (u16, u16), wait: Duration) -> (Probe, Probe) {
    client.run(|| {
        let started = Instant::now();
        let tcp = TcpStream::connect_timeout(&SocketAddr::new(addr, ports.0), wait)
            .and_then(|mut s| {
                s.set_read_timeout(Some(wait))?;
                let mut b = [0u8; 16];
                s.read(&mut b).map(|_| ())
            })
            .map_err(|e| e.kind());
        let tcp = (tcp, started.elapsed());
        let started = Instant::now();
        let udp = (|| -> io::Result<()> {
            let bind: IpAddr = if addr.is_ipv6() {
                "::".parse().unwrap()
            } else {
                "0.0.0.0".parse().unwrap()
            };
            let u = UdpSocket::bind((bind, 0))?;
            u.connect((addr, ports.1))?;
            u.set_read_timeout(Some(wait))?;
            u.send(b"hello\n")?;
            u.recv(&mut [0u8; 64]).map(|_| ())
        })()
        .map_err(|e| e.kind());
        (tcp, (udp, started.elapsed()))
    })
}

/// A node process's connect (TCP, then connected UDP) to `target`: each one's errno.
fn node_connects(lab: &Lab, target: SocketAddr) -> Vec<(Option<i32>, f64, bool)> {
    [Mode::Tcp, Mode::UdpConnected]
        .iter()
        .flat_map(|m| {
            let req = Requests::new(*m, target, 1).timeout(SILENT);
            HostClient::spawn(lab.node_ns(), Some(lab.cgroup()), &req).all()
        })
        .map(|o| (o.errno, o.ms, o.ok))
        .collect()
}

/// `lbproxy_datapath_drops_total{reason}` as `/metrics` shows it now.
fn metric(lab: &Lab, reason: &str) -> f64 {
    let r = http_get_full(
        lab.node_ns(),
        METRICS_ADDR.parse().unwrap(),
        "/metrics",
        Duration::from_secs(2),
    )
    .expect("GET /metrics");
    let prefix = format!("lbproxy_datapath_drops_total{{reason=\"{reason}\"}} ");
    r.body
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A lab with `client` and `b1` (serving), `web` over `b1`, the unallocated address real
/// beyond the uplink, and lbproxy running. Dropped in field order: lbproxy first, the lab
/// (its namespaces) last.
struct Rig {
    _lb: Lbproxy,
    _srv: Backend,
    beyond: Beyond,
    client: Pod,
    b1: Pod,
    lab: Lab,
}

/// A [`Rig`], lbproxy healthy, with the ServiceCIDR if `with_cidr`.
fn setup(shape: Shape, family: Family, with_cidr: bool) -> Rig {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let srv = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    let beyond = beyond_uplink(&lab, vip_in(family, UNALLOCATED));
    write_manifest(&lab, family, &b1, with_cidr);
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    Rig {
        _lb: lb,
        _srv: srv,
        beyond,
        client,
        b1,
        lab,
    }
}

/// `web`'s defined ports answer from `b1`.
fn web_serves(client: &Pod, family: Family, ctx: &str) {
    for proto in [Proto::Tcp, Proto::Udp] {
        let port = if proto == Proto::Tcp {
            WEB_TCP
        } else {
            WEB_UDP
        };
        let t = client.tally(proto, web_vip(family), port, 3, T);
        assert!(
            t.all_ok() && t.count("b1") == 3,
            "{ctx}: web's defined port {port}: {t}"
        );
    }
}

fn unallocated_address_dropped_at_the_node(shape: Shape, family: Family) {
    let ctx = format!("[{shape}, {family}]");
    let r = setup(shape, family, true);
    let (lab, client, beyond) = (&r.lab, &r.client, &r.beyond);
    let u = vip_in(family, UNALLOCATED);
    let (d0, m0) = (
        lab.drop_count("service_cidr_unallocated"),
        metric(lab, "service_cidr_unallocated"),
    );
    const N: usize = 3;
    let mut probes = Vec::new();
    for _ in 0..N {
        probes.push(probe(client, u, (WEB_TCP, WEB_UDP), SILENT));
    }
    eprintln!(
        "{ctx} pod to the unallocated {u}: {probes:?}; beyond the uplink {:?}",
        beyond.counts()
    );
    for (tcp, udp) in &probes {
        assert!(
            tcp.0.is_err() && udp.0.is_err(),
            "{ctx} a pod reached the unallocated {u} (TCP {tcp:?}, UDP {udp:?})"
        );
    }
    assert_eq!(
        beyond.counts(),
        (0, 0),
        "{ctx} (connections, datagrams) from a pod to the unallocated {u} left by the uplink"
    );
    let d1 = lab.drop_count("service_cidr_unallocated");
    assert!(
        d1 - d0 >= 2 * N as u64,
        "{ctx} service_cidr_unallocated {d0} -> {d1}, want +{} at least",
        2 * N
    );
    wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
        (metric(lab, "service_cidr_unallocated") >= m0 + (2 * N) as f64).then_some(())
    })
    .unwrap_or_else(|_| {
        panic!(
            "{ctx} lbproxy_datapath_drops_total{{reason=\"service_cidr_unallocated\"}} did not \
             grow by {} from {m0}",
            2 * N
        )
    });

    // A node process: its connect fails at once with EPERM, as a netfilter drop in OUTPUT
    // makes it; nothing leaves by the uplink.
    let d2 = lab.drop_count("service_cidr_unallocated");
    for port in [WEB_TCP, WEB_UDP] {
        let got = node_connects(lab, SocketAddr::new(u, port));
        eprintln!("{ctx} node process to {u}:{port}: {got:?}");
        for (errno, ms, ok) in &got {
            assert!(
                !ok && *errno == Some(EPERM) && *ms < REFUSED_WITHIN.as_millis() as f64,
                "{ctx} a node process's connect to the unallocated {u}:{port}: want EPERM at \
                 once, got {got:?}"
            );
        }
    }
    assert_eq!(
        beyond.counts(),
        (0, 0),
        "{ctx} a node process's traffic left by the uplink"
    );
    assert!(
        lab.drop_count("service_cidr_unallocated") >= d2 + 4,
        "{ctx} the node processes' connects were not counted"
    );
    web_serves(client, family, &ctx);
}

fn undefined_port_refused_at_once(shape: Shape, family: Family) {
    let ctx = format!("[{shape}, {family}]");
    let r = setup(shape, family, true);
    let (lab, client) = (&r.lab, &r.client);
    let vip = web_vip(family);
    let counts = || {
        [
            "cluster_ip_port_tcp_reset",
            "cluster_ip_port_icmp_unreachable",
        ]
        .map(|r| lab.drop_count(r))
    };
    let before = counts();
    const N: usize = 3;
    for i in 0..N {
        let (tcp, udp) = probe(client, vip, (UNDEFINED_PORT, UNDEFINED_PORT), SILENT);
        eprintln!("{ctx} #{i} {vip}:{UNDEFINED_PORT}: TCP {tcp:?}, UDP {udp:?}");
        for (proto, r) in [("TCP", tcp), ("UDP", udp)] {
            assert!(
                r.0 == Err(io::ErrorKind::ConnectionRefused) && r.1 < REFUSED_WITHIN,
                "{ctx} {proto} to {vip}:{UNDEFINED_PORT}, a port web does not define: want \
                 connection refused within {REFUSED_WITHIN:?}, got {r:?}"
            );
        }
    }
    let after = counts();
    assert!(
        after[0] - before[0] >= N as u64 && after[1] - before[1] >= N as u64,
        "{ctx} counters {before:?} -> {after:?}, want +{N} each"
    );
    // A node process: ECONNREFUSED at connect.
    let got = node_connects(lab, SocketAddr::new(vip, UNDEFINED_PORT));
    eprintln!("{ctx} node process to {vip}:{UNDEFINED_PORT}: {got:?}");
    for (errno, ms, ok) in &got {
        assert!(
            !ok && *errno == Some(ECONNREFUSED) && *ms < REFUSED_WITHIN.as_millis() as f64,
            "{ctx} a node process's connect to {vip}:{UNDEFINED_PORT}: want ECONNREFUSED at \
             once, got {got:?}"
        );
    }
    web_serves(client, family, &ctx);
}

/// Without a ServiceCIDR: the unallocated address is reached through the uplink, and an
/// undefined port of a ClusterIP is not refused (it leaves by the uplink, where nothing
/// answers it).
fn nothing_changed(lab: &Lab, client: &Pod, beyond: &Beyond, family: Family, ctx: &str) {
    let u = vip_in(family, UNALLOCATED);
    let before = beyond.counts();
    let (tcp, udp) = probe(client, u, (WEB_TCP, WEB_UDP), Duration::from_secs(2));
    assert!(
        tcp.0.is_ok() && udp.0.is_ok(),
        "{ctx} without a ServiceCIDR the pod must reach {u} beyond the uplink: TCP {tcp:?}, \
         UDP {udp:?}"
    );
    let after = beyond.counts();
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "{ctx} beyond the uplink {before:?} -> {after:?}"
    );
    let got = node_connects(lab, SocketAddr::new(u, WEB_TCP));
    assert!(
        got.iter().all(|(errno, _, _)| *errno != Some(EPERM)),
        "{ctx} without a ServiceCIDR a node process's connect to {u} is not refused: {got:?}"
    );
    let vip = web_vip(family);
    let (tcp, udp) = probe(client, vip, (UNDEFINED_PORT, UNDEFINED_PORT), SILENT);
    assert!(
        tcp.0 != Err(io::ErrorKind::ConnectionRefused)
            && udp.0 != Err(io::ErrorKind::ConnectionRefused),
        "{ctx} without a ServiceCIDR {vip}:{UNDEFINED_PORT} must not be refused: TCP {tcp:?}, \
         UDP {udp:?}"
    );
    web_serves(client, family, ctx);
}

fn without_a_service_cidr_nothing_changes(shape: Shape, family: Family) {
    let ctx = format!("[{shape}, {family}]");
    let r = setup(shape, family, false);
    let (lab, client, beyond) = (&r.lab, &r.client, &r.beyond);
    let drops = || {
        [
            "service_cidr_unallocated",
            "cluster_ip_port_tcp_reset",
            "cluster_ip_port_icmp_unreachable",
        ]
        .map(|r| lab.drop_count(r))
    };
    nothing_changed(lab, client, beyond, family, &format!("{ctx} before"));
    assert_eq!(drops(), [0, 0, 0], "{ctx} counted without a ServiceCIDR");

    // With the ServiceCIDR the address is dropped; removed again, nothing is.
    write_manifest(lab, family, &r.b1, true);
    let u = vip_in(family, UNALLOCATED);
    wait_for(APPLY_WITHIN, Duration::from_millis(50), || {
        probe(client, u, (WEB_TCP, WEB_UDP), Duration::from_millis(200))
            .0
            .0
            .is_err()
            .then_some(())
    })
    .unwrap_or_else(|_| panic!("{ctx} the ServiceCIDR written was not applied"));
    write_manifest(lab, family, &r.b1, false);
    wait_for(APPLY_WITHIN, Duration::from_millis(50), || {
        probe(client, u, (WEB_TCP, WEB_UDP), Duration::from_millis(200))
            .0
            .0
            .is_ok()
            .then_some(())
    })
    .unwrap_or_else(|_| panic!("{ctx} the ServiceCIDR removed still applies"));
    let counted = drops();
    nothing_changed(lab, client, beyond, family, &format!("{ctx} after"));
    assert_eq!(
        drops(),
        counted,
        "{ctx} counted after the ServiceCIDR was removed"
    );
}
