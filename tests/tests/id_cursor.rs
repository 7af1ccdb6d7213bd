//! Service and backend ids across a restart (issue 10 §4, "identifiers"): flow entries hold
//! both, and the flow table outlives a restart, so an id freed before a restart must not be
//! handed out after it. The controller persists its id cursor in the pinned `LB_CONFIG_V1`
//! (`next_id`) ahead of every id it writes, and the next run goes on from there.
//!
//! [`ids_freed_before_a_restart_are_not_reused_after_it`]: `web` over b1, then `zzz` over b2
//! (so zzz's ids are the highest); every id in the maps is below the pinned cursor; zzz is
//! deleted, freeing its ids; lbproxy restarts (the cursor is kept, not reset by the
//! start-up's config write); a new service over b3 gets none of the ids used before the
//! restart. ("Continue after the highest id in use", the rule before the cursor, hands
//! zzz's ids out again.)

mod common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::{Inspect as _, Lab, Pod, Shape, bpf};

/// `next_id`, the fourth `u32` of `LB_CONFIG_V1`'s value (`flags`, `hash_seed_lo`,
/// `hash_seed_hi`, `next_id`).
fn pinned_cursor(lab: &Lab) -> u32 {
    let path = lab.bpffs_dir().join("LB_CONFIG_V1");
    let map =
        bpf::pinned_map(&path).unwrap_or_else(|e| panic!("BPF_OBJ_GET {}: {e}", path.display()));
    let mut value = [0u8; 16];
    bpf::map_lookup(&map, &0u32.to_ne_bytes(), &mut value)
        .unwrap_or_else(|e| panic!("LB_CONFIG_V1 lookup: {e}"));
    u32::from_ne_bytes(value[12..16].try_into().unwrap())
}

/// Backend ids by address (`ip:port/proto`), and the served frontends' service ids, as
/// `lbproxy inspect` reads them from the pinned maps.
fn ids(lab: &Lab) -> (Vec<(String, u32)>, BTreeSet<u32>) {
    let backends = lab
        .inspect_backends()
        .into_iter()
        .map(|b| (format!("{}:{}/{}", b.addr, b.port, b.protocol), b.id))
        .collect();
    let svcs = lab
        .inspect_services()
        .into_iter()
        .filter(|s| s.served)
        .map(|s| s.svc_id)
        .collect();
    (backends, svcs)
}

/// Every id in use: backend ids and service ids (separate spaces, one cursor).
fn all_ids(lab: &Lab) -> BTreeSet<u32> {
    let (b, s) = ids(lab);
    b.into_iter().map(|(_, id)| id).chain(s).collect()
}

/// Waits until the programmed backends are exactly those of `pods` (both ports each).
fn wait_for_backends(lab: &Lab, pods: &[&Pod], ctx: &str) {
    let want: BTreeSet<String> = pods
        .iter()
        .flat_map(|p| {
            [
                format!("{}:{BACKEND_TCP}/TCP", p.ip),
                format!("{}:{BACKEND_UDP}/UDP", p.ip),
            ]
        })
        .collect();
    let start = Instant::now();
    loop {
        let have: BTreeSet<String> = ids(lab).0.into_iter().map(|(a, _)| a).collect();
        if have == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{ctx}: backends {have:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

const ZZZ_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 20);
const NEW_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 30);

/// The ids of the frontends on `vip` and of the backends of `pod`.
fn ids_of(lab: &Lab, vip: Ipv4Addr, pod: &Pod) -> BTreeSet<u32> {
    let backends = ids(lab)
        .0
        .into_iter()
        .filter(|(a, _)| a.starts_with(&format!("{}:", pod.ip)))
        .map(|(_, id)| id);
    let svcs = lab
        .inspect_services()
        .into_iter()
        .filter(|s| s.vip == vip.to_string())
        .map(|s| s.svc_id)
        .collect::<Vec<_>>();
    backends.chain(svcs).collect()
}

#[test]
fn ids_freed_before_a_restart_are_not_reused_after_it() {
    let mut s = Setup::with_members(Shape::Routed, &["b1", "b2", "b3"], &["b1"]);
    let (b1, b2, b3) = (
        s.backend("b1").clone(),
        s.backend("b2").clone(),
        s.backend("b3").clone(),
    );
    // A second service, programmed after `web`, so its ids are the highest in use.
    s.lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&[&b1])),
        web_objects("zzz", ZZZ_VIP, ready(&[&b2])),
    ]));
    wait_for_backends(&s.lab, &[&b1, &b2], "zzz added");

    let cursor = pinned_cursor(&s.lab);
    let used = all_ids(&s.lab);
    assert!(
        used.iter().all(|id| *id < cursor),
        "ids {used:?} in the maps, pinned cursor {cursor}\n{}",
        s.lb.log()
    );
    let zzz = ids_of(&s.lab, ZZZ_VIP, &b2);
    assert_eq!(zzz.len(), 4, "2 frontends and 2 backends: {zzz:?}");

    // zzz goes: its ids, the highest, are freed.
    s.lab
        .write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    wait_for_backends(&s.lab, &[&b1], "zzz removed");
    assert!(
        all_ids(&s.lab).is_disjoint(&zzz),
        "zzz's ids are still in the maps"
    );

    // A restart keeps the cursor: the start-up rewrites LB_CONFIG_V1's settings, not it.
    let (st, _) = s.lb.terminate(EXIT_WITHIN);
    assert_eq!(
        st.code(),
        Some(0),
        "exit after SIGTERM: {st}\n{}",
        s.lb.log()
    );
    s.lb = s.lab.start_lbproxy();
    s.lb.expect_healthy(HEALTHY_WITHIN);
    assert_eq!(
        pinned_cursor(&s.lab),
        cursor,
        "the restart moved the cursor though it programmed nothing new\n{}",
        s.lb.log()
    );

    // A new service after the restart gets new ids, none of those used before it.
    s.lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&[&b1])),
        web_objects("new", NEW_VIP, ready(&[&b3])),
    ]));
    wait_for_backends(&s.lab, &[&b1, &b3], "new added after the restart");
    let new = ids_of(&s.lab, NEW_VIP, &b3);
    assert_eq!(new.len(), 4, "2 frontends and 2 backends: {new:?}");
    let reused: Vec<&u32> = new.intersection(&used).collect();
    assert!(
        reused.is_empty(),
        "the new service got ids {reused:?}, used before the restart ({used:?}); cursor was \
         {cursor}\n{}",
        s.lb.log()
    );
    assert!(
        new.iter().all(|id| *id < pinned_cursor(&s.lab)),
        "the cursor is not past the new ids {new:?}"
    );
}
