//! The periodic full reconcile (`--sync-period`) repairs drift: a service entry deleted by
//! hand with bpftool comes back, and the service answers again. It reads the maps back in
//! batches, and over maps larger than one batch it reads exactly what was written.

mod common;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::manifest::Endpoint;
use lbproxy_tests::lab::{Family, Lab, Pod, Shape};

#[test]
fn entry_deleted_with_bpftool_is_restored_by_the_next_full_sync() {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let b1: Pod = lab.add_pod("b1");
    let _server = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    let mut lb = lab.start_lbproxy_with(&["--sync-period", "2s"]);
    lb.expect_healthy(HEALTHY_WITHIN);
    client
        .tcp_request(WEB_VIP, WEB_TCP, T)
        .expect("service answers before the deletion");

    // ServiceKey {addr, port_be, proto, scope} of 198.19.0.10:80/TCP.
    let o = WEB_VIP.octets();
    let key: Vec<String> = [o[0], o[1], o[2], o[3], 0, 80, 6, 0]
        .iter()
        .map(u8::to_string)
        .collect();
    let pin = lab.bpffs_dir().join("LB_SERVICES_V2");
    let mut argv = vec![
        "bpftool".to_string(),
        "map".into(),
        "delete".into(),
        "pinned".into(),
        pin.display().to_string(),
        "key".into(),
    ];
    argv.extend(key);
    let out = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool map delete: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deleted = Instant::now();
    // Right after the deletion the frontend is gone: the VIP does not answer.
    assert!(
        client
            .tcp_request(WEB_VIP, WEB_TCP, Duration::from_millis(300))
            .is_err(),
        "the VIP still answered right after its entry was deleted"
    );
    // Within two sync periods the entry is back.
    let back = loop {
        if client
            .tcp_request(WEB_VIP, WEB_TCP, Duration::from_millis(300))
            .is_ok()
        {
            break deleted.elapsed();
        }
        assert!(
            deleted.elapsed() < Duration::from_secs(6),
            "the deleted entry was not restored within 6 s; log:\n{}",
            lb.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        lb.stderr().contains("drifted"),
        "restored after {back:?} but the repair was not logged"
    );
}

/// Entries in the map pinned as `name`, as bpftool counts them.
fn bpftool_count(lab: &Lab, name: &str) -> usize {
    let pin = lab.bpffs_dir().join(name);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&pin)
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool map dump {}: {}",
        pin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let entries: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("bpftool -j prints JSON");
    entries
        .as_array()
        .unwrap_or_else(|| panic!("bpftool's dump of {name} is not a list"))
        .len()
}

/// (id, backend) of every row of `inspect backends`.
fn backend_ids(lab: &Lab) -> BTreeSet<(u64, String)> {
    let rows = lab.inspect_json("backends");
    rows.as_array()
        .expect("inspect backends --json is a list")
        .iter()
        .map(|r| {
            (
                r["id"].as_u64().expect("a backend row has an id"),
                format!("{}:{}/{}", r["addr"], r["port"], r["protocol"]),
            )
        })
        .collect()
}

both_shapes!(maps_larger_than_one_batch_read_back_exactly);

/// The full reconcile and the adoption at a restart read the maps back with
/// `BPF_MAP_LOOKUP_BATCH`, 4,096 entries a call. Over maps holding more than one batch,
/// in both families, with the same pods behind two Services, they read exactly what was
/// written: no reconcile finds drift, `inspect` counts what bpftool counts, and a restarted
/// lbproxy adopts every backend under its id and writes nothing.
fn maps_larger_than_one_batch_read_back_exactly(shape: Shape) {
    let lab = Lab::new(shape);
    let b1: Pod = lab.add_pod("b1");
    let _server = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    // 3,000 endpoints besides b1 in each family, on two ports: 6,002 backends a family.
    // `web` and `web2` have the same IPv4 endpoints (one backend each, named by both).
    let mut eps4 = ready_in(Family::V4, &[&b1]);
    let mut eps6 = ready_in(Family::V6, &[&b1]);
    for i in 0..3000u16 {
        let (hi, lo) = ((i / 250) as u8, (i % 250 + 1) as u8);
        eps4.push(Endpoint::ready(Ipv4Addr::new(10, 250, hi, lo)));
        eps6.push(Endpoint::ready(Ipv6Addr::new(
            0xfd00,
            0x250,
            0,
            0,
            0,
            0,
            0,
            i + 1,
        )));
    }
    let per_family = 2 * eps4.len();
    lab.write_manifest(&merge([
        web_objects("web", vip_in(Family::V4, 10), eps4.clone()),
        web_objects("web2", vip_in(Family::V4, 11), eps4),
        web_objects("web6", vip_in(Family::V6, 10), eps6),
    ]));
    let env = [(
        "RUST_LOG",
        "info,lbproxy::controller=debug,lbproxy::bpf::batch=debug",
    )];
    let mut args = lab.lbproxy_run_args();
    args.extend(["--sync-period".into(), "2s".into()]);
    let mut lb = lab.start_lbproxy_argv(args.clone(), &env);
    lb.expect_healthy(HEALTHY_WITHIN);
    let reconciles = |log: &str| log.matches("reconcile: maps read back").count();
    let t = Instant::now();
    while reconciles(&lb.stderr()) < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "no two full reconciles within 15 s at --sync-period 2s; log:\n{}",
            lb.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = lb.stderr();
    assert!(
        !log.contains("BPF_MAP_LOOKUP_BATCH refused"),
        "the batch read was refused; log:\n{log}"
    );
    assert!(
        !log.contains("drifted"),
        "a full reconcile read back something other than what was written; log:\n{log}"
    );
    // Three Services' slots and members (both families share those maps), two families'
    // backends.
    for (map, want) in [
        ("LB_BACKENDS_V1", per_family),
        ("LB_BACKENDS6_V1", per_family),
        ("LB_SLOTS_V1", 3 * per_family),
        ("LB_MEMBERS_V1", 3 * per_family),
    ] {
        assert_eq!(bpftool_count(&lab, map), want, "entries in {map}");
    }
    let before = backend_ids(&lab);
    assert_eq!(before.len(), 2 * per_family, "inspect backends rows");
    // A restart adopts what the maps hold: every backend keeps its id, and its first sync
    // changes nothing.
    lb.terminate(EXIT_WITHIN);
    let mut lb = lab.start_lbproxy_argv(args, &env);
    lb.expect_healthy(HEALTHY_WITHIN);
    let log = lb.stderr();
    let first = log
        .lines()
        .find(|l| l.contains("sync done") && l.contains("initial list"))
        .unwrap_or_else(|| panic!("no first sync after the restart; log:\n{log}"));
    assert!(
        first.contains("changed=0"),
        "the restarted lbproxy rewrote frontends it should have adopted: {first}"
    );
    assert_eq!(backend_ids(&lab), before, "backends after the restart");
}
