//! Socket-level load balancing: the cgroup programs (`lb_connect4`, `lb_sendmsg4`,
//! `lb_recvmsg4`, `lb_getpeername4`) on `--cgroup-root`, and their settings.
//!
//! Links are pinned under `--bpffs-dir` as `cgroup-links/<program>`, so the programs stay
//! attached while the controller restarts. A new controller attaches its own programs first
//! and then detaches the pinned ones: for that moment both run, which is harmless (the
//! second sees the backend address the first wrote, which is no frontend).

use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use aya::maps::{Array, Map, MapData};
use aya::programs::links::FdLink;
use aya::programs::{CgroupAttachMode, CgroupSockAddr};
use lbproxy_common::{SOCK_F_ALL_NETNS, SOCK_F_ENABLED, SockConfig, map_names, program_names};

use super::{BpfError, Datapath, open_pinned};
use crate::config::{CgroupRoot, SocketLb};

/// The directory under `--bpffs-dir` that holds the cgroup links' pins.
pub const LINKS_DIR: &str = "cgroup-links";
/// Where lbproxy mounts its own cgroup2 hierarchy when `/sys/fs/cgroup` is not cgroup v2.
pub const OWN_MOUNT: &str = "/run/lbproxy/cgroupv2";
const SYS_FS_CGROUP: &str = "/sys/fs/cgroup";
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
/// `SO_NETNS_COOKIE` (asm-generic; Linux 5.14).
const SO_NETNS_COOKIE: libc::c_int = 71;

#[derive(Debug, thiserror::Error)]
pub enum SockError {
    #[error(
        "cgroupRoot {0}: not a cgroup v2 directory; give a directory of a cgroup2 mount (`mount -t cgroup2 none DIR`), or leave cgroupRoot unset to use /sys/fs/cgroup or lbproxy's own mount at {OWN_MOUNT}"
    )]
    NotCgroup2(PathBuf),
    #[error("cgroupRoot {path}: {step}: {source}")]
    Io {
        path: PathBuf,
        step: &'static str,
        source: std::io::Error,
    },
    #[error("this network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14+): {0}")]
    NetnsCookie(std::io::Error),
    #[error("program {name} on cgroup {cgroup}: {step}: {reason}")]
    Attach {
        name: &'static str,
        cgroup: PathBuf,
        step: &'static str,
        reason: String,
    },
    #[error("sock_diag {0}: {1}")]
    Diag(&'static str, std::io::Error),
    #[error(transparent)]
    Bpf(#[from] BpfError),
}

fn is_cgroup2(path: &Path) -> bool {
    super::fs_type_is(path, CGROUP2_SUPER_MAGIC)
}

/// The cgroup v2 directory to attach to: the one given, which must be cgroup v2; by default
/// `/sys/fs/cgroup` when that is cgroup v2, else [`OWN_MOUNT`], mounted here when it is not
/// yet (as Cilium does on cgroup v1 hosts: a new cgroup2 hierarchy's root holds every
/// process of the node).
pub fn resolve_cgroup_root(root: &CgroupRoot) -> Result<PathBuf, SockError> {
    match root {
        CgroupRoot::Path(p) if is_cgroup2(p) => Ok(p.clone()),
        CgroupRoot::Path(p) => Err(SockError::NotCgroup2(p.clone())),
        CgroupRoot::Default if is_cgroup2(Path::new(SYS_FS_CGROUP)) => {
            Ok(PathBuf::from(SYS_FS_CGROUP))
        }
        CgroupRoot::Default => {
            let path = PathBuf::from(OWN_MOUNT);
            if is_cgroup2(&path) {
                return Ok(path);
            }
            let io = |step, source| SockError::Io {
                path: path.clone(),
                step,
                source,
            };
            std::fs::create_dir_all(&path).map_err(|e| io("creating the mount point", e))?;
            let target = std::ffi::CString::new(OWN_MOUNT).expect("no NUL");
            // SAFETY: NUL-terminated strings that outlive the call; no data.
            let rc = unsafe {
                libc::mount(
                    c"none".as_ptr(),
                    target.as_ptr(),
                    c"cgroup2".as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            if rc != 0 {
                return Err(io(
                    "mounting cgroup2 (/sys/fs/cgroup is not cgroup v2)",
                    std::io::Error::last_os_error(),
                ));
            }
            tracing::info!(
                path = OWN_MOUNT,
                "mounted a cgroup2 hierarchy for the socket-level programs (/sys/fs/cgroup is not cgroup v2)"
            );
            Ok(path)
        }
    }
}

/// The cookie of the network namespace this process runs in.
pub fn netns_cookie() -> std::io::Result<u64> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("0.0.0.0:0"))?;
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the buffer and its length describe `cookie`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Writes `LB_SOCKCFG_V1`.
fn write_config(dir: &Path, config: SockConfig) -> Result<(), BpfError> {
    let mut map: Array<MapData, SockConfig> = open_pinned(dir, map_names::SOCK_CONFIG, Map::Array)?;
    map.set(0, config, 0).map_err(|source| BpfError::Map {
        name: map_names::SOCK_CONFIG,
        path: dir.join(map_names::SOCK_CONFIG),
        source,
    })
}

/// The pins of the cgroup links under `dir`.
pub fn pinned_links(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir.join(LINKS_DIR)) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    out.sort();
    out
}

/// Detaches and unpins every cgroup link under `dir`. Returns the programs detached.
pub fn detach_all(dir: &Path) -> Result<Vec<String>, BpfError> {
    let mut out = Vec::new();
    for p in pinned_links(dir) {
        super::cleanup::detach_and_unpin(&p)?;
        out.push(
            p.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into()),
        );
    }
    Ok(out)
}

