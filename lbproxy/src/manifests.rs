//! The manifests source: `--manifests PATH`, a file or a directory of multi-document YAML or
//! JSON holding `v1` Service and `discovery.k8s.io/v1` EndpointSlice objects exactly as
//! Kubernetes serializes them (a `v1` `List` of them works too).
//!
//! A load either yields a whole new [`Model`] or an error naming the file, the document, the
//! object and the reason; the caller keeps the last good model on error.

use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service as K8sService;
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;
use serde_json::Value;

use crate::model::{self, Model, Normalized};

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

/// Objects a manifest set holds, before normalization.
#[derive(Default)]
pub struct Objects {
    pub services: Vec<(Origin, K8sService)>,
    pub slices: Vec<(Origin, K8sEndpointSlice)>,
}

/// Where an object came from, for error messages.
#[derive(Clone, Debug)]
pub struct Origin {
    pub file: PathBuf,
    pub document: usize,
}

/// The files a manifest path stands for: the file itself, or every `.yaml`, `.yml` and
/// `.json` file under the directory (recursively, in name order, skipping hidden entries
/// such as a ConfigMap volume's `..data`).
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
    while let Some(dir) = dirs.pop() {
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

/// Reads and parses every manifest under `path`.
pub fn read_objects(path: &Path) -> Result<Objects, ManifestError> {
    let mut objects = Objects::default();
    for file in manifest_files(path)? {
        let text = std::fs::read_to_string(&file).map_err(|e| ManifestError {
            file: file.clone(),
            document: None,
            object: None,
            reason: format!("cannot read: {e}"),
        })?;
        parse_text(&file, &text, &mut objects)?;
    }
    Ok(objects)
}

/// Parses one file's text into `objects`.
pub fn parse_text(file: &Path, text: &str, objects: &mut Objects) -> Result<(), ManifestError> {
    let is_json = file.extension().is_some_and(|e| e == "json");
    let docs: Vec<Value> = if is_json {
        serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .enumerate()
            .map(|(i, d)| {
                d.map_err(|e| ManifestError {
                    file: file.to_path_buf(),
                    document: Some(i + 1),
                    object: None,
                    reason: format!("invalid JSON: {e}"),
                })
            })
            .collect::<Result<_, _>>()?
    } else {
        let mut docs = Vec::new();
        for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let value =
                <Value as serde::Deserialize>::deserialize(doc).map_err(|e| ManifestError {
                    file: file.to_path_buf(),
                    document: Some(i + 1),
                    object: None,
                    reason: format!("invalid YAML: {e}"),
                })?;
            docs.push(value);
        }
        docs
    };
    for (i, doc) in docs.into_iter().enumerate() {
        let origin = Origin {
            file: file.to_path_buf(),
            document: i + 1,
        };
        add_document(&origin, doc, objects)?;
    }
    Ok(())
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

fn add_document(origin: &Origin, doc: Value, objects: &mut Objects) -> Result<(), ManifestError> {
    if doc.is_null() {
        // An empty document (a stray `---`).
        return Ok(());
    }
    let err = |object: Option<String>, reason: String| ManifestError {
        file: origin.file.clone(),
        document: Some(origin.document),
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
                add_document(origin, item, objects)?;
            }
            Ok(())
        }
        ("v1", "Service") => {
            let what = describe(&doc);
            let svc: K8sService = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid Service: {e}")))?;
            objects.services.push((origin.clone(), svc));
            Ok(())
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let what = describe(&doc);
            let slice: K8sEndpointSlice = serde_json::from_value(doc)
                .map_err(|e| err(Some(what), format!("not a valid EndpointSlice: {e}")))?;
            objects.slices.push((origin.clone(), slice));
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

/// What a successful load produced, with the objects that were valid but not proxied.
#[derive(Debug)]
pub struct Loaded {
    pub model: Model,
    pub skipped: Vec<String>,
}

/// Normalizes parsed objects into a model. Any invalid object rejects the whole set.
pub fn build_model(objects: Objects) -> Result<Loaded, ManifestError> {
    let mut model = Model::default();
    let mut skipped = Vec::new();
    let wrap = |origin: &Origin, e: model::InvalidObject| ManifestError {
        file: origin.file.clone(),
        document: Some(origin.document),
        object: Some(format!("{} {}", e.kind, e.object)),
        reason: e.reason,
    };
    for (origin, svc) in &objects.services {
        match model::service_from_k8s(svc).map_err(|e| wrap(origin, e))? {
            Normalized::Proxied(s) => {
                if model.services.contains_key(&s.id) {
                    return Err(ManifestError {
                        file: origin.file.clone(),
                        document: Some(origin.document),
                        object: Some(format!("Service {}", s.id)),
                        reason: "defined more than once".into(),
                    });
                }
                model.services.insert(s.id.clone(), s);
            }
            Normalized::Skipped(why) => skipped.push(format!(
                "Service {}/{}: {why}",
                svc.metadata.namespace.as_deref().unwrap_or("default"),
                svc.metadata.name.as_deref().unwrap_or("")
            )),
        }
    }
    for (origin, slice) in &objects.slices {
        match model::slice_from_k8s(slice).map_err(|e| wrap(origin, e))? {
            Normalized::Proxied(s) => {
                if model.has_slice(&s.id) {
                    return Err(ManifestError {
                        file: origin.file.clone(),
                        document: Some(origin.document),
                        object: Some(format!("EndpointSlice {}", s.id)),
                        reason: "defined more than once".into(),
                    });
                }
                model.upsert_slice(s);
            }
            Normalized::Skipped(why) => skipped.push(format!(
                "EndpointSlice {}/{}: {why}",
                slice.metadata.namespace.as_deref().unwrap_or("default"),
                slice.metadata.name.as_deref().unwrap_or("")
            )),
        }
    }
    Ok(Loaded { model, skipped })
}

/// Reads `path` and builds the model it describes.
pub fn load(path: &Path) -> Result<Loaded, ManifestError> {
    build_model(read_objects(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str, text: &str) -> Result<Loaded, ManifestError> {
        let mut o = Objects::default();
        parse_text(Path::new(name), text, &mut o)?;
        build_model(o)
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
        let l = load(&dir).unwrap();
        assert_eq!(l.model.services.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
