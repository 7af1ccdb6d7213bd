//! IPv4 and IPv6 fragments through a service, with real sockets: a UDP request larger than
//! the MTU reaches a backend, and the backend's answer, larger than the MTU too, reaches the
//! client from the VIP (Kubernetes' e2e "should be able to handle large requests: udp", and
//! DNS over EDNS0). Every veth has a 1500-byte MTU, so both kernels really fragment: each
//! datagram crosses the datapath as fragments of which only the first carries the ports
//! (`LB_FRAGS_V1`, `LB_FRAGS6_V1`). Each test runs once per IP family, over a single-stack
//! Service of that family.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{Family, Inspect as _, Lab, Pod, Shape, ns_run, run_in_ns};

lbproxy_tests::both_families!(
    large_udp_routed,
    large_udp_bridge,
    large_udp_routed_stack_bypass
);

const MTU: &str = "1500";
/// The request: two fragments at a 1500-byte MTU.
const REQUEST_LEN: usize = 2000;
/// The answer: three fragments.
const ANSWER_LEN: usize = 3000;
/// Large exchanges made one after another, each a new flow's fragments.
const EXCHANGES: usize = 3;

/// The request's bytes: a pattern no two offsets of 251 bytes share.
fn request() -> Vec<u8> {
    (0..REQUEST_LEN).map(|i| (i % 251) as u8).collect()
}

/// What the backend answers to `req`: its length and the backend's name, then a pattern
/// derived from the request, so the client can tell the answer is to its own request and
/// whole.
fn answer_to(req: &[u8], backend: &str) -> Vec<u8> {
    let mut a = format!("{} {backend} ", req.len()).into_bytes();
    let mut i = 0;
    while a.len() < ANSWER_LEN {
        a.push(req[i % req.len()] ^ 0x5a);
        i += 7;
    }
    a
}

/// Sets `IP_MTU_DISCOVER` to `IP_PMTUDISC_DONT` (IPv6: `IPV6_MTU_DISCOVER` to
/// `IPV6_PMTUDISC_DONT`): datagrams larger than the MTU are fragmented by this host,
/// whatever the system's path-MTU default.
fn fragment_locally(sock: &UdpSocket, family: Family) {
    let (level, opt, v) = match family {
        Family::V4 => (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DONT,
        ),
        Family::V6 => (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DONT,
        ),
    };
    // SAFETY: a valid socket and an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            (&raw const v).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(
        rc,
        0,
        "[{family}] IP_MTU_DISCOVER: {}",
        std::io::Error::last_os_error()
    );
}

/// The IP counters of `family` of the calling thread's network namespace, by name without
/// prefix: `/proc/net/snmp`'s `Ip:` lines, or `/proc/net/snmp6`'s `Ip6...` ones.
fn ip_counters(family: Family) -> std::collections::BTreeMap<String, u64> {
    if family == Family::V6 {
        let text = std::fs::read_to_string("/proc/thread-self/net/snmp6").expect("read snmp6");
        return text
            .lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(char::is_whitespace)?;
                let name = name.strip_prefix("Ip6")?;
                Some((name.to_string(), value.trim().parse().unwrap_or(0)))
            })
            .collect();
    }
    let text = std::fs::read_to_string("/proc/thread-self/net/snmp").expect("read snmp");
    let mut ip = text.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (
        ip.next().expect("Ip: names"),
        ip.next().expect("Ip: values"),
    );
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .skip(1)
        .map(|(n, v)| (n.to_string(), v.parse().unwrap_or(0)))
        .collect()
}

fn counter(ns: &str, family: Family, name: &str) -> u64 {
    run_in_ns(ns, || ip_counters(family))[name]
}

/// The unspecified address of `family`.
fn any(family: Family) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::UNSPECIFIED.into(),
        Family::V6 => Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// A UDP server on `pod`:[`BACKEND_UDP`] answering a [`REQUEST_LEN`]-byte datagram with