/// Applies `--socket-lb` and `--cgroup-root`: writes the settings, then attaches the four
/// programs to the cgroup (replacing links an earlier run pinned), or with `off` detaches
/// them. Returns the cgroup attached to.
pub fn attach(
    dp: &mut Datapath,
    root: &CgroupRoot,
    mode: SocketLb,
) -> Result<Option<PathBuf>, SockError> {
    let dir = dp.dir.clone();
    if mode == SocketLb::Off {
        write_config(&dir, SockConfig::default())?;
        let detached = detach_all(&dir)?;
        tracing::info!(
            ?detached,
            "socket-level load balancing off: the node's own processes are not load-balanced"
        );
        return Ok(None);
    }
    let cgroup = resolve_cgroup_root(root)?;
    let netns_cookie = netns_cookie().map_err(SockError::NetnsCookie)?;
    let flags = SOCK_F_ENABLED
        | if mode == SocketLb::Pods {
            SOCK_F_ALL_NETNS
        } else {
            0
        };
    // The settings before the programs, so their first socket finds them.
    write_config(
        &dir,
        SockConfig {
            netns_cookie,
            flags,
            _pad: 0,
        },
    )?;
    let cg = std::fs::File::open(&cgroup).map_err(|source| SockError::Io {
        path: cgroup.clone(),
        step: "opening",
        source,
    })?;
    let links = dir.join(LINKS_DIR);
    std::fs::create_dir_all(&links).map_err(|source| BpfError::Io {
        path: links.clone(),
        source,
    })?;
    for name in program_names::SOCK {
        let err = |step, reason: String| SockError::Attach {
            name,
            cgroup: cgroup.clone(),
            step,
            reason,
        };
        let prog: &mut CgroupSockAddr = dp
            .ebpf
            .program_mut(name)
            .ok_or_else(|| err("finding it", "missing from the object".into()))?
            .try_into()
            .map_err(|e| err("finding it", super::error_chain(&e)))?;
        // Links from BPF_LINK_CREATE always allow other programs beside them: no flags.
        let id = prog
            .attach(&cg, CgroupAttachMode::Single)
            .map_err(|e| err("attaching", super::error_chain(&e)))?;
        let link: FdLink = prog
            .take_link(id)
            .map_err(|e| err("taking the link", super::error_chain(&e)))?
            .try_into()
            .map_err(|e| err("not an fd link", super::error_chain(&e)))?;
        let pin = links.join(name);
        if pin.exists() {
            // The earlier run's link: ours is attached, so it can go.
            super::cleanup::detach_and_unpin(&pin)?;
        }
        link.pin(&pin)
            .map_err(|e| err("pinning the link", super::error_chain(&e)))?;
    }
    tracing::info!(
        cgroup = %cgroup.display(),
        mode = mode.as_str(),
        netns_cookie,
        "socket-level load balancing attached (connect, sendmsg, recvmsg, getpeername; 4 and 6)"
    );
    Ok(Some(cgroup))
}

