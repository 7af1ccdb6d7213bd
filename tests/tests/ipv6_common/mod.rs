//! The IPv6 one-node suites' requests and checks (ipv6_cluster_ip.rs, ipv6_pod_paths.rs),
//! over the dual-stack `web` Service of [`crate::common::dual_stack_manifest`].
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use crate::common::*;

/// One answered request: the backend that answered, the client address it saw, and the
/// address the answer came from.
#[derive(Debug)]
pub struct Answer {
    pub backend: String,
    pub client_seen: String,
    pub from: SocketAddr,
}

pub fn parse(line: &str, from: SocketAddr) -> Result<Answer, String> {
    let (backend, seen) = line
        .trim_end()
        .split_once(' ')
        .ok_or_else(|| format!("malformed reply {line:?}"))?;
    Ok(Answer {
        backend: backend.to_string(),
        client_seen: seen.to_string(),
        from,
    })
}

/// A new TCP connection to `[VIP6]:WEB_TCP` from the calling thread's namespace, one
/// request on it.
pub fn tcp6() -> Result<Answer, String> {
    let to = SocketAddr::from((VIP6, WEB_TCP));
    let mut c = TcpStream::connect_timeout(&to, T).map_err(|e| format!("connect {to}: {e}"))?;
    c.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
    c.write_all(b"hello\n").map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(&c)
        .read_line(&mut line)
        .map_err(|e| format!("read from {to}: {e}"))?;
    let peer = c.peer_addr().map_err(|e| e.to_string())?;
    parse(&line, peer)
}

/// One UDP request to `[VIP6]:WEB_UDP` from a new socket (a new source port, so a new flow).
pub fn udp6() -> Result<Answer, String> {
    let to = SocketAddr::from((VIP6, WEB_UDP));
    let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
    u.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
    u.send_to(b"hello\n", to)
        .map_err(|e| format!("send to {to}: {e}"))?;
    let mut buf = [0u8; 512];
    let (n, from) = u
        .recv_from(&mut buf)
        .map_err(|e| format!("no UDP answer from {to}: {e}"))?;
    parse(&String::from_utf8_lossy(&buf[..n]), from)
}

/// `n` TCP connections and `n` UDP requests over IPv6 from `client`: each must be answered
/// from the VIP:port it was sent to, by a backend that saw the client's own IPv6 address.
/// Returns the answers per backend, (TCP, UDP).
pub fn ipv6_traffic_ok(
    ctx: &str,
    s: &Setup,
    n: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let c6 = s.client.ip6.unwrap();
    let (tcp, udp) = s.client.run(|| {
        let tcp: Vec<_> = (0..n).map(|_| tcp6()).collect();
        let udp: Vec<_> = (0..n).map(|_| udp6()).collect();
        (tcp, udp)
    });
    let mut out = (BTreeMap::new(), BTreeMap::new());
    for (proto, answers, port, tally) in [
        ("TCP", tcp, WEB_TCP, &mut out.0),
        ("UDP", udp, WEB_UDP, &mut out.1),
    ] {
        for (i, a) in answers.into_iter().enumerate() {
            let a = a.unwrap_or_else(|e| {
                panic!(
                    "{ctx}: {proto} #{i} over IPv6: {e}\n{}",
                    s.lab.diagnostics()
                )
            });
            assert_eq!(
                a.from,
                SocketAddr::from((VIP6, port)),
                "{ctx}: {proto} #{i}: the answer must come from the IPv6 ClusterIP: {a:?}"
            );
            let seen: SocketAddr = a.client_seen.parse().unwrap();
            assert_eq!(
                seen.ip(),
                IpAddr::V6(c6),
                "{ctx}: {proto} #{i}: the backend must see the client's own address: {a:?}"
            );
            *tally.entry(a.backend).or_insert(0) += 1;
        }
    }
    out
}

/// The second Service's IPv6 clusterIP: no endpoints at all.
pub const EMPTY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x20);

/// `lbproxy ARGS --bpffs-dir DIR` in the lab's node namespace, which must succeed: its
/// stdout parsed as JSON.
pub fn tool_json(s: &Setup, args: &[&str]) -> serde_json::Value {
    let dir = s.lab.bpffs_dir().display().to_string();
    let argv: Vec<&str> = args.iter().copied().chain(["--bpffs-dir", &dir]).collect();
    let out = s.lab.lbproxy_cmd(&argv);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "lbproxy {argv:?}: {}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("lbproxy {argv:?}: bad JSON ({e}): {text}"))
}

/// Puts a sticky destination-options header (one PadN option, 8 bytes in all) on every
/// packet `sock` sends (`IPV6_DSTOPTS`, which needs CAP_NET_RAW: the tests run as root).
pub fn with_dest_opts(sock: &impl std::os::fd::AsRawFd) {
    // Next header (the kernel fills it in), length 0 (8 bytes), PadN of 4 zero bytes.
    let opts: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    // SAFETY: a valid socket and an 8-byte option buffer.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_DSTOPTS,
            opts.as_ptr().cast(),
            opts.len() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "setsockopt(IPV6_DSTOPTS): {}",
        std::io::Error::last_os_error()
    );
}

/// A TCP connection and a connected UDP socket's datagram (from `udp_port`, 0 for any) from
/// the client to the frontend without endpoints, with a destination-options header on
/// every packet when `dest_opts`: each must be refused within 500 ms.
pub fn refused_at_once(s: &Setup, udp_port: u16, dest_opts: bool, what: &str) {
    let (tcp, udp) = s.client.run(|| {
        let to = SocketAddr::from((EMPTY6, WEB_TCP));
        let t = socket2::Socket::new(
            socket2::Domain::IPV6,
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
        .unwrap();
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, udp_port)).unwrap();
        if dest_opts {
            with_dest_opts(&t);
            with_dest_opts(&u);
        }
        let started = Instant::now();
        let tcp = t
            .connect_timeout(&to.into(), Duration::from_secs(3))
            .map_err(|e| (e.kind(), started.elapsed()));
        u.connect((EMPTY6, WEB_UDP)).unwrap();
        u.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let started = Instant::now();
        u.send(b"hello\n").unwrap();
        let udp = u
            .recv(&mut [0u8; 64])
            .map(|_| ())
            .map_err(|e| (e.kind(), started.elapsed()));
        (tcp, udp)
    });
    for (proto, r) in [("TCP", tcp), ("UDP", udp)] {
        match r {
            Err((std::io::ErrorKind::ConnectionRefused, took)) => assert!(
                took < Duration::from_millis(500),
                "{proto} {what}: refused, but only after {took:?}"
            ),
            other => panic!(
                "{proto} {what} to an IPv6 frontend without endpoints: want connection \
                 refused at once, got {other:?}\n{}",
                s.lab.diagnostics()
            ),
        }
    }
}
