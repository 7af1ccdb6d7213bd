//! The programmer against `MemMaps`: minimal writes, ids, and consistency after a failed
//! write at every position.

use super::*;
use crate::model::Protocol;
use crate::program::mem::MemMaps;
use lbproxy_common::{MEMBER_DRAINING, MEMBER_SERVING};
use std::net::Ipv4Addr;

fn fe(last: u8, port: u16) -> Frontend {
    Frontend {
        addr: Ipv4Addr::new(198, 19, 0, last).into(),
        port,
        proto: Protocol::Tcp,
        pods_only: false,
    }
}
fn be(last: u8) -> BackendAddr {
    BackendAddr {
        addr: Ipv4Addr::new(198, 18, 0, last).into(),
        port: 8080,
        proto: Protocol::Tcp,
    }
}
fn spec(backends: &[u8]) -> FrontendSpec {
    FrontendSpec {
        label: "ns/svc:http".into(),
        backends: backends.iter().map(|b| be(*b)).collect(),
        draining: vec![],
        affinity_timeout_s: 0,
        kind: crate::desired::FrontendKind::ClusterIp,
        policy: crate::desired::Policy::default(),
        src_ranges: vec![],
    }
}

#[test]
fn draining_backends_keep_their_entry_but_get_no_slot() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3]));
    p.apply(&mut m, &d).unwrap();
    // 3 turns not-ready/terminating: no slot, but its backend entry stays.
    let mut s = spec(&[2]);
    s.draining = vec![be(3)];
    d.insert(fe(10, 80), s);
    p.apply(&mut m, &d).unwrap();
    assert_eq!(served(&m, fe(10, 80)), vec![be(2)]);
    assert!(m.backends.values().any(|b| *b == be(3).value()));
    // A draining backend that was never programmed is not created.
    let mut s = spec(&[2]);
    s.draining = vec![be(3), be(7)];
    d.insert(fe(10, 80), s);
    p.apply(&mut m, &d).unwrap();
    assert_eq!(m.backends.len(), 2);
    // Gone from the slice: the entry goes, and with it its flows.
    d.insert(fe(10, 80), spec(&[2]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(m.backends.len(), 1);
}

/// The members of frontend `f` in `LB_MEMBERS_V1`: backend address -> how it belongs.
fn members_of(m: &MemMaps, f: Frontend) -> BTreeMap<BackendAddr, u32> {
    let svc_id = m.services[&f.key()].svc_id;
    m.members
        .iter()
        .filter(|((s, _), _)| *s == svc_id)
        .map(|((_, id), how)| (BackendAddr::from_value(&m.backends[id]).unwrap(), *how))
        .collect()
}

/// A draining backend is a member of its frontend as `MEMBER_DRAINING` (its flows stay
/// live), a serving one as `MEMBER_SERVING`; turning back to serving flips it in place.
#[test]
fn members_say_serving_or_draining() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3]));
    p.apply(&mut m, &d).unwrap();
    let mut s = spec(&[2]);
    s.draining = vec![be(3)];
    d.insert(fe(10, 80), s.clone());
    p.apply(&mut m, &d).unwrap();
    let want = BTreeMap::from([(be(2), MEMBER_SERVING), (be(3), MEMBER_DRAINING)]);
    assert_eq!(members_of(&m, fe(10, 80)), want);
    // Adopted from the maps as written: the next apply of the same state writes nothing.
    let mut q = Programmer::adopt(m.read_programmed(), 0);
    let before = m.ops;
    q.apply(&mut m, &d).unwrap();
    assert_eq!(
        m.ops, before,
        "re-applying an adopted state wrote something"
    );
    d.insert(fe(10, 80), spec(&[2, 3]));
    q.apply(&mut m, &d).unwrap();
    let want = BTreeMap::from([(be(2), MEMBER_SERVING), (be(3), MEMBER_SERVING)]);
    assert_eq!(members_of(&m, fe(10, 80)), want);
}

