//! Ingest: source events into the model.
//!
//! An object event updates one object of the model and marks its service dirty. A full list
//! (between [`SourceEvent::Listing`] and [`SourceEvent::Listed`]) is buffered, then replaces
//! the whole set of its kind: what was known and is not listed is gone. Change counters and
//! trigger times for kube-proxy's metrics are kept here until a sync writes the changes.

use std::collections::BTreeSet;

use crate::model::{self, Model, NamespacedName};
use crate::source::{Kind, SourceEvent};

use super::report::Report;

type Listed<T> = Vec<(NamespacedName, Option<T>)>;

#[derive(Debug, Default)]
pub struct Ingest {
    pub model: Model,
    /// Services whose frontends may have changed since the last sync.
    pub dirty: BTreeSet<NamespacedName>,
    /// Lists in progress, already normalized so a big list never holds every raw object.
    listing_services: Option<Listed<model::Service>>,
    listing_slices: Option<Listed<model::EndpointSlice>>,
    listing_cidrs: Option<Listed<model::ServiceCidr>>,
    /// The ServiceCIDRs changed since the last sync.
    pub cidrs_changed: bool,
    /// Which kinds have been listed in full at least once.
    listed: BTreeSet<Kind>,
    /// Trigger times of slice changes not yet written.
    pub triggers: Vec<f64>,
    pub service_changes_pending: i64,
    pub endpoint_changes_pending: i64,
}

impl Ingest {
    /// Every kind has been listed once: the model is complete enough to program.
    pub fn ready(&self) -> bool {
        Kind::ALL.iter().all(|k| self.listed.contains(k))
    }

    /// Applies one source event to the model.
    pub fn apply(&mut self, ev: SourceEvent, report: &mut Report) {
        match ev {
            SourceEvent::Batch(events) => {
                for ev in events {
                    self.apply(ev, report);
                }
            }
            SourceEvent::Listing(Kind::Services) => self.listing_services = Some(Vec::new()),
            SourceEvent::Listing(Kind::Slices) => self.listing_slices = Some(Vec::new()),
            SourceEvent::Listing(Kind::Node) => {}
            SourceEvent::Listing(Kind::ServiceCidrs) => self.listing_cidrs = Some(Vec::new()),
            SourceEvent::ServiceCidr { id, cidr } => match &mut self.listing_cidrs {
                Some(list) => list.push((id, cidr)),
                None => self.cidrs_changed |= self.model.set_service_cidr(&id, cidr),
            },
            SourceEvent::Service { id, service } => match &mut self.listing_services {
                Some(list) => list.push((id, service)),
                None => {
                    self.service_changes_pending += 1;
                    report.service_change(self.service_changes_pending);
                    if self.model.set_service(&id, service) {
                        self.dirty.insert(id);
                    }
                }
            },
            SourceEvent::Slice { id, slice, trigger } => match &mut self.listing_slices {
                Some(list) => list.push((id, slice)),
                None => {
                    self.endpoint_changes_pending += 1;
                    report.endpoint_change(self.endpoint_changes_pending);
                    self.triggers.extend(trigger);
                    let touched = self.model.set_slice(&id, slice);
                    self.dirty.extend(touched);
                }
            },
            SourceEvent::Listed(kind) => self.listed(kind, report),
            SourceEvent::Node {
                uid,
                not_eligible,
                zone,
            } => {
                if uid.is_some() {
                    report.node_uid = uid;
                }
                report.health.set_node_eligible(not_eligible);
                if zone != self.model.node_zone {
                    tracing::info!(
                        zone = zone.as_deref().unwrap_or("<none>"),
                        "this node's zone changed: zone hints are chosen again"
                    );
                }
                let touched = self.model.set_node_zone(zone);
                self.dirty.extend(touched);
            }
            SourceEvent::Failed { source, error } => report.source_failed(source, &error),
            SourceEvent::Rejected { source, error } => report.source_rejected(source, &error),
        }
    }

    /// A full list of `kind` is complete: it replaces what the model held of that kind.
    fn listed(&mut self, kind: Kind, report: &mut Report) {
        match kind {
            Kind::Services => {
                let list = self.listing_services.take().unwrap_or_default();
                let keep: BTreeSet<&NamespacedName> = list.iter().map(|(k, _)| k).collect();
                let gone: Vec<NamespacedName> = self
                    .model
                    .services
                    .keys()
                    .filter(|k| !keep.contains(k))
                    .cloned()
                    .collect();
                for k in gone {
                    self.model.set_service(&k, None);
                    self.dirty.insert(k);
                }
                for (k, s) in list {
                    if self.model.set_service(&k, s) {
                        self.dirty.insert(k);
                    }
                }
                if !self.dirty.is_empty() {
                    self.service_changes_pending += 1;
                    report.service_change(self.service_changes_pending);
                }
            }
            Kind::Slices => {
                let list = self.listing_slices.take().unwrap_or_default();
                let keep: BTreeSet<&NamespacedName> = list.iter().map(|(k, _)| k).collect();
                let before = self.dirty.len();
                for k in self.model.slice_ids() {
                    if !keep.contains(&k)
                        && let Some(svc) = self.model.remove_slice(&k)
                    {
                        self.dirty.insert(svc);
                    }
                }
                for (k, s) in list {
                    let touched = self.model.set_slice(&k, s);
                    self.dirty.extend(touched);
                }
                if self.dirty.len() != before || !self.listed.contains(&Kind::Slices) {
                    // A list is one change (kube-proxy counts it once, too), whatever it
                    // held; it is not counted in the changes total.
                    self.endpoint_changes_pending += 1;
                    report.queued();
                }
            }
            Kind::ServiceCidrs => {
                let list = self.listing_cidrs.take().unwrap_or_default();
                let keep: BTreeSet<&NamespacedName> = list.iter().map(|(k, _)| k).collect();
                let gone: Vec<NamespacedName> = self
                    .model
                    .service_cidrs
                    .keys()
                    .filter(|k| !keep.contains(k))
                    .cloned()
                    .collect();
                for k in gone {
                    self.cidrs_changed |= self.model.set_service_cidr(&k, None);
                }
                for (k, c) in list {
                    self.cidrs_changed |= self.model.set_service_cidr(&k, c);
                }
            }
            Kind::Node => {}
        }
        self.listed.insert(kind);
    }

    /// Everything ingested so far is written: reset what waits for a sync.
    pub fn written(&mut self) -> Vec<f64> {
        self.service_changes_pending = 0;
        self.endpoint_changes_pending = 0;
        std::mem::take(&mut self.triggers)
    }
}
