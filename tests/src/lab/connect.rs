//! A TCP connect from a fixed source port, left in flight: what a client's SYN and the
//! kernel's retransmissions look like to the load balancer. Used by the flow-lifecycle tests
//! and the churn benchmark.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::{Duration, Instant};

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn setsockopt<T>(fd: i32, level: i32, name: i32, v: &T) -> io::Result<()> {
    // SAFETY: valid fd; the option value and its size come from the same `T`.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A TCP socket bound to a fixed source port (SO_REUSEADDR) with a non-blocking connect in
/// flight. Create it inside the client's namespace (`Pod::run`); use it from anywhere.
/// Dropping it closes at once (SO_LINGER 0: a RST if connected), freeing the port.
pub struct PendingConnect {
    fd: Option<OwnedFd>,
    pub port: u16,
    pub started: Instant,
}

/// How long [`PendingConnect::start`] retries a connect refused with EADDRNOTAVAIL.
const TUPLE_RELEASE: Duration = Duration::from_millis(200);

impl PendingConnect {
    /// Starts the connect. Right after a connection on the same tuple was closed with a RST,
    /// the kernel sometimes still holds the tuple for a moment (EADDRNOTAVAIL, about one
    /// reuse in a hundred here, with no socket left on the port when `ss` looks): that is
    /// the client's own socket table, so the connect is retried for up to 200 ms.
    pub fn start(src_port: u16, dst: SocketAddrV4) -> io::Result<PendingConnect> {
        let deadline = Instant::now() + TUPLE_RELEASE;
        loop {
            match PendingConnect::start_once(src_port, dst) {
                Err(e)
                    if e.raw_os_error() == Some(libc::EADDRNOTAVAIL)
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                r => return r,
            }
        }
    }

    fn start_once(src_port: u16, dst: SocketAddrV4) -> io::Result<PendingConnect> {
        // SAFETY: a plain socket call; the fd is owned at once.
        let fd = unsafe {
            let fd = libc::socket(
                libc::AF_INET,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            );
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            OwnedFd::from_raw_fd(fd)
        };
        let raw = fd.as_raw_fd();
        setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            &(1 as libc::c_int),
        )?;
        let local = sockaddr(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, src_port));
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: valid fd and sockaddr.
        if unsafe { libc::bind(raw, (&local as *const libc::sockaddr_in).cast(), len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let remote = sockaddr(dst);
        let started = Instant::now();
        // SAFETY: valid fd and sockaddr.
        let rc = unsafe { libc::connect(raw, (&remote as *const libc::sockaddr_in).cast(), len) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
        }
        Ok(PendingConnect {
            fd: Some(fd),
            port: src_port,
            started,
        })
    }

    fn raw(&self) -> i32 {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// Waits at most `wait`. `None`: still pending; `Some(Ok(t))`: connected `t` after the
    /// connect call; `Some(Err)`: the socket's error.
    pub fn poll(&self, wait: Duration) -> Option<io::Result<Duration>> {
        let mut p = libc::pollfd {
            fd: self.raw(),
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, wait.as_millis().min(60_000) as i32) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return (e.kind() != io::ErrorKind::Interrupted).then_some(Err(e));
        }
        if n == 0 {
            return None;
        }
        let at = self.started.elapsed();
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: valid fd, correctly sized out-parameter.
        let rc = unsafe {
            libc::getsockopt(
                self.raw(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        Some(if rc != 0 {
            Err(io::Error::last_os_error())
        } else if err != 0 {
            Err(io::Error::from_raw_os_error(err))
        } else {
            Ok(at)
        })
    }

    /// Waits until `deadline` for the connect to finish. `Ok(t)`: connected `t` after the
    /// connect call; `Err`: the socket's error, or `TimedOut`.
    pub fn wait_until(&self, deadline: Instant) -> io::Result<Duration> {
        loop {
            if let Some(r) = self.poll(deadline.saturating_duration_since(Instant::now())) {
                return r;
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "not connected {:?} after the connect call",
                        self.started.elapsed()
                    ),
                ));
            }
        }
    }

    /// The connected socket as a blocking stream with `timeout` on reads and writes.
    pub fn into_stream(mut self, timeout: Duration) -> TcpStream {
        let s = TcpStream::from(self.fd.take().expect("socket present"));
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(timeout)).unwrap();
        s.set_write_timeout(Some(timeout)).unwrap();
        s
    }

    /// Closes at once, freeing the source port for another connect.
    pub fn abort(self) {}
}

impl Drop for PendingConnect {
    fn drop(&mut self) {
        if self.fd.is_some() {
            let _ = reset_on_close(self.raw());
        }
    }
}

/// Makes closing the socket `fd` send a RST (SO_LINGER 0): no TIME_WAIT keeps its port.
pub fn reset_on_close(fd: i32) -> io::Result<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, &l)
}