/// A backend shared by two frontends that leaves one of them keeps its entry (the other
/// still uses it) but is no longer a member of the one it left: that is what ends the
/// left frontend's flows to it, in the datapath and in the socket reaper.
#[test]
fn a_backend_leaving_one_of_two_frontends_stops_being_its_member_only() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2]));
    d.insert(fe(11, 80), spec(&[2]));
    p.apply(&mut m, &d).unwrap();
    d.insert(fe(10, 80), spec(&[3]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(
        members_of(&m, fe(10, 80)),
        BTreeMap::from([(be(3), MEMBER_SERVING)])
    );
    assert_eq!(
        members_of(&m, fe(11, 80)),
        BTreeMap::from([(be(2), MEMBER_SERVING)])
    );
    assert!(m.backends.values().any(|b| *b == be(2).value()));
}

/// What the datapath would see for a frontend: its backends, as a sorted list.
fn served(m: &MemMaps, f: Frontend) -> Vec<BackendAddr> {
    let Some(v) = m.services.get(&f.key()) else {
        return vec![];
    };
    let mut out: Vec<BackendAddr> = (0..v.count)
        .map(|slot| {
            let id = m.slots[&SlotKey {
                svc_id: v.svc_id,
                slot,
            }];
            BackendAddr::from_value(&m.backends[&id]).unwrap()
        })
        .collect();
    out.sort();
    out
}

#[test]
fn programs_then_diffs_without_clearing() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3, 4]));
    d.insert(fe(11, 80), spec(&[3]));
    let s = p.apply(&mut m, &d).unwrap();
    assert_eq!(served(&m, fe(10, 80)), vec![be(2), be(3), be(4)]);
    assert_eq!(m.backends.len(), 3, "backend 3 is shared");
    assert_eq!((s.frontends_changed, s.frontends_created), (2, 2));

    // Same desired state: nothing written.
    let before = m.ops;
    let s = p.apply(&mut m, &d).unwrap();
    assert_eq!((m.ops, s), (before, ApplyStats::default()));

    // Remove one backend: one slot rewritten, count updated, one slot deleted, the
    // backend deleted. The other frontend is untouched.
    d.insert(fe(10, 80), spec(&[2, 4]));
    let svc_id_before = m.services[&fe(10, 80).key()].svc_id;
    let s = p.apply(&mut m, &d).unwrap();
    assert_eq!(served(&m, fe(10, 80)), vec![be(2), be(4)]);
    assert_eq!(m.services[&fe(10, 80).key()].svc_id, svc_id_before);
    assert_eq!((s.frontends_changed, s.frontends_created), (1, 0));
    // Membership out, one slot rewritten, the count, the last slot and the backend out.
    assert!(s.writes + s.deletes <= 5, "{s:?}");
    assert!(
        m.backends.values().any(|b| *b == be(3).value()),
        "still used by .11"
    );

    // Add one: one slot, one count, one backend.
    d.insert(fe(10, 80), spec(&[2, 4, 5]));
    let s = p.apply(&mut m, &d).unwrap();
    assert_eq!(served(&m, fe(10, 80)), vec![be(2), be(4), be(5)]);
    // Membership, backend, slot and count.
    assert_eq!(s.writes, 4);

    // Remove a frontend and the backends only it used.
    d.remove(&fe(10, 80));
    p.apply(&mut m, &d).unwrap();
    assert!(!m.services.contains_key(&fe(10, 80).key()));
    assert_eq!(m.slots.len(), 1);
    assert_eq!(m.backends.len(), 1);
    assert_eq!(m.labels.len(), 1);

    // Created again: a new frontend, with a service id of its own (flows and the node's
    // sockets of the old one must not take it for theirs), counted as created (the
    // socket reaper's cue for sockets connected to its bare address).
    d.insert(fe(10, 80), spec(&[2]));
    let s = p.apply(&mut m, &d).unwrap();
    assert_eq!(s.frontends_created, 1);
    assert_ne!(m.services[&fe(10, 80).key()].svc_id, svc_id_before);
}

#[test]
fn zero_backends_is_a_frontend_with_count_zero() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(m.services[&fe(10, 80).key()].count, 0);
    d.insert(fe(10, 80), spec(&[2]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(served(&m, fe(10, 80)), vec![be(2)]);
}

#[test]
fn adoption_keeps_ids_and_writes_nothing_when_unchanged() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3]));
    p.apply(&mut m, &d).unwrap();
    let state = p.programmed().clone();

    let mut p2 = Programmer::adopt(state, m.read_id_cursor());
    let before = m.ops;
    p2.apply(&mut m, &d).unwrap();
    assert_eq!(
        m.ops, before,
        "a restart with the same desired state rewrites nothing"
    );
    d.insert(fe(12, 80), spec(&[9]));
    p2.apply(&mut m, &d).unwrap();
    let ids: Vec<u32> = m.services.values().map(|v| v.svc_id).collect();
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1], "new ids never collide with adopted ones");
}

