//! `lbt-client`: a lab client that runs as its own process, so it can be placed in a cgroup
//! (socket-level load balancing acts on a process's cgroup, which a test thread cannot
//! change for itself alone).
//!
//! ```text
//! lbt-client --netns PATH [--cgroup DIR] MODE ADDR:PORT [--count N] [--interval-ms MS] [--timeout-ms MS] [--bind-port P]
//! ```
//! It first joins the cgroup (writes its pid to `DIR/cgroup.procs`), then the network
//! namespace, then runs MODE, printing one JSON object per request on stdout:
//! `{"ok":true,"backend":"b1","client_seen":"ip:port","peer":"ip:port","ms":1.2}` or
//! `{"ok":false,"error":"...","errno":111,"ms":0.1}`. Modes (the lab's wire protocol, see
//! `lab::net`):
//! - `tcp`: a new connection per request; `peer` is `getpeername()`.
//! - `udp`: an unconnected socket per request (`sendto`/`recvfrom`); `peer` is the
//!   datagram's source.
//! - `udp-connected`: one connected socket for all requests; `peer` is `recvfrom`'s source.
//!   A request whose send or receive fails reconnects the socket (a new socket) before the
//!   next, as a resolver does.
//! - `tcp-connected`: one connection for all requests, a request line and its answer each;
//!   `peer` is `getpeername()`. A request that fails drops the connection, and the next one
//!   connects again, as a client library's pool does.
//! - `udp-oneway`: a one-way sender (statsd-like) on one unconnected socket bound to
//!   `--bind-port` (0: any): `sendto` only, never a receive; each line is one send's result.
//! - `udp-oneway-connected`: the same on a connected socket: a send that fails (the socket
//!   was destroyed, or the kernel reported an ICMP error) connects the same socket again
//!   (same source port) and sends once more, as a statsd client that reconnects on error.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::time::{Duration, Instant};

struct Args {
    netns: String,
    cgroup: Option<String>,
    mode: String,
    target: SocketAddr,
    count: usize,
    interval: Duration,
    timeout: Duration,
    bind_port: u16,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut netns = None;
    let mut cgroup = None;
    let mut pos = Vec::new();
    let mut count = 1;
    let mut interval = Duration::ZERO;
    let mut timeout = Duration::from_secs(2);
    let mut bind_port = 0;
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--netns" => netns = Some(val("--netns")?),
            "--cgroup" => cgroup = Some(val("--cgroup")?),
            "--count" => {
                count = val("--count")?
                    .parse()
                    .map_err(|e| format!("--count: {e}"))?
            }
            "--interval-ms" => {
                interval = Duration::from_millis(
                    val("--interval-ms")?
                        .parse()
                        .map_err(|e| format!("--interval-ms: {e}"))?,
                )
            }
            "--timeout-ms" => {
                timeout = Duration::from_millis(
                    val("--timeout-ms")?
                        .parse()
                        .map_err(|e| format!("--timeout-ms: {e}"))?,
                )
            }
            "--bind-port" => {
                bind_port = val("--bind-port")?
                    .parse()
                    .map_err(|e| format!("--bind-port: {e}"))?
            }
            _ => pos.push(a),
        }
    }
    let [mode, target] =
        <[String; 2]>::try_from(pos).map_err(|p| format!("want MODE ADDR:PORT, got {p:?}"))?;
    Ok(Args {
        netns: netns.ok_or("--netns is required")?,
        cgroup,
        mode,
        target: target.parse().map_err(|e| format!("{target}: {e}"))?,
        count,
        interval,
        timeout,
        bind_port,
    })
}

fn setns(path: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a valid fd; CLONE_NEWNET is the namespace type it refers to.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn parse_reply(buf: &[u8]) -> Result<(String, String), String> {
    let text = String::from_utf8_lossy(buf);
    let line = text.trim_end_matches(['\r', '\n']);
    line.split_once(' ')
        .map(|(b, c)| (b.to_string(), c.to_string()))
        .ok_or_else(|| format!("malformed reply {line:?}"))
}

type Outcome = Result<(String, String, SocketAddr), std::io::Error>;

fn tcp(target: SocketAddr, timeout: Duration) -> Outcome {
    let s = TcpStream::connect_timeout(&target, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    let peer = s.peer_addr()?;
    (&s).write_all(b"hello\n")?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    let (b, c) = parse_reply(line.as_bytes()).map_err(std::io::Error::other)?;
    Ok((b, c, peer))
}

/// One request on a connection that stays open.
fn tcp_on(s: &TcpStream, timeout: Duration) -> Outcome {
    s.set_read_timeout(Some(timeout))?;
    let peer = s.peer_addr()?;
    (&*s).write_all(b"hello\n")?;
    let mut line = String::new();
    if BufReader::new(s).read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    let (b, c) = parse_reply(line.as_bytes()).map_err(std::io::Error::other)?;
    Ok((b, c, peer))
}

fn udp_once(sock: &UdpSocket, target: Option<SocketAddr>, timeout: Duration) -> Outcome {
    match target {
        Some(t) => sock.send_to(b"hello\n", t)?,
        None => sock.send(b"hello\n")?,
    };
    sock.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; 2048];
    let (n, from) = sock.recv_from(&mut buf)?;
    let (b, c) = parse_reply(&buf[..n]).map_err(std::io::Error::other)?;
    Ok((b, c, from))
}

/// A UDP socket of `target`'s family: an IPv6 one (dual-stack, so it can also talk to an
/// IPv4-mapped address) for an IPv6 target.
fn udp_for(target: SocketAddr) -> std::io::Result<UdpSocket> {
    UdpSocket::bind(if target.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    })
}