/// [`answer_to`] and echoing any other; it records the length and source of each request and whether its bytes were [`request`].
struct LargeUdpServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(usize, SocketAddr, bool)>>>,
}

impl LargeUdpServer {
    fn start(pod: &Pod, family: Family) -> LargeUdpServer {
        let sock =
            pod.run(|| UdpSocket::bind((any(family), BACKEND_UDP)).expect("bind the UDP server"));
        fragment_locally(&sock, family);
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("read timeout");
        let stop = Arc::new(AtomicBool::new(false));
        let (name, st) = (pod.name.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut buf = vec![0u8; 65536];
            while !st.load(Ordering::SeqCst) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                seen.push((n, from, buf[..n] == request()[..]));
                let answer = if n == REQUEST_LEN {
                    answer_to(&buf[..n], &name)
                } else {
                    buf[..n].to_vec()
                };
                let _ = sock.send_to(&answer, from);
            }
            seen
        });
        LargeUdpServer {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the server and returns what it received.
    fn stop(mut self) -> Vec<(usize, SocketAddr, bool)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().expect("server thread")
    }
}

impl Drop for LargeUdpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Pins the MTU of `pod`'s interfaces, both sides, to [`MTU`].
fn set_mtu(lab: &Lab, pod: &Pod) {
    ns_run(
        &pod.netns,
        &["ip", "link", "set", "dev", "eth0", "mtu", MTU],
    )
    .unwrap_or_else(|e| panic!("MTU of {}'s eth0: {e}", pod.name));
    lab.node_run(&["ip", "link", "set", "dev", &pod.host_if, "mtu", MTU])
        .unwrap_or_else(|e| panic!("MTU of {}: {e}", pod.host_if));
}

/// Sends `payload` from `client` to `vip`:[`WEB_UDP`] (up to 3 tries) and returns the
/// answer and where it came from.
fn exchange(client: &Pod, vip: IpAddr, payload: &[u8]) -> Result<(Vec<u8>, SocketAddr), String> {
    let family = if vip.is_ipv6() {
        Family::V6
    } else {
        Family::V4
    };
    client.run(|| {
        let sock = UdpSocket::bind((any(family), 0)).expect("bind the client");
        fragment_locally(&sock, family);
        sock.set_read_timeout(Some(Duration::from_secs(1)))
            .expect("read timeout");
        let mut buf = vec![0u8; 65536];
        let mut last = String::new();
        for _ in 0..3 {
            sock.send_to(payload, (vip, WEB_UDP))
                .map_err(|e| format!("send: {e}"))?;
            match sock.recv_from(&mut buf) {
                Ok((n, from)) => return Ok((buf[..n].to_vec(), from)),
                Err(e) => last = format!("no answer within 1 s: {e}"),
            }
        }
        Err(last)
    })
}