#[test]
fn a_failed_write_leaves_the_maps_consistent_and_the_next_apply_repairs() {
    // Fail every possible write position once; MemMaps::check asserts consistency
    // after every single write.
    for fail in 0..12 {
        let mut m = MemMaps::default();
        let mut p = Programmer::default();
        let mut d = Desired::new();
        d.insert(fe(10, 80), spec(&[2, 3, 4]));
        p.apply(&mut m, &d).unwrap();
        d.insert(fe(10, 80), spec(&[3, 5]));
        d.insert(fe(11, 53), spec(&[6]));
        m.fail_at = Some(fail);
        let _ = p.apply(&mut m, &d);
        m.check();
        p.apply(&mut m, &d).unwrap();
        assert_eq!(served(&m, fe(10, 80)), vec![be(3), be(5)], "fail at {fail}");
        assert_eq!(served(&m, fe(11, 53)), vec![be(6)], "fail at {fail}");
        assert_eq!(m.backends.len(), 3, "fail at {fail}: {:?}", m.backends);
        // Membership (what affinity checks) matches the slots exactly once repaired.
        let from_slots: std::collections::BTreeSet<(u32, u32)> = m
            .services
            .values()
            .flat_map(|v| {
                (0..v.count).map(|slot| {
                    (
                        v.svc_id,
                        m.slots[&SlotKey {
                            svc_id: v.svc_id,
                            slot,
                        }],
                    )
                })
            })
            .collect();
        let serving: std::collections::BTreeSet<(u32, u32)> = m
            .members
            .iter()
            .filter(|(_, how)| **how == MEMBER_SERVING)
            .map(|(k, _)| *k)
            .collect();
        assert_eq!(serving, from_slots, "fail at {fail}");
    }
}

/// The (backend id, address) pairs in the maps and the service ids of the frontends.
fn ids(m: &MemMaps) -> (BTreeMap<u32, BackendAddr>, Vec<u32>) {
    let backends = m
        .backends
        .iter()
        .map(|(id, b)| (*id, BackendAddr::from_value(b).unwrap()))
        .collect();
    (backends, m.services.values().map(|v| v.svc_id).collect())
}

/// Backend ids wrap at u32::MAX, skip 0 and skip every id still in use: the backends
/// programmed before the wrap keep their ids and addresses.
#[test]
fn backend_ids_wrap_past_zero_and_ids_in_use() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3, 4]));
    p.apply(&mut m, &d).unwrap();
    let (before, _) = ids(&m);
    assert_eq!(before.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);

    let mut p =
        Programmer::adopt(p.programmed().clone(), m.read_id_cursor()).with_next_id(u32::MAX - 1);
    d.insert(fe(11, 80), spec(&[5, 6, 7, 8]));
    p.apply(&mut m, &d).unwrap();
    m.check();
    let (after, _) = ids(&m);
    for (id, addr) in &before {
        assert_eq!(
            after.get(id),
            Some(addr),
            "id {id} changed hands: {after:?}"
        );
    }
    let new: Vec<u32> = after
        .keys()
        .copied()
        .filter(|id| !before.contains_key(id))
        .collect();
    assert_eq!(new, vec![4, 5, u32::MAX - 1, u32::MAX], "{after:?}");
    assert_eq!(served(&m, fe(10, 80)), vec![be(2), be(3), be(4)]);
    assert_eq!(served(&m, fe(11, 80)), vec![be(5), be(6), be(7), be(8)]);

    // Freed ids are not handed out again before the counter comes round to them: the
    // new backend gets the next id after the last one handed out (fe 11's service id).
    let last = m.services[&fe(11, 80).key()].svc_id;
    d.insert(fe(11, 80), spec(&[9]));
    p.apply(&mut m, &d).unwrap();
    let (after, _) = ids(&m);
    assert_eq!(
        after.keys().copied().collect::<Vec<_>>(),
        vec![1, 2, 3, last + 1],
        "{after:?}"
    );
}

