//! Which BPF programs are attached (tcx) to the interfaces of a namespace.
//!
//! The bpftool on these machines (7.1) predates tcx and does not list tcx attachments in
//! `bpftool net show`, and tcx links carry only an ifindex (which is per namespace). So this
//! asks the kernel directly: `BPF_PROG_QUERY` for `BPF_TCX_INGRESS`/`BPF_TCX_EGRESS` on each
//! interface, from a thread inside the namespace (the ifindex is resolved in the caller's
//! namespace), and reads each program's name with `BPF_OBJ_GET_INFO_BY_FD`.
//!
//! [`prog_test_run`] runs one of those attached programs on a hand-built frame
//! (`BPF_PROG_TEST_RUN`). aya 0.14 has `TestRun` for `SchedClassifier`, but only for a program
//! it loaded or that is pinned as a program; lbproxy pins links, so a raw call on an fd
//! from the program's id is the shorter way to the real, attached program.

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use super::ns::{ns_run, run_in_ns};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
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

/// A file descriptor for program `id` (`BPF_PROG_GET_FD_BY_ID`), closed on drop.
pub fn prog_fd(id: u32) -> io::Result<OwnedFd> {
    let mut attr = [0u8; 16];
    attr[0..4].copy_from_slice(&id.to_ne_bytes());
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The map pinned at `path` (`BPF_OBJ_GET`), closed on drop.
pub fn pinned_map(path: &std::path::Path) -> io::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut attr = [0u8; 16];
    attr[0..8].copy_from_slice(&(c.as_ptr() as u64).to_ne_bytes());
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `union bpf_attr` for the map element commands: map fd, key, value (or next key), flags.
fn elem_attr(map: &OwnedFd, key: *const u8, value: *mut u8) -> [u8; 32] {
    let mut attr = [0u8; 32];
    attr[0..4].copy_from_slice(&(map.as_raw_fd() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(key as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(value as u64).to_ne_bytes());
    attr
}

/// Reads the value of `key` into `value` (whose length must be the map's value size).
pub fn map_lookup(map: &OwnedFd, key: &[u8], value: &mut [u8]) -> io::Result<()> {
    bpf(
        BPF_MAP_LOOKUP_ELEM,
        &mut elem_attr(map, key.as_ptr(), value.as_mut_ptr()),
    )
    .map(drop)
}

/// Deletes `key` (ENOENT when it is not there).
pub fn map_delete(map: &OwnedFd, key: &[u8]) -> io::Result<()> {
    bpf(
        BPF_MAP_DELETE_ELEM,
        &mut elem_attr(map, key.as_ptr(), std::ptr::null_mut()),
    )
    .map(drop)
}

/// Deletes every entry of a hash map whose keys are `key_size` bytes; returns how many keys
/// it listed. Entries the datapath or the collector delete meanwhile are not an error.
pub fn map_clear(map: &OwnedFd, key_size: usize) -> io::Result<usize> {
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    loop {
        let mut next = vec![0u8; key_size];
        let prev = keys.last().map_or(std::ptr::null(), |k| k.as_ptr());
        match bpf(
            BPF_MAP_GET_NEXT_KEY,
            &mut elem_attr(map, prev, next.as_mut_ptr()),
        ) {
            Ok(_) if seen.insert(next.clone()) => keys.push(next),
            // A key seen again: the walk restarted (the key it stood on was deleted);
            // every key is listed.
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => return Err(e),
        }
    }
    for k in &keys {
        match bpf(
            BPF_MAP_DELETE_ELEM,
            &mut elem_attr(map, k.as_ptr(), std::ptr::null_mut()),
        ) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(keys.len())
}

/// The name of program `id` ("?" if it cannot be read).
pub fn prog_name(id: u32) -> String {
    let Ok(fd) = prog_fd(id) else {
        return "?".into();
    };
    let mut info = [0u8; 256];
    let mut attr = [0u8; 16];
    attr[0..4].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(info.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(info.as_mut_ptr() as u64).to_ne_bytes());
    if bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).is_err() {
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

/// An IPv4 address as `bpftool -j` formats a `[u8; 4]` field: an array of four numbers.
pub fn ipv4_of_json(v: &serde_json::Value) -> Option<std::net::Ipv4Addr> {
    let b: Vec<u8> = v
        .as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u8::try_from(n).ok()))
        .collect::<Option<_>>()?;
    let b: [u8; 4] = b.try_into().ok()?;
    Some(b.into())
}

/// What one `BPF_PROG_TEST_RUN` of a TC program gave back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestRun {
    /// The program's return value, a TC action (-1 `TC_ACT_UNSPEC`, 0 `TC_ACT_OK`,
    /// 2 `TC_ACT_SHOT`, 7 `TC_ACT_REDIRECT`).
    pub retval: i32,
    /// The frame as the program left it (the kernel copies out the whole skb).
    pub data: Vec<u8>,
    /// `skb->mark` as the program left it.
    pub mark: u32,
}

/// `sizeof(struct __sk_buff)` in the uapi of Linux 6.x.
const SK_BUFF_LEN: usize = 192;
/// `offsetof(struct __sk_buff, ifindex)`.
const SK_BUFF_IFINDEX_OFF: usize = 40;
/// `offsetof(struct __sk_buff, mark)`.
const SK_BUFF_MARK_OFF: usize = 8;
/// Room for the output frame: a reject can make a packet longer (ICMP quotes it).
const TEST_RUN_OUT_LEN: usize = 4096;

/// Runs program `prog_id` (a sched_cls program) once on `frame` with `BPF_PROG_TEST_RUN`,
/// with `__sk_buff.ifindex` = `ifindex`, an interface of namespace `ns`: helpers that use
/// the skb's device (`bpf_redirect` to `ctx.ifindex`, FIB lookups) see that interface. The
/// kernel resolves the ifindex in the caller's namespace, so this runs on a thread inside
/// `ns`. Nothing is sent: a redirect only shows as the return value. Maps are the
/// program's own, so a run reads and updates the same flow table and counters as real
/// traffic.
///
/// The kernel refuses (EINVAL) a frame shorter than an Ethernet header, or one whose EtherType
/// is IPv4 or IPv6 but that is cut before the end of that IP header: send those through a
/// real interface instead.
pub fn prog_test_run(ns: &str, prog_id: u32, ifindex: u32, frame: &[u8]) -> io::Result<TestRun> {
    prog_test_run_marked(ns, prog_id, ifindex, frame, 0)
}

/// [`prog_test_run`] of a packet that arrives with `skb->mark` = `mark`.
pub fn prog_test_run_marked(
    ns: &str,
    prog_id: u32,
    ifindex: u32,
    frame: &[u8],
    mark: u32,
) -> io::Result<TestRun> {
    run_in_ns(ns, || {
        let fd = prog_fd(prog_id)?;
        let mut out = vec![0u8; TEST_RUN_OUT_LEN];
        let r = test_run_once(&fd, Ctx::Skb { ifindex, mark }, frame, &mut out)?;
        out.truncate(r.len);
        Ok(TestRun {
            retval: r.retval,
            data: out,
            mark: r.mark,
        })
    })
}

/// Runs program `prog_id` on `frame(0)`, `frame(1)`, … `frame(n - 1)`, each a
/// `BPF_PROG_TEST_RUN` of its own (a fresh copy of the frame, so a translating program
/// never meets its own output), as [`prog_test_run`] does. Returns the last run's TC action
/// and each run's duration in ns, as the kernel measured it around the program alone.
pub fn prog_test_run_durations(
    ns: &str,
    prog_id: u32,
    ifindex: u32,
    frame: impl Fn(usize) -> Vec<u8> + Sync,
    n: usize,
) -> io::Result<(i32, Vec<u32>)> {
    test_run_durations(ns, prog_id, Ctx::Skb { ifindex, mark: 0 }, frame, n)
}

/// [`prog_test_run_durations`] with the context `given`.
fn test_run_durations(
    ns: &str,
    prog_id: u32,
    given: Ctx,
    frame: impl Fn(usize) -> Vec<u8> + Sync,
    n: usize,
) -> io::Result<(i32, Vec<u32>)> {
    run_in_ns(ns, || {
        let fd = prog_fd(prog_id)?;
        let mut out = vec![0u8; TEST_RUN_OUT_LEN];
        let mut durations = Vec::with_capacity(n);
        let mut retval = 0;
        for i in 0..n {
            let r = test_run_once(&fd, given, &frame(i), &mut out)?;
            retval = r.retval;
            durations.push(r.duration_ns);
        }
        Ok((retval, durations))
    })
}

/// [`prog_test_run`] of an XDP program (`prog_id`, attached to interface `ifindex` of `ns`):
/// the frame arrives as if on that interface (`xdp_md.ingress_ifindex`, its first receive
/// queue). The return value is the XDP action.
pub fn xdp_test_run(ns: &str, prog_id: u32, ifindex: u32, frame: &[u8]) -> io::Result<TestRun> {
    run_in_ns(ns, || {
        let fd = prog_fd(prog_id)?;
        let mut out = vec![0u8; TEST_RUN_OUT_LEN];
        let r = test_run_once(&fd, Ctx::Xdp { ifindex }, frame, &mut out)?;
        out.truncate(r.len);
        Ok(TestRun {
            retval: r.retval,
            data: out,
            mark: 0,
        })
    })
}

/// [`prog_test_run_durations`] of an XDP program, as [`xdp_test_run`] runs it. Returns the
/// last run's XDP action and each run's duration in ns.
pub fn xdp_test_run_durations(
    ns: &str,
    prog_id: u32,
    ifindex: u32,
    frame: impl Fn(usize) -> Vec<u8> + Sync,
    n: usize,
) -> io::Result<(i32, Vec<u32>)> {
    test_run_durations(ns, prog_id, Ctx::Xdp { ifindex }, frame, n)
}

/// The id of the XDP program attached to `ifname` of namespace `ns` (`ip -j -d link`), if
/// any.
pub fn xdp_prog_id(ns: &str, ifname: &str) -> Option<u32> {
    let out = super::ns_run(ns, &["ip", "-j", "-d", "link", "show", "dev", ifname]).ok()?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    let xdp = &v.get(0)?["xdp"];
    let id = xdp["prog"]["id"]
        .as_u64()
        .or_else(|| xdp["attached"].get(0)?["prog"]["id"].as_u64())?;
    u32::try_from(id).ok()
}

/// The context a test run gives its program.
#[derive(Clone, Copy)]
enum Ctx {
    /// A sched_cls program's `__sk_buff`: its device and mark.
    Skb { ifindex: u32, mark: u32 },
    /// An XDP program's `xdp_md`: the interface the frame arrives on.
    Xdp { ifindex: u32 },
}

/// `sizeof(struct xdp_md)` and `offsetof(struct xdp_md, data_end)`, `ingress_ifindex`.
const XDP_MD_LEN: usize = 24;
const XDP_MD_DATA_END_OFF: usize = 4;
const XDP_MD_INGRESS_OFF: usize = 12;

/// What [`test_run_once`] gave.
struct Once {
    retval: i32,
    /// The output frame's length.
    len: usize,
    /// The program's run time as the kernel measured it.
    duration_ns: u32,
    /// `__sk_buff.mark` after the run.
    mark: u32,
}

/// One `BPF_PROG_TEST_RUN` (repeat 1) of program `fd` on `frame` with the context `given`
/// (`__sk_buff.ifindex` and `.mark`, or `xdp_md.ingress_ifindex`), the output frame into
/// `out`.
fn test_run_once(fd: &OwnedFd, given: Ctx, frame: &[u8], out: &mut [u8]) -> io::Result<Once> {
    let mut ctx = [0u8; SK_BUFF_LEN];
    let put = |ctx: &mut [u8; SK_BUFF_LEN], at: usize, v: u32| {
        ctx[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    };
    let ctx_len = match given {
        Ctx::Skb { ifindex, mark } => {
            put(&mut ctx, SK_BUFF_IFINDEX_OFF, ifindex);
            put(&mut ctx, SK_BUFF_MARK_OFF, mark);
            SK_BUFF_LEN
        }
        Ctx::Xdp { ifindex } => {
            // data 0, data_end the frame's length, no metadata, queue 0.
            put(&mut ctx, XDP_MD_DATA_END_OFF, frame.len() as u32);
            put(&mut ctx, XDP_MD_INGRESS_OFF, ifindex);
            XDP_MD_LEN
        }
    };
    let ctx = &ctx[..ctx_len];
    let mut ctx_out = [0u8; SK_BUFF_LEN];
    let ctx_out = &mut ctx_out[..ctx_len];
    // The `test` member of union bpf_attr.
    let mut attr = [0u8; 80];
    attr[0..4].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    attr[12..16].copy_from_slice(&(out.len() as u32).to_ne_bytes());
    attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
    attr[24..32].copy_from_slice(&(out.as_mut_ptr() as u64).to_ne_bytes());
    attr[32..36].copy_from_slice(&1u32.to_ne_bytes()); // repeat
    attr[40..44].copy_from_slice(&(ctx.len() as u32).to_ne_bytes());
    attr[44..48].copy_from_slice(&(ctx_out.len() as u32).to_ne_bytes());
    attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
    attr[56..64].copy_from_slice(&(ctx_out.as_mut_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    let word = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap());
    Ok(Once {
        retval: word(&attr, 4) as i32,
        len: (word(&attr, 12) as usize).min(out.len()),
        duration_ns: word(&attr, 36),
        mark: match given {
            Ctx::Skb { .. } => word(ctx_out, SK_BUFF_MARK_OFF),
            Ctx::Xdp { .. } => 0,
        },
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
