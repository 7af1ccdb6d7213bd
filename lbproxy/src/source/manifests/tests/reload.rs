//! Unit tests of incremental reloads: only changed documents are parsed, and a reload
//! always agrees with a load from scratch.

use super::*;

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
    let json =
        |yaml: &str| serde_json::to_string(&crate::yaml::from_str::<Value>(yaml).unwrap()).unwrap();
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
        "c.yaml: document 3 (ConfigMap shop/web): unknown kind ConfigMap (apiVersion v1); expected v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Node or networking.k8s.io/v1 ServiceCIDR"
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
    let json =
        |yaml: &str| serde_json::to_string(&crate::yaml::from_str::<Value>(yaml).unwrap()).unwrap();
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