/// Service ids wrap the same way; adopting maps that hold u32::MAX does not overflow.
#[test]
fn service_ids_wrap_past_zero_and_ids_in_use_and_adoption_at_the_top() {
    // Frontends without endpoints take a service id and no backend id.
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[]));
    d.insert(fe(11, 80), spec(&[]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(ids(&m).1, vec![1, 2]);

    let mut p =
        Programmer::adopt(p.programmed().clone(), m.read_id_cursor()).with_next_id(u32::MAX);
    d.insert(fe(12, 80), spec(&[]));
    p.apply(&mut m, &d).unwrap();
    d.insert(fe(13, 80), spec(&[]));
    p.apply(&mut m, &d).unwrap();
    m.check();
    let svc_of = |m: &MemMaps, last| m.services[&fe(last, 80).key()].svc_id;
    assert_eq!(
        [10, 11, 12, 13].map(|l| svc_of(&m, l)),
        [1, 2, u32::MAX, 3],
        "{:?}",
        m.services
    );
    assert_eq!(m.labels.len(), 4);

    // A restart over maps without a cursor (written by an older version) adopts ids up
    // to u32::MAX and goes on past 0 and the ids in use.
    let mut old = m.clone();
    old.id_cursor = 0;
    let mut p0 = Programmer::adopt(old.read_programmed(), 0);
    d.insert(fe(14, 80), spec(&[]));
    p0.apply(&mut old, &d).unwrap();
    assert_eq!(svc_of(&old, 14), 4, "{:?}", old.services);

    // With the cursor, it goes on from the cursor, which is past every id handed out.
    let mut p = Programmer::adopt(m.read_programmed(), m.read_id_cursor());
    p.apply(&mut m, &d).unwrap();
    let new = svc_of(&m, 14);
    assert!(
        ![0, 1, 2, 3, u32::MAX].contains(&new),
        "{new} was handed out before: {:?}",
        m.services
    );
    let all = ids(&m).1;
    let distinct: std::collections::BTreeSet<u32> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "{all:?}");
}

/// Every id handed out, from the maps: backends, service entries, slots, members and
/// labels.
fn ids_in(m: &MemMaps) -> std::collections::BTreeSet<u32> {
    m.backends
        .keys()
        .copied()
        .chain(m.services.values().map(|v| v.svc_id))
        .chain(m.slots.keys().map(|k| k.svc_id))
        .chain(m.slots.values().copied())
        .chain(m.members.keys().flat_map(|(s, b)| [*s, *b]))
        .chain(m.labels.keys().copied())
        .collect()
}

/// A restart reads the persisted cursor: ids the earlier run freed (here the highest
/// ones, which "continue after the highest id in use" would hand out again) stay unused.
#[test]
fn ids_freed_before_a_restart_are_not_handed_out_after_it() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3]));
    d.insert(fe(11, 80), spec(&[4, 5]));
    p.apply(&mut m, &d).unwrap();
    let mut used = ids_in(&m);
    d.remove(&fe(11, 80));
    p.apply(&mut m, &d).unwrap();
    assert!(
        ids_in(&m).len() < used.len(),
        "removing a frontend freed no id"
    );

    for restart in 0..3 {
        let mut p = Programmer::adopt(m.read_programmed(), m.read_id_cursor());
        let f = fe(20 + restart, 80);
        d.insert(f, spec(&[30 + restart, 40 + restart]));
        p.apply(&mut m, &d).unwrap();
        let now = ids_in(&m);
        let v = m.services[&f.key()];
        let mine: std::collections::BTreeSet<u32> = (0..v.count)
            .map(|slot| {
                m.slots[&SlotKey {
                    svc_id: v.svc_id,
                    slot,
                }]
            })
            .chain([v.svc_id])
            .collect();
        let reused: Vec<&u32> = mine.intersection(&used).collect();
        assert!(
            reused.is_empty(),
            "restart {restart}: ids {reused:?} handed out again; used before: {used:?}"
        );
        used.extend(now);
        // Freed again before the next restart.
        d.remove(&f);
        p.apply(&mut m, &d).unwrap();
    }
}

/// The cursor reaches the maps before any id it covers, whichever write fails: after a
/// crash at any point, every id in the maps is below the persisted cursor.
#[test]
fn the_cursor_is_persisted_before_the_ids_it_covers() {
    for fail in 0..16 {
        let mut m = MemMaps::default();
        let mut p = Programmer::default();
        let mut d = Desired::new();
        d.insert(fe(10, 80), spec(&[2, 3]));
        d.insert(fe(11, 80), spec(&[4]));
        m.fail_at = Some(fail);
        let _ = p.apply(&mut m, &d);
        for id in ids_in(&m) {
            assert!(
                id < m.id_cursor,
                "fail at {fail}: id {id} in the maps, cursor {}",
                m.id_cursor
            );
        }
    }
    // At the end of a lease, the cursor moves ahead again before the next id is used
    // (a lease of 2 here, instead of ID_LEASE: the same code path, fewer ids).
    let mut m = MemMaps::default();
    let mut p = Programmer::default().with_next_id(1);
    p.lease_start = 1;
    p.lease_end = 3;
    m.id_cursor = 3;
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3, 4]));
    p.apply(&mut m, &d).unwrap();
    let max = ids_in(&m).into_iter().max().unwrap();
    assert!(max >= 3, "{max}: the test did not cross the lease");
    assert_eq!(m.id_cursor, 3 + ID_LEASE, "{:?}", ids_in(&m));
    assert!(
        max < m.id_cursor,
        "id {max} in the maps, cursor {}",
        m.id_cursor
    );
}

