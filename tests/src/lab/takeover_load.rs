//! The client load of the takeover tests (issue 29): what a node's clients do while lbproxy
//! takes a Service over from kube-proxy, and every way they could notice it.
//!
//! [`Load::start`] opens, from a client pod, [`TCP_CONNS`] long-lived TCP connections to the
//! TCP frontend and [`UDP_SOCKETS`] connected UDP sockets to the UDP frontend, and waits for
//! each one's first answer: the backend named in that answer is the one the connection or
//! socket must keep. Then each sends a request every [`EVERY`], and a new TCP connection (one
//! request, then close) is opened [`NEW_PER_SECOND`] times a second.
//!
//! A [`Failure`] is recorded, as it happens, for every request that got no answer within
//! [`TIMEOUT`], was reset, refused or closed, failed otherwise, or was answered by another
//! backend than its connection's (or socket's) first. A long-lived TCP connection that was
//! reset or closed is dead: its lane records that once and stops. Timeouts and refusals
//! leave a lane going (a late answer is then read as the next one's: the same backend).
//!
//! Every lane is a thread of its own: the long-lived sockets are made in the pod's namespace
//! and used from plain threads; the new connections' thread runs inside the namespace
//! ([`run_in_ns`]). [`Load::failures_since`] reads the failures while the load runs;
//! [`Load::stop`] ends it and returns a [`Report`] (per connection its backend and counts,
//! and [`Report::summary`] with every failure's time relative to a mark).
//!
//! Check: `cargo test -p lbproxy-tests --test takeover load_is_clean_under_kube_proxy`
//! (zero failures through kube-proxy's rules alone) and `naive_switch_baseline` (failures
//! seen when kube-proxy's rules and conntrack are flushed under it).

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Pod;
use super::net::{Reply, TcpConn, tcp_request_here};
use super::ns::run_in_ns;
use super::paced::{SinceKill, tick_while};

/// Long-lived TCP connections.
pub const TCP_CONNS: usize = 6;
/// Connected UDP sockets.
pub const UDP_SOCKETS: usize = 2;
/// One request per long-lived connection or socket this often.
pub const EVERY: Duration = Duration::from_millis(100);
/// New TCP connections a second.
pub const NEW_PER_SECOND: u32 = 5;
/// A request not answered within this is a timeout.
pub const TIMEOUT: Duration = Duration::from_secs(1);
/// The lanes start this far apart, so their requests do not all go out at once.
const STAGGER: Duration = Duration::from_millis(7);
/// The request line (the lab backends answer any line).
const REQUEST: &[u8] = b"hello\n";

/// Which part of the load a request belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lane {
    /// Long-lived TCP connection `i`.
    Tcp(usize),
    /// Connected UDP socket `i`.
    Udp(usize),
    /// The new TCP connections.
    New,
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Lane::Tcp(i) => write!(f, "tcp#{i}"),
            Lane::Udp(i) => write!(f, "udp#{i}"),
            Lane::New => f.write_str("new-tcp"),
        }
    }
}

/// What went wrong with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// No answer within [`TIMEOUT`] (or no connection within it).
    Timeout,
    /// ECONNRESET, ECONNABORTED or EPIPE.
    Reset,
    /// ECONNREFUSED: a RST to a SYN, or an ICMP port unreachable to a connected UDP socket.
    Refused,
    /// The peer closed the connection (end of stream).
    Closed,
    /// Answered, by another backend than the connection's first.
    BackendChanged,
    /// Any other error (unreachable, a malformed answer, ...).
    Other,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Timeout => "timeout",
            Kind::Reset => "reset",
            Kind::Refused => "refused",
            Kind::Closed => "closed",
            Kind::BackendChanged => "backend changed",
            Kind::Other => "error",
        })
    }
}

impl Kind {
    fn of(e: &io::Error) -> Kind {
        use io::ErrorKind as E;
        match e.kind() {
            E::WouldBlock | E::TimedOut => Kind::Timeout,
            E::ConnectionReset | E::ConnectionAborted | E::BrokenPipe => Kind::Reset,
            E::ConnectionRefused => Kind::Refused,
            E::UnexpectedEof => Kind::Closed,
            _ => Kind::Other,
        }
    }
}

/// One failed request.
#[derive(Clone, Debug)]
pub struct Failure {
    /// When the request was sent.
    pub at: Instant,
    /// How long until it failed.
    pub took: Duration,
    pub lane: Lane,
    pub kind: Kind,
    /// The error, or which backend answered instead.
    pub detail: String,
}

