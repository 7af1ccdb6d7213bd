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
use std::os::fd::OwnedFd;

use common::*;
use lbproxy_tests::lab::{Lab, Shape, bpf};

/// Fixed client source ports (below the ephemeral range, so nothing else takes them).
const SRC_PORTS: std::ops::RangeInclusive<u16> = 21_001..=21_016;

/// `LB_FLOWS_V3`'s key size (`FlowKey`).
const FLOW_KEY_SIZE: usize = 16;

/// The map `name` pinned in the lab's bpffs dir.
fn pinned(lab: &Lab, name: &str) -> OwnedFd {
    let path = lab.bpffs_dir().join(name);
    bpf::pinned_map(&path).unwrap_or_else(|e| panic!("BPF_OBJ_GET {}: {e}", path.display()))
}

/// The flow-hash seed in the pinned `LB_CONFIG_V1` (key 0; value `flags`, `hash_seed_lo`,
/// `hash_seed_hi`, `next_id`, as `u32`s).
fn pinned_seed(lab: &Lab) -> u64 {
    let mut value = [0u8; 16];
    bpf::map_lookup(
        &pinned(lab, "LB_CONFIG_V1"),
        &0u32.to_ne_bytes(),
        &mut value,
    )
    .unwrap_or_else(|e| panic!("LB_CONFIG_V1 lookup: {e}"));
    let word = |i: usize| u64::from(u32::from_ne_bytes(value[i..i + 4].try_into().unwrap()));
    word(8) << 32 | word(4)
}

/// Deletes every entry of the pinned `LB_FLOWS_V3`, so the next packet of each flow is
/// selected anew. Returns how many were deleted.
fn clear_flows(lab: &Lab) -> usize {
    bpf::map_clear(&pinned(lab, "LB_FLOWS_V3"), FLOW_KEY_SIZE)
        .unwrap_or_else(|e| panic!("clearing LB_FLOWS_V3: {e}"))
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
