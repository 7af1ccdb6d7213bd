//! The manifests source: `--manifests PATH`, a file or a directory of multi-document YAML or
//! JSON holding `v1` Service, `discovery.k8s.io/v1` EndpointSlice and
//! `networking.k8s.io/v1` ServiceCIDR objects exactly as Kubernetes serializes them (a `v1`
//! `List` of them works too).
//!
//! A load either yields what changed since the last good load or an error naming the file,
//! the document, the object and the reason; the caller keeps the last good model on error.
//!
//! Reloads are incremental. [`Loader`] splits each YAML file into its documents, keeps what
//! each document's text parsed and normalized to, and parses again only documents whose text
//! changed; a load returns only the objects of changed documents ([`Change`]). Rewriting a
//! 10,000-service file to change one endpoint so costs one document's parse and a scan of
//! the text, not a parse of the whole file and a rebuild of the model.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::model::{self, NamespacedName, Normalized};

mod documents;
pub mod watch;

use documents::{parse_piece, split_documents};

/// Why a manifest set was rejected.
#[derive(Debug)]
pub struct ManifestError {
    pub file: PathBuf,
    /// 1-based document number in the file, when the error is about one document.
    pub document: Option<usize>,
    /// `Kind namespace/name`, when known.
    pub object: Option<String>,
    pub reason: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(d) = self.document {
            write!(f, ": document {d}")?;
        }
        if let Some(o) = &self.object {
            write!(f, " ({o})")?;
        }
        write!(f, ": {}", self.reason)
    }
}

impl std::error::Error for ManifestError {}

