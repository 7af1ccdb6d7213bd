//! Spoofed sources (issue 10 §3): a pod that sends to a service with a source address that
//! is not its own gets no translation. The packet is dropped and counted as
//! `spoofed_source`, takes no flow entry, and reaches no backend; the pod's own address
//! keeps working. Real `lbproxy run`, real sockets, both pod-network shapes.
//!
//! The client pod gets a second address, [`SPOOFED`], outside the pods' subnet, and sends
//! from sockets bound to it: the node routes that address out of its uplink, not out of the
//! client's interface (routed) or the pods' bridge (bridge). Without the source check the
//! datapath translates these packets like any other: it creates their flows and counts
//! nothing, so the test fails.
//!
//! In the routed shape a pod also cannot use a neighbour pod's address. In the bridge shape
//! it can: the node routes every address of the bridge's subnet to the bridge, so the check
//! does not tell the bridge's pods apart (README, "Spoofed sources").

mod common;

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::{Lab, Pod, Shape, ns_run};
use serde_json::Value;

both_shapes!(spoofed_source_is_dropped);

/// The client's second address: outside the pods' 198.18.0.0/24 and the uplink's /30, so
/// the node routes it out of the uplink.
const SPOOFED: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 200);
/// Fixed source ports of the spoofed sockets.
const SRC_UDP: u16 = 21001;
const SRC_TCP: u16 = 21002;
/// UDP requests sent from each spoofed address.
const UDP_SENDS: u64 = 3;
/// How long to wait for an answer that must not come.
const SILENCE: Duration = Duration::from_secs(1);

/// `inspect drops --json` counter `reason` (0 when absent).
fn drop_count(lab: &Lab, reason: &str) -> u64 {
    lab.inspect_json("drops")[reason].as_u64().unwrap_or(0)
}

/// The flow entries (`inspect flows --json`) whose client is `addr`, any port.
fn flows_from(lab: &Lab, addr: Ipv4Addr) -> Vec<Value> {
    let all = lab.inspect_json("flows");
    let prefix = format!("{addr}:");
    all.as_array()
        .unwrap_or_else(|| panic!("inspect flows --json: not an array: {all}"))
        .iter()
        .filter(|f| f["client"].as_str().is_some_and(|c| c.starts_with(&prefix)))
        .cloned()
        .collect()
}

/// Packets the counting rule for `src` in `pod`'s INPUT chain has seen.
fn input_packets_from(pod: &Pod, src: Ipv4Addr) -> u64 {
    let out = ns_run(&pod.netns, &["iptables", "-L", "INPUT", "-v", "-n", "-x"])
        .unwrap_or_else(|e| panic!("iptables -L in {}: {e}", pod.name));
    out.lines()
        .find(|l| l.split_whitespace().any(|w| w == src.to_string()))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no counting rule for {src} in {}:\n{out}", pod.name))
}

/// A non-blocking TCP connect from `src` to `dst`, in the calling thread's namespace.
fn connect_from(src: SocketAddrV4, dst: SocketAddrV4) -> io::Result<OwnedFd> {
    let sin = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on an fd owned at once, with valid sockaddrs.
    unsafe {
        let fd = libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        let local = sin(src);
        if libc::bind(fd.as_raw_fd(), (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(io::Error::last_os_error());
        }
        let remote = sin(dst);
        if libc::connect(fd.as_raw_fd(), (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
        }
        Ok(fd)
    }
}

/// Whether the connect on `fd` completed within `wait`.
fn connected_within(fd: &OwnedFd, wait: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, wait.as_millis() as i32) };
    if n <= 0 {
        return false;
    }
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: valid fd, and an int-sized option buffer.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut err as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    err == 0
}

