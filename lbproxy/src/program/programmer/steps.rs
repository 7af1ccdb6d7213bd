//! The write steps of one frontend's apply, each a write (or none) that records what it
//! wrote, in the order the programmer's module documentation gives.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use lbproxy_common::{MEMBER_DRAINING, MEMBER_SERVING, MaglevKey, ServiceValue, SlotKey};

use super::{ApplyStats, ProgrammedFrontend, Programmer};
use crate::desired::{Frontend, FrontendSpec};
use crate::program::maglev::Built;
use crate::program::maps::{MapWriteError, Maps};

impl Programmer {
    /// What is programmed for `fe`, to record a write in.
    pub(super) fn programmed_mut(&mut self, fe: Frontend) -> Option<&mut ProgrammedFrontend> {
        self.state.frontends.get_mut(&fe)
    }

    /// The ids of the backends for new flows, writing the ones not in the map yet.
    pub(super) fn backend_ids<M: Maps>(
        &mut self,
        maps: &mut M,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<Vec<u32>, MapWriteError> {
        spec.backends
            .iter()
            .map(|b| self.backend_id(maps, *b, stats))
            .collect()
    }

    /// Draining backends keep their entry (and so their flows) but get no slot. Only ones
    /// already in the map matter: a backend not there has no flows to keep. Takes a
    /// reference on each and releases the ones the frontend held before.
    pub(super) fn hold_draining(&mut self, fe: Frontend, spec: &FrontendSpec) -> Vec<u32> {
        let draining: Vec<u32> = spec
            .draining
            .iter()
            .filter_map(|b| self.by_addr.get(b).copied())
            .collect();
        for id in &draining {
            *self.refs.entry(*id).or_default() += 1;
        }
        if let Some(f) = self.programmed_mut(fe) {
            let old = std::mem::replace(&mut f.draining, draining.clone());
            for id in old {
                self.release(id);
            }
        }
        draining
    }

    /// A new frontend: its id (the cursor persisted first) and label; no entry yet.
    pub(super) fn create<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        spec: &FrontendSpec,
        (svc_id, next_id): (u32, u32),
        draining: Vec<u32>,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        self.lease(maps, svc_id, &|| format!("frontend {fe}"))?;
        self.next_id = next_id;
        maps.put_label(svc_id, &spec.label)?;
        self.svc_ids.insert(svc_id);
        stats.writes += 1;
        stats.frontends_created += 1;
        self.state.frontends.insert(
            fe,
            ProgrammedFrontend {
                svc_id,
                label: spec.label.clone(),
                slots: Vec::new(),
                value: None,
                src_ranges: BTreeSet::new(),
                members: BTreeMap::new(),
                draining,
                maglev: Default::default(),
            },
        );
        Ok(())
    }

