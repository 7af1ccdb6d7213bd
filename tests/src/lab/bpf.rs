//! Which BPF programs are attached (tcx) to the interfaces of a namespace.
//!
//! The bpftool on these machines (7.1) predates tcx and does not list tcx attachments in
//! `bpftool net show`, and tcx links carry only an ifindex (which is per namespace). So this
//! asks the kernel directly: `BPF_PROG_QUERY` for `BPF_TCX_INGRESS`/`BPF_TCX_EGRESS` on each
//! interface, from a thread inside the namespace (the ifindex is resolved in the caller's
//! namespace), and reads each program's name with `BPF_OBJ_GET_INFO_BY_FD`.

use std::io;

use super::ns::{ns_run, run_in_ns};

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// One program attached with tcx.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcxAttachment {
    pub ifname: String,
    pub ifindex: u32,
    /// "ingress" or "egress".
    pub direction: &'static str,
    pub prog_id: u32,
    /// 0 if attached without a link.
    pub link_id: u32,
    /// The kernel's program name (at most 15 bytes).
    pub prog_name: String,
}

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> io::Result<i64> {
    // SAFETY: `attr` is a writable buffer of the size passed, as bpf(2) requires.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len() as u32) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Program and link ids attached at `attach_type` on `ifindex` (current thread's netns).
fn query(ifindex: u32, attach_type: u32) -> io::Result<Vec<(u32, u32)>> {
    let mut prog_ids = [0u32; 64];
    let mut link_ids = [0u32; 64];
    let mut attr = [0u8; 64];
    attr[0..4].copy_from_slice(&ifindex.to_ne_bytes());
    attr[4..8].copy_from_slice(&attach_type.to_ne_bytes());
    attr[16..24].copy_from_slice(&(prog_ids.as_mut_ptr() as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&(prog_ids.len() as u32).to_ne_bytes());
    attr[40..48].copy_from_slice(&(link_ids.as_mut_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_QUERY, &mut attr)?;
    let count = u32::from_ne_bytes(attr[24..28].try_into().unwrap()) as usize;
    Ok((0..count.min(64))
        .map(|i| (prog_ids[i], link_ids[i]))
        .collect())
}

/// The name of program `id` ("?" if it cannot be read).
pub fn prog_name(id: u32) -> String {
    let mut attr = [0u8; 16];
    attr[0..4].copy_from_slice(&id.to_ne_bytes());
    let fd = match bpf(BPF_PROG_GET_FD_BY_ID, &mut attr) {
        Ok(fd) => fd as i32,
        Err(_) => return "?".into(),
    };
    let mut info = [0u8; 256];
    let mut attr = [0u8; 16];
    attr[0..4].copy_from_slice(&(fd as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(info.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
    let r = bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr);
    // SAFETY: closing the fd we just got.
    unsafe { libc::close(fd) };
    if r.is_err() {
        return "?".into();
    }
    // struct bpf_prog_info: char name[16] at offset 64.
    let name = &info[64..80];
    let end = name.iter().position(|&b| b == 0).unwrap_or(16);
    String::from_utf8_lossy(&name[..end]).into_owned()
}

/// Interfaces of namespace `ns` as `(ifindex, name)`.
pub fn interfaces(ns: &str) -> Vec<(u32, String)> {
    let out = ns_run(ns, &["ip", "-o", "link", "show"]).unwrap_or_else(|e| panic!("{e}"));
    out.lines()
        .filter_map(|l| {
            let mut it = l.split(": ");
            let idx = it.next()?.trim().parse().ok()?;
            let name = it.next()?.split('@').next()?.to_owned();
            Some((idx, name))
        })
        .collect()
}

/// Every tcx attachment on every interface of namespace `ns`.
pub fn tcx_attachments(ns: &str) -> Vec<TcxAttachment> {
    let ifs = interfaces(ns);
    run_in_ns(ns, || {
        let mut v = Vec::new();
        for (ifindex, ifname) in &ifs {
            for (dir, at) in [("ingress", BPF_TCX_INGRESS), ("egress", BPF_TCX_EGRESS)] {
                let ids = query(*ifindex, at)
                    .unwrap_or_else(|e| panic!("BPF_PROG_QUERY {ifname} tcx/{dir}: {e}"));
                for (prog_id, link_id) in ids {
                    v.push(TcxAttachment {
                        ifname: ifname.clone(),
                        ifindex: *ifindex,
                        direction: dir,
                        prog_id,
                        link_id,
                        prog_name: prog_name(prog_id),
                    });
                }
            }
        }
        v
    })
}

/// Ids of all BPF links on the machine (`bpftool -j link show`).
pub fn all_link_ids() -> Vec<u32> {
    ids_from_bpftool(&["bpftool", "-j", "link", "show"])
}

/// Ids of all BPF programs on the machine (`bpftool -j prog show`).
pub fn all_prog_ids() -> Vec<u32> {
    ids_from_bpftool(&["bpftool", "-j", "prog", "show"])
}

fn ids_from_bpftool(argv: &[&str]) -> Vec<u32> {
    let out = std::process::Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {argv:?}: {e} (is bpftool installed?)"));
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{argv:?}: bad JSON: {e}"));
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|o| o["id"].as_u64())
                .map(|i| i as u32)
                .collect()
        })
        .unwrap_or_default()
}
