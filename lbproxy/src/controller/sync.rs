//! Sync: the model into the maps, through the [`Maps`] trait.
//!
//! A full sync derives every service's frontends; a dirty sync only those of the services
//! ingest marked, so one endpoint change costs the same at 10 or 10,000 services. Either
//! way the programmer writes only the difference. A reconcile reads the maps back first
//! and adopts what it finds when it differs from what was written (an entry deleted by
//! hand with bpftool, say), so the full sync that follows repairs it.
//!
//! Two services can claim the same frontend (VIP:port/proto), an externalIP both list, say.
//! One gets it, whatever the order of events: the older by `metadata.creationTimestamp`
//! (a service without one after every service with one), then the first by namespace/name.
//! Only its spec is programmed; the others are reported (a warning once per change, and
//! `lbproxy_frontend_conflicts`). The claims index keeps every claimant of every frontend,
//! so a dirty sync finds the next one at once when the holder leaves: deleting a loser does
//! not touch the frontend, deleting the holder hands it over in the same sync.
//!
//! The maps are per node and shared by every service, so one service may take at most
//! [`MAX_SLOTS_PER_SERVICE`] backend slots (the sum over its frontends of their endpoints).
//! A service over it is not programmed at all, not even in part (its frontends already
//! programmed are removed: a service served on some ports only would be harder to
//! diagnose than one refused with a message), and a warning names it and the numbers, once
//! per change. kube-proxy has no such limit; it is what keeps one service from filling the
//! slot map and black-holing every new one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lbproxy_common::{UnservedKey, UnservedValue};

use crate::desired::{self, Frontend, FrontendSpec, Unserved};
use crate::model::{Model, NamespacedName, Service};
use crate::program::cidrs::CidrProgrammer;
use crate::program::{ApplyStats, MapWriteError, Maps, Programmed, Programmer, ReadBack};

/// The most backend slots (frontends × endpoints) one service may take: an eighth of the
/// slot map (`MAX_SLOTS`, 262,144), so no single service can fill it, while a service of
/// 8,000 pods on 4 ports still fits.
pub const MAX_SLOTS_PER_SERVICE: usize = 32_768;

/// `n` with a comma every three digits, as people write it.
fn thousands(n: usize) -> String {
    crate::bpf::flow_top::thousands(n as u64)
}

/// Why `svc`'s frontends are over the per-service limit, if they are.
fn over_limit(svc: &NamespacedName, served: &[(Frontend, FrontendSpec)]) -> Option<String> {
    let slots: usize = served.iter().map(|(_, s)| s.backends.len()).sum();
    if slots <= MAX_SLOTS_PER_SERVICE {
        return None;
    }
    let most = served
        .iter()
        .map(|(_, s)| s.backends.len())
        .max()
        .unwrap_or(0);
    let same = served.iter().all(|(_, s)| s.backends.len() == most);
    Some(format!(
        "Service {svc}: {} frontend{} × {}{} endpoints = {} backend slots, over the \
         per-service limit of {}; not programmed",
        thousands(served.len()),
        if served.len() == 1 { "" } else { "s" },
        if same { "" } else { "up to " },
        thousands(most),
        thousands(slots),
        thousands(MAX_SLOTS_PER_SERVICE),
    ))
}

pub type ApplyResult = Result<ApplyStats, (ApplyStats, Vec<MapWriteError>)>;

/// `result` with the ServiceCIDR tables' failed writes added.
fn with_errors(result: ApplyResult, errors: Vec<MapWriteError>) -> ApplyResult {
    if errors.is_empty() {
        return result;
    }
    match result {
        Ok(stats) => Err((stats, errors)),
        Err((stats, mut e)) => {
            e.extend(errors);
            Err((stats, e))
        }
    }
}

/// A service claiming a frontend, ordered so that the first claimant gets it: the older
/// service (by `creationTimestamp`; one without it after every one with it), then the
/// smaller namespace/name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claimant {
    age_unknown: bool,
    created: Option<jiff::Timestamp>,
    id: NamespacedName,
}

