//! The flow-hash seed (issue 10 §3, "hostile pods, backend choice"): the 5-tuple hash that
//! picks a backend is keyed by a per-node seed in the pinned `LB_CONFIG_V1`, so a client
//! cannot choose its backend by choosing its source port.
//!
//! [`seed_kept_across_restart_renewed_by_cleanup`]: the first run creates a non-zero seed; a
//! restart (SIGTERM, run again) keeps it, so fixed-source-port UDP clients reach the same
//! backends through their existing flows *and* as new flows (the flow table emptied); after
//! `lbproxy cleanup` the next run creates another seed, and the same source ports are spread
//! differently.

mod common;

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;

use common::*;
use lbproxy_tests::lab::{Lab, Shape};

/// Fixed client source ports (below the ephemeral range, so nothing else takes them).
const SRC_PORTS: std::ops::RangeInclusive<u16> = 21_001..=21_016;

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
/// `LB_FLOWS_V1`'s key size (`FlowKey`).
const FLOW_KEY_SIZE: usize = 16;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 4]) -> io::Result<i64> {
    // SAFETY: `attr` is a writable 32-byte union bpf_attr prefix, as bpf(2) requires for
    // these commands; the pointers in it outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 32u32) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A map pinned at `path`.
fn open_pinned(path: &Path) -> OwnedFd {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [c.as_ptr() as u64, 0, 0, 0];
    let fd = bpf(BPF_OBJ_GET, &mut attr)
        .unwrap_or_else(|e| panic!("BPF_OBJ_GET {}: {e}", path.display()));
    // SAFETY: a new fd the kernel just returned, owned from here on.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// The flow-hash seed in the pinned `LB_CONFIG_V1` (key 0; value `flags`, `hash_seed_lo`,
/// `hash_seed_hi`, `_reserved`, as `u32`s).
fn pinned_seed(lab: &Lab) -> u64 {
    let map = open_pinned(&lab.bpffs_dir().join("LB_CONFIG_V1"));
    let key = 0u32;
    let mut value = [0u32; 4];
    let mut attr = [
        map.as_raw_fd() as u64,
        &raw const key as u64,
        value.as_mut_ptr() as u64,
        0,
    ];
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).unwrap_or_else(|e| panic!("LB_CONFIG_V1 lookup: {e}"));
    u64::from(value[2]) << 32 | u64::from(value[1])
}

/// Deletes every entry of the pinned `LB_FLOWS_V1`, so the next packet of each flow is
/// selected anew. Returns how many were deleted.
fn clear_flows(lab: &Lab) -> usize {
    let map = open_pinned(&lab.bpffs_dir().join("LB_FLOWS_V1"));
    let mut keys: Vec<[u8; FLOW_KEY_SIZE]> = Vec::new();
    let mut seen = BTreeSet::new();
    loop {
        let mut next = [0u8; FLOW_KEY_SIZE];
        let prev = keys.last().map_or(0, |k| k.as_ptr() as u64);
        let mut attr = [map.as_raw_fd() as u64, prev, next.as_mut_ptr() as u64, 0];
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) if seen.insert(next) => keys.push(next),
            // A key seen again: the walk restarted (the flow collector deleted the key it
            // stood on); every key is listed.
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => panic!("LB_FLOWS_V1 get_next_key: {e}"),
        }
    }
    for k in &keys {
        let mut attr = [map.as_raw_fd() as u64, k.as_ptr() as u64, 0, 0];
        match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => panic!("LB_FLOWS_V1 delete: {e}"),
        }
    }
    keys.len()
}

/// The backend each fixed source port's UDP request reaches.
fn choices(s: &Setup, ctx: &str) -> Vec<String> {
    SRC_PORTS
        .map(|p| {
            s.client
                .udp_request(WEB_VIP, WEB_UDP, T, Some(p))
                .map(|(r, _)| r.backend)
                .unwrap_or_else(|e| {
                    panic!("{ctx}: UDP from port {p}: {e}\n{}", s.lab.diagnostics())
                })
        })
        .collect()
}

/// Panics unless the running lbproxy logged `what` (the seed was "kept" or "created").
fn assert_logged(s: &Setup, what: &str, ctx: &str) {
    let line = format!("flow hash seed {what}");
    assert!(
        s.lb.stderr().contains(&line),
        "{ctx}: no \"{line}\" in the log\n{}",
        s.lb.log()
    );
}

fn restart(s: &mut Setup, ctx: &str) {
    let (st, _) = s.lb.terminate(EXIT_WITHIN);
    assert_eq!(
        st.code(),
        Some(0),
        "{ctx}: exit after SIGTERM: {st}\n{}",
        s.lb.log()
    );
}

#[test]
fn seed_kept_across_restart_renewed_by_cleanup() {
    let mut s = Setup::new(Shape::Routed, &["b1", "b2", "b3", "b4"]);

    // The first run creates a seed.
    let seed = pinned_seed(&s.lab);
    assert_ne!(
        seed,
        0,
        "first run: no seed in LB_CONFIG_V1\n{}",
        s.lb.log()
    );
    assert_logged(&s, "created", "first run");
    let before = choices(&s, "first run");
    let spread: BTreeSet<&String> = before.iter().collect();
    assert!(
        spread.len() >= 2,
        "first run: {} source ports all reached {spread:?}",
        before.len()
    );
    // Selection is a function of the 5-tuple and the seed: new flows from the same ports
    // reach the same backends.
    let n = clear_flows(&s.lab);
    assert!(
        n >= before.len(),
        "first run: only {n} flow entries to clear"
    );
    let again = choices(&s, "first run, flows cleared");
    assert_eq!(
        again, before,
        "first run: new flows from the same ports moved"
    );

    // A restart keeps the seed: existing flows and new flows keep their backends.
    restart(&mut s, "restart");
    s.lb = s.lab.start_lbproxy();
    s.lb.expect_healthy(HEALTHY_WITHIN);
    assert_logged(&s, "kept", "after the restart");
    assert_eq!(
        pinned_seed(&s.lab),
        seed,
        "the restart changed the seed\n{}",
        s.lb.log()
    );
    let kept_flows = choices(&s, "after the restart");
    assert_eq!(
        kept_flows, before,
        "after the restart: existing flows moved"
    );
    clear_flows(&s.lab);
    let new_flows = choices(&s, "after the restart, flows cleared");
    assert_eq!(
        new_flows,
        before,
        "after the restart: new flows from the same ports moved (seed kept: {})",
        pinned_seed(&s.lab) == seed
    );

    // `lbproxy cleanup` removes the seed with the maps; the next run creates another one,
    // and the same source ports are spread otherwise. (With 4 backends, 16 ports landing as
    // before under an independent seed has probability 4^-16, about 2e-10.)
    restart(&mut s, "before cleanup");
    let out = s.lab.lbproxy_cleanup();
    assert!(
        out.status.success(),
        "lbproxy cleanup: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    s.lb = s.lab.start_lbproxy();
    s.lb.expect_healthy(HEALTHY_WITHIN);
    assert_logged(&s, "created", "after cleanup");
    let renewed = pinned_seed(&s.lab);
    assert!(
        renewed != 0 && renewed != seed,
        "after cleanup: the seed is {} (want a new non-zero one)",
        if renewed == 0 { "0" } else { "the old one" }
    );
    let after = choices(&s, "after cleanup");
    assert_ne!(
        after, before,
        "after cleanup: a new seed, yet every source port reached the same backend"
    );
    eprintln!("source ports {SRC_PORTS:?}: before {before:?}; after cleanup {after:?}");
}