/// From inside `client`'s namespace: [`UDP_SENDS`] UDP requests to the web service and one
/// TCP connect to it, all from `src`. Returns the UDP answers and whether the connect
/// completed, within [`SILENCE`].
fn send_from(client: &Pod, src: Ipv4Addr) -> (Vec<String>, bool) {
    client.run(|| {
        let udp = UdpSocket::bind((src, SRC_UDP)).expect("bind UDP to the spoofed address");
        for _ in 0..UDP_SENDS {
            udp.send_to(b"hello\n", (WEB_VIP, WEB_UDP))
                .expect("UDP send from the spoofed address");
        }
        let syn = connect_from(
            SocketAddrV4::new(src, SRC_TCP),
            SocketAddrV4::new(WEB_VIP, WEB_TCP),
        )
        .expect("TCP connect from the spoofed address");
        let end = Instant::now() + SILENCE;
        let mut answers = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            udp.set_read_timeout(Some(left)).unwrap();
            match udp.recv_from(&mut buf) {
                Ok((n, from)) => answers.push(format!(
                    "{} from {from}",
                    String::from_utf8_lossy(&buf[..n]).trim()
                )),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) => panic!("UDP recv: {e}"),
            }
        }
        (answers, connected_within(&syn, Duration::ZERO))
    })
}

/// A client sends UDP and a TCP SYN to the web VIP from an address that is not its own.
/// Nothing is translated: no answer, no connection, no backend sees a packet from that
/// address, no flow entry names it, and `spoofed_source` counts every packet. Traffic from
/// the client's own address works before and after, and is never counted as spoofed. In
/// the routed shape, the same holds for a neighbour pod's address.
fn spoofed_source_is_dropped(shape: Shape) {
    let s = Setup::new(shape, &["b1", "b2"]);
    let lab = &s.lab;
    web_traffic_ok_in(Some(lab), "own address, before", &s.client, WEB_VIP, 4);
    assert_eq!(
        drop_count(lab, "spoofed_source"),
        0,
        "the client's own address was counted as spoofed\n{}",
        lab.diagnostics()
    );

    let mut spoofed = vec![SPOOFED];
    if shape == Shape::Routed {
        // A neighbour's address: routed out of the neighbour's interface, not the client's.
        spoofed.push(s.backend("b2").ip);
    }
    for &addr in &spoofed {
        for b in &s.backends {
            ns_run(
                &b.netns,
                &["iptables", "-I", "INPUT", "-s", &addr.to_string(), "-j", "ACCEPT"],
            )
            .unwrap_or_else(|e| panic!("counting rule in {}: {e}", b.name));
        }
        ns_run(
            &s.client.netns,
            &["ip", "addr", "add", &format!("{addr}/32"), "dev", "eth0"],
        )
        .unwrap_or_else(|e| panic!("adding {addr} to the client: {e}"));

        let before = drop_count(lab, "spoofed_source");
        let (answers, connected) = send_from(&s.client, addr);
        let dropped = drop_count(lab, "spoofed_source") - before;
        let ctx = format!("{shape}, client {} sending from {addr}", s.client.ip);
        assert!(
            answers.is_empty(),
            "{ctx}: UDP answered: {answers:?}\n{}",
            lab.diagnostics()
        );
        assert!(!connected, "{ctx}: TCP connected\n{}", lab.diagnostics());
        // Each UDP request and at least the first SYN (the kernel retransmits it after 1 s).
        assert!(
            dropped > UDP_SENDS,
            "{ctx}: spoofed_source counted {dropped} packets, want at least {}\n{}",
            UDP_SENDS + 1,
            lab.diagnostics()
        );
        let flows = flows_from(lab, addr);
        assert!(
            flows.is_empty(),
            "{ctx}: flow entries for the spoofed address: {flows:#?}"
        );
        for b in &s.backends {
            let n = input_packets_from(b, addr);
            assert_eq!(n, 0, "{ctx}: backend {} received {n} packets from {addr}", b.name);
        }
        ns_run(
            &s.client.netns,
            &["ip", "addr", "del", &format!("{addr}/32"), "dev", "eth0"],
        )
        .unwrap_or_else(|e| panic!("removing {addr} from the client: {e}"));
    }

    let before = drop_count(lab, "spoofed_source");
    web_traffic_ok_in(Some(lab), "own address, after", &s.client, WEB_VIP, 4);
    assert_eq!(
        drop_count(lab, "spoofed_source"),
        before,
        "the client's own address was counted as spoofed"
    );
    let own = flows_from(lab, s.client.ip);
    assert!(
        !own.is_empty(),
        "no flow entry for the client's own address ({}): inspect flows shows nothing?",
        s.client.ip
    );
}