impl Failure {
    /// `+1234ms tcp#3 timeout after 1.001s: <detail>`, the time relative to `mark` (which
    /// must not be before `start`, the load's start).
    pub fn show(&self, start: Instant, mark: Instant) -> String {
        format!(
            "{} {} {} after {:?}: {}",
            since(start, self.at, mark),
            self.lane,
            self.kind,
            self.took,
            self.detail
        )
    }
}

/// `at` relative to `mark`, both taken since `start`.
fn since(start: Instant, at: Instant, mark: Instant) -> SinceKill {
    SinceKill(
        at.saturating_duration_since(start),
        mark.saturating_duration_since(start),
    )
}

/// A long-lived connection or socket: its lane, its own address, and the backend its first
/// request was answered by.
#[derive(Clone, Debug)]
pub struct Conn {
    pub lane: Lane,
    pub local: SocketAddr,
    pub backend: String,
}

/// What one long-lived lane did.
#[derive(Clone, Debug)]
pub struct ConnReport {
    pub conn: Conn,
    /// Requests sent after the first.
    pub requests: usize,
    /// Of those, answered by [`Conn::backend`].
    pub answered: usize,
    /// The lane stopped early: its connection was reset or closed.
    pub dead: bool,
}

/// What the new connections did.
#[derive(Clone, Debug, Default)]
pub struct NewReport {
    pub tried: usize,
    /// Answers per backend.
    pub by_backend: BTreeMap<String, usize>,
}

/// What the whole load did ([`Load::stop`]).
#[derive(Clone, Debug)]
pub struct Report {
    pub start: Instant,
    pub stopped: Instant,
    pub conns: Vec<ConnReport>,
    pub new: NewReport,
    pub failures: Vec<Failure>,
}

impl Report {
    /// The failures from `t` on (by the time their request was sent).
    pub fn failures_since(&self, t: Instant) -> Vec<Failure> {
        self.failures
            .iter()
            .filter(|f| f.at >= t)
            .cloned()
            .collect()
    }

    /// Every request the load sent (first requests included).
    pub fn requests(&self) -> usize {
        self.conns.iter().map(|c| c.requests + 1).sum::<usize>() + self.new.tried
    }

    /// The load's lanes and counts, and each failure, times relative to `mark`.
    pub fn summary(&self, mark: Instant) -> String {
        let mut out = format!(
            "load ran {:?} (started {} relative to the mark), {} requests, {} failed",
            self.stopped - self.start,
            since(self.start, self.start, mark),
            self.requests(),
            self.failures.len()
        );
        for c in &self.conns {
            out.push_str(&format!(
                "\n  {} from {} to {}: {} requests, {} answered by it{}",
                c.conn.lane,
                c.conn.local,
                c.conn.backend,
                c.requests,
                c.answered,
                if c.dead { ", then dead" } else { "" }
            ));
        }
        out.push_str(&format!(
            "\n  new-tcp: {} tried, answers {:?}",
            self.new.tried, self.new.by_backend
        ));
        out.push_str(&show_failures(&self.failures, self.start, mark));
        out
    }

    /// Panics unless the load saw no failure at all and every long-lived lane ran to the
    /// end; the message names the test (`what`), gives the summary relative to `mark`
    /// (called `mark_name`), then `extra` (logs).
    pub fn assert_clean(&self, what: &str, mark: Instant, mark_name: &str, extra: &str) {
        assert!(
            self.failures.is_empty(),
            "[{what}] {} failed requests (times relative to {mark_name}):\n{}\n{extra}",
            self.failures.len(),
            self.summary(mark)
        );
        assert!(
            self.conns.iter().all(|c| c.requests > 0 && !c.dead),
            "[{what}] every long-lived lane ran to the end:\n{}",
            self.summary(mark)
        );
    }
}

/// The failures `v` (of a load started at `start`) counted per lane and kind, then one line
/// per failure, its time relative to `mark`; repeats of one failure (the same lane, kind
/// and detail) folded into the line of the first, with their count and the last's time.
pub fn show_failures(v: &[Failure], start: Instant, mark: Instant) -> String {
    let mut by_kind: BTreeMap<(Lane, Kind), usize> = BTreeMap::new();
    for f in v {
        *by_kind.entry((f.lane, f.kind)).or_default() += 1;
    }
    let mut out = String::new();
    if !v.is_empty() {
        let counts: Vec<String> = by_kind
            .iter()
            .map(|((l, k), n)| format!("{l} {k} x{n}"))
            .collect();
        out.push_str(&format!("\n  failures: {}", counts.join(", ")));
    }
    let mut runs: Vec<(&Failure, usize, Instant)> = Vec::new();
    for f in v {
        let same = |r: &&mut (&Failure, usize, Instant)| {
            (r.0.lane, r.0.kind, &r.0.detail) == (f.lane, f.kind, &f.detail)
        };
        match runs.iter_mut().find(same) {
            Some(r) => (r.1, r.2) = (r.1 + 1, f.at),
            None => runs.push((f, 1, f.at)),
        }
    }
    for (f, n, last) in runs {
        out.push_str(&format!("\n    {}", f.show(start, mark)));
        if n > 1 {
            out.push_str(&format!(
                " (x{n} in all, the last at {})",
                since(start, last, mark)
            ));
        }
    }
    out
}

