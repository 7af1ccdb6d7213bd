//! Sync: the model into the maps, through the [`Maps`] trait.
//!
//! A full sync derives every service's frontends; a dirty sync only those of the services
//! ingest marked, so one endpoint change costs the same at 10 or 10,000 services. Either
//! way the programmer writes only the difference. A reconcile reads the maps back first
//! and adopts what it finds when it differs from what was written (an entry deleted by
//! hand with bpftool, say), so the full sync that follows repairs it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lbproxy_common::{FAMILY_IPV4, FAMILY_IPV6, UnservedKey, UnservedValue};

use crate::desired::{self, Family, Frontend, FrontendSpec, Unserved};
use crate::model::{Model, NamespacedName};
use crate::program::{ApplyStats, MapWriteError, Maps, Programmer};

pub type ApplyResult = Result<ApplyStats, (ApplyStats, Vec<MapWriteError>)>;

pub struct Sync<M: Maps> {
    maps: M,
    programmer: Programmer,
    /// The frontends each service currently owns.
    frontends_of: HashMap<NamespacedName, Vec<Frontend>>,
    /// The frontends not served yet, as written for `lbproxy inspect`, and by service.
    unserved: BTreeMap<UnservedKey, UnservedValue>,
    unserved_of: HashMap<NamespacedName, Vec<UnservedKey>>,
}