    pub(super) fn relabel<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        maps.put_label(svc_id, &spec.label)?;
        stats.writes += 1;
        if let Some(f) = self.programmed_mut(fe) {
            f.label = spec.label.clone();
        }
        Ok(())
    }

    /// Membership, which the flows and session affinity check: leavers first, so their
    /// flows end and no client is sent back to them; newcomers (and members whose way of
    /// belonging changed) before their slots, so a flow to them is live from its first
    /// packet and affinity to them holds at once.
    pub(super) fn write_members<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        members: &BTreeMap<u32, u32>,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        let old = self
            .state
            .frontends
            .get(&fe)
            .map(|f| f.members.clone())
            .unwrap_or_default();
        for id in old.keys().filter(|id| !members.contains_key(id)) {
            maps.del_member(svc_id, *id)?;
            stats.deletes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.members.remove(id);
            }
        }
        for (id, how) in members.iter().filter(|(id, how)| old.get(id) != Some(how)) {
            maps.put_member(svc_id, *id, *how)?;
            stats.writes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.members.insert(*id, *how);
            }
        }
        Ok(())
    }

    /// Writes the slots of `slots` that differ from what is programmed. The programmed view
    /// tracks the longer of old and new until the count is written (slots past the old
    /// count are not live yet; recorded so a later failure still releases them on the next
    /// apply). Returns that view.
    pub(super) fn write_slots<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        slots: &[u32],
        stats: &mut ApplyStats,
    ) -> Result<Vec<u32>, MapWriteError> {
        let mut current = self
            .state
            .frontends
            .get(&fe)
            .map(|f| f.slots.clone())
            .unwrap_or_default();
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
            if let Some(f) = self.programmed_mut(fe) {
                f.slots = current.clone();
            }
        }
        Ok(current)
    }

    /// Source ranges the new entry admits, before it names them (a range that stays is not
    /// rewritten).
    pub(super) fn add_ranges<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        for r in &spec.src_ranges {
            if self
                .state
                .frontends
                .get(&fe)
                .is_some_and(|f| f.src_ranges.contains(r))
            {
                continue;
            }
            maps.put_src_range(svc_id, *r)?;
            stats.writes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.src_ranges.insert(*r);
            }
        }
        Ok(())
    }

    /// Source ranges the entry no longer names, after it stopped naming them.
    pub(super) fn del_ranges<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        spec: &FrontendSpec,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        let gone: Vec<ipnet::IpNet> = self.state.frontends.get(&fe).map_or_else(Vec::new, |f| {
            f.src_ranges
                .iter()
                .filter(|r| !spec.src_ranges.contains(r))
                .copied()
                .collect()
        });
        for r in gone {
            maps.del_src_range(svc_id, r)?;
            stats.deletes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.src_ranges.remove(&r);
            }
        }
        Ok(())
    }

    /// The service entry, when it differs from the one written.
    pub(super) fn write_entry<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        value: ServiceValue,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        if self
            .state
            .frontends
            .get(&fe)
            .is_some_and(|f| f.value == Some(value))
        {
            return Ok(());
        }
        maps.put_service(fe.key(), value)?;
        stats.writes += 1;
        if let Some(f) = self.programmed_mut(fe) {
            f.value = Some(value);
        }
        Ok(())
    }

    /// Writes the chunks of the table `built` describes that differ from those written, and
    /// returns how many chunks it has. The table holds a reference on each backend it
    /// names: the new ones are taken before the first write, the old ones given back after
    /// the last, so a write that fails half-way leaves every named backend in place.
    pub(super) fn write_maglev<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        built: &Built,
        stats: &mut ApplyStats,
    ) -> Result<u32, MapWriteError> {
        let Some(cur) = self.state.frontends.get(&fe) else {
            return Ok(0);
        };
        // The table's chunk count follows from its size alone: a table already built from
        // the same inputs is not built again just to count them.
        let n = built.m.div_ceil(lbproxy_common::MAGLEV_CHUNK);
        if cur.maglev.built.as_ref() == Some(built) {
            return Ok(n);
        }
        let backends = &self.state.backends;
        let chunks = crate::program::maglev::chunks(
            &built.ids,
            |id| backends.get(&id).copied(),
            built.m,
            built.seed,
        );
        debug_assert_eq!(chunks.len(), n as usize);
        let new_held: BTreeSet<u32> = built.ids.iter().copied().collect();
        let old_held = cur.maglev.held.clone();
        for id in new_held.difference(&old_held) {
            *self.refs.entry(*id).or_default() += 1;
        }
        if let Some(f) = self.programmed_mut(fe) {
            f.maglev.held = old_held.union(&new_held).copied().collect();
            f.maglev.built = None;
        }
        for (no, chunk) in &chunks {
            let print = crate::program::maglev::fingerprint(chunk);
            let same = self
                .state
                .frontends
                .get(&fe)
                .and_then(|f| f.maglev.chunks.get(no))
                == Some(&print);
            if same {
                continue;
            }
            maps.put_maglev_chunk(MaglevKey { svc_id, chunk: *no }, chunk)?;
            stats.writes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.maglev.chunks.insert(*no, print);
            }
        }
        if let Some(f) = self.programmed_mut(fe) {
            f.maglev.built = Some(built.clone());
            f.maglev.held = new_held.clone();
        }
        for id in old_held.difference(&new_held) {
            self.release(*id);
        }
        Ok(n)
    }

    /// Deletes the chunks of the frontend's Maglev table from chunk `keep` on, last first;
    /// with `keep` 0, the whole table and the references it holds.
    pub(super) fn trim_maglev<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        keep: u32,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        let extra: Vec<u32> = self.state.frontends.get(&fe).map_or_else(Vec::new, |f| {
            f.maglev
                .chunks
                .range(keep..)
                .map(|(no, _)| *no)
                .rev()
                .collect()
        });
        for no in extra {
            maps.del_maglev_chunk(MaglevKey { svc_id, chunk: no })?;
            stats.deletes += 1;
            if let Some(f) = self.programmed_mut(fe) {
                f.maglev.chunks.remove(&no);
            }
        }
        if keep == 0 {
            let held = self
                .programmed_mut(fe)
                .map(|f| {
                    f.maglev.built = None;
                    std::mem::take(&mut f.maglev.held)
                })
                .unwrap_or_default();
            for id in held {
                self.release(id);
            }
        }
        Ok(())
    }

    /// Deletes the slots of `current` past `len`, last first.
    pub(super) fn trim_slots<M: Maps>(
        &mut self,
        maps: &mut M,
        fe: Frontend,
        svc_id: u32,
        mut current: Vec<u32>,
        len: usize,
        stats: &mut ApplyStats,
    ) -> Result<(), MapWriteError> {
        while current.len() > len {
            let slot = u32::try_from(current.len() - 1).unwrap_or(u32::MAX);
            maps.del_slot(SlotKey { svc_id, slot })?;
            stats.deletes += 1;
            if let Some(id) = current.pop() {
                self.release(id);
            }
            if let Some(f) = self.programmed_mut(fe) {
                f.slots = current.clone();
            }
        }
        Ok(())
    }
}

/// The new slot arrangement: keep backends where they are, fill holes left by removed ones
/// with the last slots, append new ones. O(changes) writes. A failed earlier apply can leave
/// a backend in two slots: its first is kept only.
pub(super) fn arrange(old: &[u32], want: &[u32]) -> Vec<u32> {
    let want_set: HashSet<u32> = want.iter().copied().collect();
    let mut kept = HashSet::new();
    let mut slots = old.to_vec();
    let mut i = 0;
    while i < slots.len() {
        if want_set.contains(&slots[i]) && kept.insert(slots[i]) {
            i += 1;
        } else {
            slots.swap_remove(i);
        }
    }
    let have: HashSet<u32> = slots.iter().copied().collect();
    for id in want {
        if !have.contains(id) {
            slots.push(*id);
        }
    }
    slots
}

/// The members of a frontend: the slots serving, the draining backends keeping their flows
/// (and only those).
pub(super) fn members_of(slots: &[u32], draining: &[u32]) -> BTreeMap<u32, u32> {
    draining
        .iter()
        .map(|id| (*id, MEMBER_DRAINING))
        .chain(slots.iter().map(|id| (*id, MEMBER_SERVING)))
        .collect()
}