#[test]
fn next_free_id_skips_zero_and_ids_in_use_and_reports_exhaustion() {
    let in_use = [u32::MAX, 1, 2];
    let mut next = u32::MAX;
    assert_eq!(next_free_id(&mut next, 3, |i| in_use.contains(&i)), Some(3));
    assert_eq!(next, 4);
    let mut next = 0;
    assert_eq!(next_free_id(&mut next, 0, |_| false), Some(1));
    assert_eq!(next_free_id(&mut next, u32::MAX as usize, |_| true), None);
}

/// The entry is compared as a whole value: a change of kind, policy or affinity alone
/// rewrites the entry and nothing else, and adopting it back writes nothing.
#[test]
fn a_change_of_the_entry_alone_rewrites_the_entry_only() {
    let mut m = MemMaps::default();
    let mut p = Programmer::default();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3]));
    p.apply(&mut m, &d).unwrap();
    let mut s = spec(&[2, 3]);
    s.kind = crate::desired::FrontendKind::LoadBalancerIp;
    s.policy.local_only_elsewhere = true;
    s.affinity_timeout_s = 60;
    d.insert(fe(10, 80), s);
    let st = p.apply(&mut m, &d).unwrap();
    assert_eq!(
        (st.writes, st.deletes, st.frontends_changed),
        (1, 0, 1),
        "{st:?}"
    );
    let v = m.services[&fe(10, 80).key()];
    assert_eq!(
        (v.kind, v.flags, v.affinity_timeout_s, v.count),
        (
            lbproxy_common::SVC_KIND_LOAD_BALANCER,
            lbproxy_common::SVC_F_LOCAL_ONLY,
            60,
            2
        )
    );
    let mut q = Programmer::adopt(m.read_programmed(), m.read_id_cursor());
    let before = m.ops;
    q.apply(&mut m, &d).unwrap();
    assert_eq!(
        m.ops, before,
        "re-applying an adopted entry wrote something"
    );
}

/// A small prime table for the tests (2 chunks, the last one partial).
const TEST_M: u32 = 8191;

fn maglev_maps() -> MemMaps {
    MemMaps {
        maglev_m: TEST_M,
        ..MemMaps::default()
    }
}

/// The backend of every entry of `f`'s Maglev table, by address.
fn maglev_owners(m: &MemMaps, f: Frontend) -> Vec<BackendAddr> {
    let svc_id = m.services[&f.key()].svc_id;
    (0..TEST_M)
        .map(|i| {
            let (chunk, pos) = lbproxy_common::maglev::position(u64::from(i), TEST_M);
            let id =
                m.maglev[&lbproxy_common::MaglevKey { svc_id, chunk }].backend_ids[pos as usize];
            BackendAddr::from_value(&m.backends[&id]).unwrap()
        })
        .collect()
}