impl Claimant {
    fn of(svc: &Service) -> Self {
        Self {
            age_unknown: svc.created.is_none(),
            created: svc.created,
            id: svc.id.clone(),
        }
    }
}

/// The claimants of one frontend, first the one that gets it. A sorted `Vec`: nearly every
/// frontend has one claimant, and a `BTreeSet` would allocate room for eleven (the index
/// took 49 MiB at 50,000 services with one, 21 MiB with this).
#[derive(Debug, Default)]
struct Claims(Vec<Claimant>);

impl Claims {
    fn insert(&mut self, c: Claimant) {
        if let Err(at) = self.0.binary_search(&c) {
            self.0.insert(at, c);
        }
    }

    fn remove(&mut self, c: &Claimant) {
        if let Ok(at) = self.0.binary_search(c) {
            self.0.remove(at);
        }
    }

    fn first(&self) -> Option<&Claimant> {
        self.0.first()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn iter(&self) -> impl Iterator<Item = &Claimant> {
        self.0.iter()
    }
}

pub struct Sync<M: Maps> {
    maps: M,
    programmer: Programmer,
    /// The ServiceCIDR tables (`desired::service_cidrs`).
    cidrs: CidrProgrammer,
    /// The frontends each service claims, with the rank it claims them with.
    frontends_of: HashMap<NamespacedName, (Claimant, Vec<Frontend>)>,
    /// Every claimant of every frontend, first the one that gets it.
    claims: HashMap<Frontend, Claims>,
    /// Frontends claimed by more than one service, as last reported: the holder first.
    conflicts: BTreeMap<Frontend, Vec<NamespacedName>>,
    /// The frontends not served yet, as written for `lbproxy inspect`, and by service.
    unserved: BTreeMap<UnservedKey, UnservedValue>,
    unserved_of: HashMap<NamespacedName, Vec<UnservedKey>>,
    /// Services over [`MAX_SLOTS_PER_SERVICE`], with the message last logged.
    too_large: HashMap<NamespacedName, String>,
    /// Messages of services that went over the limit (or changed numbers) since taken.
    too_large_news: Vec<(NamespacedName, String)>,
    /// While a read-back runs on another thread: the frontends written since it started,
    /// which its comparison leaves out (see [`Sync::start_read_back`]).
    watched: Option<BTreeSet<Frontend>>,
    /// Frontends left out of that many read-backs in a row (written during each).
    skipped: HashMap<Frontend, u32>,
    /// Frontends whose last write failed. The next sync touches them again, whatever it
    /// syncs: a frontend whose removal failed has left the claims, so a retry of its
    /// service's sync alone would not.
    unsettled: BTreeSet<Frontend>,
}

/// A frontend written during this many read-backs in a row is compared the blocking way:
/// one that changes all the time must not escape drift repair for good.
pub const MAX_SKIPPED_READS: u32 = 10;

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
        let cursor = maps.read_id_cursor();
        if cursor == 0 && !adopted.frontends.is_empty() {
            tracing::info!(
                "no id cursor pinned (maps written by an older version): new ids continue \
                 after the highest one in use"
            );
        }
        Self {
            programmer: Programmer::adopt(adopted, cursor),
            unserved: maps.read_unserved(),
            cidrs: CidrProgrammer::adopt(maps.read_service_cidrs(), maps.read_service_cidrs_flag()),
            maps,
            frontends_of: HashMap::new(),
            claims: HashMap::new(),
            conflicts: BTreeMap::new(),
            unserved_of: HashMap::new(),
            too_large: HashMap::new(),
            too_large_news: Vec::new(),
            watched: None,
            skipped: HashMap::new(),
            unsettled: BTreeSet::new(),
        }
    }

    /// After an apply of `written`: the frontends it failed are unsettled, the others of
    /// `written` settled.
    fn settle(&mut self, written: &BTreeSet<Frontend>) {
        for f in written {
            self.unsettled.remove(f);
        }
        self.unsettled
            .extend(self.programmer.failed().iter().map(|(f, _)| *f));
    }

    /// Forgets the failed writes, as a bookkeeping bug would (for the test of the sweep's
    /// last resort, [`Sync::remove_unclaimed`]).
    #[cfg(test)]
    pub fn forget_unsettled(&mut self) {
        self.unsettled.clear();
    }

    /// Builds a Maglev table of `m` entries with `seed` for every frontend.
    pub fn use_maglev(&mut self, m: u32, seed: u64) {
        self.programmer = std::mem::take(&mut self.programmer).with_maglev(m, seed);
    }

    /// `svc`'s frontends, none served when it is over the per-service limit (logged when
    /// that starts, changes or ends).
    fn frontends(&mut self, model: &Model, svc: &Service, node: &str) -> desired::ServiceFrontends {
        let mut fes = desired::frontends_for(model, svc, node);
        match over_limit(&svc.id, &fes.served) {
            Some(msg) => {
                if self.too_large.get(&svc.id) != Some(&msg) {
                    tracing::warn!(service = %svc.id, "{msg}");
                    self.too_large_news.push((svc.id.clone(), msg.clone()));
                    self.too_large.insert(svc.id.clone(), msg);
                }
                fes.served.clear();
            }
            None => {
                if self.too_large.remove(&svc.id).is_some() {
                    tracing::info!(
                        service = %svc.id,
                        "Service {}: within the per-service limit again; programmed",
                        svc.id
                    );
                }
            }
        }
        fes
    }

    /// The services over the per-service limit, with why.
    pub fn too_large(&self) -> &HashMap<NamespacedName, String> {
        &self.too_large
    }

    /// The services that went over the limit, or over it with other numbers, since the
    /// last call: each once per change.
    pub fn take_too_large_news(&mut self) -> Vec<(NamespacedName, String)> {
        std::mem::take(&mut self.too_large_news)
    }

    /// The services with a frontend the last apply could not write because a map is full
    /// (E2BIG), each with the first such frontend.
    pub fn map_full(&self) -> BTreeMap<NamespacedName, Frontend> {
        let mut out = BTreeMap::new();
        for (f, errno) in self.programmer.failed() {
            if *errno != Some(libc::E2BIG) {
                continue;
            }
            if let Some(c) = self.holder(f) {
                out.entry(c.id.clone()).or_insert(*f);
            }
        }
        out
    }

    /// How many frontends more than one service claims.
    pub fn conflicts(&self) -> usize {
        self.conflicts.len()
    }

    /// Records `svc`'s claims on the frontends it serves; returns its rank as claimant.
    fn claim(&mut self, svc: &Service, served: &[(Frontend, FrontendSpec)]) -> Claimant {
        let c = Claimant::of(svc);
        let mine: Vec<Frontend> = served.iter().map(|(f, _)| *f).collect();
        for f in &mine {
            self.claims.entry(*f).or_default().insert(c.clone());
        }
        if !mine.is_empty() {
            self.frontends_of.insert(svc.id.clone(), (c.clone(), mine));
        }
        c
    }

    /// The service that gets `f`, if any claims it.
    fn holder(&self, f: &Frontend) -> Option<&Claimant> {
        self.claims.get(f).and_then(Claims::first)
    }

    /// Reports the frontends among `frontends` whose conflict changed: a warning naming the
    /// holder and the others when one starts or changes, a line when it ends.
    fn note_conflicts(&mut self, frontends: impl IntoIterator<Item = Frontend>) {
        for f in frontends {
            let now: Option<Vec<NamespacedName>> = self
                .claims
                .get(&f)
                .filter(|c| c.len() > 1)
                .map(|c| c.iter().map(|c| c.id.clone()).collect());
            if now.as_ref() == self.conflicts.get(&f) {
                continue;
            }
            match now {
                Some(names) => {
                    let others: Vec<String> = names[1..].iter().map(ToString::to_string).collect();
                    tracing::warn!(
                        frontend = %f,
                        holder = %names[0],
                        others = %others.join(", "),
                        "services claim the same frontend: {} gets it (the oldest, then by \
                         namespace/name); {} not served on it",
                        names[0],
                        others.join(", "),
                    );
                    self.conflicts.insert(f, names);
                }
                None => {
                    tracing::info!(frontend = %f, "the frontend is claimed by one service again");
                    self.conflicts.remove(&f);
                }
            }
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
        // It may write any frontend: a read-back under way cannot be compared.
        self.watched = None;
        let mut desired = desired::Desired::new();
        let mut unserved = BTreeMap::new();
        self.frontends_of.clear();
        self.claims.clear();
        self.unserved_of.clear();
        self.too_large
            .retain(|id, _| model.services.contains_key(id));
        for svc in model.services.values() {
            let fes = self.frontends(model, svc, node);
            let c = self.claim(svc, &fes.served);
            // Whatever the order, the frontend ends with its first claimant's spec.
            for (f, spec) in fes.served {
                if self.holder(&f) == Some(&c) {
                    desired.insert(f, spec);
                }
            }
            let entries: Vec<(UnservedKey, UnservedValue)> =
                fes.unserved.iter().map(Unserved::entry).collect();
            if !entries.is_empty() {
                self.unserved_of
                    .insert(svc.id.clone(), entries.iter().map(|(k, _)| *k).collect());
            }
            unserved.extend(entries);
        }
        let contested: BTreeSet<Frontend> = self
            .conflicts
            .keys()
            .copied()
            .chain(
                self.claims
                    .iter()
                    .filter(|(_, c)| c.len() > 1)
                    .map(|(f, _)| *f),
            )
            .collect();
        self.note_conflicts(contested);
        let result = self.programmer.apply(&mut self.maps, &desired);
        self.unsettled = self.programmer.failed().iter().map(|(f, _)| *f).collect();
        let result = with_errors(result, self.cidrs.all(&mut self.maps, model));
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
        // The frontends whose claims changed (and those whose last write failed), and the
        // served specs computed so far by service.
        let mut touched: BTreeSet<Frontend> = self.unsettled.clone();
        let mut specs: HashMap<NamespacedName, HashMap<Frontend, FrontendSpec>> = HashMap::new();
        for name in dirty {
            let svc = model.services.get(name);
            if svc.is_none() {
                self.too_large.remove(name);
            }
            let fes = svc.map(|svc| self.frontends(model, svc, node));
            let (new, unserved) = fes.map_or_else(Default::default, |f| (f.served, f.unserved));
            let entries: BTreeMap<UnservedKey, UnservedValue> =
                unserved.iter().map(Unserved::entry).collect();
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
            if let Some((c, old)) = self.frontends_of.remove(name) {
                for f in old {
                    if let Some(claims) = self.claims.get_mut(&f) {
                        claims.remove(&c);
                    }
                    touched.insert(f);
                }
            }
            if let Some(svc) = svc {
                self.claim(svc, &new);
                touched.extend(new.iter().map(|(f, _)| *f));
                specs.insert(name.clone(), new.into_iter().collect());
            }
        }
        // Each touched frontend gets its holder's spec (computed here for a holder that did
        // not change: O(its frontends)), or goes when no one claims it. Writing an unchanged
        // spec costs no map write, and a failed write is retried by the next sync
        // (`unsettled`).
        for f in &touched {
            let Some(holder) = self.holder(f).map(|c| c.id.clone()) else {
                self.claims.remove(f);
                removed.push(*f);
                continue;
            };
            if !specs.contains_key(&holder) {
                let served = match model.services.get(&holder) {
                    Some(svc) => self.frontends(model, svc, node).served,
                    None => Vec::new(),
                };
                specs.insert(holder.clone(), served.into_iter().collect());
            }
            if let Some(spec) = specs.get_mut(&holder).and_then(|s| s.remove(f)) {
                upserts.push((*f, spec));
            }
        }
        if let Some(w) = &mut self.watched {
            w.extend(touched.iter().copied());
        }
        let result = self.programmer.apply_changes(
            &mut self.maps,
            upserts.iter().map(|(f, s)| (*f, s)),
            &removed,
        );
        self.settle(&touched);
        self.note_conflicts(touched);
        let result = with_errors(result, self.cidrs.services(&mut self.maps, model, dirty));
        self.write_unserved(&unserved_gone, unserved_new.iter());
        result
    }

    /// Starts a read of the maps that runs on another thread while syncs go on: returns
    /// the read, and from now on notes every frontend a sync writes, until
    /// [`Sync::drifted`] compares. `None`: the maps cannot be read that way.
    pub fn start_read_back(&mut self) -> Option<ReadBack> {
        let read = self.maps.read_back()?;
        self.watched = Some(BTreeSet::new());
        Some(read)
    }

    /// Stops noting written frontends (a read-back given up).
    pub fn stop_read_back(&mut self) {
        self.watched = None;
    }

    /// The frontends where `observed`, read by [`Sync::start_read_back`]'s read while syncs
    /// went on, differs from what was written; left out are those written since the read
    /// started (the read may have seen them before or after). Compared as the blocking
    /// [`Sync::reconcile`] compares: each frontend's entries, and the backends they name.
    /// `None`: the read cannot be compared (a full sync wrote meanwhile, no read-back was
    /// started, or a frontend was left out of [`MAX_SKIPPED_READS`] read-backs in a row):
    /// the blocking reconcile is due.
    pub fn drifted(&mut self, observed: &Programmed) -> Option<Vec<Frontend>> {
        let skip = self.watched.take()?;
        self.skipped.retain(|f, _| skip.contains(f));
        for f in &skip {
            *self.skipped.entry(*f).or_default() += 1;
        }
        if let Some((f, n)) = self.skipped.iter().find(|(_, n)| **n >= MAX_SKIPPED_READS) {
            tracing::debug!(
                frontend = %f,
                "written during each of the last {n} read-backs: comparing the blocking way"
            );
            return None;
        }
        Some(drifted_frontends(
            observed,
            self.programmer.programmed(),
            &skip,
        ))
    }

    /// Removes the programmed frontends no service claims, as a full sync removes what it
    /// does not want. The change path retries a failed removal itself (`unsettled`); this
    /// is the reconcile's last resort, should that bookkeeping ever miss one.
    pub fn remove_unclaimed(&mut self) -> ApplyResult {
        let unclaimed: Vec<Frontend> = self
            .programmer
            .programmed()
            .frontends
            .keys()
            .filter(|f| self.holder(f).is_none())
            .copied()
            .collect();
        if unclaimed.is_empty() {
            return Ok(ApplyStats::default());
        }
        tracing::info!(
            frontends = unclaimed.len(),
            "removing frontends no service claims (an earlier removal failed)"
        );
        self.programmer
            .apply_changes(&mut self.maps, std::iter::empty(), &unclaimed)
    }

    /// The frontends whose write failed in the last apply.
    pub fn failed(&self) -> Vec<(Frontend, Option<i32>)> {
        self.programmer.failed().to_vec()
    }

    /// Adds `earlier` failures to the last apply's (a sweep's slices).
    pub fn keep_failed(&mut self, earlier: Vec<(Frontend, Option<i32>)>) {
        self.programmer.keep_failed(earlier);
    }

    /// After a read-back found no drift: the ServiceCIDR tables (a few entries) read back
    /// and written where they differ, as a full sync does.
    pub fn service_cidrs(&mut self, model: &Model) -> ApplyResult {
        self.cidrs.readopt(
            self.maps.read_service_cidrs(),
            self.maps.read_service_cidrs_flag(),
        );
        with_errors(
            Ok(ApplyStats::default()),
            self.cidrs.all(&mut self.maps, model),
        )
    }

    /// Reads the maps back and, when they drifted from what was written, adopts what they
    /// hold; then programs the whole model, which repairs the drift.
    pub fn reconcile(&mut self, model: &Model, node: &str) -> ApplyResult {
        self.skipped.clear();
        let started = std::time::Instant::now();
        let observed = self.maps.read_programmed();
        let read = started.elapsed();
        let mut ours = self.programmer.programmed().clone();
        for f in ours.frontends.values_mut() {
            f.draining.clear();
        }
        if observed != ours {
            tracing::warn!("the maps drifted from the model (edited by hand?); repairing");
            self.programmer.readopt(observed);
        }
        self.cidrs.readopt(
            self.maps.read_service_cidrs(),
            self.maps.read_service_cidrs_flag(),
        );
        let compared = started.elapsed();
        let result = self.all(model, node);
        tracing::debug!(
            read_ms = read.as_millis() as u64,
            compare_ms = (compared - read).as_millis() as u64,
            program_ms = (started.elapsed() - compared).as_millis() as u64,
            "reconcile: maps read back, compared, whole model programmed"
        );
        result
    }
}

