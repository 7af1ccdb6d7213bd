//! Unit tests of the manifests source: parsing and splitting documents, errors that name
//! the file, document, object and reason; `reload` has the incremental reloads.

mod reload;

use super::*;
use serde_json::Value;

use super::documents::document_at;

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
        "bad.yaml: document 2 (ConfigMap x/cm): unknown kind ConfigMap (apiVersion v1); expected v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node or networking.k8s.io/v1 ServiceCIDR"
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

#[test]
fn service_cidrs_are_read_beside_services() {
    let text = format!(
        "{GOOD}---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\n\
         metadata: {{name: kubernetes}}\nspec: {{cidrs: [198.19.0.0/16, 'fd00:198:19::/112']}}\n"
    );
    let l = parse("a.yaml", &text).unwrap();
    assert_eq!(l.model.services.len(), 1);
    let ids: Vec<String> = l
        .model
        .service_cidrs
        .keys()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ids, ["kubernetes"]);
    let cidrs: Vec<String> = l
        .model
        .service_cidrs
        .values()
        .next()
        .unwrap()
        .cidrs
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(cidrs, ["198.19.0.0/16", "fd00:198:19::/112"]);
}

#[test]
fn an_invalid_service_cidr_names_the_object_and_the_field() {
    let e = parse(
        "c.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: extra}\n\
         spec: {cidrs: [198.19.0/16]}\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "c.yaml: document 1 (ServiceCIDR extra): spec.cidrs[0] \"198.19.0/16\" is not a valid CIDR"
    );
    let twice = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: a}\n\
                 spec: {cidrs: [198.19.0.0/16]}\n";
    let e = parse("c.yaml", &format!("{twice}---\n{twice}")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "c.yaml: document 2 (ServiceCIDR a): defined more than once"
    );
}

#[test]
fn a_service_cidr_removed_from_the_files_is_gone() {
    let cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: a}\n\
                spec: {cidrs: [198.19.0.0/16]}\n";
    let mut loader = Loader::default();
    let first = loader
        .load_text(Path::new("c.yaml"), &format!("{GOOD}---\n{cidr}"))
        .unwrap();
    assert_eq!(first.service_cidrs.len(), 1);
    let second = loader.load_text(Path::new("c.yaml"), GOOD).unwrap();
    let gone: Vec<(String, bool)> = second
        .service_cidrs
        .iter()
        .map(|(id, c)| (id.to_string(), c.is_some()))
        .collect();
    assert_eq!(gone, [("a".to_string(), false)]);
}
