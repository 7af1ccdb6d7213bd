//! Minimal servers for the backend pods and the load generators run in the client pod.
//!
//! - TCP: the server accepts, reads 1 byte, writes its 1-byte identity, closes. A client
//!   worker connects, sends 1 byte, reads 1 byte and closes with `SO_LINGER {1, 0}` (a RST),
//!   so neither side keeps TIME_WAIT and the client's ephemeral ports never run out.
//! - UDP: the server answers each datagram with its identity byte. A client worker keeps one
//!   connected socket and one request in flight.

use std::io::{self, Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lbproxy_tests::lab::connect::reset_on_close;
use lbproxy_tests::lab::{run_in_ns, set_rcvtimeo};

/// Threads per server socket.
const SERVER_THREADS: usize = 4;

/// TCP and UDP servers in one backend pod; stopped on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    /// Serves `tcp_port` and `udp_port` on 0.0.0.0 inside `ns`, answering with `id`.
    pub fn start(ns: &str, id: u8, tcp_port: u16, udp_port: u16) -> io::Result<Server> {
        Server::start_on(ns, Ipv4Addr::UNSPECIFIED.into(), id, tcp_port, udp_port)
    }

    /// The same on `any`: 0.0.0.0, or `::` for IPv6 (which, with the namespace's default
    /// `bindv6only=0`, would take IPv4 too; the benchmark runs one family per lab).
    pub fn start_on(
        ns: &str,
        any: IpAddr,
        id: u8,
        tcp_port: u16,
        udp_port: u16,
    ) -> io::Result<Server> {
        let (l, u) = run_in_ns(ns, || -> io::Result<(TcpListener, UdpSocket)> {
            let l = TcpListener::bind(SocketAddr::new(any, tcp_port))?;
            let u = UdpSocket::bind(SocketAddr::new(any, udp_port))?;
            Ok((l, u))
        })?;
        set_rcvtimeo(l.as_raw_fd(), Duration::from_millis(100))?;
        u.set_read_timeout(Some(Duration::from_millis(100)))?;
        let l = Arc::new(l);
        let u = Arc::new(u);
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for _ in 0..SERVER_THREADS {
            let (l, stop) = (l.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut s, _)) = l.accept() else { continue };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                    let mut b = [0u8; 1];
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&[id]);
                    }
                }
            }));
        }
        for _ in 0..2 {
            let (u, stop) = (u.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut b = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, peer)) = u.recv_from(&mut b) {
                        let _ = u.send_to(&[id], peer);
                    }
                }
            }));
        }
        Ok(Server { stop, threads })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The outcome of one load run.
#[derive(Clone, Debug, Default)]
pub struct Load {
    pub ok: u64,
    pub errors: u64,
    pub secs: f64,
    /// Sorted latencies of the successful requests, in microseconds.
    pub lat_us: Vec<u32>,
}

impl Load {
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.secs.max(1e-9)
    }

    pub fn pct(&self, p: f64) -> f64 {
        if self.lat_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_us.len() as f64 - 1.0) * p).round() as usize;
        f64::from(self.lat_us[i.min(self.lat_us.len() - 1)])
    }
}

/// One TCP request on a new connection: connect, 1 byte out, 1 byte in, close (RST).
/// Returns the identity byte.
pub fn tcp_once(addr: SocketAddr, timeout: Duration) -> io::Result<u8> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    let _ = reset_on_close(s.as_raw_fd());
    s.set_read_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

/// `workers` threads inside `ns`, each opening its client with `open` (a failure counts as
/// one error and ends that worker) and then calling `request` on it back to back for `dur`,
/// timing every successful request.
fn drive<C>(
    ns: &str,
    workers: usize,
    dur: Duration,
    open: impl Fn() -> io::Result<C> + Sync,
    request: impl Fn(&mut C) -> io::Result<()> + Sync,
) -> Load {
    run_in_ns(ns, || {
        let start = Instant::now();
        let end = start + dur;
        let parts: Vec<(u64, u64, Vec<u32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..workers)
                .map(|_| {
                    // Threads inherit the creating thread's network namespace.
                    s.spawn(|| {
                        let (mut ok, mut err, mut lat) = (0u64, 0u64, Vec::with_capacity(1 << 16));
                        let Ok(mut client) = open() else {
                            return (0, 1, lat);
                        };
                        loop {
                            let t = Instant::now();
                            if t >= end {
                                break;
                            }
                            match request(&mut client) {
                                Ok(()) => {
                                    ok += 1;
                                    lat.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                                }
                                Err(_) => err += 1,
                            }
                        }
                        (ok, err, lat)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut load = Load {
            secs: start.elapsed().as_secs_f64(),
            ..Load::default()
        };
        for (ok, err, lat) in parts {
            load.ok += ok;
            load.errors += err;
            load.lat_us.extend(lat);
        }
        load.lat_us.sort_unstable();
        load
    })
}

/// `workers` threads inside `ns`, each making new TCP connections to `addr` for `dur`.
pub fn tcp_crr(ns: &str, addr: SocketAddr, workers: usize, dur: Duration) -> Load {
    drive(
        ns,
        workers,
        dur,
        || Ok(()),
        |()| tcp_once(addr, Duration::from_secs(1)).map(drop),
    )
}

/// `workers` threads inside `ns`, each with one connected UDP socket and one request to
/// `addr` in flight at a time, for `dur`.
pub fn udp_rr(ns: &str, addr: SocketAddr, workers: usize, dur: Duration) -> Load {
    drive(
        ns,
        workers,
        dur,
        || {
            let any: IpAddr = if addr.is_ipv6() {
                Ipv6Addr::UNSPECIFIED.into()
            } else {
                Ipv4Addr::UNSPECIFIED.into()
            };
            let sock = UdpSocket::bind(SocketAddr::new(any, 0))?;
            sock.connect(addr)?;
            sock.set_read_timeout(Some(Duration::from_millis(200)))?;
            Ok(sock)
        },
        |sock| {
            if let Err(e) = sock.send(b"x") {
                std::thread::sleep(Duration::from_millis(1));
                return Err(e);
            }
            sock.recv(&mut [0u8; 16]).map(drop)
        },
    )
}
