//! Backend servers and clients that run inside lab namespaces.
//!
//! Wire protocol (same for TCP and UDP): the client sends a line (`"hello\n"`); the server
//! answers `"<identity> <client-ip>:<client-port>\n"`, where identity is normally the pod
//! name and the client address is the peer as the server saw it. Over TCP every request line
//! gets one reply line, so one connection can carry many requests ([`TcpConn`]).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ns::run_in_ns;

/// TCP or UDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        })
    }
}

/// A server's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The identity of the server that answered (the backend pod's name).
    pub backend: String,
    /// The client address as the server saw it (`ip:port`).
    pub client_seen: String,
}

impl Reply {
    pub(crate) fn parse(line: &str) -> io::Result<Reply> {
        let line = line.trim_end_matches(['\r', '\n']);
        let (backend, client_seen) = line.split_once(' ').ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("malformed reply {line:?}"),
            )
        })?;
        Ok(Reply {
            backend: backend.to_owned(),
            client_seen: client_seen.to_owned(),
        })
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (saw client {})", self.backend, self.client_seen)
    }
}

const REQUEST: &[u8] = b"hello\n";
const POLL: Duration = Duration::from_millis(100);

/// Sets `SO_RCVTIMEO` on a socket; on Linux this also bounds `accept(2)`.
pub fn set_rcvtimeo(fd: i32, d: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as _,
        tv_usec: d.subsec_micros() as _,
    };
    // SAFETY: valid fd and a correctly sized timeval.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether a blocking receive with a timeout should simply go round again: it timed out, or