/// The largest manifest file read, 64 MiB: ten times a 10,000-service set. A larger file is
/// refused with its size, before it is read.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// The files a manifest path stands for: the file itself, or every `.yaml`, `.yml` and
/// `.json` file under the directory (recursively, in name order, skipping hidden entries
/// such as a ConfigMap volume's `..data`). A directory reached twice through symbolic links
/// (a loop) is an error naming it.
pub fn manifest_files(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let err = |reason: String| ManifestError {
        file: path.to_path_buf(),
        document: None,
        object: None,
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot read: {e}")))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut dirs = vec![path.to_path_buf()];
    let mut seen = HashSet::new();
    while let Some(dir) = dirs.pop() {
        let real = std::fs::canonicalize(&dir).map_err(|e| ManifestError {
            file: dir.clone(),
            document: None,
            object: None,
            reason: format!("cannot resolve: {e}"),
        })?;
        if !seen.insert(real.clone()) {
            return Err(ManifestError {
                file: dir,
                document: None,
                object: None,
                reason: format!(
                    "symbolic link loop: {} is reached twice under {}",
                    real.display(),
                    path.display()
                ),
            });
        }
        let entries = std::fs::read_dir(&dir).map_err(|e| ManifestError {
            file: dir.clone(),
            document: None,
            object: None,
            reason: format!("cannot list directory: {e}"),
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            let p = entry.path();
            if p.is_dir() {
                dirs.push(p);
            } else if name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What a load changed since the previous good load of the same [`Loader`] (for the first
/// load: everything). Objects come from documents whose text changed, so a `Some` may equal
/// what the model already holds; the caller compares.
#[derive(Debug, Default)]
pub struct Change {
    /// A service now defined as given (`Some`), or no longer defined (`None`).
    pub services: Vec<(NamespacedName, Option<model::Service>)>,
    /// A slice now defined as given (`Some`), or no longer defined (`None`).
    pub slices: Vec<(NamespacedName, Option<model::EndpointSlice>)>,
    /// A Node now defined as given (`Some`), or no longer defined (`None`), by name.
    pub nodes: Vec<(NamespacedName, Option<model::NodeInfo>)>,
    /// A ServiceCIDR now defined as given (`Some`), or no longer defined (`None`).
    pub service_cidrs: Vec<(NamespacedName, Option<model::ServiceCidr>)>,
    /// The valid objects that are not proxied, among the documents new to this load.
    pub skipped: Vec<String>,
    /// The pieces (see [`split_documents`]) of the set, and how many had to be parsed.
    pub pieces: usize,
    pub parsed: usize,
}

/// Loads a manifest path again and again, parsing only the documents whose text changed.
///
/// It keeps, per file, what each piece of text (one document, usually) parsed and normalized
/// to, and the applied set: the pieces of the last good load, which the caller's model was
/// built from and the next load is compared with. Only pieces new to a load are checked and
/// reported, so a reload costs the changed documents' parse plus a pass over the text and
/// the pieces that does no parsing.
#[derive(Default)]
pub struct Loader {
    /// Per file, the pieces of the text last read (and of the applied set), by their text.
    files: HashMap<PathBuf, HashMap<Box<str>, Arc<Piece>>>,
    /// The pieces holding objects that the last good load was made of.
    applied: Vec<Arc<Piece>>,
    /// The applied piece defining each object, by kind.
    defined: Defined,
    /// Counts loads.
    generation: u64,
}

/// Which applied piece defines an object.
#[derive(Default)]
struct Defined {
    services: HashMap<NamespacedName, Arc<Piece>>,
    slices: HashMap<NamespacedName, Arc<Piece>>,
    nodes: HashMap<NamespacedName, Arc<Piece>>,
    service_cidrs: HashMap<NamespacedName, Arc<Piece>>,
}

/// A piece in its place in the set being loaded.
struct Placed {
    /// Index in the list of files.
    file: usize,
    /// The file's number for the piece's first document.
    first_document: usize,
    piece: Arc<Piece>,
    /// The piece's text came earlier in this load already (in the same file).
    repeated: bool,
}

impl Placed {
    /// Whether the check has to look at this piece: one that is new, or applied but now
    /// twice in the set. (An applied piece placed once was checked when it was applied.)
    fn unchecked(&self) -> bool {
        self.repeated || !self.piece.applied.load(Ordering::Relaxed)
    }
}

/// A piece of a manifest file, parsed and normalized: what the loader keeps of a text.
struct Piece {
    /// The YAML documents (JSON values) the text holds, empty ones included: documents are
    /// numbered across the file.
    documents: usize,
    services: Vec<Entry<model::Service>>,
    slices: Vec<Entry<model::EndpointSlice>>,
    nodes: Vec<Entry<model::NodeInfo>>,
    service_cidrs: Vec<Entry<model::ServiceCidr>>,
    /// The last load that placed the piece: the applied pieces a load did not place are
    /// gone from the set. (Atomics only so that the loader stays `Send`.)
    placed_in: AtomicU64,
    /// Whether the piece is in the applied set.
    applied: AtomicBool,
}

impl Piece {
    fn has_objects(&self) -> bool {
        !self.services.is_empty()
            || !self.slices.is_empty()
            || !self.nodes.is_empty()
            || !self.service_cidrs.is_empty()
    }

    fn placed_in(&self, generation: u64) -> bool {
        self.placed_in.load(Ordering::Relaxed) == generation
    }
}

/// One object of a piece.
struct Entry<T> {
    /// The object's document, counted from 0 within the piece.
    document: usize,
    outcome: Outcome<T>,
}

/// What normalizing an object gave. An invalid object is kept rather than reported at once,
/// so that a set's errors are reported in the same order whichever pieces came from the
/// cache: parse errors first, then services, then slices (see [`check`]).
enum Outcome<T> {
    Proxied(T),
    /// Valid but not proxied: `Kind namespace/name: why`.
    Skipped(String),
    Invalid(model::InvalidObject),
}

impl<T> Outcome<T> {
    fn of(
        kind: &str,
        meta: &ObjectMeta,
        normalized: Result<Normalized<T>, model::InvalidObject>,
    ) -> Self {
        match normalized {
            Ok(Normalized::Proxied(t)) => Outcome::Proxied(t),
            Ok(Normalized::Skipped(why)) => Outcome::Skipped(format!(
                "{kind} {}/{}: {why}",
                meta.namespace.as_deref().unwrap_or("default"),
                meta.name.as_deref().unwrap_or("")
            )),
            Err(e) => Outcome::Invalid(e),
        }
    }
}

/// A kind of object the manifests hold, as the loader handles it.
trait Kind: Clone + 'static {
    const KIND: &'static str;
    fn id(&self) -> &NamespacedName;
    fn entries(piece: &Piece) -> &[Entry<Self>];
    fn defined(d: &mut Defined) -> &mut HashMap<NamespacedName, Arc<Piece>>;
}

impl Kind for model::Service {
    const KIND: &'static str = "Service";
    fn id(&self) -> &NamespacedName {
        &self.id
    }
    fn entries(piece: &Piece) -> &[Entry<Self>] {
        &piece.services
    }
    fn defined(d: &mut Defined) -> &mut HashMap<NamespacedName, Arc<Piece>> {
        &mut d.services
    }
}

impl Kind for model::EndpointSlice {
    const KIND: &'static str = "EndpointSlice";
    fn id(&self) -> &NamespacedName {
        &self.id
    }
    fn entries(piece: &Piece) -> &[Entry<Self>] {
        &piece.slices
    }
    fn defined(d: &mut Defined) -> &mut HashMap<NamespacedName, Arc<Piece>> {
        &mut d.slices
    }
}

impl Kind for model::NodeInfo {
    const KIND: &'static str = "Node";
    fn id(&self) -> &NamespacedName {
        &self.id
    }
    fn entries(piece: &Piece) -> &[Entry<Self>] {
        &piece.nodes
    }
    fn defined(d: &mut Defined) -> &mut HashMap<NamespacedName, Arc<Piece>> {
        &mut d.nodes
    }
}

impl Kind for model::ServiceCidr {
    const KIND: &'static str = "ServiceCIDR";
    fn id(&self) -> &NamespacedName {
        &self.id
    }
    fn entries(piece: &Piece) -> &[Entry<Self>] {
        &piece.service_cidrs
    }
    fn defined(d: &mut Defined) -> &mut HashMap<NamespacedName, Arc<Piece>> {
        &mut d.service_cidrs
    }
}

/// The proxied objects of kind `T` in `pieces`.
fn proxied<T: Kind>(pieces: &[Arc<Piece>]) -> impl Iterator<Item = &T> {
    pieces
        .iter()
        .flat_map(|p| T::entries(p))
        .filter_map(|e| match &e.outcome {
            Outcome::Proxied(t) => Some(t),
            _ => None,
        })
}

/// Why the skipped objects of kind `T` in `pieces` are not proxied.
fn skipped<T: Kind>(pieces: &[Arc<Piece>]) -> impl Iterator<Item = String> {
    pieces
        .iter()
        .flat_map(|p| T::entries(p))
        .filter_map(|e| match &e.outcome {
            Outcome::Skipped(why) => Some(why.clone()),
            _ => None,
        })
}

impl Loader {
    /// Reads the manifests under `path`. On error nothing is kept as applied: the next load
    /// is compared with the last good one still.
    pub fn load(&mut self, path: &Path) -> Result<Change, ManifestError> {
        let files = manifest_files(path)?;
        self.load_with(&files, |file| {
            let err = |reason: String| ManifestError {
                file: file.to_path_buf(),
                document: None,
                object: None,
                reason,
            };
            let size = std::fs::metadata(file)
                .map_err(|e| err(format!("cannot read: {e}")))?
                .len();
            if size > MAX_FILE_BYTES {
                return Err(err(format!(
                    "{size} bytes is more than the {MAX_FILE_BYTES} bytes a manifest file may have"
                )));
            }
            std::fs::read_to_string(file).map_err(|e| err(format!("cannot read: {e}")))
        })
    }

    /// [`Loader::load`] of `files`, whose text `read` gives.
    fn load_with(
        &mut self,
        files: &[PathBuf],
        mut read: impl FnMut(&Path) -> Result<String, ManifestError>,
    ) -> Result<Change, ManifestError> {
        self.generation += 1;
        let mut placed = Vec::new();
        let mut parsed = 0;
        for (index, file) in files.iter().enumerate() {
            let text = read(file)?;
            parsed += self.place_file(index, file, &text, &mut placed)?;
        }
        let listed: HashSet<&PathBuf> = files.iter().collect();
        self.files.retain(|f, _| listed.contains(f));
        check::<model::Service>(files, &placed, &self.defined.services, self.generation)?;
        check::<model::EndpointSlice>(files, &placed, &self.defined.slices, self.generation)?;
        check::<model::NodeInfo>(files, &placed, &self.defined.nodes, self.generation)?;
        check::<model::ServiceCidr>(files, &placed, &self.defined.service_cidrs, self.generation)?;
        let mut change = self.commit(&placed);
        change.parsed = parsed;
        Ok(change)
    }

    /// Splits one file's text into pieces, takes each from the cache or parses it, and
    /// appends them to `placed`. Returns how many pieces were parsed.
    fn place_file(
        &mut self,
        index: usize,
        file: &Path,
        text: &str,
        placed: &mut Vec<Placed>,
    ) -> Result<usize, ManifestError> {
        let json = file.extension().is_some_and(|e| e == "json");
        let whole = 0..text.len();
        let pieces = if json {
            vec![whole]
        } else {
            split_documents(text).unwrap_or_else(|| vec![whole])
        };
        let cache = self.files.entry(file.to_path_buf()).or_default();
        let mut document = 1;
        let mut parsed = 0;
        for range in pieces {
            let piece = match cache.get(&text[range.clone()]) {
                Some(piece) => Arc::clone(piece),
                None => {
                    let piece = Arc::new(parse_piece(file, document, text, range.clone(), json)?);
                    parsed += 1;
                    cache.insert(text[range].into(), Arc::clone(&piece));
                    piece
                }
            };
            let repeated =
                piece.placed_in.swap(self.generation, Ordering::Relaxed) == self.generation;
            document += piece.documents;
            placed.push(Placed {
                file: index,
                first_document: document - piece.documents,
                piece,
                repeated,
            });
        }
        // Only after the whole file parsed: a file that failed keeps its older pieces too.
        // The pieces of the applied set stay as well, so that going back to it after a
        // rejected edit parses nothing and changes nothing.
        let generation = self.generation;
        cache.retain(|_, p| p.placed_in(generation) || p.applied.load(Ordering::Relaxed));
        Ok(parsed)
    }

    /// Makes `placed`, a good set, the applied one and returns how it differs from the
    /// previous one: the objects of pieces new to the set, and the objects of pieces gone
    /// from it that no new piece defines again.
    fn commit(&mut self, placed: &[Placed]) -> Change {
        let generation = self.generation;
        let mut removed = Vec::new();
        self.applied.retain(|p| {
            let keep = p.placed_in(generation);
            if !keep {
                p.applied.store(false, Ordering::Relaxed);
                removed.push(Arc::clone(p));
            }
            keep
        });
        let mut added = Vec::new();
        for p in placed {
            // A piece may repeat in a good set only if it holds no proxied object (an empty
            // document, say); the flag keeps it from being added twice.
            if p.piece.has_objects() && !p.piece.applied.swap(true, Ordering::Relaxed) {
                self.applied.push(Arc::clone(&p.piece));
                added.push(Arc::clone(&p.piece));
            }
        }
        Change {
            services: self.apply::<model::Service>(&added, &removed),
            slices: self.apply::<model::EndpointSlice>(&added, &removed),
            nodes: self.apply::<model::NodeInfo>(&added, &removed),
            service_cidrs: self.apply::<model::ServiceCidr>(&added, &removed),
            skipped: skipped::<model::Service>(&added)
                .chain(skipped::<model::EndpointSlice>(&added))
                .collect(),
            pieces: placed.len(),
            parsed: 0,
        }
    }

    /// Updates which piece defines each object of kind `T`, and returns the objects that
    /// `added` pieces define and those that `removed` pieces defined and none does now.
    fn apply<T: Kind>(
        &mut self,
        added: &[Arc<Piece>],
        removed: &[Arc<Piece>],
    ) -> Vec<(NamespacedName, Option<T>)> {
        let defined = T::defined(&mut self.defined);
        // Removals first: an object that moved to an added piece ends up defined there.
        for t in proxied::<T>(removed) {
            defined.remove(t.id());
        }
        let mut change = Vec::new();
        for piece in added {
            for t in proxied::<T>(std::slice::from_ref(piece)) {
                defined.insert(t.id().clone(), Arc::clone(piece));
                change.push((t.id().clone(), Some(t.clone())));
            }
        }
        for t in proxied::<T>(removed) {
            if !defined.contains_key(t.id()) {
                change.push((t.id().clone(), None));
            }
        }
        change
    }
}

/// A position in the set: the index of a placed piece, and of an entry in it.
type Position = (usize, usize);

/// Fails on the first invalid object of kind `T`, or the first defined a second time, in
/// file and document order, as a check of every object in turn would.
///
/// Only the unchecked pieces (see [`Placed::unchecked`]) are looked at: the applied set was
/// checked whole, so any error now has an object of an unchecked piece. An object defined
/// again is found among the unchecked pieces, or in `defined`, the applied pieces' objects,
/// when the applied piece is still placed.
fn check<T: Kind>(
    files: &[PathBuf],
    placed: &[Placed],
    defined: &HashMap<NamespacedName, Arc<Piece>>,
    generation: u64,
) -> Result<(), ManifestError> {
    let mut first: HashMap<&NamespacedName, Position> = HashMap::new();
    // The earliest error found, with its position.
    let mut error: Option<(Position, ManifestError)> = None;
    let mut found = |at: Position, object: String, reason: String| {
        if error.as_ref().is_none_or(|(e, _)| at < *e) {
            let p = &placed[at.0];
            let document = p.first_document + T::entries(&p.piece)[at.1].document;
            let e = ManifestError {
                file: files[p.file].clone(),
                document: Some(document),
                object: Some(object),
                reason,
            };
            error = Some((at, e));
        }
    };
    let again = "defined more than once";
    for (i, p) in placed.iter().enumerate().filter(|(_, p)| p.unchecked()) {
        for (j, e) in T::entries(&p.piece).iter().enumerate() {
            match &e.outcome {
                Outcome::Invalid(invalid) => found(
                    (i, j),
                    format!("{} {}", invalid.kind, invalid.object),
                    invalid.reason.clone(),
                ),
                Outcome::Proxied(t) => {
                    if first.contains_key(t.id()) {
                        found((i, j), format!("{} {}", T::KIND, t.id()), again.into());
                    } else {
                        first.insert(t.id(), (i, j));
                    }
                }
                Outcome::Skipped(_) => {}
            }
        }
    }
    for (id, &at) in &first {
        let Some(piece) = defined.get(*id).filter(|p| p.placed_in(generation)) else {
            continue;
        };
        // The applied piece's first place: never among the unchecked, so never `at` itself.
        let Some(i) = placed.iter().position(|p| Arc::ptr_eq(&p.piece, piece)) else {
            continue;
        };
        let Some(j) = T::entries(piece)
            .iter()
            .position(|e| matches!(&e.outcome, Outcome::Proxied(t) if t.id() == *id))
        else {
            continue;
        };
        if (i, j) != at {
            found(at.max((i, j)), format!("{} {id}", T::KIND), again.into());
        }
    }
    match error {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// A whole model and the objects not proxied, for tests: what one load from scratch gives.
#[cfg(test)]
#[derive(Debug)]
pub struct Loaded {
    pub model: model::Model,
    pub skipped: Vec<String>,
}

#[cfg(test)]
impl Change {
    /// Applies the change to `model` as the controller does; returns the services to
    /// reprogram.
    pub fn apply_to(self, model: &mut model::Model) -> std::collections::BTreeSet<NamespacedName> {
        let mut dirty = std::collections::BTreeSet::new();
        for (id, s) in self.services {
            if model.set_service(&id, s) {
                dirty.insert(id);
            }
        }
        for (id, s) in self.slices {
            dirty.extend(model.set_slice(&id, s));
        }
        for (id, c) in self.service_cidrs {
            model.set_service_cidr(&id, c);
        }
        dirty
    }

    /// The model the change builds from nothing.
    pub fn into_loaded(mut self) -> Loaded {
        let skipped = std::mem::take(&mut self.skipped);
        let mut model = model::Model::default();
        self.apply_to(&mut model);
        Loaded { model, skipped }
    }
}

#[cfg(test)]
impl Loader {
    /// [`Loader::load`] of one file with this text.
    pub fn load_text(&mut self, file: &Path, text: &str) -> Result<Change, ManifestError> {
        self.load_with(&[file.to_path_buf()], |_| Ok(text.to_string()))
    }
}

/// The model one file with this text describes, for tests.
#[cfg(test)]
pub fn parse(file: &Path, text: &str) -> Result<Loaded, ManifestError> {
    Ok(Loader::default().load_text(file, text)?.into_loaded())
}

#[cfg(test)]
mod tests;