/// The running load. Stops on [`Load::stop`] or drop.
pub struct Load {
    start: Instant,
    conns: Vec<Conn>,
    stop: Arc<AtomicBool>,
    failures: Arc<Mutex<Vec<Failure>>>,
    lanes: Vec<JoinHandle<ConnReport>>,
    new: Option<JoinHandle<NewReport>>,
}

/// A long-lived socket of either kind, made in the pod's namespace.
enum Sock {
    Tcp(TcpConn),
    Udp(UdpSocket),
}

impl Sock {
    /// One request and its answer.
    fn request(&mut self) -> io::Result<Reply> {
        match self {
            Sock::Tcp(c) => c.request(),
            Sock::Udp(u) => udp_request(u),
        }
    }
}

/// Sends [`REQUEST`] on a connected UDP socket and reads one answer (at most [`TIMEOUT`],
/// the socket's read timeout). Answers still queued from requests that timed out are
/// dropped first, so each answer read is the one to this request.
fn udp_request(u: &UdpSocket) -> io::Result<Reply> {
    u.set_nonblocking(true)?;
    let mut buf = [0u8; 512];
    while u.recv(&mut buf).is_ok() {}
    u.set_nonblocking(false)?;
    u.send(REQUEST)?;
    let n = u.recv(&mut buf)?;
    Reply::parse(&String::from_utf8_lossy(&buf[..n]))
}

