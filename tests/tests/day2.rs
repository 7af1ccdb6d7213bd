//! Day-2 tools against a real `lbproxy run` in the lab (issue 13): `lbproxy monitor` streams
//! drops and rejects with reason, 5-tuple, interface and service, only while it listens and
//! no faster than its rate cap; `lbproxy flows flush` removes exactly the flows selected,
//! both halves, and leaves the others serving.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::inspect::rows::{AffinityRow, ServiceRow, Status};
use lbproxy_tests::lab::{
    Backend, Conditions, Endpoint, HEALTHZ_ADDR, Lab, Lbproxy, Pod, Shape, lbproxy_bin, ns_run,
    vip, wait_for,
};
use serde_json::Value;

/// A service with no endpoints: TCP to it is answered with a RST, UDP with ICMP.
fn empty_vip() -> Ipv4Addr {
    vip(20)
}

/// The client's second address, outside the pods' networks: the node does not route it back
/// out of the client's interface, so packets from it to a service are `spoofed_source`.
const SPOOFED: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 201);

/// A lab with `client` and `other`, backends `b1` and `b2` behind `default/web`, and `default/empty`
/// with no endpoints; lbproxy healthy.
fn lab_with_empty() -> (Lab, Pod, Vec<Pod>, Vec<Backend>, Lbproxy) {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    // A second client, for the flush test.
    lab.add_pod("other");
    let (pods, servers) = serving_pods(&lab, &["b1", "b2"]);
    let refs: Vec<&Pod> = pods.iter().collect();
    lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&refs)),
        web_objects("empty", empty_vip(), vec![]),
    ]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    (lab, client, pods, servers, lb)
}

/// A UDP datagram to the web service's UDP port from the spoofed address.
fn send_spoofed(client: &Pod, n: usize) {
    client.run(|| {
        let s = UdpSocket::bind(SocketAddrV4::new(SPOOFED, 21011)).expect("bind spoofed");
        for _ in 0..n {
            s.send_to(b"x", SocketAddrV4::new(WEB_VIP, WEB_UDP))
                .expect("send spoofed");
        }
    });
}

/// A UDP request from `port` to the empty service, on a connected socket (which is what
/// reports the ICMP port unreachable as ECONNREFUSED).
fn udp_rejected(client: &Pod, port: Option<u16>) {
    let r = client.run(|| -> std::io::Result<()> {
        let u = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port.unwrap_or(0)))?;
        u.connect((empty_vip(), WEB_UDP))?;
        u.set_read_timeout(Some(Duration::from_secs(3)))?;
        u.send(b"hello\n")?;
        let mut buf = [0u8; 64];
        u.recv(&mut buf).map(|_| ())
    });
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "UDP to the empty service must be refused (ICMP port unreachable): {r:?}"
    );
}