/// What one [`reap`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Reaped {
    /// Translated sockets whose backend is gone (their reverse entries are removed).
    pub stale: usize,
    /// Of those, the sockets still open, destroyed.
    pub destroyed: usize,
    /// Destroys the kernel refused (the socket closed meanwhile, say).
    pub failed: usize,
}

/// Destroys the node's sockets translated to a backend that is gone from the socket's
/// service: one that is no longer a member of the service it was chosen for
/// (`LB_MEMBERS_V1`, the per-packet path's test of a live flow), even if another service
/// still has the same address and port; or whose id is no longer in `LB_BACKENDS_V1` or now
/// names another address. A terminating endpoint listed in the service's slices keeps its
/// sockets until it goes. The reverse entries of those sockets go too.
pub fn reap(dir: &Path) -> Result<Reaped, SockError> {
    use aya::maps::HashMap as BpfHashMap;
    use lbproxy_common::{
        Backend, Backend6, MemberKey, SockRevKey, SockRevKey6, SockRevValue, SockRevValue6,
    };
    let mut rev: BpfHashMap<MapData, SockRevKey, SockRevValue> =
        open_pinned(dir, map_names::SOCK_REV, Map::LruHashMap)?;
    let mut rev6: BpfHashMap<MapData, SockRevKey6, SockRevValue6> =
        open_pinned(dir, map_names::SOCK_REV6, Map::LruHashMap)?;
    let backends: BpfHashMap<MapData, u32, Backend> =
        open_pinned(dir, map_names::BACKENDS, Map::HashMap)?;
    let backends6: BpfHashMap<MapData, u32, Backend6> =
        open_pinned(dir, map_names::BACKENDS6, Map::HashMap)?;
    let members: BpfHashMap<MapData, MemberKey, u32> =
        open_pinned(dir, map_names::MEMBERS, Map::HashMap)?;
    let member = |svc_id, backend_id| members.get(&MemberKey { svc_id, backend_id }, 0).is_ok();
    let mut stale: std::collections::BTreeSet<SockRevKey> = std::collections::BTreeSet::new();
    for (k, v) in rev.iter().flatten() {
        let live = member(v.svc_id, v.backend_id)
            && backends
                .get(&v.backend_id, 0)
                .is_ok_and(|b| b.addr == k.backend_addr && b.port_be == k.backend_port_be);
        if !live {
            stale.insert(k);
        }
    }
    let mut stale6: std::collections::BTreeSet<SockRevKey6> = std::collections::BTreeSet::new();
    for (k, v) in rev6.iter().flatten() {
        let live = member(v.svc_id, v.backend_id)
            && backends6
                .get(&v.backend_id, 0)
                .is_ok_and(|b| b.addr == k.backend_addr && b.port_be == k.backend_port_be);
        if !live {
            stale6.insert(k);
        }
    }
    let mut out = Reaped {
        stale: stale.len() + stale6.len(),
        ..Reaped::default()
    };
    if out.stale == 0 {
        return Ok(out);
    }
    let diag = super::sock_diag::SockDiag::open().map_err(|e| SockError::Diag("open", e))?;
    for proto in [lbproxy_common::IPPROTO_TCP, lbproxy_common::IPPROTO_UDP] {
        let v4 = stale.iter().any(|k| k.proto == proto);
        let v6 = stale6.iter().any(|k| k.proto == proto);
        if !v4 && !v6 {
            continue;
        }
        let mut socks = Vec::new();
        if v4 {
            socks.extend(diag.dump(proto).map_err(|e| SockError::Diag("dump", e))?);
        }
        // IPv6 sockets: those talking IPv6, and those talking IPv4 through mapped addresses.
        socks.extend(diag.dump6(proto).map_err(|e| SockError::Diag("dump", e))?);
        for s in socks {
            let backend = if let Some((addr, port)) = s.remote() {
                let key = SockRevKey {
                    cookie: s.cookie,
                    backend_addr: addr,
                    backend_port_be: port.to_be(),
                    proto,
                    _pad: 0,
                };
                if !stale.contains(&key) {
                    continue;
                }
                std::net::SocketAddr::from((addr, port))
            } else if let Some((addr, port)) = s.remote6() {
                let key = SockRevKey6 {
                    cookie: s.cookie,
                    backend_addr: addr,
                    backend_port_be: port.to_be(),
                    proto,
                    _pad: 0,
                    _pad2: 0,
                };
                if !stale6.contains(&key) {
                    continue;
                }
                std::net::SocketAddr::from((addr, port))
            } else {
                continue;
            };
            match diag.destroy(proto, &s) {
                Ok(()) => {
                    out.destroyed += 1;
                    tracing::info!(
                        cookie = s.cookie,
                        %backend,
                        proto,
                        "destroyed a node socket whose backend left"
                    );
                }
                Err(e) => {
                    out.failed += 1;
                    tracing::warn!(
                        cookie = s.cookie,
                        "destroying a node socket whose backend left: {e}"
                    );
                }
            }
        }
    }
    for k in &stale {
        let _ = rev.remove(k);
    }
    for k in &stale6 {
        let _ = rev6.remove(k);
    }
    Ok(out)
}

