//! The manifests source: `--manifests PATH`, a file or a directory of multi-document YAML or
//! JSON holding `v1` Service and `discovery.k8s.io/v1` EndpointSlice objects exactly as
//! Kubernetes serializes them (a `v1` `List` of them works too).
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
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use k8s_openapi::api::core::v1::Service as K8sService;
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::model::{self, NamespacedName, Normalized};

pub mod watch;

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
    /// The last load that placed the piece: the applied pieces a load did not place are
    /// gone from the set. (Atomics only so that the loader stays `Send`.)
    placed_in: AtomicU64,
    /// Whether the piece is in the applied set.
    applied: AtomicBool,
}

impl Piece {
    fn has_objects(&self) -> bool {
        !self.services.is_empty() || !self.slices.is_empty()
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

/// Splits YAML text into pieces that each parse, on their own, to the documents they hold in
/// the whole text: a piece starts at each line that begins with the document start marker
/// `---` followed by a space, a tab or the line's end (content may follow on that line).
/// A first piece of only comments and blank lines, which is no document, is left out.
///
/// This is how a YAML parser reads such a line: at column 0 it starts a
/// document wherever it appears. A block scalar's content is indented at least one column
/// (libyaml enforces that even at the top level), a plain scalar ends before it, and inside
/// a quoted scalar or a flow collection it is an error, which the piece before it, left
/// unterminated, reports too. A `...` document end marker stays at the end of its piece.
/// Splitting at `\n` only is safe: other line breaks YAML knows merely leave bigger pieces.
///
/// Returns the pieces' byte ranges, or `None`, to parse the text whole, when a line starts
/// with `%`: a directive belongs to the document after it, in the next piece.
fn split_documents(text: &str) -> Option<Vec<Range<usize>>> {
    let body = text.strip_prefix('\u{feff}').unwrap_or(text);
    if body.starts_with('%') || text.contains("\n%") {
        return None;
    }
    let is_marker = |line: &str| {
        line.starts_with("---")
            && matches!(
                line.as_bytes().get(3),
                None | Some(b' ' | b'\t' | b'\r' | b'\n')
            )
    };
    let mut starts = vec![0];
    starts.extend(
        text.match_indices("\n---")
            .map(|(i, _)| i + 1)
            .filter(|&i| is_marker(&text[i..])),
    );
    starts.push(text.len());
    let mut pieces: Vec<Range<usize>> = starts.windows(2).map(|w| w[0]..w[1]).collect();
    if pieces.first().is_some_and(|first| {
        let first = &text[first.clone()];
        !is_marker(first) && is_blank(first)
    }) {
        pieces.remove(0);
    }
    Some(pieces)
}

/// Whether YAML text holds only blank lines and comments (after a byte order mark).
fn is_blank(text: &str) -> bool {
    text.strip_prefix('\u{feff}')
        .unwrap_or(text)
        .lines()
        .map(|l| l.trim_start_matches([' ', '\t', '\r']))
        .all(|l| l.is_empty() || l.starts_with('#'))
}

/// Parses and normalizes the piece `range` of `file`'s text, whose first document is number
/// `first`.
fn parse_piece(
    file: &Path,
    first: usize,
    file_text: &str,
    range: Range<usize>,
    json: bool,
) -> Result<Piece, ManifestError> {
    let text = &file_text[range.clone()];
    let mut piece = Piece {
        documents: 0,
        services: Vec::new(),
        slices: Vec::new(),
        placed_in: AtomicU64::new(0),
        applied: AtomicBool::new(false),
    };
    let invalid = |index: usize, reason: String| ManifestError {
        file: file.to_path_buf(),
        document: Some(first + index),
        object: None,
        reason,
    };
    if json {
        for (i, doc) in serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .enumerate()
        {
            let doc = doc.map_err(|e| invalid(i, format!("invalid JSON: {e}")))?;
            piece.documents += 1;
            add_document(file, first, i, doc, &mut piece)?;
        }
    } else {
        let docs: Vec<Value> = crate::yaml::documents(text).map_err(|e| {
            let e = in_file(file_text, range.clone()).unwrap_or(e);
            let index = document_at(file_text, range.clone(), &e);
            invalid(index, format!("invalid YAML: {e}"))
        })?;
        // An empty document (`---` and nothing, or comments) reads as none, but is one: it
        // keeps the numbers of the documents after it.
        if docs.is_empty() && !is_blank(text) {
            piece.documents += 1;
        }
        for (i, doc) in docs.into_iter().enumerate() {
            piece.documents += 1;
            add_document(file, first, i, doc, &mut piece)?;
        }
    }
    Ok(piece)
}

/// The YAML error of a piece with the line numbers of the file: the piece parsed again after
/// as many blank lines as come before it in the file. (For errors only, which are rare: it
/// costs a scan of the text before the piece.)
fn in_file(file_text: &str, range: Range<usize>) -> Option<crate::yaml::Error> {
    let lines = file_text[..range.start].matches('\n').count();
    let shifted = format!("{}{}", "\n".repeat(lines), &file_text[range]);
    crate::yaml::documents::<Value>(&shifted).err()
}

/// Which document of a piece an error (with the file's line numbers) is in, 0-based: one
/// per document start marker before the error's line, less one when the piece's first
/// document starts with its marker (nothing but comments before it).
fn document_at(file_text: &str, range: Range<usize>, e: &crate::yaml::Error) -> usize {
    let Some(line) = crate::yaml::error_line(e) else {
        return 0;
    };
    let first_line = file_text[..range.start].matches('\n').count() as u64 + 1;
    let text = &file_text[range];
    let is_marker = |l: &str| {
        l.starts_with("---") && matches!(l.as_bytes().get(3), None | Some(b' ' | b'\t' | b'\r'))
    };
    let mut markers = 0;
    let mut offset = 0;
    let mut first_marker_at = None;
    for (i, l) in text.split('\n').enumerate() {
        if first_line + i as u64 >= line {
            break;
        }
        if is_marker(l) {
            markers += 1;
            first_marker_at.get_or_insert(offset);
        }
        offset += l.len() + 1;
    }
    match first_marker_at {
        Some(at) if is_blank(&text[..at]) => markers - 1,
        _ => markers,
    }
}

fn describe(doc: &Value) -> String {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("<no kind>");
    let meta = doc.get("metadata");
    let ns = meta
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let name = meta
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("<no name>");
    format!("{kind} {ns}/{name}")
}

/// Adds the objects of document `index` of a piece (number `first + index` in the file).
fn add_document(
    file: &Path,
    first: usize,
    index: usize,
    doc: Value,
    piece: &mut Piece,
) -> Result<(), ManifestError> {
    if doc.is_null() {
        // An empty document (a stray `---`).
        return Ok(());
    }
    let err = |object: Option<String>, reason: String| ManifestError {
        file: file.to_path_buf(),
        document: Some(first + index),
        object,
        reason,
    };
    if !doc.is_object() {
        return Err(err(None, "document is not a mapping (object)".into()));
    }
    let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    match (api_version, kind) {
        ("v1", "List") => {
            let items = doc
                .get("items")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for item in items {
                add_document(file, first, index, item, piece)?;
            }
            Ok(())
        }
        ("v1", "Service") => {
            let what = describe(&doc);
            let svc: K8sService = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid Service: {e}")))?;
            piece.services.push(Entry {
                document: index,
                outcome: Outcome::of("Service", &svc.metadata, model::service_from_k8s(&svc)),
            });
            Ok(())
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let what = describe(&doc);
            let slice: K8sEndpointSlice = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid EndpointSlice: {e}")))?;
            piece.slices.push(Entry {
                document: index,
                outcome: Outcome::of(
                    "EndpointSlice",
                    &slice.metadata,
                    model::slice_from_k8s(&slice),
                ),
            });
            Ok(())
        }
        ("", _) | (_, "") => Err(err(
            Some(describe(&doc)),
            "apiVersion and kind are required".into(),
        )),
        (api, kind) => Err(err(
            Some(describe(&doc)),
            format!(
                "unknown kind {kind} (apiVersion {api}); expected v1 Service or discovery.k8s.io/v1 EndpointSlice"
            ),
        )),
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
mod tests {
    use super::*;

    fn parse(name: &str, text: &str) -> Result<Loaded, ManifestError> {
        super::parse(Path::new(name), text)
    }

    const GOOD: &str = r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 198.19.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
---
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: shop
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [198.18.0.2]}]
";

    #[test]
    fn multi_document_yaml_with_empty_documents() {
        let l = parse("a.yaml", GOOD).unwrap();
        assert_eq!(l.model.services.len(), 1);
        assert_eq!(l.model.slice_count(), 1);
    }

    #[test]
    fn json_list_and_concatenated_objects() {
        let text = r#"{"apiVersion":"v1","kind":"List","items":[
            {"apiVersion":"v1","kind":"Service","metadata":{"name":"a","namespace":"x"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]}}]}
            {"apiVersion":"v1","kind":"Service","metadata":{"name":"b","namespace":"x"},"spec":{"clusterIP":"198.19.0.2","ports":[{"port":80}]}}"#;
        let l = parse("a.json", text).unwrap();
        assert_eq!(l.model.services.len(), 2);
    }

    #[test]
    fn errors_name_file_document_object_and_reason() {
        let e = parse("bad.yaml", "a: [unclosed\n").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("bad.yaml: document 1: invalid YAML"),
            "{e}"
        );

        let e = parse(
            "bad.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: ok}\nspec: {clusterIP: 198.19.0.1}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm, namespace: x}\n",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad.yaml: document 2 (ConfigMap x/cm): unknown kind ConfigMap (apiVersion v1); expected v1 Service or discovery.k8s.io/v1 EndpointSlice"
        );

        let e = parse(
            "bad.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.1, ports: [{port: 0}]}\n",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad.yaml: document 1 (Service shop/web): spec.ports[0].port 0 is out of range 1-65535"
        );

        let e = parse(
            "bad.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {ports: [{port: not-a-number}]}\n",
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("bad.yaml: document 1 (Service default/web): not a valid Service"),
            "{e}"
        );
    }

    #[test]
    fn duplicates_are_rejected() {
        let text = format!("{GOOD}\n---\n{GOOD}");
        let e = parse("d.yaml", &text).unwrap_err();
        assert!(
            e.to_string()
                .contains("(Service shop/web): defined more than once"),
            "{e}"
        );
    }

    #[test]
    fn directory_is_read_recursively_skipping_hidden() {
        let dir = std::env::temp_dir().join(format!("lbproxy-manifests-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        std::fs::write(dir.join("sub/a.yaml"), GOOD).unwrap();
        std::fs::write(dir.join("..data/a.yaml"), "not: [valid").unwrap();
        std::fs::write(dir.join("notes.txt"), "ignored").unwrap();
        let l = Loader::default().load(&dir).unwrap().into_loaded();
        assert_eq!(l.model.services.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The documents a parse of the whole `text` reads.
    fn documents(text: &str) -> Vec<Value> {
        crate::yaml::documents(text).unwrap()
    }

    /// The error of a parse of the whole `text`, with the document it is in (0-based).
    fn whole_error(text: &str) -> Option<(usize, crate::yaml::Error)> {
        let e = crate::yaml::documents::<Value>(text).err()?;
        Some((document_at(text, 0..text.len(), &e), e))
    }

    /// Splits `text`, checks that its pieces read, one by one, as the same documents as the
    /// whole text, and returns them.
    fn split_checked(text: &str) -> Vec<&str> {
        let pieces: Vec<&str> = (split_documents(text).expect("splittable").into_iter())
            .map(|r| &text[r])
            .collect();
        let whole = documents(text);
        let joined: Vec<Value> = pieces.iter().flat_map(|p| documents(p)).collect();
        // A text of comments only reads as one null document, which no piece stands for.
        if !(whole == [Value::Null] && pieces.is_empty()) {
            assert_eq!(joined, whole, "{text:?} split as {pieces:?}");
        }
        pieces
    }

    #[test]
    fn splitting_cuts_at_document_start_lines_only() {
        // A leading comment is no document; `--- # comment` and `--- {…}` start documents.
        let text = "# header\n\n---\na: 1\n--- # second\nb: 2\n--- {c: 3}\n";
        assert_eq!(
            split_checked(text),
            ["---\na: 1\n", "--- # second\nb: 2\n", "--- {c: 3}\n"]
        );
        // No marker at the start: the first document is implicit.
        assert_eq!(split_checked("a: 1\n---\nb: 2"), ["a: 1\n", "---\nb: 2"]);
        // `---` inside block scalars (indented, at any depth) and in a value does not split.
        let text = "a: |\n  x\n  ---\n  y\nb:\n  c: >\n    ---\n  d: '---'\n---\ne: 2\n";
        assert_eq!(
            split_checked(text),
            [
                "a: |\n  x\n  ---\n  y\nb:\n  c: >\n    ---\n  d: '---'\n",
                "---\ne: 2\n"
            ]
        );
        // Nor do lines that merely begin with dashes (a plain scalar, here).
        assert_eq!(
            split_checked("----\n---x\n---\ne: 2\n"),
            ["----\n---x\n", "---\ne: 2\n"]
        );
        // A top-level block scalar keeps its indented `---`.
        assert_eq!(
            split_checked("--- |\n  one\n  ---\n  two\n---\nb: 2\n"),
            ["--- |\n  one\n  ---\n  two\n", "---\nb: 2\n"]
        );
        // `...` ends a document and stays in its piece, with the comments after it.
        assert_eq!(
            split_checked("a: 1\n...\n# between\n---\nb: 2\n...\n"),
            ["a: 1\n...\n# between\n", "---\nb: 2\n...\n"]
        );
        // Empty documents are documents: `---` twice, and a trailing `---`.
        assert_eq!(
            split_checked("a: 1\n---\n---\t\nb: 2\n---\n"),
            ["a: 1\n", "---\n", "---\t\nb: 2\n", "---\n"]
        );
        // CRLF line ends, and a byte order mark.
        assert_eq!(
            split_checked("\u{feff}a: 1\r\n---\r\nb: 2\r\n--- \r\nc: 3\r\n"),
            ["\u{feff}a: 1\r\n", "---\r\nb: 2\r\n", "--- \r\nc: 3\r\n"]
        );
        assert_eq!(
            split_checked("\u{feff}# only a comment\r\n---\r\nb: 2\r\n"),
            ["---\r\nb: 2\r\n"]
        );
        assert!(split_checked("# nothing\n\n").is_empty());
        assert!(split_checked("").is_empty());
    }

    #[test]
    fn text_with_directives_is_not_split() {
        assert_eq!(split_documents("%YAML 1.1\n---\na: 1\n"), None);
        assert_eq!(split_documents("a: 1\n...\n%YAML 1.1\n---\nb: 2\n"), None);
        assert_eq!(split_documents("\u{feff}%YAML 1.1\n---\na: 1\n"), None);
        // Parsed whole, it still loads.
        let text = format!("%YAML 1.1\n---\n{}", GOOD.trim_start());
        assert_eq!(parse("d.yaml", &text).unwrap().model.services.len(), 1);
    }

    fn service(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]}}\n"
        )
    }

    fn slice(service: &str, ip: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {service}-a, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{{addresses: [{ip}]}}]\n"
        )
    }

    /// Three services with a slice each, in six documents after a comment.
    fn three(web_endpoint: &str) -> String {
        let docs = [
            service("api", "198.19.0.1"),
            slice("api", "198.18.0.1"),
            service("web", "198.19.0.2"),
            slice("web", web_endpoint),
            service("db", "198.19.0.3"),
            slice("db", "198.18.0.3"),
        ];
        format!("# generated\n---\n{}", docs.join("---\n"))
    }

    fn names(set: impl IntoIterator<Item = NamespacedName>) -> Vec<String> {
        set.into_iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn a_reload_parses_only_the_documents_that_changed() {
        let file = Path::new("c.yaml");
        let mut loader = Loader::default();
        let mut model = model::Model::default();
        let c = loader.load_text(file, &three("198.18.0.2")).unwrap();
        assert_eq!((c.pieces, c.parsed), (6, 6));
        c.apply_to(&mut model);

        // The same text again: nothing parsed, nothing changed.
        let c = loader.load_text(file, &three("198.18.0.2")).unwrap();
        assert_eq!(c.parsed, 0);
        assert!(c.services.is_empty() && c.slices.is_empty());

        // One endpoint changed: one document parsed, one slice in the change, one service to
        // reprogram, and the model is what a load from scratch gives.
        let text = three("198.18.0.9");
        let c = loader.load_text(file, &text).unwrap();
        assert_eq!((c.pieces, c.parsed), (6, 1));
        assert!(c.services.is_empty());
        assert_eq!(
            names(c.slices.iter().map(|(id, _)| id.clone())),
            ["shop/web-a"]
        );
        let before = model.clone();
        let dirty = c.apply_to(&mut model);
        let fresh = parse("c.yaml", &text).unwrap().model;
        assert_eq!(model, fresh);
        assert_eq!(dirty, before.changed_services(&fresh));
        assert_eq!(names(dirty), ["shop/web"]);

        // A comment edited: that document is parsed again, but nothing is reprogrammed.
        let c = loader
            .load_text(file, &text.replace("ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: db-a", "ports: [{name: http, port: 80}]}\n# db's slice\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: db-a"))
            .unwrap();
        assert_eq!(c.parsed, 1);
        assert!(c.apply_to(&mut model).is_empty());
    }

    #[test]
    fn removed_and_moved_objects() {
        let file = Path::new("c.yaml");
        let mut loader = Loader::default();
        let mut model = model::Model::default();
        loader
            .load_text(file, &three("198.18.0.2"))
            .unwrap()
            .apply_to(&mut model);
        // db's service and slice removed; web's documents swapped (the same text, so not
        // parsed again); api's service and slice moved into one document, a List.
        let json = |yaml: &str| {
            serde_json::to_string(&crate::yaml::from_str::<Value>(yaml).unwrap()).unwrap()
        };
        let text = format!(
            "---\n{}---\n{}---\napiVersion: v1\nkind: List\nitems:\n- {}\n- {}\n",
            slice("web", "198.18.0.2"),
            service("web", "198.19.0.2"),
            json(&service("api", "198.19.0.1")),
            json(&slice("api", "198.18.0.1")),
        );
        let c = loader.load_text(file, &text).unwrap();
        assert_eq!((c.pieces, c.parsed), (3, 1));
        let gone: Vec<String> = (c.services.iter().filter(|(_, s)| s.is_none()))
            .map(|(id, _)| id.to_string())
            .chain((c.slices.iter().filter(|(_, s)| s.is_none())).map(|(id, _)| id.to_string()))
            .collect();
        assert_eq!(gone, ["shop/db", "shop/db-a"]);
        let before = model.clone();
        let dirty = c.apply_to(&mut model);
        let fresh = parse("c.yaml", &text).unwrap().model;
        assert_eq!(model, fresh);
        assert_eq!(dirty, before.changed_services(&fresh));
        assert_eq!(names(dirty), ["shop/db"]);
    }

    #[test]
    fn errors_after_a_good_load_name_file_document_object_and_keep_the_last_good_set() {
        let file = Path::new("c.yaml");
        let mut loader = Loader::default();
        let good = three("198.18.0.2");
        loader.load_text(file, &good).unwrap();

        // An invalid object in a changed document.
        let bad = good.replace(
            "198.19.0.3, ports: [{name: http, port: 80}]",
            "198.19.0.3, ports: [{name: http, port: 0}]",
        );
        let e = loader.load_text(file, &bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.yaml: document 5 (Service shop/db): spec.ports[0].port 0 is out of range 1-65535"
        );
        // The same bad document, now cached, after a document inserted before it.
        let moved = bad.replacen(
            "---\n",
            &format!("---\n{}---\n", service("new", "198.19.0.4")),
            1,
        );
        let e = loader.load_text(file, &moved).unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.yaml: document 6 (Service shop/db): spec.ports[0].port 0 is out of range 1-65535"
        );
        // Unparsable YAML and an unknown kind.
        // Its position is the file's, as a parse of the whole text gives it.
        let unparsable = good.replace(
            "kind: EndpointSlice\nmetadata: {name: web-a",
            "kind: EndpointSlice\nmetadata: [{name: web-a",
        );
        let (index, whole) = whole_error(&unparsable).unwrap();
        assert_eq!(index, 3, "{whole}");
        assert!(whole.to_string().contains("line 2"), "{whole}");
        let e = loader.load_text(file, &unparsable).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("c.yaml: document 4: invalid YAML: {whole}")
        );
        let e = loader
            .load_text(
                file,
                &good.replace(
                    "kind: Service\nmetadata: {name: web",
                    "kind: ConfigMap\nmetadata: {name: web",
                ),
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.yaml: document 3 (ConfigMap shop/web): unknown kind ConfigMap (apiVersion v1); expected v1 Service or discovery.k8s.io/v1 EndpointSlice"
        );
        // A service defined again, after and then before its first definition: the later
        // document is named, whether it is new or cached.
        let e = loader
            .load_text(
                file,
                &format!("{good}---\n{}", service("api", "198.19.0.9")),
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.yaml: document 7 (Service shop/api): defined more than once"
        );
        let e = loader
            .load_text(
                file,
                &format!("{}---\n{good}", service("api", "198.19.0.9")),
            )
            .unwrap_err();
        // (Document 2 is the comment after the first `---`: an empty document.)
        assert_eq!(
            e.to_string(),
            "c.yaml: document 3 (Service shop/api): defined more than once"
        );

        // Back to the good text: it is what the caller's model holds, so nothing changed,
        // and every document is still cached.
        let c = loader.load_text(file, &good).unwrap();
        assert_eq!(c.parsed, 0);
        assert!(c.services.is_empty() && c.slices.is_empty());
        // A fix after an error yields the change from the last good set.
        let c = loader.load_text(file, &three("198.18.0.7")).unwrap();
        assert_eq!(c.parsed, 1);
        assert_eq!(
            names(c.slices.into_iter().map(|(id, _)| id)),
            ["shop/web-a"]
        );
    }

    #[test]
    fn files_are_cached_apart_and_a_file_gone_removes_its_objects() {
        let a = PathBuf::from("d/a.yaml");
        let b = PathBuf::from("d/b.json");
        let b_text = serde_json::to_string(
            &crate::yaml::from_str::<Value>(&service("json", "198.19.0.8")).unwrap(),
        )
        .unwrap();
        let texts = |files: &[PathBuf]| {
            let mut loader_files: Vec<(PathBuf, String)> = Vec::new();
            for f in files {
                let t = if *f == a {
                    three("198.18.0.2")
                } else {
                    b_text.clone()
                };
                loader_files.push((f.clone(), t));
            }
            loader_files
        };
        let mut loader = Loader::default();
        let mut model = model::Model::default();
        let both = texts(&[a.clone(), b.clone()]);
        let read = |set: &[(PathBuf, String)]| {
            let set = set.to_vec();
            move |f: &Path| Ok(set.iter().find(|(p, _)| p == f).unwrap().1.clone())
        };
        let c = loader
            .load_with(&[a.clone(), b.clone()], read(&both))
            .unwrap();
        assert_eq!((c.pieces, c.parsed), (7, 7));
        c.apply_to(&mut model);
        assert_eq!(model.services.len(), 4);
        // The same text in another file is parsed for that file: here it defines the
        // services twice.
        let e = loader
            .load_with(&[a.clone(), PathBuf::from("d/c.yaml")], |_: &Path| {
                Ok(three("198.18.0.2"))
            })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "d/c.yaml: document 1 (Service shop/api): defined more than once"
        );
        let only_a = texts(std::slice::from_ref(&a));
        let c = loader
            .load_with(std::slice::from_ref(&a), read(&only_a))
            .unwrap();
        assert_eq!(c.parsed, 0);
        assert_eq!(names(c.apply_to(&mut model)), ["shop/json"]);
        assert_eq!(model.services.len(), 3);
    }

    #[test]
    fn skipped_objects_are_reported_when_first_read() {
        let text = format!(
            "{}---\napiVersion: v1\nkind: Service\nmetadata: {{name: h, namespace: shop}}\nspec: {{clusterIP: None}}\n",
            service("web", "198.19.0.2")
        );
        assert_eq!(
            parse("s.yaml", &text).unwrap().skipped,
            ["Service shop/h: headless (clusterIP None)"]
        );
        let mut loader = Loader::default();
        assert_eq!(
            loader
                .load_text(Path::new("s.yaml"), &text)
                .unwrap()
                .skipped
                .len(),
            1
        );
        assert!(
            loader
                .load_text(Path::new("s.yaml"), &text)
                .unwrap()
                .skipped
                .is_empty()
        );
    }

    /// Loads a long run of random edits of two files, from documents that repeat, define
    /// objects twice, move between files, are invalid or unparsable, and checks every load
    /// against a load from scratch: the same error, or a change that makes the model the
    /// same and marks exactly the services that differ.
    #[test]
    fn reloads_agree_with_loads_from_scratch() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            usize::try_from(seed % n as u64).unwrap()
        };
        let json = |yaml: &str| {
            serde_json::to_string(&crate::yaml::from_str::<Value>(yaml).unwrap()).unwrap()
        };
        let mut pool = Vec::new();
        for name in ["a", "b", "c"] {
            for variant in 1..=2 {
                pool.push(service(name, &format!("198.19.0.{variant}")));
                pool.push(slice(name, &format!("198.18.0.{variant}")));
            }
        }
        pool.extend([
            String::new(),
            "# a comment\n".into(),
            "apiVersion: v1\nkind: Service\nmetadata: {name: h, namespace: shop}\nspec: {clusterIP: None}\n".into(),
            "apiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: shop}\nspec: {clusterIP: 198.19.0.9, ports: [{port: 0}]}\n".into(),
            format!(
                "apiVersion: v1\nkind: List\nitems:\n- {}\n- {}\n",
                json(&service("l", "198.19.0.7")),
                json(&slice("l", "198.18.0.7"))
            ),
        ]);
        let unparsable = "a: [unclosed\n";
        let text = |random: &mut dyn FnMut(usize) -> usize| {
            let docs: Vec<&str> = (0..random(6))
                .map(|_| {
                    if random(40) == 0 {
                        unparsable
                    } else {
                        pool[random(pool.len())].as_str()
                    }
                })
                .collect();
            let lead = ["", "---\n", "# head\n---\n"][random(3)];
            format!("{lead}{}", docs.join("---\n"))
        };
        let files = [PathBuf::from("d/1.yaml"), PathBuf::from("d/2.yaml")];
        let mut loader = Loader::default();
        let mut model = model::Model::default();
        let (mut good, mut bad, mut unparsable) = (0, 0, 0);
        for step in 0..3000 {
            let texts = [text(&mut random), text(&mut random)];
            let set = &files[..1 + random(2)];
            let read = |f: &Path| Ok(texts[usize::from(f == files[1])].clone());
            let fresh = Loader::default().load_with(set, read);
            // Unparsable YAML is reported as a parse of each whole file reports it.
            let whole = set.iter().find_map(|f| {
                let text = read(f).unwrap();
                let (i, e) = whole_error(&text)?;
                Some(format!(
                    "{}: document {}: invalid YAML: {e}",
                    f.display(),
                    i + 1
                ))
            });
            if let Some(whole) = whole {
                unparsable += 1;
                let e = fresh.as_ref().map(|_| ()).unwrap_err();
                assert_eq!(e.to_string(), whole, "step {step}: {texts:?}");
            }
            match (loader.load_with(set, read), fresh) {
                (Ok(change), Ok(fresh)) => {
                    let fresh = fresh.into_loaded().model;
                    let before = model.clone();
                    let dirty = change.apply_to(&mut model);
                    assert_eq!(model, fresh, "step {step}: {texts:?}");
                    assert_eq!(
                        dirty,
                        before.changed_services(&fresh),
                        "step {step}: {texts:?}"
                    );
                    good += 1;
                }
                (Err(e), Err(fresh)) => {
                    assert_eq!(e.to_string(), fresh.to_string(), "step {step}: {texts:?}");
                    bad += 1;
                }
                (r, fresh) => panic!(
                    "step {step}: {texts:?}: {:?} but from scratch {:?}",
                    r.map(|_| ()),
                    fresh.map(|_| ())
                ),
            }
        }
        // Both outcomes are well exercised.
        assert!(
            good > 300 && bad > 300 && unparsable > 100,
            "{good} good, {bad} rejected, {unparsable} unparsable"
        );
    }

    /// The datapath benchmark's manifest (`cargo xtask bench datapath`: xtask's
    /// `bench_datapath/rules.rs`, written as the lab's `manifest.rs` writes YAML): `n`
    /// services with one TCP port and two endpoints, the middle one, `target`, with
    /// `target_endpoints`.
    fn bench_yaml(n: usize, target_endpoints: &[&str]) -> String {
        use std::fmt::Write as _;
        use std::net::Ipv4Addr;
        let target = (n - 1) / 2;
        let mut docs = Vec::new();
        for i in 0..n {
            let offset = |base: Ipv4Addr, k: usize| {
                Ipv4Addr::from(u32::from(base) + u32::try_from(k).unwrap()).to_string()
            };
            let vip = offset(Ipv4Addr::new(198, 19, 0, 16), i);
            let (name, endpoints) = if i == target {
                let eps = target_endpoints.iter().map(ToString::to_string).collect();
                ("target".to_string(), eps)
            } else {
                let filler = |k| offset(Ipv4Addr::new(198, 18, 64, 0), 2 * i + k);
                (format!("svc-{i}"), vec![filler(0), filler(1)])
            };
            let mut y = String::new();
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  clusterIP: {vip}\n  clusterIPs:\n  - {vip}\n  internalTrafficPolicy: Cluster\n  ipFamilies:\n  - IPv4\n  ipFamilyPolicy: SingleStack\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n  sessionAffinity: None\n  type: ClusterIP\nstatus:\n  loadBalancer: {{}}\n"
            );
            docs.push(y);
            let mut y =
                String::from("addressType: IPv4\napiVersion: discovery.k8s.io/v1\nendpoints:\n");
            for e in &endpoints {
                let _ = write!(
                    y,
                    "- addresses:\n  - {e}\n  conditions:\n    ready: true\n    serving: true\n    terminating: false\n  nodeName: lab-node\n"
                );
            }
            let _ = write!(
                y,
                "kind: EndpointSlice\nmetadata:\n  labels:\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n    kubernetes.io/service-name: {name}\n  name: {name}-1\n  namespace: default\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n"
            );
            docs.push(y);
        }
        docs.join("---\n")
    }

    /// What the manifests source costs at the datapath benchmark's N = 10,000: the file
    /// rewritten (atomically) with one endpoint changed, then a reload and its change
    /// applied to the model, as the controller does before programming the maps.
    #[test]
    #[ignore = "a benchmark: cargo test --release -p lbproxy reload_benchmark -- --ignored --nocapture"]
    fn reload_benchmark() {
        const RUNS: usize = 21;
        let dir = std::env::temp_dir().join(format!("lbproxy-reload-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cluster.yaml");
        let write = |text: &str| {
            let tmp = dir.join(".cluster.yaml.tmp");
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, &file).unwrap();
        };
        let text = bench_yaml(10_000, &["198.18.0.2", "198.18.0.3", "198.18.0.4"]);
        write(&text);
        let mut loader = Loader::default();
        let mut model = model::Model::default();
        let t = std::time::Instant::now();
        loader.load(&file).unwrap().apply_to(&mut model);
        let first = t.elapsed();
        assert_eq!(model.services.len(), 10_000);
        let mut took = Vec::new();
        for run in 0..RUNS {
            // Each run a new third endpoint for the target.
            write(&text.replace("198.18.0.4\n", &format!("198.18.1.{run}\n")));
            let t = std::time::Instant::now();
            let change = loader.load(&file).unwrap();
            let parsed = change.parsed;
            let dirty = change.apply_to(&mut model);
            took.push(t.elapsed());
            assert_eq!(parsed, 1);
            assert_eq!(names(dirty), ["default/target"]);
        }
        took.sort();
        eprintln!(
            "{} KiB, 20,000 objects: first load {:.1} ms; reload after one endpoint change: median {:.1} ms, min {:.1} ms, max {:.1} ms ({RUNS} runs)",
            text.len() / 1024,
            first.as_secs_f64() * 1e3,
            took[RUNS / 2].as_secs_f64() * 1e3,
            took[0].as_secs_f64() * 1e3,
            took[RUNS - 1].as_secs_f64() * 1e3,
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A directory that links back to itself is refused with the loop named, not walked
    /// forever.
    #[test]
    fn a_symlink_loop_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("lbproxy-loop-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::os::unix::fs::symlink(&dir, dir.join("a").join("back")).unwrap();
        std::fs::write(dir.join("a").join("x.yaml"), "").unwrap();
        let e = manifest_files(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.reason.contains("symbolic link loop"), "{e}");
    }

    /// A file over the size cap is refused before it is read, with its size.
    #[test]
    fn a_file_over_the_cap_is_refused() {
        let dir = std::env::temp_dir().join(format!("lbproxy-big-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("big.yaml");
        let file = std::fs::File::create(&f).unwrap();
        file.set_len(MAX_FILE_BYTES + 1).unwrap();
        let e = Loader::default().load(&f).err();
        std::fs::remove_dir_all(&dir).unwrap();
        let e = e.expect("an oversized file was accepted");
        assert!(e.reason.contains("more than the"), "{e}");
    }

    /// A YAML alias bomb (each level doubles the nodes an expansion would make) is refused,
    /// not expanded.
    #[test]
    fn a_yaml_alias_bomb_is_refused() {
        let mut y = String::from("a0: &a0 [x, x]\n");
        for i in 1..40 {
            y.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}]\n", p = i - 1));
        }
        y.push_str("kind: Service\napiVersion: v1\nmetadata: {name: bomb}\nspec: {ports: *a39}\n");
        let e = parse("bomb.yaml", &y).expect_err("an alias bomb was accepted");
        assert!(
            e.to_string().contains("bomb.yaml") && e.reason.contains("budget breached"),
            "{e}"
        );
    }
}