/// Rejects and a drop, each with its reason, tuple, hook, interface and service; nothing
/// from before the monitor listened; and nothing after it stopped (its lease ran out).
#[test]
fn monitor_streams_drops_and_rejects_only_while_listening() {
    let (lab, client, _pods, _servers, _lb) = lab_with_empty();
    ns_run(
        &client.netns,
        &["ip", "addr", "add", &format!("{SPOOFED}/32"), "dev", "eth0"],
    )
    .expect("add the spoofed address");

    // Nobody listens: this reject must never show up.
    udp_rejected(&client, Some(40_001));

    let mon = Monitor::start(&lab, &["--duration", "30"]);
    let tcp = client.tcp_request(empty_vip(), WEB_TCP, T);
    assert!(
        matches!(&tcp, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "TCP to the empty service must be refused: {tcp:?}"
    );
    udp_rejected(&client, Some(40_002));
    send_spoofed(&client, 1);
    // All it sends in 2 s, so that nothing from this part is left in the ring.
    let events = mon.events(usize::MAX, Duration::from_secs(2));
    eprintln!("events: {events:#?}");
    assert!(events.len() >= 3, "three events expected: {events:?}");
    for e in &events {
        assert_ne!(
            e["src"],
            format!("{}:40001", client.ip),
            "the reject from before the monitor listened was sent: {e}"
        );
        assert_eq!(e["hook"], "from_pod", "{e}");
        let ifname = e["interface"].as_str().unwrap();
        assert!(
            ifname.starts_with(lab.if_prefix()),
            "interface {ifname}: {e}"
        );
    }
    let by_reason = |r: &str| {
        events
            .iter()
            .find(|e| e["reason"] == r)
            .unwrap_or_else(|| panic!("no {r} event among {events:#?}"))
    };
    let tcp_ev = by_reason("no_backend_tcp_reset");
    assert_eq!(tcp_ev["verdict"], "reject");
    assert_eq!(tcp_ev["protocol"], "TCP");
    assert_eq!(tcp_ev["dst"], format!("{}:{WEB_TCP}", empty_vip()));
    assert!(
        tcp_ev["src"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}:", client.ip))
    );
    assert_eq!(tcp_ev["service"], "default/empty:http");
    let udp_ev = by_reason("no_backend_icmp_unreachable");
    assert_eq!(udp_ev["verdict"], "reject");
    assert_eq!(udp_ev["protocol"], "UDP");
    assert_eq!(udp_ev["src"], format!("{}:40002", client.ip));
    assert_eq!(udp_ev["dst"], format!("{}:{WEB_UDP}", empty_vip()));
    assert_eq!(udp_ev["service"], "default/empty:dns");
    let spoofed = by_reason("spoofed_source");
    assert_eq!(spoofed["verdict"], "drop");
    assert_eq!(spoofed["src"], format!("{SPOOFED}:21011"));
    assert_eq!(spoofed["dst"], format!("{WEB_VIP}:{WEB_UDP}"));
    assert_eq!(spoofed["service"], "default/web:dns");
    drop(mon);

    // The stopped monitor's lease runs out; a reject after that is not sent, so a new
    // monitor sees only what happens once it listens.
    std::thread::sleep(Duration::from_millis(3_500));
    udp_rejected(&client, Some(40_003));
    let mon = Monitor::start(&lab, &["--duration", "20"]);
    udp_rejected(&client, Some(40_004));
    let events = mon.events(usize::MAX, Duration::from_millis(1500));
    let srcs: Vec<&str> = events.iter().filter_map(|e| e["src"].as_str()).collect();
    assert!(
        srcs.contains(&format!("{}:40004", client.ip).as_str()),
        "the reject sent while the new monitor listens is missing: {events:#?}"
    );
    assert!(
        !srcs.contains(&format!("{}:40003", client.ip).as_str()),
        "the reject sent after the lease ran out, with nobody listening, was sent: {events:#?}"
    );
}

/// Runs the calling thread on CPU 0 only, so the datapath handles its packets there (a veth
/// runs the receiving side's programs on the sender's CPU).
fn pin_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity"
        );
    }
}

/// With `--rate 2`, a burst of 60 rejects gives at most 2 events per CPU per second, each
/// counted in full by the drop counters; the rest are reported as suppressed.
#[test]
fn monitor_rate_cap_holds_under_a_burst() {
    let (lab, client, _pods, _servers, _lb) = lab_with_empty();
    let before = lab.drop_count("no_backend_icmp_unreachable");
    let mon = Monitor::start(&lab, &["--rate", "2", "--duration", "20"]);
    let burst = Instant::now();
    client.run(|| {
        pin_to_cpu0();
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..60 {
            s.send_to(b"x", SocketAddrV4::new(empty_vip(), WEB_UDP))
                .unwrap();
        }
    });
    let sent_in = burst.elapsed();
    let events = mon.events(1000, Duration::from_millis(1500));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!(
        "burst of 60 in {sent_in:?}: {} events on {cpus} CPUs",
        events.len()
    );
    assert!(!events.is_empty(), "the burst gave no event at all");
    // One window per CPU, and at most one more if the burst straddled a window's end.
    assert!(
        events.len() <= 2 * 2 * cpus,
        "rate cap 2/CPU/s let {} events through: {events:#?}",
        events.len()
    );
    let after = wait_for(Duration::from_secs(5), Duration::from_millis(200), || {
        let n = lab.drop_count("no_backend_icmp_unreachable");
        (n >= before + 60).then_some(n)
    });
    assert!(after.is_ok(), "the drop counter must count all 60 rejects");
    // The next event of a capped CPU reports what was left out before it.
    std::thread::sleep(Duration::from_millis(1100));
    client.run(|| {
        // The same CPU as the burst: the suppressed count is per CPU.
        pin_to_cpu0();
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..cpus * 4 {
            s.send_to(b"x", SocketAddrV4::new(empty_vip(), WEB_UDP))
                .unwrap();
        }
    });
    let later = mon.events(cpus * 2, Duration::from_secs(3));
    let suppressed: u64 = later.iter().filter_map(|e| e["suppressed"].as_u64()).sum();
    assert!(
        suppressed > 0,
        "events after the capped second must report the suppressed ones: {later:#?}"
    );
}