/// Under Maglev every frontend with a backend is flagged and has a whole table (MemMaps
/// checks it after every write); the table follows the backend set, not the ids or the order
/// they were learnt in; a frontend without backends, or removed, has none.
#[test]
fn maglev_tables_follow_the_backend_set() {
    let mut m = maglev_maps();
    let mut p = Programmer::default().with_maglev(TEST_M, 9);
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3, 4]));
    // Learnt in another order, on another node with other ids.
    let mut m2 = maglev_maps();
    let mut p2 = Programmer::default()
        .with_next_id(500)
        .with_maglev(TEST_M, 9);
    let mut d2 = Desired::new();
    d2.insert(fe(11, 80), spec(&[7]));
    d2.insert(fe(10, 80), spec(&[4, 2, 3]));
    p.apply(&mut m, &d).unwrap();
    p2.apply(&mut m2, &d2).unwrap();
    let v = m.services[&fe(10, 80).key()];
    assert_ne!(v.flags & lbproxy_common::SVC_F_MAGLEV, 0);
    assert_eq!(
        maglev_owners(&m, fe(10, 80)),
        maglev_owners(&m2, fe(10, 80))
    );
    assert_eq!(m.maglev.len(), 2, "8191 entries take 2 chunks");

    // The same desired state again writes nothing.
    let st = p.apply(&mut m, &d).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0));

    // One backend leaves: its entries change hands, and few others (Maglev's ~1%).
    let before = maglev_owners(&m, fe(10, 80));
    d.insert(fe(10, 80), spec(&[2, 4]));
    p.apply(&mut m, &d).unwrap();
    let after = maglev_owners(&m, fe(10, 80));
    let stayers_moved = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| **b != be(3) && b != a)
        .count();
    assert!(
        stayers_moved * 50 <= TEST_M as usize,
        "{stayers_moved} of {TEST_M} entries of staying backends moved"
    );
    assert!(!after.contains(&be(3)));
    assert_eq!(m.backends.len(), 2, "the leaver's backend entry goes");

    // No backend: no flag, no table. Then the frontend goes: nothing left.
    d.insert(fe(10, 80), spec(&[]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(
        m.services[&fe(10, 80).key()].flags & lbproxy_common::SVC_F_MAGLEV,
        0
    );
    assert!(m.maglev.is_empty());
    d.insert(fe(10, 80), spec(&[5]));
    p.apply(&mut m, &d).unwrap();
    assert_eq!(m.maglev.len(), 2);
    d.remove(&fe(10, 80));
    p.apply(&mut m, &d).unwrap();
    assert!(m.maglev.is_empty() && m.services.is_empty() && m.backends.is_empty());
}

/// A restart adopts the tables it finds (their chunks, not their content: each chunk is
/// written once more, then nothing); a restart without Maglev removes them (after the
/// entries lose the flag); one with another seed rewrites them.
#[test]
fn maglev_tables_are_adopted_removed_or_rebuilt_at_restart() {
    let mut m = maglev_maps();
    let mut d = Desired::new();
    d.insert(fe(10, 80), spec(&[2, 3, 4]));
    d.insert(fe(11, 80), spec(&[3]));
    Programmer::default()
        .with_maglev(TEST_M, 9)
        .apply(&mut m, &d)
        .unwrap();
    let before = maglev_owners(&m, fe(10, 80));
    let mut again = Programmer::adopt(m.read_programmed(), m.id_cursor).with_maglev(TEST_M, 9);
    let st = again.apply(&mut m, &d).unwrap();
    assert_eq!(
        (st.writes, st.deletes),
        (4, 0),
        "2 frontends, 2 chunks each, rewritten"
    );
    assert_eq!(maglev_owners(&m, fe(10, 80)), before);
    let st = again.apply(&mut m, &d).unwrap();
    assert_eq!((st.writes, st.deletes), (0, 0));

    let before = maglev_owners(&m, fe(10, 80));
    let mut reseeded = Programmer::adopt(m.read_programmed(), m.id_cursor).with_maglev(TEST_M, 10);
    reseeded.apply(&mut m, &d).unwrap();
    assert_ne!(maglev_owners(&m, fe(10, 80)), before);

    let mut jump = Programmer::adopt(m.read_programmed(), m.id_cursor);
    jump.apply(&mut m, &d).unwrap();
    assert!(m.maglev.is_empty());
    assert!(
        m.services
            .values()
            .all(|v| v.flags & lbproxy_common::SVC_F_MAGLEV == 0)
    );
    assert_eq!(m.backends.len(), 3);
}

/// A write that fails anywhere leaves every table whole and naming live backends (checked
/// by MemMaps after each write), and the next apply finishes the job.
#[test]
fn a_failed_maglev_write_leaves_the_maps_consistent() {
    for fail in 0..24 {
        let mut m = maglev_maps();
        let mut p = Programmer::default().with_maglev(TEST_M, 9);
        let mut d = Desired::new();
        d.insert(fe(10, 80), spec(&[2, 3, 4]));
        p.apply(&mut m, &d).unwrap();
        d.insert(fe(10, 80), spec(&[3, 5]));
        d.insert(fe(11, 53), spec(&[6]));
        m.fail_at = Some(fail);
        let _ = p.apply(&mut m, &d);
        m.check();
        p.apply(&mut m, &d).unwrap();
        let owners: std::collections::BTreeSet<BackendAddr> =
            maglev_owners(&m, fe(10, 80)).into_iter().collect();
        assert_eq!(owners, [be(3), be(5)].into(), "fail at {fail}");
        assert_eq!(m.backends.len(), 3, "fail at {fail}: {:?}", m.backends);
        let st = p.apply(&mut m, &d).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "fail at {fail}");
    }
}
