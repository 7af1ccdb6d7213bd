//! Splitting a manifest file into its documents, and parsing one piece of documents into
//! the objects it holds, each error naming the file, the document, the object and the reason.

use std::ops::Range;

use k8s_openapi::api::core::v1::{Node as K8sNode, Service as K8sService};
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR as K8sServiceCidr;
use serde_json::Value;

use super::*;

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
pub(super) fn split_documents(text: &str) -> Option<Vec<Range<usize>>> {
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
pub(super) fn is_blank(text: &str) -> bool {
    text.strip_prefix('\u{feff}')
        .unwrap_or(text)
        .lines()
        .map(|l| l.trim_start_matches([' ', '\t', '\r']))
        .all(|l| l.is_empty() || l.starts_with('#'))
}

/// Parses and normalizes the piece `range` of `file`'s text, whose first document is number
/// `first`.
pub(super) fn parse_piece(
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
        nodes: Vec::new(),
        service_cidrs: Vec::new(),
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
pub(super) fn in_file(file_text: &str, range: Range<usize>) -> Option<crate::yaml::Error> {
    let lines = file_text[..range.start].matches('\n').count();
    let shifted = format!("{}{}", "\n".repeat(lines), &file_text[range]);
    crate::yaml::documents::<Value>(&shifted).err()
}

/// Which document of a piece an error (with the file's line numbers) is in, 0-based: one
/// per document start marker before the error's line, less one when the piece's first
/// document starts with its marker (nothing but comments before it).
pub(super) fn document_at(file_text: &str, range: Range<usize>, e: &crate::yaml::Error) -> usize {
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

pub(super) fn describe(doc: &Value) -> String {
    let kind = doc
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("<no kind>");
    let meta = doc.get("metadata");
    let cluster_scoped = kind == "Node" || kind == "ServiceCIDR";
    let ns = meta
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let name = meta
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("<no name>");
    if cluster_scoped {
        return format!("{kind} {name}");
    }
    format!("{kind} {ns}/{name}")
}

/// Adds the objects of document `index` of a piece (number `first + index` in the file).
pub(super) fn add_document(
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
        ("v1", "Node") => {
            let what = describe(&doc);
            let node: K8sNode = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid Node: {e}")))?;
            piece.nodes.push(Entry {
                document: index,
                outcome: Outcome::of("Node", &node.metadata, model::node_from_k8s(&node)),
            });
            Ok(())
        }
        ("networking.k8s.io/v1", "ServiceCIDR") => {
            let what = describe(&doc);
            let cidr: K8sServiceCidr = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid ServiceCIDR: {e}")))?;
            piece.service_cidrs.push(Entry {
                document: index,
                outcome: Outcome::of(
                    "ServiceCIDR",
                    &cidr.metadata,
                    model::service_cidr_from_k8s(&cidr),
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
                "unknown kind {kind} (apiVersion {api}); expected v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node or networking.k8s.io/v1 ServiceCIDR"
            ),
        )),
    }
}
