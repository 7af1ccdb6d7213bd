//! Sync: the model into the maps, through the [`Maps`] trait.
//!
//! A full sync derives every service's frontends; a dirty sync only those of the services
//! ingest marked, so one endpoint change costs the same at 10 or 10,000 services. Either
//! way the programmer writes only the difference. A reconcile reads the maps back first
//! and adopts what it finds when it differs from what was written (an entry deleted by
//! hand with bpftool, say), so the full sync that follows repairs it.

use std::collections::{BTreeSet, HashMap};

use crate::desired::{self, Frontend, FrontendSpec};
use crate::model::{Model, NamespacedName};
use crate::program::{ApplyStats, MapWriteError, Maps, Programmer};

pub type ApplyResult = Result<ApplyStats, (ApplyStats, Vec<MapWriteError>)>;

pub struct Sync<M: Maps> {
    maps: M,
    programmer: Programmer,
    /// The frontends each service currently owns.
    frontends_of: HashMap<NamespacedName, Vec<Frontend>>,
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
            maps,
            frontends_of: HashMap::new(),
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

    /// Programs the whole model.
    pub fn all(&mut self, model: &Model, node: &str) -> ApplyResult {
        let mut desired = desired::Desired::new();
        self.frontends_of.clear();
        for svc in model.services.values() {
            let fes = desired::desired_for(model, svc, node);
            self.frontends_of
                .insert(svc.id.clone(), fes.iter().map(|(f, _)| *f).collect());
            desired.extend(fes);
        }
        self.programmer.apply(&mut self.maps, &desired)
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
        for name in dirty {
            let new: Vec<(Frontend, FrontendSpec)> = model
                .services
                .get(name)
                .map(|svc| desired::desired_for(model, svc, node))
                .unwrap_or_default();
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
        self.programmer.apply_changes(
            &mut self.maps,
            upserts.iter().map(|(f, s)| (*f, s)),
            &removed,
        )
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
            self.programmer = Programmer::adopt(observed);
        }
        self.all(model, node)
    }
}