/// a signal interrupted it (`SO_RCVTIMEO` makes the kernel return `EINTR` rather than
/// restart the call).
pub fn recv_again(e: &io::Error) -> bool {
    is_timeout(e) || e.kind() == io::ErrorKind::Interrupted
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// TCP and UDP servers in one namespace, answering with an identity on one or more ports.
/// Stopped (sockets closed, threads joined) on drop.
pub struct Backend {
    identity: String,
    ports: Vec<u16>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Backend {
    /// Starts a TCP and a UDP server on each of `ports` inside `ns`, on IPv4 (0.0.0.0) and
    /// on IPv6 ([::], IPv6 only, so IPv4 clients keep being seen as IPv4 addresses),
    /// answering with `identity`. Returns once all sockets are bound. Panics if binding fails.
    pub fn start(ns: &str, identity: &str, ports: &[u16]) -> Backend {
        assert!(
            !identity.contains(char::is_whitespace),
            "identity must not contain spaces"
        );
        let sockets: Vec<(TcpListener, UdpSocket)> = run_in_ns(ns, || {
            ports
                .iter()
                .flat_map(|&p| {
                    let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, p));
                    let t = TcpListener::bind(any)
                        .unwrap_or_else(|e| panic!("[{ns}] bind TCP :{p}: {e}"));
                    let u = UdpSocket::bind(any)
                        .unwrap_or_else(|e| panic!("[{ns}] bind UDP :{p}: {e}"));
                    let v6 = bind_v6only(p).unwrap_or_else(|e| panic!("[{ns}] bind [::]:{p}: {e}"));
                    [(t, u), v6]
                })
                .collect()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let mut threads = Vec::new();
        for (tcp, udp) in sockets {
            set_rcvtimeo(tcp.as_raw_fd(), POLL).expect("SO_RCVTIMEO on listener");
            udp.set_read_timeout(Some(POLL)).expect("UDP read timeout");
            let (id, st, cs) = (identity.to_owned(), stop.clone(), conns.clone());
            threads.push(std::thread::spawn(move || tcp_accept_loop(tcp, id, st, cs)));
            let (id, st) = (identity.to_owned(), stop.clone());
            threads.push(std::thread::spawn(move || udp_loop(udp, id, st)));
        }
        Backend {
            identity: identity.to_owned(),
            ports: ports.to_vec(),
            stop,
            threads,
            conns,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap());
        for t in conns {
            let _ = t.join();
        }
    }
}

fn tcp_accept_loop(
    l: TcpListener,
    id: String,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    while !stop.load(Ordering::SeqCst) {
        match l.accept() {
            Ok((s, peer)) => {
                let (id, st) = (id.clone(), stop.clone());
                let h = std::thread::spawn(move || tcp_conn_loop(s, peer, id, st));
                let mut cs = conns.lock().unwrap();
                cs.retain(|h| !h.is_finished());
                cs.push(h);
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("lab backend {id}: accept: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

fn tcp_conn_loop(s: TcpStream, peer: SocketAddr, id: String, stop: Arc<AtomicBool>) {
    let _ = s.set_read_timeout(Some(POLL));
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut r = BufReader::new(s);
    let mut line = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match r.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with(b"\n") => {
                line.clear();
                if w.write_all(format!("{id} {peer}\n").as_bytes()).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
    let _ = w.shutdown(Shutdown::Both);
}

fn udp_loop(u: UdpSocket, id: String, stop: Arc<AtomicBool>) {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::SeqCst) {
        match u.recv_from(&mut buf) {
            Ok((_, peer)) => {
                let _ = u.send_to(format!("{id} {peer}\n").as_bytes(), peer);
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("lab backend {id}: UDP recv: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

// ---- clients: the `*_here` functions use the calling thread's namespace ----

/// [`tcp_request`] in the calling thread's namespace (use inside [`run_in_ns`] to make many
/// requests without a thread per request).
pub fn tcp_request_here(
    addr: impl Into<IpAddr>,
    port: u16,
    timeout: Duration,
) -> io::Result<(Reply, SocketAddr)> {
    let mut c = TcpConn::connect_here(addr, port, timeout)?;
    let r = c.request()?;
    Ok((r, c.peer))
}

/// A source port no earlier request of this process used (until 10,000 have gone by), for
/// UDP requests that must each be a new flow. An ephemeral port from the kernel can repeat
/// within a test, and a repeated 5-tuple is, rightly, the same flow to the load balancer.
/// The range 10000-19999 lies below the kernel's ephemeral range and the fixed ports tests
/// choose.
fn fresh_udp_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    10_000 + NEXT.fetch_add(1, Ordering::Relaxed) % 10_000
}

/// [`udp_request`] in the calling thread's namespace (see [`tcp_request_here`]); without
/// `src_port`, from a port no earlier request used ([`fresh_udp_port`]).
pub fn udp_request_here(
    addr: impl Into<IpAddr>,
    port: u16,
    timeout: Duration,
    src_port: Option<u16>,
) -> io::Result<(Reply, SocketAddr)> {
    let to = SocketAddr::from((addr.into(), port));
    let src_port = src_port.unwrap_or_else(fresh_udp_port);
    let sock = match to {
        SocketAddr::V4(_) => socket2_udp(src_port)?,
        SocketAddr::V6(_) => socket2_udp6(src_port)?,
    };
    sock.send_to(REQUEST, to)?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no UDP reply from {to} within {timeout:?}"),
            ));
        }
        sock.set_read_timeout(Some(left))?;
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                return Ok((Reply::parse(&text)?, from));
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Waits until no UDP socket of the calling thread's network namespace is bound to local
/// `port` (IPv4 or IPv6), for at most `within`; returns how long that took.
///
/// Dropping a socket does not close it while a copy of its descriptor lives on: a child
/// process that another test thread of this process is starting (`fork`, then `exec`) holds
/// a copy of every descriptor until its `exec` closes the close-on-exec ones. For that while,
/// a datagram to the port is still delivered to the socket, and the kernel answers nothing.
/// A test about what happens once the socket is gone (the port unreachable the client's
/// kernel sends) waits for this first.
pub fn wait_udp_port_released(port: u16, within: Duration) -> Result<Duration, String> {
    let want = format!(":{port:04X}");
    let started = Instant::now();
    loop {
        let mut held = false;
        for table in ["/proc/thread-self/net/udp", "/proc/thread-self/net/udp6"] {
            let text = std::fs::read_to_string(table).map_err(|e| format!("{table}: {e}"))?;
            held |= text
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().nth(1))
                .any(|local| local.ends_with(&want));
        }
        if !held {
            return Ok(started.elapsed());
        }
        if started.elapsed() > within {
            return Err(format!(
                "a UDP socket is still bound to port {port} {within:?} after its close"
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// From a UDP server socket that got a datagram from `from` after the sender closed its
/// socket: connects to `from`, sends an answer and waits up to 2 s for what the kernel then
/// reports (the sender's ICMP port unreachable, translated back, arrives as
/// `ConnectionRefused`). Returns the receive's result and how long it took.
pub fn answer_after_close(server: &UdpSocket, from: SocketAddr) -> (io::Result<usize>, Duration) {
    let started = Instant::now();
    let sent = server
        .connect(from)
        .and_then(|()| server.send(b"too late\n"))
        .and_then(|_| server.set_read_timeout(Some(Duration::from_secs(2))));
    if let Err(e) = sent {
        return (Err(e), started.elapsed());
    }
    let mut buf = [0u8; 64];
    (server.recv(&mut buf), started.elapsed())
}

/// A TCP listener and a UDP socket on `[::]:port`, IPv6 only (`IPV6_V6ONLY`), in the
/// calling thread's namespace.
fn bind_v6only(port: u16) -> io::Result<(TcpListener, UdpSocket)> {
    fn one(kind: libc::c_int, port: u16) -> io::Result<std::os::fd::OwnedFd> {
        // SAFETY: plain socket syscalls on an fd wrapped in an OwnedFd at once; the address
        // is a zeroed sockaddr_in6 with its family and port set.
        unsafe {
            let fd = libc::socket(libc::AF_INET6, kind | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let owned = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
            let one: libc::c_int = 1;
            for opt in [libc::IPV6_V6ONLY] {
                if libc::setsockopt(
                    fd,
                    libc::IPPROTO_IPV6,
                    opt,
                    (&raw const one).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            let mut sa: libc::sockaddr_in6 = std::mem::zeroed();
            sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sa.sin6_port = port.to_be();
            if libc::bind(
                fd,
                (&raw const sa).cast(),
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if kind == libc::SOCK_STREAM && libc::listen(fd, 128) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(owned)
        }
    }
    let t = TcpListener::from(one(libc::SOCK_STREAM, port)?);
    let u = UdpSocket::from(one(libc::SOCK_DGRAM, port)?);
    Ok((t, u))
}

/// [`socket2_udp`] over IPv6: an unconnected UDP socket on `[::]:port` (IPv6 only) with
/// SO_REUSEADDR.
pub fn socket2_udp6(port: u16) -> io::Result<UdpSocket> {
    let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::DGRAM, None)?;
    s.set_only_v6(true)?;
    s.set_reuse_address(true)?;
    s.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)).into())?;
    Ok(s.into())
}

/// An unconnected UDP socket on 0.0.0.0:`port` with SO_REUSEADDR (so a fixed source port can
/// be reused right away). Unconnected, so replies from any source are seen as they came.
pub fn socket2_udp(port: u16) -> io::Result<UdpSocket> {
    if port == 0 {
        return UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0));
    }
    // SAFETY: plain socket syscalls on an fd we own; the fd is wrapped in a UdpSocket at once.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let sock = <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let one: libc::c_int = 1;
        let rc = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: 0 },
            sin_zero: [0; 8],
        };
        let rc = libc::bind(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sock)
    }
}

/// From inside `ns`: connect to `addr:port`, send one request, read the reply, close.
/// Returns the reply and the connection's peer address (what the client believes it is
/// talking to: the VIP when going through lbproxy). `timeout` bounds each step.
pub fn tcp_request(
    ns: &str,
    addr: impl Into<IpAddr>,
    port: u16,
    timeout: Duration,
) -> io::Result<(Reply, SocketAddr)> {
    let addr = addr.into();
    run_in_ns(ns, || tcp_request_here(addr, port, timeout))
}

/// From inside `ns`: send one UDP datagram to `addr:port` from a new socket (source port
/// `src_port`, or an ephemeral one), and wait up to `timeout` for a reply. Returns the reply
/// and the address the reply came from (recvfrom), which should be `addr:port`.
pub fn udp_request(
    ns: &str,
    addr: impl Into<IpAddr>,
    port: u16,
    timeout: Duration,
    src_port: Option<u16>,
) -> io::Result<(Reply, SocketAddr)> {
    let addr = addr.into();
    run_in_ns(ns, || udp_request_here(addr, port, timeout, src_port))
}

/// A long-lived TCP connection created inside a namespace; send several requests over it.
pub struct TcpConn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Peer address as seen by the client.
    pub peer: SocketAddr,
    /// Local (client) address.
    pub local: SocketAddr,
}

impl TcpConn {
    /// Connects from inside `ns`. `timeout` bounds the connect and every later request.
    pub fn connect(
        ns: &str,
        addr: impl Into<IpAddr>,
        port: u16,
        timeout: Duration,
    ) -> io::Result<TcpConn> {
        let addr = addr.into();
        run_in_ns(ns, || TcpConn::connect_here(addr, port, timeout))
    }

    /// [`TcpConn::connect`] from source port `src_port` (bound with `SO_REUSEADDR`, so a port
    /// whose last connection is in TIME_WAIT can be taken again).
    pub fn connect_from(
        ns: &str,
        src_port: u16,
        addr: impl Into<IpAddr>,
        port: u16,
        timeout: Duration,
    ) -> io::Result<TcpConn> {
        let addr = addr.into();
        run_in_ns(ns, || {
            let dst = SocketAddr::from((addr, port));
            let s = socket2::Socket::new(
                socket2::Domain::for_address(dst),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            s.set_reuse_address(true)?;
            let any: IpAddr = if addr.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            };
            s.bind(&SocketAddr::from((any, src_port)).into())?;
            s.connect_timeout(&dst.into(), timeout)?;
            TcpConn::of(s.into(), timeout)
        })
    }

    /// [`TcpConn::connect`] in the calling thread's namespace, over either family.
    pub fn connect_here(
        addr: impl Into<IpAddr>,
        port: u16,
        timeout: Duration,
    ) -> io::Result<TcpConn> {
        let s = TcpStream::connect_timeout(&SocketAddr::from((addr.into(), port)), timeout)?;
        TcpConn::of(s, timeout)
    }

    /// A connection over the connected stream `s`; `timeout` bounds every request.
    fn of(s: TcpStream, timeout: Duration) -> io::Result<TcpConn> {
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        s.set_nodelay(true)?;
        let peer = s.peer_addr()?;
        let local = s.local_addr()?;
        Ok(TcpConn {
            writer: s.try_clone()?,
            reader: BufReader::new(s),
            peer,
            local,
        })
    }

    /// Sends one request line and reads one reply line.
    pub fn request(&mut self) -> io::Result<Reply> {
        self.writer.write_all(REQUEST)?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        Reply::parse(&line)
    }
}

/// The result of many requests from one client to one frontend ([`tally`]).
#[derive(Clone, Debug)]
pub struct Tally {
    pub proto: Proto,
    pub target: SocketAddr,
    pub attempts: usize,
    /// Replies per backend identity.
    pub by_backend: BTreeMap<String, usize>,
    /// Replies whose source (TCP peer / UDP recvfrom address) was not `target`:
    /// `(backend, source)`.
    pub wrong_source: Vec<(String, SocketAddr)>,
    /// Failed requests, as `"#i: error"`.
    pub errors: Vec<String>,
    pub elapsed: Duration,
}

impl Tally {
    /// Number of requests that got a reply.
    pub fn replies(&self) -> usize {
        self.by_backend.values().sum()
    }

    /// Replies from `backend`.
    pub fn count(&self, backend: &str) -> usize {
        self.by_backend.get(backend).copied().unwrap_or(0)
    }

    /// True if every attempt got a reply from `target` as source.
    pub fn all_ok(&self) -> bool {
        self.errors.is_empty() && self.wrong_source.is_empty() && self.replies() == self.attempts
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} x{} in {:?}: replies {:?}",
            self.proto, self.target, self.attempts, self.elapsed, self.by_backend
        )?;
        if !self.wrong_source.is_empty() {
            write!(f, "; wrong reply source {:?}", self.wrong_source)?;
        }
        if !self.errors.is_empty() {
            write!(f, "; {} errors: {:?}", self.errors.len(), self.errors)?;
        }
        Ok(())
    }
}

/// How many failed requests [`tally`] tolerates before giving up on the rest.
pub const TALLY_MAX_ERRORS: usize = 8;

/// From inside `ns`, makes `n` requests to `addr:port` (either family): new TCP connections, or UDP
/// datagrams each from a new socket (so a new source port). Stops early after
/// [`TALLY_MAX_ERRORS`] failures. `timeout` is per request.
pub fn tally(
    ns: &str,
    proto: Proto,
    addr: impl Into<IpAddr>,
    port: u16,
    n: usize,
    timeout: Duration,
) -> Tally {
    let addr = addr.into();
    run_in_ns(ns, || {
        let target = SocketAddr::new(addr, port);
        let mut t = Tally {
            proto,
            target,
            attempts: 0,
            by_backend: BTreeMap::new(),
            wrong_source: Vec::new(),
            errors: Vec::new(),
            elapsed: Duration::ZERO,
        };
        let start = Instant::now();
        for i in 0..n {
            if t.errors.len() >= TALLY_MAX_ERRORS {
                t.errors.push(format!("gave up after {i} of {n} attempts"));
                break;
            }
            t.attempts += 1;
            let r = match proto {
                Proto::Tcp => tcp_request_here(addr, port, timeout),
                Proto::Udp => udp_request_here(addr, port, timeout, None),
            };
            match r {
                Ok((reply, src)) => {
                    if src != target {
                        t.wrong_source.push((reply.backend.clone(), src));
                    }
                    *t.by_backend.entry(reply.backend).or_default() += 1;
                }
                Err(e) => t.errors.push(format!("#{i}: {e}")),
            }
        }
        t.elapsed = start.elapsed();
        t
    })
}

/// Polls `f` every `interval` until it returns `Some` or `timeout` passes. Returns the value
/// and the time it took, or the elapsed time on timeout.
pub fn wait_for<T>(
    timeout: Duration,
    interval: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Result<(T, Duration), Duration> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok((v, start.elapsed()));
        }
        if start.elapsed() >= timeout {
            return Err(start.elapsed());
        }
        std::thread::sleep(interval);
    }
}

/// `tx-checksumming` off for interface `ifname` of network namespace `ns` (the ethtool
/// ioctl `ETHTOOL_STXCSUM`, as `ethtool -K IF tx off` does; the machines have no `ethtool`).
/// A packet sent through the interface then leaves with its checksum complete, as one from
/// a wire always has. With it on (a veth's default), a packet a local socket sent may keep a
/// partial checksum that only the skb's metadata completes, and an XDP frame carries no
/// such metadata.
pub fn tx_checksum_off(ns: &str, ifname: &str) -> io::Result<()> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_STXCSUM: u32 = 0x17;
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    if ifname.len() >= libc::IFNAMSIZ {
        return Err(io::Error::other(format!(
            "interface name {ifname} too long"
        )));
    }
    run_in_ns(ns, || {
        let mut value = EthtoolValue {
            cmd: ETHTOOL_STXCSUM,
            data: 0,
        };
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: &raw mut value,
            _pad: [0; 16],
        };
        req.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
        let sock = UdpSocket::bind("0.0.0.0:0")?;
        // SAFETY: `req` and `value` outlive the call; the kernel reads `req`, and `value`
        // through `req.data`.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCETHTOOL, &raw mut req) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::other(format!(
                "[{ns}] ETHTOOL_STXCSUM {ifname}: {e}"
            )));
        }
        Ok(())
    })
}

