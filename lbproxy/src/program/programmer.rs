//! The programmer: holds what is programmed and turns a new desired state into the minimal
//! map writes.
//!
//! Write order keeps every frontend consistent at every instant, so a packet never sees a
//! half-programmed service:
//! - a new or changed frontend: backends, then slots, then the service entry (its count);
//! - a removed frontend: the service entry, then its slots;
//! - backends no frontend uses any more go last.
//!
//! The map writes go through the [`Maps`] trait; `bpf::PinnedMaps` is the real one.

use std::collections::{BTreeMap, HashMap};

use lbproxy_common::{MEMBER_DRAINING, MEMBER_SERVING, ServiceValue, SlotKey};

use super::maps::{MapWriteError, Maps};
use crate::desired::{BackendAddr, Desired, Frontend, FrontendSpec};

/// What is in the maps, as read back at start-up (adoption) or as written since.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub frontends: BTreeMap<Frontend, ProgrammedFrontend>,
    pub backends: HashMap<u32, BackendAddr>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgrammedFrontend {
    pub svc_id: u32,
    pub label: String,
    /// `slots[i]` is the backend id in slot `i`, including slots written past the count by
    /// an apply that failed before writing the count.
    pub slots: Vec<u32>,
    /// The count in the service entry, `None` when the entry is not written yet.
    pub count: Option<u32>,
    /// The affinity timeout in the service entry.
    pub affinity_timeout_s: u32,
    /// The kind in the service entry (`SVC_KIND_*`).
    pub kind: u8,
    /// The flags in the service entry (`SVC_F_*`).
    pub flags: u16,
    /// Its `loadBalancerSourceRanges` in `LB_SRCRANGES_V1` (`LB_SRCRANGE6_V1` for IPv6).
    pub src_ranges: std::collections::BTreeSet<ipnet::IpNet>,
    /// Backend ids written to `LB_MEMBERS_V1` for this service, with how they belong
    /// (`MEMBER_SERVING`: in a slot; `MEMBER_DRAINING`: keeps its flows only).
    pub members: BTreeMap<u32, u32>,
    /// Backends kept live for existing flows only (not in any slot).
    pub draining: Vec<u32>,
}

/// Counts of what one apply wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub writes: usize,
    pub deletes: usize,
    pub frontends_changed: usize,
}

/// Holds what is programmed and turns a new desired state into the minimal writes.
#[derive(Debug, Default)]
pub struct Programmer {
    state: Programmed,
    by_addr: HashMap<BackendAddr, u32>,
    refs: HashMap<u32, usize>,
    /// Backends whose count dropped to zero since the last sweep.
    maybe_unused: std::collections::HashSet<u32>,
    /// The next id to try, for services and backends alike; see [`next_free_id`].
    next_id: u32,
    /// Ids from `lease_start` up to `lease_end` (exclusive, wrapping) may be handed out
    /// without another write of the persisted cursor: `lease_end` is what the maps hold.
    lease_start: u32,
    lease_end: u32,
    /// Service ids of the programmed frontends, so allocation skips them in O(1).
    svc_ids: std::collections::HashSet<u32>,
    /// The frontends whose write failed in the last apply, with the errno of the failure
    /// (`None`: not a kernel refusal), so the caller can name their services.
    failed: Vec<(Frontend, Option<i32>)>,
}

/// How many ids one write of the persisted cursor covers. A restart skips what is left of
/// the last lease; 4,096 ids lost per restart is nothing against 2^32, and a start-up that
/// programs 200,000 ids writes the cursor some 50 times.
const ID_LEASE: u32 = 4096;

/// The id to hand out from `*next` on: the first that is not 0 and not `in_use`, in
/// increasing order, wrapping at `u32::MAX`. `*next` moves past it, so an id just freed is
/// not handed out again until every other id has been (flows may still refer to it).
/// `None` when every id is in use (more than any map holds).
fn next_free_id(next: &mut u32, in_use_count: usize, in_use: impl Fn(u32) -> bool) -> Option<u32> {
    if in_use_count >= u32::MAX as usize {
        return None;
    }
    let mut id = *next;
    loop {
        if id != 0 && !in_use(id) {
            *next = id.wrapping_add(1);
            return Some(id);
        }
        id = id.wrapping_add(1);
    }
}