/// The entry of a frontend not served yet in `LB_UNSERVED_V1`.
fn unserved_entry(u: &Unserved) -> (UnservedKey, UnservedValue) {
    let mut addr = [0u8; 16];
    match u.addr {
        Some(std::net::IpAddr::V4(a)) => addr[..4].copy_from_slice(&a.octets()),
        Some(std::net::IpAddr::V6(a)) => addr = a.octets(),
        None => {}
    }
    let key = UnservedKey {
        addr,
        port_be: u.port.to_be(),
        proto: u.proto.number(),
        kind: u.kind.number(),
        family: match u.family {
            Family::V4 => FAMILY_IPV4,
            Family::V6 => FAMILY_IPV6,
        },
        _pad: [0; 3],
        svc_hash: fnv1a(u.label.as_bytes()),
    };
    let value = UnservedValue {
        label: crate::bpf::pinned::nul_padded(&u.label),
        reason: crate::bpf::pinned::nul_padded(u.reason),
    };
    (key, value)
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| {
        (h ^ u64::from(*c)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl<M: Maps> Sync<M> {
    /// Starts from what `maps` already hold (an earlier run's state), keeping every id so
    /// the flows it recorded stay valid.
    pub fn adopt(maps: M) -> Self {
        let adopted = maps.read_programmed();
        if !adopted.frontends.is_empty() {
            tracing::info!(
                frontends = adopted.frontends.len(),
                backends = adopted.backends.len(),
                "adopting the state pinned by an earlier run"
            );
        }
        Self {
            programmer: Programmer::adopt(adopted),
            unserved: maps.read_unserved(),
            maps,
            frontends_of: HashMap::new(),
            unserved_of: HashMap::new(),
        }
    }

    #[cfg(test)]
    pub fn maps(&self) -> &M {
        &self.maps
    }

    #[cfg(test)]
    pub fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }

    pub fn programmed(&self) -> &crate::program::Programmed {
        self.programmer.programmed()
    }

    /// The frontends not served yet, by kind, for the metric.
    pub fn unserved_by_kind(&self) -> BTreeMap<u8, usize> {
        let mut out = BTreeMap::new();
        for k in self.unserved.keys() {
            *out.entry(k.kind).or_default() += 1;
        }
        out
    }

    /// Programs the whole model.
    pub fn all(&mut self, model: &Model, node: &str) -> ApplyResult {
        let mut desired = desired::Desired::new();
        let mut unserved = BTreeMap::new();
        self.frontends_of.clear();
        self.unserved_of.clear();
        for svc in model.services.values() {
            let fes = desired::frontends_for(model, svc, node);
            self.frontends_of
                .insert(svc.id.clone(), fes.served.iter().map(|(f, _)| *f).collect());
            let entries: Vec<(UnservedKey, UnservedValue)> =
                fes.unserved.iter().map(unserved_entry).collect();
            self.unserved_of
                .insert(svc.id.clone(), entries.iter().map(|(k, _)| *k).collect());
            unserved.extend(entries);
            desired.extend(fes.served);
        }
        let result = self.programmer.apply(&mut self.maps, &desired);
        let gone: Vec<UnservedKey> = self
            .unserved
            .keys()
            .filter(|k| !unserved.contains_key(k))
            .copied()
            .collect();
        self.write_unserved(&gone, unserved.iter());
        result
    }

    /// Removes `gone` and writes `entries` (those that differ) to the unserved map. The list
    /// is informational: a failed write is logged, never fails the sync (nor `/healthz`),
    /// and is retried by the next full sync.
    fn write_unserved<'a>(
        &mut self,
        gone: &[UnservedKey],
        entries: impl Iterator<Item = (&'a UnservedKey, &'a UnservedValue)>,
    ) {
        let mut errors = Vec::new();
        for k in gone {
            match self.maps.del_unserved(*k) {
                Ok(()) => {
                    self.unserved.remove(k);
                }
                Err(e) => errors.push(e),
            }
        }
        for (k, v) in entries {
            if self.unserved.get(k) == Some(v) {
                continue;
            }
            match self.maps.put_unserved(*k, v) {
                Ok(()) => {
                    self.unserved.insert(*k, *v);
                }
                Err(e) => errors.push(e),
            }
        }
        if let Some(first) = errors.first() {
            tracing::warn!(
                failed = errors.len(),
                "the list of frontends not served yet is incomplete (inspect and the metric \
                 undercount): {}",
                crate::bpf::error_chain(first)
            );
        }
    }

    /// Programs only `dirty` services.
    pub fn services(
        &mut self,
        model: &Model,
        node: &str,
        dirty: &BTreeSet<NamespacedName>,
    ) -> ApplyResult {
        let mut upserts: Vec<(Frontend, FrontendSpec)> = Vec::new();
        let mut removed: Vec<Frontend> = Vec::new();
        let mut unserved_gone: Vec<UnservedKey> = Vec::new();
        let mut unserved_new: BTreeMap<UnservedKey, UnservedValue> = BTreeMap::new();
        for name in dirty {
            let fes = model
                .services
                .get(name)
                .map(|svc| desired::frontends_for(model, svc, node));
            let (new, unserved) = fes.map_or_else(Default::default, |f| (f.served, f.unserved));
            let entries: BTreeMap<UnservedKey, UnservedValue> =
                unserved.iter().map(unserved_entry).collect();
            for old in self.unserved_of.remove(name).unwrap_or_default() {
                if !entries.contains_key(&old) {
                    unserved_gone.push(old);
                }
            }
            if !entries.is_empty() {
                self.unserved_of
                    .insert(name.clone(), entries.keys().copied().collect());
            }
            unserved_new.extend(entries);
            let new_fes: Vec<Frontend> = new.iter().map(|(f, _)| *f).collect();
            for old in self.frontends_of.get(name).into_iter().flatten() {
                if !new_fes.contains(old) {
                    removed.push(*old);
                }
            }
            if new_fes.is_empty() {
                self.frontends_of.remove(name);
            } else {
                self.frontends_of.insert(name.clone(), new_fes);
            }
            upserts.extend(new);
        }
        let result = self.programmer.apply_changes(
            &mut self.maps,
            upserts.iter().map(|(f, s)| (*f, s)),
            &removed,
        );
        self.write_unserved(&unserved_gone, unserved_new.iter());
        result
    }

    /// Reads the maps back and, when they drifted from what was written, adopts what they
    /// hold; then programs the whole model, which repairs the drift.
    pub fn reconcile(&mut self, model: &Model, node: &str) -> ApplyResult {
        let observed = self.maps.read_programmed();
        let mut ours = self.programmer.programmed().clone();
        for f in ours.frontends.values_mut() {
            f.draining.clear();
        }
        if observed != ours {
            tracing::warn!("the maps drifted from the model (edited by hand?); repairing");
            self.programmer.readopt(observed);
        }
        self.all(model, node)
    }
}
