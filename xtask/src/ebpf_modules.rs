//! The datapath's module graph (`lbproxy-ebpf/src`), for the check that it has no import
//! circle (issue 27 §1): shared types go down into leaf modules (`packet`, `stage`, `csum`)
//! that import nothing of the stages. An edge is every `crate::` path a module names (in its
//! `use` lines or inline), resolved to the longest module path it starts with, and every
//! `super::` path of a module in a directory (`hooks/from_pod.rs` -> `hooks`); comments are
//! left out. A parent
//! declaring its child (`pub mod from_pod;`) is not an import, so a child using its
//! parent's items is no circle.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// Module path (`crate::hooks::from_pod`) -> the modules it names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The module graph of the crate whose sources are under `src`.
pub fn graph(src: &Path) -> std::io::Result<Graph> {
    let mut sources = BTreeMap::new();
    collect(src, src, &mut sources)?;
    let names: BTreeSet<String> = sources.keys().cloned().collect();
    let mut g = Graph::new();
    for (module, text) in &sources {
        let parent = module.rsplit_once("::").map(|(p, _)| p.to_string());
        let mut edges = BTreeSet::new();
        for path in paths(text) {
            let full = match (path.strip_prefix("super::"), &parent) {
                (Some(rest), Some(p)) => format!("{p}::{rest}"),
                _ => path,
            };
            if let Some(m) = longest_module(&names, &full)
                && m != *module
                && m != "crate"
            {
                edges.insert(m);
            }
        }
        g.insert(module.clone(), edges);
    }
    Ok(g)
}

/// A cycle of `g`, if it has one (its modules in order, the first repeated at the end).
pub fn cycle(g: &Graph) -> Option<Vec<String>> {
    // 0: not seen, 1: on the current path, 2: done.
    let mut state: BTreeMap<&str, u8> = BTreeMap::new();
    let mut path: Vec<&str> = Vec::new();
    fn visit<'a>(
        g: &'a Graph,
        m: &'a str,
        state: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        match state.get(m).copied().unwrap_or(0) {
            1 => {
                let start = path.iter().position(|p| *p == m).unwrap_or(0);
                let mut c: Vec<String> = path[start..].iter().map(|s| s.to_string()).collect();
                c.push(m.to_string());
                return Some(c);
            }
            2 => return None,
            _ => {}
        }
        state.insert(m, 1);
        path.push(m);
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(g, next, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(m, 2);
        None
    }
    g.keys().find_map(|m| visit(g, m, &mut state, &mut path))
}

fn collect(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if p.is_dir() {
            collect(root, &p, out)?;
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(root).unwrap_or(&p).with_extension("");
            let rel = rel.to_string_lossy().replace('/', "::");
            let rel = rel.strip_suffix("::mod").unwrap_or(&rel).to_string();
            let name = match rel.as_str() {
                "main" | "lib" => "crate".to_string(),
                _ => format!("crate::{rel}"),
            };
            out.insert(name, std::fs::read_to_string(&p)?);
        }
    }
    Ok(())
}

/// Every `crate::a::b` and `super::a` path in the code of `text` (comments left out: a doc
/// link is no import), with `use` groups expanded one level (`crate::{a, b::c}` ->
/// `crate::a`, `crate::b::c`).
fn paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n");
    let text = code.as_str();
    let mut out = Vec::new();
    for root in ["crate::", "super::"] {
        let mut rest = text;
        while let Some(i) = rest.find(root) {
            let after = &rest[i + root.len()..];
            let base = root.trim_end_matches(':');
            if let Some(group) = after.strip_prefix('{') {
                let end = matching_brace(group);
                for item in split_top(&group[..end]) {
                    out.push(format!("{base}::{}", ident_path(item.trim())));
                }
            } else {
                out.push(format!("{base}::{}", ident_path(after)));
            }
            rest = after;
        }
    }
    out
}

/// The `a::b::c` path at the start of `s` (stops at the first character that is not part of
/// one, or at a `{`).
fn ident_path(s: &str) -> &str {
    let end = s
        .char_indices()
        .find(|&(_, c)| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .map_or(s.len(), |(i, _)| i);
    s[..end].trim_end_matches(':')
}

fn matching_brace(s: &str) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

/// `s` split at the commas outside braces.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn longest_module(names: &BTreeSet<String>, path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split("::").collect();
    (1..=parts.len())
        .rev()
        .map(|k| parts[..k].join("::"))
        .find(|n| names.contains(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The datapath has no import circle (issue 27 §1; 605351c had 8).
    #[test]
    fn the_datapath_has_no_import_circle() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lbproxy-ebpf/src");
        let g = graph(&src).expect("read lbproxy-ebpf/src");
        assert!(g.len() > 20, "only {} modules found under {src:?}", g.len());
        assert!(
            g["crate::hooks::from_pod"].contains("crate::hooks"),
            "super:: paths are not followed: {:?}",
            g["crate::hooks::from_pod"]
        );
        if let Some(c) = cycle(&g) {
            panic!("import circle in lbproxy-ebpf/src: {}", c.join(" -> "));
        }
    }

    /// The check finds a circle when there is one.
    #[test]
    fn a_circle_is_found() {
        let mut g = Graph::new();
        g.insert("crate::a".into(), ["crate::b".into()].into());
        g.insert("crate::b".into(), ["crate::c".into()].into());
        g.insert("crate::c".into(), ["crate::a".into()].into());
        let c = cycle(&g).expect("a cycle");
        assert_eq!(c.first(), c.last());
        assert_eq!(c.len(), 4);
        let p =
            paths("use crate::{flow, lb::{select, service}, stage::Verdict};\n x = super::y::z;");
        assert!(p.contains(&"crate::flow".to_string()), "{p:?}");
        assert!(p.contains(&"crate::stage::Verdict".to_string()), "{p:?}");
        assert!(p.contains(&"super::y::z".to_string()), "{p:?}");
    }
}