/// The frontends, `skip` left out, whose entries differ between `observed` and `ours`, or
/// that name a backend whose entry differs. A frontend's draining list is the controller's
/// own (the maps keep it in the members); backends no frontend names are not looked at, nor
/// frontends whose write failed (partly written by design, and retried).
///
/// One merge of the two sorted frontend maps, and one look at each backend: at 10,000
/// frontends and 100,000 backends a lookup per reference took 60 ms of the loop.
fn drifted_frontends(
    observed: &Programmed,
    ours: &Programmed,
    skip: &BTreeSet<Frontend>,
) -> Vec<Frontend> {
    use std::cmp::Ordering;
    // Backends written whose entry the read did not find as written. A frontend not written
    // during the read names none written during it, so any it names here drifted.
    let bad: std::collections::HashSet<u32> = ours
        .backends
        .iter()
        .filter(|(id, addr)| observed.backends.get(id) != Some(addr))
        .map(|(id, _)| *id)
        .collect();
    let differs = |o: &crate::program::ProgrammedFrontend,
                   w: &crate::program::ProgrammedFrontend| {
        o.svc_id != w.svc_id
            || o.label != w.label
            || o.slots != w.slots
            || o.value != w.value
            || o.src_ranges != w.src_ranges
            || o.members != w.members
            || o.maglev != w.maglev
            || (!bad.is_empty()
                && w.slots
                    .iter()
                    .chain(w.members.keys())
                    .any(|id| bad.contains(id)))
    };
    let mut out = Vec::new();
    let mut o = observed.frontends.iter().peekable();
    let mut w = ours.frontends.iter().peekable();
    loop {
        let (f, drifted) = match (o.peek(), w.peek()) {
            (None, None) => break,
            (Some(_), None) => (o.next().expect("peeked").0, true),
            (None, Some(_)) => (w.next().expect("peeked").0, true),
            (Some((fo, _)), Some((fw, _))) => match fo.cmp(fw) {
                Ordering::Less => (o.next().expect("peeked").0, true),
                Ordering::Greater => (w.next().expect("peeked").0, true),
                Ordering::Equal => {
                    let (f, a) = o.next().expect("peeked");
                    let (_, b) = w.next().expect("peeked");
                    (f, !skip.contains(f) && differs(a, b))
                }
            },
        };
        // Never written whole (a write failed, a full map, say): partly in the maps by
        // design, and retried by the change path.
        let unwritten = ours.frontends.get(f).is_some_and(|w| w.value.is_none());
        if drifted && !unwritten && !skip.contains(f) {
            out.push(*f);
        }
    }
    out
}
