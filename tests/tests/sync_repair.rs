//! The periodic full reconcile (`--sync-period`) repairs drift: a service entry deleted by
//! hand with bpftool comes back, and the service answers again.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::{Lab, Pod, Shape};

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