/// `lbproxy ARGS --bpffs-dir DIR` in the lab's node namespace: (whether it succeeded,
/// stdout, stderr).
fn tool(lab: &Lab, args: &[&str]) -> (bool, String, String) {
    let dir = lab.bpffs_dir().display().to_string();
    let argv: Vec<&str> = args.iter().copied().chain(["--bpffs-dir", &dir]).collect();
    let out = lab.lbproxy_cmd(&argv);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `lbproxy ARGS` that must succeed: its stdout.
fn tool_ok(lab: &Lab, args: &[&str]) -> String {
    let (ok, out, err) = tool(lab, args);
    assert!(ok, "lbproxy {args:?} failed: {err}{out}");
    out
}

/// `flows flush --json ARGS`, parsed.
fn flush(lab: &Lab, args: &[&str]) -> Value {
    let argv: Vec<&str> = ["flows", "flush", "--json"]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let text = tool_ok(lab, &argv);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON ({e}): {text}"))
}

/// `flows flush` with bad input: the error names the flag and the value.
fn flush_fails(lab: &Lab, args: &[&str], expect: &str) {
    let argv: Vec<&str> = ["flows", "flush"]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let (ok, _, err) = tool(lab, &argv);
    assert!(!ok, "lbproxy {argv:?} must fail");
    assert!(
        err.contains(expect),
        "lbproxy {argv:?}: error {err:?} lacks {expect:?}"
    );
}

/// Flow-table entries whose key or value holds `addr` (both halves of its flows).
fn entries_with(lab: &Lab, addr: Ipv4Addr) -> usize {
    let octets: Vec<Value> = addr.octets().iter().map(|o| Value::from(*o)).collect();
    lab.map_dump("LB_FLOWS_V3")
        .iter()
        .filter(|e| {
            e["key"]["src_addr"].as_array() == Some(&octets)
                || e["key"]["dst_addr"].as_array() == Some(&octets)
        })
        .count()
}

#[test]
fn flows_flush_removes_the_selected_flows_both_halves() {
    let (lab, client, pods, _servers, _lb) = lab_with_empty();
    let other = lab.pod("other");
    // Each client: a held TCP connection and a UDP flow.
    let mut c_tcp = client.connect(WEB_VIP, WEB_TCP, T).expect("client TCP");
    let mut o_tcp = other.connect(WEB_VIP, WEB_TCP, T).expect("other TCP");
    let o_backend = o_tcp.request().expect("other's first request").backend;
    c_tcp.request().expect("client's first request");
    client
        .udp_request(WEB_VIP, WEB_UDP, T, Some(41_000))
        .expect("client UDP");
    other
        .udp_request(WEB_VIP, WEB_UDP, T, Some(41_001))
        .expect("other UDP");
    // Forward key from the client, reply key to it: two per flow.
    assert_eq!(
        entries_with(&lab, client.ip),
        4,
        "client's 2 flows, both halves"
    );
    assert_eq!(
        entries_with(&lab, other.ip),
        4,
        "other's 2 flows, both halves"
    );

    flush_fails(&lab, &[], "--all");
    flush_fails(&lab, &["--backend", "web-1"], "--backend web-1");
    flush_fails(&lab, &["--client", "nope"], "--client nope");
    flush_fails(
        &lab,
        &["--service", "default/nope"],
        "--service default/nope",
    );

    let client_ip = client.ip.to_string();
    let dry = flush(&lab, &["--client", &client_ip, "--dry-run"]);
    assert_eq!(dry["flushed"], 2, "{dry:#}");
    assert_eq!(dry["dry_run"], true);
    assert_eq!(
        entries_with(&lab, client.ip),
        4,
        "--dry-run removed something"
    );

    let done = flush(&lab, &["--client", &client_ip]);
    assert_eq!(done["flushed"], 2, "{done:#}");
    assert_eq!(done["entries"], 4, "{done:#}");
    let flows = done["flows"].as_array().unwrap();
    assert!(
        flows.iter().all(|f| f["client"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{client_ip}:"))),
        "{done:#}"
    );
    assert_eq!(
        entries_with(&lab, client.ip),
        0,
        "client's halves left behind"
    );
    assert_eq!(
        entries_with(&lab, other.ip),
        4,
        "other's flows were touched"
    );
    // The other client's connection is untouched: same backend, no reset.
    assert_eq!(
        o_tcp
            .request()
            .expect("other's connection after the flush")
            .backend,
        o_backend
    );

    // By service and port: only the other client's UDP flow.
    let done = flush(&lab, &["--service", "default/web:dns"]);
    assert_eq!(done["flushed"], 1, "{done:#}");
    assert_eq!(done["flows"][0]["client"], format!("{}:41001", other.ip));
    assert_eq!(entries_with(&lab, other.ip), 2);

    // By backend: the other client's TCP flow is on `o_backend`.
    let b = pods.iter().find(|p| p.name == o_backend).unwrap();
    let done = flush(&lab, &["--backend", &format!("{}:{BACKEND_TCP}", b.ip)]);
    assert_eq!(done["flushed"], 1, "{done:#}");
    assert_eq!(
        done["flows"][0]["backend"],
        format!("{}:{BACKEND_TCP}", b.ip)
    );
    assert_eq!(entries_with(&lab, other.ip), 0);

    // Everything, after new traffic.
    client
        .udp_request(WEB_VIP, WEB_UDP, T, Some(41_002))
        .expect("client UDP again");
    let done = flush(&lab, &["--all"]);
    assert!(done["flushed"].as_u64().unwrap() >= 1, "{done:#}");
    assert!(lab.map_dump("LB_FLOWS_V3").is_empty(), "--all left entries");
}

/// `lbproxy --version` names the commit it was built from; shell completions and the man
/// pages come from the same command-line definition, so they know every subcommand.
#[test]
fn version_completions_and_man_pages() {
    let bin = lbproxy_bin();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&bin)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("lbproxy {args:?}: {e}"));
        assert!(
            out.status.success(),
            "lbproxy {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("UTF-8")
    };
    let version = run(&["--version"]);
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git rev-parse");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    assert!(
        version.starts_with("lbproxy ") && version.contains(&format!("(commit {head})")),
        "--version {version:?} does not name HEAD {head} (is LBPROXY_BIN built from this tree?)"
    );
    for shell in ["bash", "zsh", "fish"] {
        let script = run(&["completions", shell]);
        for word in ["inspect", "monitor", "flows", "flush", "bpffs-dir"] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
    let page = run(&["man"]);
    assert!(
        page.contains(".SH NAME") && page.contains("monitor"),
        "{page}"
    );
    let dir = std::env::temp_dir().join(format!("lbproxy-man-{}", std::process::id()));
    run(&["man", "--dir", dir.to_str().unwrap()]);
    for p in [
        "lbproxy.1",
        "lbproxy-run.1",
        "lbproxy-flows-flush.1",
        "lbproxy-monitor.1",
    ] {
        assert!(dir.join(p).exists(), "lbproxy man --dir wrote no {p}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `lbproxy inspect ARGS`: its stdout, or a panic with stderr.
fn inspect(lab: &Lab, args: &[&str]) -> String {
    let argv: Vec<&str> = ["inspect"]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    tool_ok(lab, &argv)
}

/// `inspect services -o yaml`, one backend per line with its state (ready, terminating
/// fallback, draining with its flows), `inspect affinity`, `inspect status` and `--watch`,
/// each showing what the test did.
#[test]
fn inspect_shows_backend_states_affinity_and_status() {
    let lab = Lab::new(Shape::Routed);
    let client = lab.add_pod("client");
    let (pods, _servers) = serving_pods(&lab, &["b1", "b2", "b3"]);
    let ep = |i: usize, c: Conditions| Endpoint::new(pods[i].ip, c).pod(&pods[i].name);
    let sticky_vip = vip(22);
    let manifest = |web: Vec<Endpoint>| {
        let sticky = web_objects("sticky", sticky_vip, vec![ep(2, Conditions::READY)])
            .to_yaml()
            .replace(
                "  sessionAffinity: None\n",
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: 600\n",
            );
        format!(
            "{}---\n{sticky}",
            merge([
                web_objects("web", WEB_VIP, web),
                web_objects(
                    "fallback",
                    vip(21),
                    vec![ep(1, Conditions::TERMINATING_SERVING)]
                ),
            ])
            .to_yaml()
        )
    };
    lab.write_manifest_text(&manifest(vec![ep(0, Conditions::READY)]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    assert!(
        manifest(vec![]).contains("sessionAffinity: ClientIP"),
        "the sticky service lost its affinity"
    );

    // A held connection to b1, then b1 turns not ready and b3 takes over: b1 drains.
    let mut conn = client.connect(WEB_VIP, WEB_TCP, T).expect("connect web");
    assert_eq!(conn.request().expect("request").backend, "b1");
    lab.write_manifest_text(&manifest(vec![
        ep(0, Conditions::NOT_READY),
        ep(2, Conditions::READY),
    ]));
    let state_of = |svc: &str, backend: &Pod| -> Option<String> {
        let yaml = inspect(&lab, &["services", "-o", "yaml"]);
        let rows: Vec<ServiceRow> = serde_saphyr::from_str(&yaml).unwrap_or_else(|e| {
            panic!("inspect services -o yaml is not YAML of service rows ({e}):\n{yaml}")
        });
        rows.into_iter()
            .filter(|r| r.service == svc && r.protocol == "TCP")
            .flat_map(|r| r.backends.into_iter().chain(r.draining))
            .find(|b| b.addr == backend.ip.to_string())
            .map(|b| match b.flows {
                Some(n) => format!("{} {n}", b.state.unwrap()),
                None => b.state.unwrap(),
            })
    };
    let drained = wait_for(Duration::from_secs(5), Duration::from_millis(100), || {
        (state_of("default/web", &pods[0]).as_deref() == Some("draining 1")).then_some(())
    });
    assert!(
        drained.is_ok(),
        "b1 not shown draining its one flow: {:?}\n{}",
        state_of("default/web", &pods[0]),
        inspect(&lab, &["services"])
    );
    assert_eq!(state_of("default/web", &pods[2]).as_deref(), Some("ready"));
    assert_eq!(
        state_of("default/fallback", &pods[1]).as_deref(),
        Some("terminating"),
        "the fallback service's only backend is terminating"
    );
    let table = inspect(&lab, &["services", "--service", "default/web"]);
    assert!(
        table.lines().next().unwrap().contains("BACKEND") && table.contains("STATE"),
        "{table}"
    );
    let lines: Vec<&str> = table.lines().filter(|l| l.contains(":80/TCP")).collect();
    assert_eq!(lines.len(), 2, "one line per backend:\n{table}");
    assert!(
        lines.iter().any(
            |l| l.contains(&format!("{}:8080", pods[0].ip)) && l.contains("draining (1 flows)")
        ),
        "{table}"
    );

    // Session affinity: the client's entry, active, with the service's timeout.
    client
        .tcp_request(sticky_vip, WEB_TCP, T)
        .expect("sticky request");
    let aff: Vec<AffinityRow> =
        serde_json::from_str(&inspect(&lab, &["affinity", "-o", "json"])).unwrap();
    let row = aff
        .iter()
        .find(|r| r.service == "default/sticky:http")
        .unwrap_or_else(|| panic!("no affinity entry for default/sticky:http: {aff:#?}"));
    assert_eq!(row.client, client.ip.to_string(), "{row:?}");
    assert_eq!(row.backend, format!("{}:8080", pods[2].ip), "{row:?}");
    assert_eq!(row.state, "active", "{row:?}");
    assert_eq!(row.timeout_seconds, 600, "{row:?}");
    assert!(row.idle_seconds < 10.0, "{row:?}");

    // Status: the controller's last sync, the client's interface, the flow table's fill.
    let st: Status = serde_json::from_str(&inspect(
        &lab,
        &["status", "-o", "json", "--healthz-address", HEALTHZ_ADDR],
    ))
    .unwrap();
    assert_eq!(st.healthy, Some(true), "{st:#?}");
    let age = st.sync_age_seconds.expect("sync age");
    assert!((0.0..60.0).contains(&age), "{st:#?}");
    let ifaces: Vec<&str> = st.interfaces.iter().map(|i| i.name.as_str()).collect();
    assert!(
        ifaces.iter().any(|i| i.starts_with(lab.if_prefix())),
        "no pod interface among {ifaces:?}"
    );
    let flows = st
        .maps
        .iter()
        .find(|m| m.map == "flows")
        .expect("flows map fill");
    assert!(flows.entries >= 2, "{flows:?}");
    assert!(flows.capacity > 0, "{flows:?}");
    // Without a controller to ask, it says so and still shows the maps.
    let st = inspect(&lab, &["status", "--healthz-address", "127.0.0.1:1"]);
    assert!(
        st.contains("controller: not reachable") && st.contains("MAP"),
        "{st}"
    );

    // --watch redraws until stopped.
    let dir = lab.bpffs_dir().display().to_string();
    let bin = lbproxy_bin();
    let mut child = lab
        .node_command(bin.to_str().unwrap())
        .args(["inspect", "drops", "--watch", "0.3", "--bpffs-dir", &dir])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.matches("REASON").count() >= 3,
        "--watch 0.3 drew the table fewer than 3 times in 1.2 s:\n{text}"
    );
}
