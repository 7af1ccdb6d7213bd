//! The stack bypass (`--stack-bypass`): service traffic between pods on one node is
//! redirected straight into the destination pod, past the node's routing and netfilter.
//! Real `lbproxy run`, real TCP and UDP.

mod common;

use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{Lab, Proto, Shape};

/// `lbproxy inspect delivery --json`'s counter for `path`.
fn delivered(lab: &Lab, path: &str) -> u64 {
    let v = lab.inspect_json("delivery");
    v["packets"][path]
        .as_u64()
        .unwrap_or_else(|| panic!("inspect delivery: no packets.{path}: {v:#}"))
}

/// Rules in the node namespace's FORWARD chain that drop the web service's backend traffic
/// both ways, whatever its address: whatever the node's stack forwards between the pods is
/// lost.
fn drop_forwarded_backend_traffic(lab: &Lab) {
    for (proto, port) in [("tcp", BACKEND_TCP), ("udp", BACKEND_UDP)] {
        for dir in ["--dport", "--sport"] {
            lab.node_run(&[
                "iptables",
                "-A",
                "FORWARD",
                "-p",
                proto,
                dir,
                &port.to_string(),
                "-j",
                "DROP",
            ])
            .unwrap_or_else(|e| panic!("installing a FORWARD drop rule: {e}"));
        }
    }
}

/// Routed pods (the shape the bypass serves): with the FORWARD chain dropping all backend
/// traffic, the pods cannot reach each other directly, yet every request through the VIP
/// is answered, by every backend, from the VIP, and the datapath counts a redirect for
/// every packet. Restarted without the bypass, the same requests are dropped by the node.
#[test]
fn routed_pods_bypass_the_node_stack() {
    let mut s = Setup::with_args(Shape::Routed, &["b1", "b2"], &["--stack-bypass"]);
    let v = s.lab.inspect_json("delivery");
    assert_eq!(v["stack_bypass"], true, "inspect delivery: {v:#}");
    let ifs = v["redirect_interfaces"].as_array().map_or(0, Vec::len);
    assert_eq!(ifs, 3, "one redirect target per pod interface: {v:#}");

    // Cold neighbours: the node has not talked to the backends yet, so the first packets
    // take the stack, which resolves them; later ones are redirected.
    let (t, u) = web_traffic_ok_in(Some(&s.lab), "bypass, open node", &s.client, WEB_VIP, 30);
    assert!(
        t.len() == 2 && u.len() == 2,
        "both backends answer: TCP {t:?} UDP {u:?}"
    );

    drop_forwarded_backend_traffic(&s.lab);
    let b1 = s.backend("b1").ip;
    let direct = s
        .client
        .tcp_request(b1, BACKEND_TCP, Duration::from_millis(500));
    assert!(
        direct.is_err(),
        "the FORWARD drop rule must stop direct pod-to-pod traffic, but b1 answered: {direct:?}"
    );

    let (to_backend, to_client) = (
        delivered(&s.lab, "redirect_to_backend"),
        delivered(&s.lab, "redirect_to_client"),
    );
    let n = 40;
    let (t, u) = web_traffic_ok_in(
        Some(&s.lab),
        "bypass, FORWARD dropping",
        &s.client,
        WEB_VIP,
        n,
    );
    assert!(
        t.len() == 2 && u.len() == 2,
        "both backends answer: TCP {t:?} UDP {u:?}"
    );
    // A TCP request is at least SYN, ACK, request, FIN out and SYN-ACK, reply, FIN back;
    // a UDP one is one packet each way.
    let (fwd, rev) = (
        delivered(&s.lab, "redirect_to_backend") - to_backend,
        delivered(&s.lab, "redirect_to_client") - to_client,
    );
    assert!(
        fwd >= 4 * n as u64 + n as u64 && rev >= 3 * n as u64 + n as u64,
        "redirects during {n} TCP and {n} UDP requests: {fwd} to backends, {rev} to the client"
    );

    // The control: the same lab without the bypass goes through FORWARD, and is dropped.
    s.lb.terminate(EXIT_WITHIN);
    let mut lb = s.lab.start_lbproxy_with(&["--stack-bypass=false"]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let v = s.lab.inspect_json("delivery");
    assert_eq!(v["stack_bypass"], false, "inspect delivery: {v:#}");
    assert_eq!(
        v["redirect_interfaces"]
            .as_array()
            .map_or(usize::MAX, Vec::len),
        0,
        "no redirect target with the bypass off: {v:#}"
    );
    let t = s
        .client
        .tally(Proto::Tcp, WEB_VIP, WEB_TCP, 5, Duration::from_millis(500));
    assert_eq!(
        t.replies(),
        0,
        "without the bypass, the FORWARD rule must drop service traffic too: {t}"
    );
}

/// Bridged pods: the route to a backend is the bridge, not the backend's own interface, so
/// nothing is redirected; every packet takes the node's stack as without the bypass, and
/// says why in the counters.
#[test]
fn bridged_pods_fall_back_to_the_stack() {
    let s = Setup::with_args(Shape::Bridge, &["b1", "b2"], &["--stack-bypass"]);
    let (t, u) = web_traffic_ok_in(Some(&s.lab), "bypass, bridge", &s.client, WEB_VIP, 20);
    assert!(
        t.len() == 2 && u.len() == 2,
        "both backends answer: TCP {t:?} UDP {u:?}"
    );
    assert_eq!(delivered(&s.lab, "redirect_to_backend"), 0);
    assert_eq!(delivered(&s.lab, "redirect_to_client"), 0);
    let not_pod = delivered(&s.lab, "stack_not_pod_interface");
    assert!(
        not_pod >= 40,
        "every client packet should be counted as routed to a non-pod interface: {not_pod}"
    );
}