/// Attaches an XDP program that passes every frame (`XDP_PASS`) to interface `ifname` of
/// network namespace `ns`, in native mode, and returns its link: the program stays
/// attached while the returned fd is open.
///
/// A veth takes the frames its peer sends back with `XDP_TX` (or redirects to it) only when
/// it has an XDP program of its own (its NAPI is then on); a physical NIC needs nothing of
/// the kind. The program is two instructions, loaded with `BPF_PROG_LOAD` and attached with
/// `BPF_LINK_CREATE`: no object file, nothing pinned.
pub fn attach_xdp_pass(ns: &str, ifname: &str) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    const BPF_XDP: u32 = 37;
    const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
    let bpf = |cmd: libc::c_long, attr: &mut [u8; 128]| -> io::Result<std::os::fd::OwnedFd> {
        // SAFETY: `attr` is a zero-padded `union bpf_attr` of the size given.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new fd the kernel returned, owned from here on.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
    };
    let put = |attr: &mut [u8; 128], at: usize, bytes: &[u8]| {
        attr[at..at + bytes.len()].copy_from_slice(bytes);
    };
    run_in_ns(ns, || {
        // r0 = XDP_PASS (2); exit.
        let insns: [u64; 2] = [0x0000_0002_0000_00b7, 0x0000_0000_0000_0095];
        let license = c"GPL";
        let mut load = [0u8; 128];
        // prog_type, insn_cnt, insns, license; expected_attach_type (at 68) BPF_XDP.
        put(&mut load, 0, &BPF_PROG_TYPE_XDP.to_ne_bytes());
        put(&mut load, 4, &2u32.to_ne_bytes());
        put(&mut load, 8, &(insns.as_ptr() as u64).to_ne_bytes());
        put(&mut load, 16, &(license.as_ptr() as u64).to_ne_bytes());
        put(&mut load, 68, &BPF_XDP.to_ne_bytes());
        let prog = bpf(BPF_PROG_LOAD, &mut load)
            .map_err(|e| io::Error::other(format!("[{ns}] loading an XDP pass program: {e}")))?;
        let index = {
            let name = std::ffi::CString::new(ifname).map_err(io::Error::other)?;
            // SAFETY: a NUL-terminated name.
            unsafe { libc::if_nametoindex(name.as_ptr()) }
        };
        if index == 0 {
            return Err(io::Error::other(format!("[{ns}] no interface {ifname}")));
        }
        let mut link = [0u8; 128];
        // prog_fd, target_ifindex, attach_type, flags.
        put(&mut link, 0, &(prog.as_raw_fd() as u32).to_ne_bytes());
        put(&mut link, 4, &index.to_ne_bytes());
        put(&mut link, 8, &BPF_XDP.to_ne_bytes());
        put(&mut link, 12, &XDP_FLAGS_DRV_MODE.to_ne_bytes());
        bpf(BPF_LINK_CREATE, &mut link).map_err(|e| {
            io::Error::other(format!(
                "[{ns}] attaching an XDP pass program to {ifname}: {e}"
            ))
        })
    })
}
