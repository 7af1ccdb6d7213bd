//! The ServiceCIDR tables follow the model: only differences are written, a dirty sync
//! looks only at the dirty services' ClusterIPs, a failed write is repaired by the next sync.

use std::collections::BTreeSet;

use super::*;
use crate::model::{NamespacedName, Normalized, Service, ServiceCidr, service_from_k8s};
use crate::program::mem::MemMaps;

fn svc(name: &str, ips: &[&str]) -> Service {
    let doc = serde_json::json!({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIPs": ips, "ports": [{"port": 80}]},
    });
    match service_from_k8s(&serde_json::from_value(doc).unwrap()).unwrap() {
        Normalized::Proxied(s) => s,
        other => panic!("{other:?}"),
    }
}

fn set_cidr(m: &mut Model, name: &str, cidrs: &[&str]) {
    let id = NamespacedName {
        namespace: String::new(),
        name: name.into(),
    };
    let c = (!cidrs.is_empty()).then(|| ServiceCidr {
        id: id.clone(),
        cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
    });
    m.set_service_cidr(&id, c);
}

fn table(maps: &MemMaps) -> Vec<String> {
    maps.service_cidrs
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect()
}

#[test]
fn nothing_is_written_without_a_service_cidr() {
    let mut m = Model::default();
    let s = svc("web", &["198.19.0.10"]);
    m.set_service(&s.id.clone(), Some(s));
    let mut maps = MemMaps::default();
    let mut p = CidrProgrammer::adopt(BTreeMap::new(), false);
    assert!(p.all(&mut maps, &m).is_empty());
    // Not even the flag: it is clear, and the datapath does not look the tries up.
    assert_eq!((maps.ops, maps.service_cidrs_flag), (0, false));
    let dirty = BTreeSet::from([NamespacedName {
        namespace: "ns".into(),
        name: "web".into(),
    }]);
    assert!(p.services(&mut maps, &m, &dirty).is_empty());
    assert_eq!(maps.ops, 0);
}

#[test]
fn a_dirty_sync_writes_only_the_dirty_services_cluster_ips() {
    let mut m = Model::default();
    let web = svc("web", &["198.19.0.10", "fd00:198:19::10"]);
    m.set_service(&web.id.clone(), Some(web.clone()));
    set_cidr(
        &mut m,
        "kubernetes",
        &["198.19.0.0/16", "fd00:198:19::/112"],
    );
    let mut maps = MemMaps::default();
    let mut p = CidrProgrammer::adopt(BTreeMap::new(), false);
    assert!(p.all(&mut maps, &m).is_empty());
    assert!(maps.service_cidrs_flag);
    assert_eq!(
        table(&maps),
        [
            "198.19.0.0/16=1",
            "198.19.0.10/32=2",
            "fd00:198:19::/112=1",
            "fd00:198:19::10/128=2"
        ]
    );
    // A second service: one write per ClusterIP, nothing else.
    let api = svc("api", &["198.19.0.20"]);
    m.set_service(&api.id.clone(), Some(api.clone()));
    let before = maps.ops;
    let dirty = BTreeSet::from([api.id.clone()]);
    assert!(p.services(&mut maps, &m, &dirty).is_empty());
    assert_eq!(maps.ops - before, 1);
    assert!(
        maps.service_cidrs
            .contains_key(&"198.19.0.20/32".parse().unwrap())
    );
    // The service goes: its ClusterIP is unallocated again.
    m.set_service(&web.id, None);
    let dirty = BTreeSet::from([web.id.clone()]);
    assert!(p.services(&mut maps, &m, &dirty).is_empty());
    assert_eq!(
        table(&maps),
        ["198.19.0.0/16=1", "198.19.0.20/32=2", "fd00:198:19::/112=1"]
    );
    // The last ServiceCIDR goes: the tables empty, so nothing changes in the datapath.
    set_cidr(&mut m, "kubernetes", &[]);
    assert!(p.services(&mut maps, &m, &BTreeSet::new()).is_empty());
    assert!(table(&maps).is_empty(), "{:?}", table(&maps));
    assert!(!maps.service_cidrs_flag);
    assert_eq!(p.programmed().len(), 0);
}

#[test]
fn a_failed_write_is_repaired_by_the_next_sync() {
    let mut m = Model::default();
    let web = svc("web", &["198.19.0.10"]);
    m.set_service(&web.id.clone(), Some(web));
    set_cidr(&mut m, "kubernetes", &["198.19.0.0/16"]);
    let mut maps = MemMaps {
        fail_at: Some(0),
        ..MemMaps::default()
    };
    let mut p = CidrProgrammer::adopt(BTreeMap::new(), false);
    let errors = p.all(&mut maps, &m);
    assert_eq!(errors.len(), 1);
    // The ClusterIP is written before the range: the failed one was the ClusterIP.
    assert_eq!(table(&maps), ["198.19.0.0/16=1"]);
    assert!(p.services(&mut maps, &m, &BTreeSet::new()).is_empty());
    assert_eq!(table(&maps), ["198.19.0.0/16=1", "198.19.0.10/32=2"]);
}