/// A 2000-byte request to the VIP reaches the backend (from the client's own address, bytes
/// intact) and its 3000-byte answer reaches the client from VIP:53, bytes intact, each of
/// [`EXCHANGES`] times; both datagrams were fragmented on the way (the namespaces'
/// `FragCreates` counters moved), and no fragment went untranslated
/// (`fragment_without_first` did not count).
fn large_udp_round_trip(shape: Shape, family: Family, args: &[&str]) {
    let what = format!("[{shape}, {family}, lbproxy run {}]", args.join(" "));
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let backend = lab.add_pod("b1");
    for pod in [&client, &backend] {
        set_mtu(&lab, pod);
    }
    let server = LargeUdpServer::start(&backend, family);
    let vip = web_vip(family);
    lab.write_manifest(&web_objects("web", vip, ready_in(family, &[&backend])));
    let mut lb = lab.start_lbproxy_with(args);
    lb.expect_healthy(HEALTHY_WITHIN);
    let to = SocketAddr::new(vip, WEB_UDP);

    // A small request first, so the neighbours are known and, with the bypass, the large
    // one is redirected (the first packets to a cold neighbour take the stack).
    let small = exchange(&client, vip, b"warm-up");
    assert!(
        matches!(&small, Ok((a, from)) if a == b"warm-up" && *from == to),
        "{what}: a small UDP request to the VIP: want the echo from {to}, got {small:?}"
    );
    let delivered = |path: &str| {
        let v = lab.inspect_delivery();
        v.packets.get(path).copied().unwrap_or(0)
    };
    let (to_backend, to_client) = (
        delivered("redirect_to_backend"),
        delivered("redirect_to_client"),
    );
    let frags_before = (
        counter(&client.netns, family, "FragCreates"),
        counter(&backend.netns, family, "FragCreates"),
    );
    let untranslated_before = lab.drop_count("fragment_without_first");

    let got: Vec<_> = (0..EXCHANGES)
        .map(|_| exchange(&client, vip, &request()))
        .collect();
    let received = server.stop();
    let drops = lab.inspect_json("drops");
    let diag = || format!("drops: {drops}\n{}\n{}", lab.diagnostics(), lb.log());
    for (i, got) in got.into_iter().enumerate() {
        let (answer, from) = got.unwrap_or_else(|e| {
            panic!(
                "{what}: {REQUEST_LEN}-byte UDP request #{i} to {to}: {e}; the backend \
                 received {received:?}\n{}",
                diag()
            )
        });
        assert_eq!(
            from,
            to,
            "{what}: the answer to #{i} must come from the VIP:port\n{}",
            diag()
        );
        assert!(
            answer == answer_to(&request(), &backend.name),
            "{what}: the answer to #{i} is not the backend's {ANSWER_LEN}-byte answer to the \
             whole request: {} bytes, starting {:?}",
            answer.len(),
            String::from_utf8_lossy(&answer[..answer.len().min(40)])
        );
    }
    let client_addr = pod_addr(&client, family);
    let large: Vec<_> = received
        .iter()
        .filter(|(n, _, _)| *n == REQUEST_LEN)
        .collect();
    assert!(
        !large.is_empty()
            && large
                .iter()
                .all(|(_, src, intact)| *intact && src.ip() == client_addr),
        "{what}: the backend should receive the {REQUEST_LEN}-byte request intact, from \
         {client_addr}: received (length, source, intact) {received:?}"
    );
    let frags_after = (
        counter(&client.netns, family, "FragCreates"),
        counter(&backend.netns, family, "FragCreates"),
    );
    assert!(
        frags_after.0 >= frags_before.0 + 2 && frags_after.1 >= frags_before.1 + 3,
        "{what}: the request and the answer should have left in fragments (FragCreates of \
         client, backend: {frags_before:?} -> {frags_after:?})"
    );
    let untranslated = lab.drop_count("fragment_without_first") - untranslated_before;
    assert_eq!(
        untranslated,
        0,
        "{what}: fragment_without_first counted {untranslated}: a fragment went untranslated\n{}",
        diag()
    );
    if args.contains(&"--stack-bypass") {
        // Every fragment redirected, both ways: 2 for the request, 3 for the answer.
        let (b, c) = (
            delivered("redirect_to_backend") - to_backend,
            delivered("redirect_to_client") - to_client,
        );
        assert!(
            b >= 2 && c >= 3,
            "{what}: with the bypass, every fragment should be redirected: {b} to the \
             backend (want 2), {c} to the client (want 3)\n{}",
            diag()
        );
    }
}

fn large_udp_routed(family: Family) {
    large_udp_round_trip(Shape::Routed, family, &[]);
}

fn large_udp_bridge(family: Family) {
    large_udp_round_trip(Shape::Bridge, family, &[]);
}

fn large_udp_routed_stack_bypass(family: Family) {
    large_udp_round_trip(Shape::Routed, family, &["--stack-bypass"]);
}
