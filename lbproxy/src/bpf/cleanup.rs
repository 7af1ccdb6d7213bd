//! `lbproxy cleanup`: detach every link, unpin every map.

use std::path::Path;

use super::BpfError;
use super::attach::pinned_interfaces;

/// Detaches the link pinned at `pin` now (`BPF_LINK_DETACH`). Removing the pin alone frees
/// the link only after an RCU grace period and a kernel workqueue pass: up to hundreds of
/// milliseconds on a busy node, during which the programs keep translating with the flow
/// table as it was. A connection from a source port that an old flow used could then have
/// its SYN-ACK reverse-NATed, and be reset, right after `cleanup` returned (seen in the
/// datapath benchmark).
fn detach_pinned_link(pin: &Path) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    use std::os::unix::ffi::OsStrExt as _;
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_DETACH: libc::c_long = 34;
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())?;
    // union bpf_attr for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags, path_fd.
    let mut get = [0u64; 3];
    get[0] = path.as_ptr() as u64;
    // SAFETY: the attr buffer and the path outlive the call; the size matches the buffer.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, get.as_mut_ptr(), 24) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned, owned from here on.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // union bpf_attr for BPF_LINK_DETACH: link_fd.
    let mut detach = [0u32; 4];
    detach[0] = link.as_raw_fd() as u32;
    // SAFETY: as above.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_DETACH, detach.as_mut_ptr(), 16) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches the link pinned at `pin` now ([`detach_pinned_link`]; failing that, it goes
/// with its pin, logged) and removes the pin.
pub(super) fn detach_and_unpin(pin: &Path) -> Result<(), BpfError> {
    if let Err(e) = detach_pinned_link(pin) {
        tracing::warn!(pin = %pin.display(), "detaching at once failed ({e}); the link goes when its pin is removed");
    }
    std::fs::remove_file(pin).map_err(|source| BpfError::Io {
        path: pin.to_path_buf(),
        source,
    })
}

/// `lbproxy cleanup`: detaches and unpins every link, unpins every map, then removes the
/// directory. Returns what it removed.
pub fn cleanup(dir: &Path) -> Result<Vec<String>, BpfError> {
    let mut removed = Vec::new();
    if !dir.exists() {
        return Ok(removed);
    }
    for (iface, paths) in pinned_interfaces(dir) {
        for p in paths {
            detach_and_unpin(&p)?;
        }
        removed.push(format!("links of {}@{}", iface.name, iface.index));
    }
    for program in super::sock::detach_all(dir)? {
        removed.push(format!("cgroup link of {program}"));
    }
    for sub in ["links", super::sock::LINKS_DIR] {
        let links = dir.join(sub);
        if !links.exists() {
            continue;
        }
        // Anything else left there (e.g. a half-written pin) goes too.
        std::fs::remove_dir_all(&links).map_err(|source| BpfError::Io {
            path: links.clone(),
            source,
        })?;
    }
    let specs = lbproxy_common::MAPS.iter().chain(lbproxy_common::MIGRATED);
    for name in specs
        .map(|spec| spec.name)
        .chain(lbproxy_common::RETIRED.iter().copied())
    {
        let p = dir.join(name);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|source| BpfError::Io {
                path: p.clone(),
                source,
            })?;
            removed.push(format!("map {name}"));
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => {}
        // The directory is a mount point (the DaemonSet mounts only lbproxy's directory of
        // the host's bpffs): its pins are gone, the directory stays.
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            tracing::info!(dir = %dir.display(), "pins removed; the directory is a mount point and stays");
        }
        Err(source) => {
            return Err(BpfError::Io {
                path: dir.to_path_buf(),
                source,
            });
        }
    }
    Ok(removed)
}