/// One send of a one-way sender on `sock`, bound to a fixed port: to `target` when
/// `connected` is `None` (unconnected), else on the connected socket, which is connected
/// again (and the datagram sent again) when the send fails; `connected` says whether it
/// is connected after this send.
fn oneway_send(sock: &UdpSocket, target: SocketAddr, connected: Option<&mut bool>) -> Outcome {
    let msg = b"oneway\n";
    let none = || Ok((String::new(), String::new(), target));
    let Some(connected) = connected else {
        sock.send_to(msg, target)?;
        return none();
    };
    if *connected && sock.send(msg).is_ok() {
        return none();
    }
    *connected = false;
    sock.connect(target)?;
    *connected = true;
    sock.send(msg)?;
    none()
}

fn connected(target: SocketAddr) -> std::io::Result<UdpSocket> {
    let s = udp_for(target)?;
    s.connect(target)?;
    Ok(s)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lbt-client: {e}");
            std::process::exit(2);
        }
    };
    if let Some(cg) = &args.cgroup {
        let procs = format!("{cg}/cgroup.procs");
        if let Err(e) = std::fs::write(&procs, std::process::id().to_string()) {
            eprintln!("lbt-client: joining {procs}: {e}");
            std::process::exit(2);
        }
    }
    if let Err(e) = setns(&args.netns) {
        eprintln!("lbt-client: setns {}: {e}", args.netns);
        std::process::exit(2);
    }
    let mut sock: Option<UdpSocket> = None;
    let mut conn: Option<TcpStream> = None;
    let mut oneway: Option<(UdpSocket, bool)> = None;
    let out = std::io::stdout();
    for i in 0..args.count {
        if i > 0 {
            std::thread::sleep(args.interval);
        }
        let start = Instant::now();
        let r = match args.mode.as_str() {
            "tcp" => tcp(args.target, args.timeout),
            "udp" => {
                udp_for(args.target).and_then(|s| udp_once(&s, Some(args.target), args.timeout))
            }
            "udp-connected" => {
                let s = match sock.take() {
                    Some(s) => Ok(s),
                    None => connected(args.target),
                };
                match s {
                    Ok(s) => {
                        let r = udp_once(&s, None, args.timeout);
                        if r.is_ok() {
                            sock = Some(s);
                        }
                        r
                    }
                    Err(e) => Err(e),
                }
            }
            "tcp-connected" => {
                let c = match conn.take() {
                    Some(c) => Ok(c),
                    None => TcpStream::connect_timeout(&args.target, args.timeout),
                };
                match c {
                    Ok(c) => {
                        let r = tcp_on(&c, args.timeout);
                        if r.is_ok() {
                            conn = Some(c);
                        }
                        r
                    }
                    Err(e) => Err(e),
                }
            }
            "udp-oneway" | "udp-oneway-connected" => {
                if oneway.is_none() {
                    let any = if args.target.is_ipv6() {
                        "[::]"
                    } else {
                        "0.0.0.0"
                    };
                    match UdpSocket::bind(format!("{any}:{}", args.bind_port)) {
                        Ok(s) => oneway = Some((s, false)),
                        Err(e) => {
                            eprintln!("lbt-client: bind port {}: {e}", args.bind_port);
                            std::process::exit(2);
                        }
                    }
                }
                let (s, connected) = oneway.as_mut().expect("bound above");
                let connected = (args.mode == "udp-oneway-connected").then_some(connected);
                oneway_send(s, args.target, connected)
            }
            m => {
                eprintln!("lbt-client: unknown mode {m}");
                std::process::exit(2);
            }
        };
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        let line = match r {
            Ok((backend, client_seen, peer)) => serde_json::json!({
                "ok": true, "backend": backend, "client_seen": client_seen,
                "peer": peer.to_string(), "ms": ms,
            }),
            Err(e) => serde_json::json!({
                "ok": false, "error": e.to_string(), "errno": e.raw_os_error(), "ms": ms,
            }),
        };
        let mut o = out.lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    }
}
