//! A paced load for restart tests: one request per tick, each recorded with when it started
//! and how long it took, and the failures shown relative to the moment of a kill. And a
//! paced one-way UDP sender ([`OneWay`]) with the receiving end that times its datagrams
//! ([`Arrivals`]), for flows whose client never reads.

use std::fmt;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One request: when it started (since the load began), how long it took, and the backend
/// that answered or the error.
pub struct Attempt {
    pub at: Duration,
    pub took: Duration,
    pub result: Result<String, String>,
}

/// An instant since the load began (`.0`), shown relative to the kill (`.1`): `-12ms`,
/// `+340ms`.
pub struct SinceKill(pub Duration, pub Duration);

impl fmt::Display for SinceKill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (at, kill) = (self.0, self.1);
        if at >= kill {
            write!(f, "+{}ms", (at - kill).as_millis())
        } else {
            write!(f, "-{}ms", (kill - at).as_millis())
        }
    }
}

/// Runs `f` every `tick` from `start` until `start + dur` (late ticks are not made up in a
/// burst), recording each result.
pub fn paced(
    start: Instant,
    dur: Duration,
    tick: Duration,
    mut f: impl FnMut() -> Result<String, String>,
) -> Vec<Attempt> {
    let mut v = Vec::new();
    tick_while(
        start,
        tick,
        |next| next < start + dur,
        || {
            let t = Instant::now();
            let result = f();
            v.push(Attempt {
                at: t - start,
                took: t.elapsed(),
                result,
            });
        },
    );
    v
}

/// Calls `f` at `start`, then every `tick`, as long as `go(when the next call is due)`
/// holds. Late calls are not made up in a burst: a call is due `tick` after the previous
/// one was due, or at once if that has passed.
pub fn tick_while(
    start: Instant,
    tick: Duration,
    mut go: impl FnMut(Instant) -> bool,
    mut f: impl FnMut(),
) {
    let mut next = start;
    while go(next) {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        f();
        next = (next + tick).max(Instant::now());
    }
}

/// The failures among `v`: errors, and answers from anything but `ok`.
pub fn failures<'a>(v: &'a [Attempt], ok: &dyn Fn(&str) -> bool) -> Vec<&'a Attempt> {
    v.iter()
        .filter(|a| a.result.as_deref().map_or(true, |b| !ok(b)))
        .collect()
}

/// `v`, one line each, times relative to `kill`.
pub fn show(v: &[&Attempt], kill: Duration) -> String {
    v.iter()
        .map(|a| {
            let r = match &a.result {
                Ok(b) => format!("answered by {b:?}"),
                Err(e) => e.clone(),
            };
            format!("at {} (took {:?}): {r}", SinceKill(a.at, kill), a.took)
        })
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// The payload's first word that marks a [`OneWay`] sender's datagrams ("oneway <seq>").
pub const ONE_WAY_TAG: &str = "oneway";

/// A one-way UDP sender, as a statsd or syslog client: from a socket the caller bound in
/// its namespace (to a fixed source port), it sends `oneway <seq>` to `dst` every `every`
/// and never reads, so it never learns of an ICMP error. A failed send is recorded and the
/// next one goes on, as such a client does. Stops on [`OneWay::stop`] or drop.
pub struct OneWay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<OneWayLog>>,
}

/// What a [`OneWay`] sender did: datagrams sent, and each failed send (when, the error).
#[derive(Debug, Default)]
pub struct OneWayLog {
    pub sent: usize,
    pub errors: Vec<(Instant, String)>,
}

