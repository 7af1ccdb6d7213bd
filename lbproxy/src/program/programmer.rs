//! The programmer: holds what is programmed and turns a new desired state into the minimal
//! map writes.
//!
//! Write order keeps every frontend consistent at every instant, so a packet never sees a
//! half-programmed service:
//! - a new or changed frontend: backends, then slots, then the service entry (its count);
//! - a removed frontend: the service entry, then its slots;
//! - backends no frontend uses any more go last.
//!
//! Within a frontend (`apply_frontend`, whose steps are in `steps`): its backends; its
//! membership in `LB_MEMBERS_V1`, leavers deleted first, then the members serving (in a
//! slot) or draining, all before the slots; the slots that change; the source ranges it
//! gains; under `--lb-algorithm maglev`, the chunks of its Maglev table that change (the
//! table holds a reference on every backend it names); the service entry, compared with the
//! one written as a whole [`ServiceValue`]; the source ranges it loses; the table's chunks
//! it no longer has (all of them when it has no backend, or Maglev is off); the slots past
//! the new count.
//!
//! The map writes go through the [`Maps`] trait; `bpf::PinnedMaps` is the real one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lbproxy_common::{ServiceValue, SlotKey};

use super::encode;
use super::maglev::{Built, MaglevTable};
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
    /// The service entry as written, `None` until it is: an apply compares the whole value
    /// it wants against it, and writes it when they differ.
    pub value: Option<ServiceValue>,
    /// Its `loadBalancerSourceRanges` in `LB_SRCRANGES_V1` (`LB_SRCRANGE6_V1` for IPv6).
    pub src_ranges: BTreeSet<ipnet::IpNet>,
    /// Backend ids written to `LB_MEMBERS_V1` for this service, with how they belong
    /// (`MEMBER_SERVING`: in a slot; `MEMBER_DRAINING`: keeps its flows only).
    pub members: BTreeMap<u32, u32>,
    /// Backends kept live for existing flows only (not in any slot).
    pub draining: Vec<u32>,
    /// Its Maglev table (`--lb-algorithm maglev`), empty under the jump hash.
    pub maglev: MaglevTable,
}

/// Counts of what one apply wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub writes: usize,
    pub deletes: usize,
    pub frontends_changed: usize,
    /// Frontends that did not exist before this apply (a new service id each).
    pub frontends_created: usize,
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
    /// `--lb-algorithm maglev`: the tables' size and the seed they are built with. `None`:
    /// the jump hash over the slots, and no table.
    maglev: Option<(u32, u64)>,
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
            for id in f.slots.iter().chain(&f.maglev.held) {
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
        let maglev = self.maglev;
        *self = Self::adopt(state, next);
        self.maglev = maglev;
        self.next_id = next;
        self.lease_start = start;
        self.lease_end = end;
    }

    /// New flows of every frontend with a backend pick it from a Maglev table of `m`
    /// entries built with `seed` (`--lb-algorithm maglev`), instead of the jump hash. Each
    /// frontend's table is written by its next apply.
    pub fn with_maglev(mut self, m: u32, seed: u64) -> Self {
        self.maglev = Some((m, seed));
        self
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

    /// The frontends whose write (or removal) failed in the last apply, with the errno.
    pub fn failed(&self) -> &[(Frontend, Option<i32>)] {
        &self.failed
    }

    /// Adds `earlier` failures to the last apply's: a reconcile's sweep applies slice by
    /// slice and reports the failures of all of them.
    pub fn keep_failed(&mut self, earlier: Vec<(Frontend, Option<i32>)>) {
        self.failed.extend(earlier);
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
                self.failed.push((*fe, e.errno()));
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
        self.trim_maglev(maps, fe, cur.svc_id, 0, stats)?;
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

    /// Programs one frontend, in the order the module documentation gives, each step a
    /// write (or none) that leaves the frontend consistent if the next one fails.
    fn apply_frontend<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        // 1. Backends.
        let want = self.backend_ids(maps, spec, stats)?;
        let draining = self.hold_draining(fe, spec);
        let existing = self.state.frontends.get(&fe);
        let mut next_svc_id = self.next_id;
        let svc_id = match existing {
            Some(cur) => cur.svc_id,
            None => {
                let ids = &self.svc_ids;
                next_free_id(&mut next_svc_id, ids.len(), |id| ids.contains(&id))
                    .ok_or_else(|| MapWriteError::no_free_id("services", &fe.to_string()))?
            }
        };
        // 2. The new slot arrangement, membership and entry.
        let slots = arrange(existing.map_or(&[][..], |c| &c.slots), &want);
        let count = u32::try_from(slots.len()).unwrap_or(u32::MAX);
        let mut value = encode::service_value(svc_id, count, spec);
        let built = self.maglev.filter(|_| !slots.is_empty()).map(|(m, seed)| {
            let mut ids = slots.clone();
            ids.sort_unstable();
            Built { m, seed, ids }
        });
        if built.is_some() {
            value.flags |= lbproxy_common::SVC_F_MAGLEV;
        }
        let members = members_of(&slots, &draining);
        if existing.is_some_and(|c| {
            c.slots == slots
                && c.label == spec.label
                && c.value == Some(value)
                && c.src_ranges.iter().eq(spec.src_ranges.iter())
                && c.members == members
                && c.maglev.built == built
                && (built.is_some() || c.maglev.chunks.is_empty())
        }) {
            return Ok(());
        }
        stats.frontends_changed += 1;
        match existing.map(|c| c.label != spec.label) {
            None => self.create(maps, fe, spec, (svc_id, next_svc_id), draining, stats)?,
            Some(true) => self.relabel(maps, fe, svc_id, spec, stats)?,
            Some(false) => {}
        }
        self.write_members(maps, fe, svc_id, &members, stats)?;
        // 3. Slots that change, while the count still hides any slot beyond the old end.
        let current = self.write_slots(maps, fe, svc_id, &slots, stats)?;
        self.add_ranges(maps, fe, svc_id, spec, stats)?;
        // The Maglev table's chunks that change, before the entry names the table.
        let keep_chunks = match &built {
            Some(b) => self.write_maglev(maps, fe, svc_id, b, stats)?,
            None => 0,
        };
        // 4. The entry (its count): from here on new flows use the new arrangement.
        self.write_entry(maps, fe, value, stats)?;
        self.del_ranges(maps, fe, svc_id, spec, stats)?;
        // 5. Slots beyond the new end, and chunks past the table (all of them without one).
        self.trim_maglev(maps, fe, svc_id, keep_chunks, stats)?;
        self.trim_slots(maps, fe, svc_id, current, slots.len(), stats)
    }
}

mod steps;
use steps::{arrange, members_of};

#[cfg(test)]
mod tests;