/// The controller's cue to the socket reaper: how many syncs deleted map entries, and how
/// many created a frontend.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncCue {
    pub deletes: u64,
    pub frontends: u64,
}

/// Runs [`reap`] at start, whenever `synced` moves (a sync deleted something or created a
/// frontend), and every 30 s, off the controller's loop. At start, after a sync that created
/// a frontend, and every 30 s, it then destroys the node's UDP sockets connected to the
/// address of a UDP frontend that appeared since the last look ([`super::sock_vip`]), which
/// reads every frontend of the maps: after every sync that only deleted (an endpoint that
/// left) that read took most of a core at 10,000 Services and 100 endpoint changes a second
/// (docs/benchmarks.md, sustained churn). A frontend created anew has a new service id, so a
/// look that comes later still finds it fresh. Counts destroyed sockets in `metrics`.
pub fn spawn_reaper(
    dir: PathBuf,
    mut synced: tokio::sync::watch::Receiver<SyncCue>,
    metrics: std::sync::Arc<crate::telemetry::Metrics>,
) {
    tokio::spawn(async move {
        let mut frontends = super::sock_vip::NewFrontends::default();
        // Looked at start, as if frontends had been created.
        let mut looked_at: Option<u64> = None;
        let mut timer_fired = false;
        loop {
            let d = dir.clone();
            let started = std::time::Instant::now();
            let created = synced.borrow_and_update().frontends;
            let look = timer_fired || looked_at != Some(created);
            let run = tokio::task::spawn_blocking(move || {
                let reaped = reap(&d);
                let fresh = look.then(|| frontends.look(&d));
                (reaped, fresh, frontends)
            })
            .await;
            match run {
                Ok((reaped, fresh, f)) => {
                    frontends = f;
                    report_reap(reaped, started, &metrics);
                    match fresh {
                        Some(Ok(r)) => {
                            looked_at = Some(created);
                            metrics.sock_destroyed.inc_by(r.destroyed as u64);
                        }
                        Some(Err(e)) => {
                            tracing::warn!("socket reaper, new UDP frontends: {e}");
                        }
                        None => {}
                    }
                }
                Err(e) => {
                    tracing::warn!("socket reaper task: {e}");
                    frontends = super::sock_vip::NewFrontends::default();
                    looked_at = None;
                }
            }
            timer_fired = tokio::select! {
                r = synced.changed() => if r.is_err() { return } else { false },
                _ = tokio::time::sleep(std::time::Duration::from_secs(30)) => true,
            };
        }
    });
}

/// Logs and counts what one [`reap`] did.
fn report_reap(
    r: Result<Reaped, SockError>,
    started: std::time::Instant,
    metrics: &crate::telemetry::Metrics,
) {
    match r {
        Ok(r) => {
            metrics.sock_destroyed.inc_by(r.destroyed as u64);
            if r.stale > 0 {
                tracing::info!(
                    stale = r.stale,
                    destroyed = r.destroyed,
                    failed = r.failed,
                    took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                    "node sockets of backends that left"
                );
            }
        }
        Err(e) => tracing::warn!("socket reaper: {e}"),
    }
}