impl OneWay {
    pub fn start(sock: UdpSocket, dst: SocketAddr, every: Duration) -> OneWay {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut log = OneWayLog::default();
            let mut next = Instant::now();
            let mut seq = 0u64;
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                let msg = format!("{ONE_WAY_TAG} {seq}\n");
                seq += 1;
                match sock.send_to(msg.as_bytes(), dst) {
                    Ok(_) => log.sent += 1,
                    Err(e) => log.errors.push((Instant::now(), e.to_string())),
                }
                next = (next + every).max(Instant::now());
            }
            log
        });
        OneWay {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the sender; what it did.
    pub fn stop(mut self) -> OneWayLog {
        self.halt()
    }

    fn halt(&mut self) -> OneWayLog {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for OneWay {
    fn drop(&mut self) {
        self.halt();
    }
}

/// One datagram at an [`Arrivals`] socket: when its `recv_from` returned, its source, and
/// its payload's first word.
#[derive(Clone, Debug)]
pub struct Arrival {
    pub at: Instant,
    pub from: SocketAddr,
    pub tag: String,
}

/// A backend's receiving socket that answers nothing and records every datagram's arrival
/// at the socket: the kernel's receive timestamp (`SIOCGSTAMPNS` after each `recv_from`), so a recording thread scheduled late does not
/// move an arrival later. Stops on drop.
pub struct Arrivals {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Arrival>>>,
    thread: Option<JoinHandle<()>>,
}

impl Arrivals {
    /// Records what reaches `sock` (bound by the caller in the backend's namespace).
    pub fn start(sock: UdpSocket) -> Arrivals {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (flag, out) = (stop.clone(), log.clone());
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("SO_RCVTIMEO");
        timestamps_on(&sock).expect("SIOCGSTAMPNS");
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !flag.load(Ordering::Relaxed) {
                match sock.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        let at = kernel_stamp(&sock).unwrap_or_else(|e| {
                            panic!("Arrivals: SIOCGSTAMPNS after a datagram: {e}")
                        });
                        let text = String::from_utf8_lossy(&buf[..n]);
                        let tag = text.split_whitespace().next().unwrap_or("").to_owned();
                        out.lock().unwrap().push(Arrival { at, from, tag });
                    }
                    Err(e) if super::net::recv_again(&e) => {}
                    Err(e) => panic!(
                        "Arrivals: recv_from: {e} ({:?}, os error {:?})",
                        e.kind(),
                        e.raw_os_error()
                    ),
                }
            }
        });
        Arrivals {
            stop,
            log,
            thread: Some(thread),
        }
    }

    /// The arrivals so far whose payload starts with `tag`.
    pub fn tagged(&self, tag: &str) -> Vec<Arrival> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.tag == tag)
            .cloned()
            .collect()
    }

    /// Waits up to `within` until `n` datagrams tagged `tag` arrived; how many did.
    pub fn wait_tagged(&self, tag: &str, n: usize, within: Duration) -> usize {
        let end = Instant::now() + within;
        loop {
            let got = self.tagged(tag).len();
            if got >= n || Instant::now() >= end {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Arrivals {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Asks the kernel to timestamp every datagram `sock` receives: the first `SIOCGSTAMPNS`
/// turns it on (`SOCK_TIMESTAMP`, so each `recv_from` records its datagram's stamp for the
/// next one), and answers ENOENT as nothing was received yet. (`SO_TIMESTAMPNS` would put
/// the stamps in control messages instead, and leave `SIOCGSTAMPNS` without one.)
fn timestamps_on(sock: &UdpSocket) -> std::io::Result<()> {
    match kernel_stamp(sock) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(e),
        Ok(_) => Ok(()),
    }
}

/// The kernel's receive time of the last datagram `sock` returned (`SIOCGSTAMPNS`,
/// `CLOCK_REALTIME`), as an [`Instant`].
fn kernel_stamp(sock: &UdpSocket) -> std::io::Result<Instant> {
    use std::os::fd::AsRawFd as _;
    /// `SIOCGSTAMPNS` (`asm-generic/sockios.h`).
    const SIOCGSTAMPNS: libc::c_ulong = 0x8907;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid socket; the kernel writes one timespec to `ts`.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCGSTAMPNS, &raw mut ts) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (now_i, now_s) = (Instant::now(), std::time::SystemTime::now());
    let stamp = std::time::UNIX_EPOCH
        + Duration::new(
            u64::try_from(ts.tv_sec).unwrap_or(0),
            u32::try_from(ts.tv_nsec).unwrap_or(0),
        );
    let ago = now_s.duration_since(stamp).unwrap_or(Duration::ZERO);
    Ok(now_i.checked_sub(ago).unwrap_or(now_i))
}

/// `v`'s times relative to `t0`, in runs: `12x +0.10s..+1.20s`.
pub fn show_arrivals(v: &[Arrival], t0: Instant) -> String {
    let rel = |t: Instant| {
        if t >= t0 {
            format!("+{:.2}s", (t - t0).as_secs_f64())
        } else {
            format!("-{:.2}s", (t0 - t).as_secs_f64())
        }
    };
    match (v.first(), v.last()) {
        (Some(a), Some(b)) => format!("{}x {}..{}", v.len(), rel(a.at), rel(b.at)),
        _ => "none".to_owned(),
    }
}
