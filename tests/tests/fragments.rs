//! IPv4 fragments through a service, with real sockets: a UDP request larger than the MTU
//! reaches a backend, and the backend's answer, larger than the MTU too, reaches the client
//! from the VIP (Kubernetes' e2e "should be able to handle large requests: udp", and DNS
//! over EDNS0). Every veth has a 1500-byte MTU, so both kernels really fragment: each
//! datagram crosses the datapath as fragments of which only the first carries the ports.

mod common;

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{Lab, Pod, Shape, ns_run, run_in_ns};

const MTU: &str = "1500";
/// The request: two fragments at a 1500-byte MTU.
const REQUEST_LEN: usize = 2000;
/// The answer: three fragments.
const ANSWER_LEN: usize = 3000;

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

/// Sets `IP_MTU_DISCOVER` to `IP_PMTUDISC_DONT`: datagrams larger than the MTU are
/// fragmented by this host, whatever the system's path-MTU default.
fn fragment_locally(sock: &UdpSocket) {
    let v: libc::c_int = libc::IP_PMTUDISC_DONT;
    // SAFETY: a valid socket and an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&raw const v).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(
        rc,
        0,
        "IP_MTU_DISCOVER: {}",
        std::io::Error::last_os_error()
    );
}

/// The `Ip:` counters of the calling thread's network namespace (`/proc/net/snmp`), by name.
fn ip_counters() -> std::collections::BTreeMap<String, u64> {
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

fn counter(ns: &str, name: &str) -> u64 {
    run_in_ns(ns, ip_counters)[name]
}

/// A UDP server on `pod`:[`BACKEND_UDP`] answering a [`REQUEST_LEN`]-byte datagram with
/// [`answer_to`] and echoing any other; it records the length and source of each request and whether its bytes were [`request`].
struct LargeUdpServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(usize, SocketAddr, bool)>>>,
}

impl LargeUdpServer {
    fn start(pod: &Pod) -> LargeUdpServer {
        let sock = pod.run(|| {
            UdpSocket::bind((Ipv4Addr::UNSPECIFIED, BACKEND_UDP)).expect("bind the UDP server")
        });
        fragment_locally(&sock);
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
fn exchange(client: &Pod, vip: Ipv4Addr, payload: &[u8]) -> Result<(Vec<u8>, SocketAddr), String> {
    client.run(|| {
        let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind the client");
        fragment_locally(&sock);
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
/// intact) and its 3000-byte answer reaches the client from VIP:53, bytes intact; both
/// datagrams were fragmented on the way (the namespaces' `FragCreates` counters moved).
fn large_udp_round_trip(shape: Shape, args: &[&str]) {
    let what = format!("[{shape}, lbproxy run {}]", args.join(" "));
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let backend = lab.add_pod("b1");
    for pod in [&client, &backend] {
        set_mtu(&lab, pod);
    }
    let server = LargeUdpServer::start(&backend);
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&[&backend])));
    let mut lb = lab.start_lbproxy_with(args);
    lb.expect_healthy(HEALTHY_WITHIN);

    // A small request first, so the neighbours are known and, with the bypass, the large
    // one is redirected (the first packets to a cold neighbour take the stack).
    let small = exchange(&client, WEB_VIP, b"warm-up");
    assert!(
        matches!(&small, Ok((a, from)) if a == b"warm-up" && *from == SocketAddr::from((WEB_VIP, WEB_UDP))),
        "{what}: a small UDP request to the VIP: want the echo from {WEB_VIP}:{WEB_UDP}, got \
         {small:?}"
    );
    let delivered = |path: &str| {
        let v = lab.inspect_json("delivery");
        v["packets"][path].as_u64().unwrap_or(0)
    };
    let (to_backend, to_client) = (
        delivered("redirect_to_backend"),
        delivered("redirect_to_client"),
    );
    let frags_before = (
        counter(&client.netns, "FragCreates"),
        counter(&backend.netns, "FragCreates"),
    );

    let got = exchange(&client, WEB_VIP, &request());
    let received = server.stop();
    let drops = lab.inspect_json("drops");
    let diag = || format!("drops: {drops}\n{}\n{}", lab.diagnostics(), lb.log());
    let (answer, from) = got.unwrap_or_else(|e| {
        panic!(
            "{what}: {REQUEST_LEN}-byte UDP request to {WEB_VIP}:{WEB_UDP}: {e}; the backend \
             received {received:?}\n{}",
            diag()
        )
    });
    let large: Vec<_> = received
        .iter()
        .filter(|(n, _, _)| *n == REQUEST_LEN)
        .collect();
    assert!(
        !large.is_empty()
            && large
                .iter()
                .all(|(_, src, intact)| *intact && src.ip() == client.ip),
        "{what}: the backend should receive the {REQUEST_LEN}-byte request intact, from \
         {}: received (length, source, intact) {received:?}",
        client.ip
    );
    assert_eq!(
        from,
        SocketAddr::from((WEB_VIP, WEB_UDP)),
        "{what}: the answer must come from the VIP:port\n{}",
        diag()
    );
    assert!(
        answer == answer_to(&request(), &backend.name),
        "{what}: the answer is not the backend's {ANSWER_LEN}-byte answer to the request: \
         {} bytes, starting {:?}",
        answer.len(),
        String::from_utf8_lossy(&answer[..answer.len().min(40)])
    );
    let frags_after = (
        counter(&client.netns, "FragCreates"),
        counter(&backend.netns, "FragCreates"),
    );
    assert!(
        frags_after.0 >= frags_before.0 + 2 && frags_after.1 >= frags_before.1 + 3,
        "{what}: the request and the answer should have left in fragments (FragCreates of \
         client, backend: {frags_before:?} -> {frags_after:?})"
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

#[test]
fn large_udp_routed() {
    large_udp_round_trip(Shape::Routed, &[]);
}

#[test]
fn large_udp_bridge() {
    large_udp_round_trip(Shape::Bridge, &[]);
}

#[test]
fn large_udp_routed_stack_bypass() {
    large_udp_round_trip(Shape::Routed, &["--stack-bypass"]);
}