impl Programmer {
    /// Starts from what the maps already hold, keeping every id, so flows recorded by an
    /// earlier run stay valid.
    ///
    /// Service and backend ids come from one cursor, which the maps persist (`cursor`, read
    /// with [`Maps::read_id_cursor`]) ahead of every id written. New ids continue from it,
    /// so an id the earlier run freed is not handed out again before the ids wrap, even if
    /// flows still hold it. Without a persisted cursor (0: maps written by a version before
    /// it) they continue after the highest id in use; ids freed above that one by the
    /// earlier run may then come back, which the datapath tolerates (a flow is live only
    /// while its `svc_id` is its frontend's and its backend id still holds the same address).
    pub fn adopt(state: Programmed, cursor: u32) -> Self {
        let next_id = if cursor != 0 {
            cursor
        } else {
            state
                .backends
                .keys()
                .copied()
                .chain(state.frontends.values().map(|f| f.svc_id))
                .max()
                .map_or(1, |m| m.wrapping_add(1))
        };
        let mut p = Programmer {
            next_id,
            // An empty lease: the first id handed out writes the cursor.
            lease_start: next_id,
            lease_end: next_id,
            ..Default::default()
        };
        p.svc_ids = state.frontends.values().map(|f| f.svc_id).collect();
        for (id, addr) in &state.backends {
            p.by_addr.insert(*addr, *id);
            p.refs.insert(*id, 0);
        }
        for f in state.frontends.values() {
            for id in &f.slots {
                *p.refs.entry(*id).or_default() += 1;
            }
        }
        p.maybe_unused = p
            .refs
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(id, _)| *id)
            .collect();
        p.state = state;
        p
    }

    /// Adopts `state` (read back after drift) in place of what was programmed, keeping the
    /// id cursor and its lease: ids freed before the drift are not handed out again any
    /// sooner.
    pub fn readopt(&mut self, state: Programmed) {
        let (next, start, end) = (self.next_id, self.lease_start, self.lease_end);
        *self = Self::adopt(state, next);
        self.next_id = next;
        self.lease_start = start;
        self.lease_end = end;
    }

    /// Sets the next id to hand out, to test what happens near a wrap.
    #[cfg(test)]
    pub fn with_next_id(mut self, id: u32) -> Self {
        self.next_id = id;
        self.lease_start = id;
        self.lease_end = id;
        self
    }

    /// Makes sure the persisted cursor is past `id` before `id` goes into a map: when `id`
    /// is outside the current lease, a new lease starting at it is written first. On a
    /// failed write the id is not handed out.
    fn lease<M: Maps>(
        &mut self,
        maps: &mut M,
        id: u32,
        entry: &dyn Fn() -> String,
    ) -> Result<(), MapWriteError> {
        if id.wrapping_sub(self.lease_start) < self.lease_end.wrapping_sub(self.lease_start) {
            return Ok(());
        }
        // 0 reads back as "no cursor"; a lease ending there ends at 1 instead (0 itself is
        // never handed out).
        let end = match id.wrapping_add(ID_LEASE) {
            0 => 1,
            e => e,
        };
        maps.put_id_cursor(end).map_err(|mut e| {
            e.op = "persist the id cursor for";
            e.entry = entry();
            e
        })?;
        self.lease_start = id;
        self.lease_end = end;
        Ok(())
    }

    pub fn programmed(&self) -> &Programmed {
        &self.state
    }

    /// The frontends whose write failed in the last apply, with the errno.
    pub fn failed(&self) -> &[(Frontend, Option<i32>)] {
        &self.failed
    }

    fn backend_id<M: Maps>(
        &mut self,
        maps: &mut M,
        addr: BackendAddr,
        stats: &mut ApplyStats,
    ) -> Result<u32, MapWriteError> {
        if let Some(id) = self.by_addr.get(&addr) {
            return Ok(*id);
        }
        let mut next = self.next_id;
        let (backends, refs) = (&self.state.backends, &self.refs);
        let id = next_free_id(&mut next, backends.len(), |id| {
            backends.contains_key(&id) || refs.contains_key(&id)
        })
        .ok_or_else(|| MapWriteError::no_free_id("backends", &addr.to_string()))?;
        self.lease(maps, id, &|| format!("backend {addr}"))?;
        maps.put_backend(id, &addr.value())?;
        stats.writes += 1;
        self.next_id = next;
        self.by_addr.insert(addr, id);
        self.refs.insert(id, 0);
        // Freed again at the end of this apply if no slot ends up using it.
        self.maybe_unused.insert(id);
        self.state.backends.insert(id, addr);
        Ok(id)
    }

    /// Programs `desired` as the whole state, writing only what differs. On a failed write it
    /// stops that frontend where it is (still consistent), goes on with the others, and
    /// returns the errors; the next apply retries.
    pub fn apply<M: Maps>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
    ) -> Result<ApplyStats, (ApplyStats, Vec<MapWriteError>)> {
        let removed: Vec<Frontend> = self
            .state
            .frontends
            .keys()
            .filter(|f| !desired.contains_key(f))
            .copied()
            .collect();
        self.apply_changes(maps, desired.iter().map(|(f, s)| (*f, s)), &removed)
    }

    /// Programs some frontends and removes others, leaving every other frontend as it is.
    /// This is what one service's change costs: O(its frontends and backends), whatever the
    /// number of services.
    pub fn apply_changes<'a, M: Maps>(
        &mut self,
        maps: &mut M,
        upserts: impl IntoIterator<Item = (Frontend, &'a FrontendSpec)>,
        removed: &[Frontend],
    ) -> Result<ApplyStats, (ApplyStats, Vec<MapWriteError>)> {
        let mut stats = ApplyStats::default();
        let mut errors = Vec::new();
        self.failed.clear();
        // Removed frontends first: frees slots and ids before new ones are written.
        for fe in removed {
            if let Err(e) = self.remove_frontend(maps, *fe, &mut stats) {
                errors.push(e);
            }
        }
        // One frontend's failure (a full map, say) stops that frontend only: the others are
        // still written.
        for (fe, spec) in upserts {
            if let Err(e) = self.apply_frontend(maps, fe, spec, &mut stats) {
                self.failed.push((fe, e.errno()));
                errors.push(e);
            }
        }
        // Backends nothing refers to any more.
        let candidates: Vec<u32> = self.maybe_unused.drain().collect();
        for id in candidates {
            if self.refs.get(&id).is_some_and(|n| *n > 0) {
                continue;
            }
            let family = self
                .state
                .backends
                .get(&id)
                .map_or(crate::model::Family::V4, BackendAddr::family);
            match maps.del_backend(id, family) {
                Ok(()) => {
                    stats.deletes += 1;
                    self.refs.remove(&id);
                    if let Some(addr) = self.state.backends.remove(&id) {
                        self.by_addr.remove(&addr);
                    }
                }
                Err(e) => {
                    self.maybe_unused.insert(id);
                    errors.push(e);
                }
            }
        }
        if errors.is_empty() {
            Ok(stats)
        } else {
            Err((stats, errors))
        }
    }

    fn remove_frontend<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        let Some(cur) = self.state.frontends.get(&fe).cloned() else {
            return Ok(());
        };
        maps.del_service(fe.key())?;
        stats.deletes += 1;
        stats.frontends_changed += 1;
        // From here on no packet reaches this frontend's slots, nor its ranges.
        for r in &cur.src_ranges {
            maps.del_src_range(cur.svc_id, *r)?;
            stats.deletes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.src_ranges.remove(r);
            }
        }
        for id in cur.members.keys().chain(cur.slots.iter()) {
            maps.del_member(cur.svc_id, *id)?;
            stats.deletes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.members.remove(id);
            }
        }
        let mut left = cur.slots.clone();
        while let Some(id) = left.last().copied() {
            let slot = u32::try_from(left.len() - 1).unwrap_or(u32::MAX);
            maps.del_slot(SlotKey {
                svc_id: cur.svc_id,
                slot,
            })?;
            stats.deletes += 1;
            left.pop();
            self.release(id);
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.slots = left.clone();
            }
        }
        maps.del_label(cur.svc_id)?;
        for id in cur.draining {
            self.release(id);
        }
        self.state.frontends.remove(&fe);
        self.svc_ids.remove(&cur.svc_id);
        Ok(())
    }

    fn release(&mut self, id: u32) {
        if let Some(n) = self.refs.get_mut(&id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.maybe_unused.insert(id);
            }
        }
    }

    fn apply_frontend<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        // 1. Backends.
        let mut want = Vec::with_capacity(spec.backends.len());
        for b in &spec.backends {
            want.push(self.backend_id(maps, *b, stats)?);
        }

        // Draining backends keep their entry (and so their flows) but get no slot. Only ones
        // already in the map matter: a backend not there has no flows to keep.
        let draining: Vec<u32> = spec
            .draining
            .iter()
            .filter_map(|b| self.by_addr.get(b).copied())
            .collect();
        for id in &draining {
            *self.refs.entry(*id).or_default() += 1;
        }
        if let Some(f) = self.state.frontends.get_mut(&fe) {
            let old = std::mem::replace(&mut f.draining, draining.clone());
            for id in old {
                self.release(id);
            }
        }

        let existing = self.state.frontends.get(&fe).cloned();
        let mut next_svc_id = self.next_id;
        let (svc_id, old_slots, is_new) = match &existing {
            Some(cur) => (cur.svc_id, cur.slots.clone(), false),
            None => {
                let ids = &self.svc_ids;
                let id = next_free_id(&mut next_svc_id, ids.len(), |id| ids.contains(&id))
                    .ok_or_else(|| MapWriteError::no_free_id("services", &fe.to_string()))?;
                (id, Vec::new(), true)
            }
        };

        // 2. The new slot arrangement: keep backends where they are, fill holes left by
        // removed ones with the last slots, append new ones. O(changes) writes.
        // A failed earlier apply can leave a backend in two slots: keep its first only.
        let want_set: std::collections::HashSet<u32> = want.iter().copied().collect();
        let mut kept = std::collections::HashSet::new();
        let mut slots = old_slots.clone();
        let mut i = 0;
        while i < slots.len() {
            if want_set.contains(&slots[i]) && kept.insert(slots[i]) {
                i += 1;
            } else {
                slots.swap_remove(i);
            }
        }
        let have: std::collections::HashSet<u32> = slots.iter().copied().collect();
        for id in &want {
            if !have.contains(id) {
                slots.push(*id);
            }
        }
        let want_count = u32::try_from(slots.len()).unwrap_or(u32::MAX);
        let old_members: BTreeMap<u32, u32> = existing
            .as_ref()
            .map(|c| c.members.clone())
            .unwrap_or_default();
        // Serving members are the slots; draining ones keep their flows, and only those.
        let new_members: BTreeMap<u32, u32> = draining
            .iter()
            .map(|id| (*id, MEMBER_DRAINING))
            .chain(slots.iter().map(|id| (*id, MEMBER_SERVING)))
            .collect();
        if !is_new
            && slots == old_slots
            && existing.as_ref().is_some_and(|c| {
                c.label == spec.label
                    && c.count == Some(want_count)
                    && c.affinity_timeout_s == spec.affinity_timeout_s
                    && c.kind == spec.kind.number()
                    && c.flags == super::encode::flags(&spec.policy).bits()
                    && c.src_ranges.iter().eq(spec.src_ranges.iter())
                    && c.members == new_members
            })
        {
            return Ok(());
        }
        stats.frontends_changed += 1;
        if is_new {
            self.lease(maps, svc_id, &|| format!("frontend {fe}"))?;
            self.next_id = next_svc_id;
            maps.put_label(svc_id, &spec.label)?;
            self.svc_ids.insert(svc_id);
            stats.writes += 1;
            self.state.frontends.insert(
                fe,
                ProgrammedFrontend {
                    svc_id,
                    label: spec.label.clone(),
                    slots: Vec::new(),
                    count: None,
                    draining,
                    affinity_timeout_s: 0,
                    kind: spec.kind.number(),
                    flags: 0,
                    src_ranges: std::collections::BTreeSet::new(),
                    members: BTreeMap::new(),
                },
            );
        } else if existing.as_ref().is_some_and(|c| c.label != spec.label) {
            maps.put_label(svc_id, &spec.label)?;
            stats.writes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.label = spec.label.clone();
            }
        }

        // 2b. Membership, which the flows and session affinity check: leavers first, so
        // their flows end and no client is sent back to them; newcomers (and members whose
        // way of belonging changed) before their slots, so a flow to them is live from its
        // first packet and affinity to them holds at once.
        for id in old_members
            .keys()
            .filter(|id| !new_members.contains_key(id))
        {
            maps.del_member(svc_id, *id)?;
            stats.deletes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.members.remove(id);
            }
        }
        for (id, how) in new_members
            .iter()
            .filter(|(id, how)| old_members.get(id) != Some(how))
        {
            maps.put_member(svc_id, *id, *how)?;
            stats.writes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.members.insert(*id, *how);
            }
        }

        // 3. Slots that change, while the count still hides any slot beyond the old end.
        // The programmed view tracks the longer of old and new until the count is written.
        let mut current = old_slots.clone();
        for (i, id) in slots.iter().enumerate() {
            if current.get(i) == Some(id) {
                continue;
            }
            let slot = u32::try_from(i).unwrap_or(u32::MAX);
            maps.put_slot(SlotKey { svc_id, slot }, *id)?;
            stats.writes += 1;
            *self.refs.entry(*id).or_default() += 1;
            if i < current.len() {
                let old = current[i];
                current[i] = *id;
                self.release(old);
            } else {
                current.push(*id);
            }
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                // Slots past the old count are not live yet; record them so a failure
                // later still releases them on the next apply.
                f.slots = current.clone();
            }
        }

        // Source ranges the new entry admits, before it names them (a range that stays is
        // not rewritten; ones that go are removed after the entry).
        let old_ranges = self
            .state
            .frontends
            .get(&fe)
            .map(|f| f.src_ranges.clone())
            .unwrap_or_default();
        for r in spec.src_ranges.iter().filter(|r| !old_ranges.contains(r)) {
            maps.put_src_range(svc_id, *r)?;
            stats.writes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.src_ranges.insert(*r);
            }
        }

        // 4. The count: from here on new flows use the new arrangement.
        let (programmed_count, programmed_affinity, programmed_kind, programmed_flags) =
            self.state.frontends.get(&fe).map_or((None, 0, 0, 0), |f| {
                (f.count, f.affinity_timeout_s, f.kind, f.flags)
            });
        if programmed_count != Some(want_count)
            || programmed_affinity != spec.affinity_timeout_s
            || programmed_kind != spec.kind.number()
            || programmed_flags != super::encode::flags(&spec.policy).bits()
        {
            maps.put_service(
                fe.key(),
                ServiceValue {
                    svc_id,
                    count: want_count,
                    affinity_timeout_s: spec.affinity_timeout_s,
                    flags: super::encode::flags(&spec.policy).bits(),
                    kind: spec.kind.number(),
                    _pad: 0,
                },
            )?;
            stats.writes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.count = Some(want_count);
                f.affinity_timeout_s = spec.affinity_timeout_s;
                f.kind = spec.kind.number();
                f.flags = super::encode::flags(&spec.policy).bits();
            }
        }

        for r in old_ranges.iter().filter(|r| !spec.src_ranges.contains(r)) {
            maps.del_src_range(svc_id, *r)?;
            stats.deletes += 1;
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.src_ranges.remove(r);
            }
        }

        // 5. Slots beyond the new end.
        while current.len() > slots.len() {
            let slot = u32::try_from(current.len() - 1).unwrap_or(u32::MAX);
            maps.del_slot(SlotKey { svc_id, slot })?;
            stats.deletes += 1;
            if let Some(id) = current.pop() {
                self.release(id);
            }
            if let Some(f) = self.state.frontends.get_mut(&fe) {
                f.slots = current.clone();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use crate::program::mem::MemMaps;
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
        assert_eq!(s.frontends_changed, 2);

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
        assert_eq!(s.frontends_changed, 1);
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

        let mut p = Programmer::adopt(p.programmed().clone(), m.read_id_cursor())
            .with_next_id(u32::MAX - 1);
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
}