/// A connected UDP socket to `to` from an ephemeral port, in the calling thread's namespace.
fn udp_connect_here(to: SocketAddr) -> io::Result<UdpSocket> {
    let any: IpAddr = match to {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let u = UdpSocket::bind((any, 0))?;
    u.connect(to)?;
    u.set_read_timeout(Some(TIMEOUT))?;
    Ok(u)
}

impl Load {
    /// Starts the load from `client` to `tcp_vip` (TCP) and `udp_vip` (UDP). Returns once
    /// every long-lived connection and socket got its first answer; panics, naming the lane,
    /// if one cannot be opened or is not answered (then the load could not start).
    pub fn start(client: &Pod, tcp_vip: SocketAddr, udp_vip: SocketAddr) -> Load {
        Load::start_in(&client.netns, tcp_vip, udp_vip)
    }

    /// [`Load::start`] from the network namespace `netns` (a pod's, or an external
    /// client's).
    pub fn start_in(netns: &str, tcp_vip: SocketAddr, udp_vip: SocketAddr) -> Load {
        let opened: Vec<(Lane, Sock, Conn)> = run_in_ns(netns, || {
            let tcp = (0..TCP_CONNS).map(|i| {
                let c = TcpConn::connect_here(tcp_vip.ip(), tcp_vip.port(), TIMEOUT)
                    .unwrap_or_else(|e| panic!("load: tcp#{i}: connect to {tcp_vip}: {e}"));
                let local = c.local;
                (Lane::Tcp(i), Sock::Tcp(c), local)
            });
            let udp = (0..UDP_SOCKETS).map(|i| {
                let u = udp_connect_here(udp_vip)
                    .unwrap_or_else(|e| panic!("load: udp#{i}: socket to {udp_vip}: {e}"));
                let local = u.local_addr().expect("UDP socket's address");
                (Lane::Udp(i), Sock::Udp(u), local)
            });
            tcp.chain(udp)
                .map(|(lane, mut s, local)| {
                    let first = s.request().unwrap_or_else(|e| {
                        panic!("load: {lane} from {local}: first request: {e}")
                    });
                    let conn = Conn {
                        lane,
                        local,
                        backend: first.backend,
                    };
                    (lane, s, conn)
                })
                .collect()
        });
        let start = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let failures: Arc<Mutex<Vec<Failure>>> = Arc::default();
        let mut conns = Vec::new();
        let mut lanes = Vec::new();
        for (k, (_, sock, conn)) in opened.into_iter().enumerate() {
            conns.push(conn.clone());
            let (stop, failures) = (stop.clone(), failures.clone());
            let first = start + STAGGER * k as u32;
            lanes.push(std::thread::spawn(move || {
                long_lived(sock, conn, first, &stop, &failures)
            }));
        }
        let ns = netns.to_owned();
        let (stop2, failures2) = (stop.clone(), failures.clone());
        let first_new = start + STAGGER * lanes.len() as u32;
        let new = std::thread::spawn(move || {
            run_in_ns(&ns, || new_conns(tcp_vip, first_new, &stop2, &failures2))
        });
        Load {
            start,
            conns,
            stop,
            failures,
            lanes,
            new: Some(new),
        }
    }

    /// When the paced requests began.
    pub fn started(&self) -> Instant {
        self.start
    }

    /// The long-lived connections and sockets, each with the backend of its first answer.
    pub fn conns(&self) -> &[Conn] {
        &self.conns
    }

    /// The failures so far of requests sent from `t` on.
    pub fn failures_since(&self, t: Instant) -> Vec<Failure> {
        self.failures
            .lock()
            .unwrap()
            .iter()
            .filter(|f| f.at >= t)
            .cloned()
            .collect()
    }

    /// Stops every lane (each finishes the request it is in, at most [`TIMEOUT`]) and
    /// reports.
    pub fn stop(mut self) -> Report {
        self.stop.store(true, Ordering::SeqCst);
        let conns = self
            .lanes
            .drain(..)
            .map(|t| t.join().expect("a load lane panicked"))
            .collect();
        let new = self
            .new
            .take()
            .map(|t| t.join().expect("the new-connection lane panicked"))
            .unwrap_or_default();
        let stopped = Instant::now();
        let mut failures = std::mem::take(&mut *self.failures.lock().unwrap());
        failures.sort_by_key(|f| f.at);
        Report {
            start: self.start,
            stopped,
            conns,
            new,
            failures,
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.lanes.drain(..) {
            let _ = t.join();
        }
        if let Some(t) = self.new.take() {
            let _ = t.join();
        }
    }
}

fn record(failures: &Mutex<Vec<Failure>>, f: Failure) {
    failures.lock().unwrap().push(f);
}

/// A long-lived lane: a request on `sock` every [`EVERY`] from `first` until `stop`, or
/// until its TCP connection is reset or closed.
fn long_lived(
    mut sock: Sock,
    conn: Conn,
    first: Instant,
    stop: &AtomicBool,
    failures: &Mutex<Vec<Failure>>,
) -> ConnReport {
    let mut rep = ConnReport {
        conn: conn.clone(),
        requests: 0,
        answered: 0,
        dead: false,
    };
    let dead = std::cell::Cell::new(false);
    tick_while(
        first,
        EVERY,
        |_| !stop.load(Ordering::SeqCst) && !dead.get(),
        || {
            let at = Instant::now();
            rep.requests += 1;
            let (kind, detail) = match sock.request() {
                Ok(r) if r.backend == conn.backend => {
                    rep.answered += 1;
                    return;
                }
                Ok(r) => (
                    Kind::BackendChanged,
                    format!("answered by {r}, first by {}", conn.backend),
                ),
                Err(e) => (Kind::of(&e), e.to_string()),
            };
            dead.set(matches!(sock, Sock::Tcp(_)) && matches!(kind, Kind::Reset | Kind::Closed));
            record(
                failures,
                Failure {
                    at,
                    took: at.elapsed(),
                    lane: conn.lane,
                    kind,
                    detail: format!("from {}: {detail}", conn.local),
                },
            );
        },
    );
    rep.dead = dead.get();
    rep
}

/// The new-connection lane, in the client's namespace: [`NEW_PER_SECOND`] connections a
/// second to `vip` from `first` until `stop`, one request each.
fn new_conns(
    vip: SocketAddr,
    first: Instant,
    stop: &AtomicBool,
    failures: &Mutex<Vec<Failure>>,
) -> NewReport {
    let mut rep = NewReport::default();
    tick_while(
        first,
        Duration::from_secs(1) / NEW_PER_SECOND,
        |_| !stop.load(Ordering::SeqCst),
        || {
            let at = Instant::now();
            rep.tried += 1;
            match tcp_request_here(vip.ip(), vip.port(), TIMEOUT) {
                Ok((r, _)) => *rep.by_backend.entry(r.backend).or_default() += 1,
                Err(e) => record(
                    failures,
                    Failure {
                        at,
                        took: at.elapsed(),
                        lane: Lane::New,
                        kind: Kind::of(&e),
                        detail: format!("to {vip}: {e}"),
                    },
                ),
            }
        },
    );
    rep
}
