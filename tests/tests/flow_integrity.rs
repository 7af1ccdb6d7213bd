//! Flow integrity (issue 10 §1, §2 half-close): the two halves of a flow, with real
//! `lbproxy run` and real sockets. Each test fails without the behaviour it names:
//! 1. [`tuple_clash`]: one client port towards two VIPs that share a backend. Without a
//!    second source port, the second connection is the first one's tuple at the backend
//!    (its SYN is answered for the first connection, and its reply entry overwrites the
//!    first's), so one of them breaks; for UDP the first socket's answers go to the second.
//! 2. [`half_close`]: the client sends its FIN and the backend answers 20 s later, after the
//!    backend set changed. A flow expired 10 s after the first FIN sends the client's ACKs
//!    to another backend, and the late answer stalls.
//! 3. [`stale_reply_direct`]: a direct connection to a pod on the tuple of a finished VIP
//!    flow. Without removing the old reply half, the pod's answers are rewritten to the VIP
//!    and never reach the direct socket.
//! 4. [`reply_half_recreated`]: the reply half of a live flow is deleted (as the LRU could);
//!    the next packet of the flow recreates it, so the answer still comes from the VIP.

mod common;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use lbproxy_tests::lab::Inspect as _;
use lbproxy_tests::lab::bpf;
use lbproxy_tests::lab::connect::PendingConnect;
use lbproxy_tests::lab::{
    EndpointSlice, Lab, Manifest, Pod, Protocol, Service, Shape, socket2_udp, vip,
};

both_shapes!(tuple_clash, stale_reply_direct, reply_half_recreated);

mod half_close {
    #[test]
    fn routed() {
        super::half_close(lbproxy_tests::lab::Shape::Routed)
    }
}

/// Fixed client source ports (below the ephemeral range, so nothing else takes them).
const SRC_CLASH_TCP: u16 = 21001;
const SRC_CLASH_UDP: u16 = 21002;
const SRC_STALE_TCP: u16 = 21011;
const SRC_STALE_UDP: u16 = 21012;
const SRC_HALF: u16 = 21021;
const SRC_HALF_CLOSE: u16 = 21031;

/// The second VIP of [`tuple_clash`], sharing `web`'s backend.
const VIP2: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);

/// A backend's answer line `"<identity> <client as seen>"`, split.
fn parse_reply(line: &str) -> (String, String) {
    let line = line.trim_end();
    let (id, seen) = line.split_once(' ').unwrap_or((line, ""));
    (id.to_string(), seen.to_string())
}

/// One request/answer on a connected stream.
fn ask(s: &TcpStream) -> std::io::Result<(String, String)> {
    s.set_read_timeout(Some(T))?;
    (&*s).write_all(b"hello\n")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other("connection closed"));
    }
    Ok(parse_reply(&line))
}

/// A connection from `src_port` to `dst`, made in `client`'s namespace; panics with `ctx`.
fn connect_from(client: &Pod, src_port: u16, dst: SocketAddrV4, ctx: &str) -> TcpStream {
    let c = client
        .run(|| PendingConnect::start(src_port, dst))
        .unwrap_or_else(|e| panic!("{ctx}: connect :{src_port} -> {dst}: {e}"));
    c.wait_until(c.started + T)
        .unwrap_or_else(|e| panic!("{ctx}: connect :{src_port} -> {dst}: {e}"));
    c.into_stream(T)
}

/// A UDP socket on `src_port` (SO_REUSEADDR) connected to `dst`, in `client`'s namespace.
fn udp_connected(client: &Pod, src_port: u16, dst: SocketAddrV4) -> std::net::UdpSocket {
    let s = client
        .run(|| socket2_udp(src_port))
        .unwrap_or_else(|e| panic!("UDP socket on :{src_port}: {e}"));
    s.connect(dst)
        .unwrap_or_else(|e| panic!("UDP connect :{src_port} -> {dst}: {e}"));
    s
}

/// One UDP request/answer on a connected socket: the answer, or why there was none.
fn udp_ask(s: &std::net::UdpSocket) -> std::io::Result<(String, String)> {
    s.set_read_timeout(Some(T))?;
    s.send(b"hello\n")?;
    let mut buf = [0u8; 512];
    let n = s.recv(&mut buf)?;
    Ok(parse_reply(&String::from_utf8_lossy(&buf[..n])))
}

fn tuple_clash(shape: Shape) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let _srv = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest(&merge([
        web_objects("web", WEB_VIP, ready(&[&b1])),
        web_objects("web2", VIP2, ready(&[&b1])),
    ]));
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);

    // TCP: one source port, both VIPs, both connections open at once.
    let one = connect_from(
        &client,
        SRC_CLASH_TCP,
        SocketAddrV4::new(WEB_VIP, WEB_TCP),
        &format!("[{shape}] first"),
    );
    let (id1, seen1) = ask(&one).unwrap_or_else(|e| panic!("[{shape}] first connection: {e}"));
    let two = connect_from(
        &client,
        SRC_CLASH_TCP,
        SocketAddrV4::new(VIP2, WEB_TCP),
        &format!("[{shape}] second (same source port, other VIP)"),
    );
    let (id2, seen2) = ask(&two).unwrap_or_else(|e| {
        panic!(
            "[{shape}] second connection: {e}\nflows: {:#}\n{}",
            lab.inspect_json("flows"),
            lb.log()
        )
    });
    // The first connection still works, through its own VIP.
    let (id1b, seen1b) = ask(&one).unwrap_or_else(|e| {
        panic!(
            "[{shape}] first connection after the second opened: {e}\n{}",
            lb.log()
        )
    });
    assert_eq!(
        (id1.as_str(), id2.as_str(), id1b.as_str()),
        ("b1", "b1", "b1"),
        "[{shape}] every answer from b1"
    );
    assert_eq!(seen1, format!("{}:{SRC_CLASH_TCP}", client.ip));
    assert_eq!(
        seen1b, seen1,
        "[{shape}] the first connection kept its tuple"
    );
    assert_ne!(
        seen2, seen1,
        "[{shape}] the second connection must reach b1 from another source port"
    );
    for (s, vip_) in [(&one, WEB_VIP), (&two, VIP2)] {
        assert_eq!(
            s.peer_addr().unwrap(),
            SocketAddr::from((vip_, WEB_TCP)),
            "[{shape}] each socket talks to its own VIP"
        );
    }
    let flows = lab.inspect_flows();
    let rewritten: Vec<_> = flows
        .iter()
        .filter(|f| f.client_port_at_backend.is_some())
        .collect();
    assert_eq!(
        rewritten.len(),
        1,
        "[{shape}] inspect flows shows one flow with a rewritten port: {flows:#?}"
    );

    // UDP: two connected sockets on one port, one per VIP; each gets its own answer.
    let u1 = udp_connected(&client, SRC_CLASH_UDP, SocketAddrV4::new(WEB_VIP, WEB_UDP));
    let u2 = udp_connected(&client, SRC_CLASH_UDP, SocketAddrV4::new(VIP2, WEB_UDP));
    for round in 0..3 {
        let a1 = udp_ask(&u1);
        let a2 = udp_ask(&u2);
        let ok1 = matches!(&a1, Ok((id, _)) if id == "b1");
        let ok2 = matches!(&a2, Ok((id, _)) if id == "b1");
        assert!(
            ok1 && ok2,
            "[{shape}] UDP round {round}: via {WEB_VIP}: {a1:?}, via {VIP2}: {a2:?}\n{}",
            lb.log()
        );
    }
    assert!(
        lab.drop_count("tuple_clash_port_rewritten") >= 2,
        "[{shape}] the clashes are counted: {:#}",
        lab.inspect_json("drops")
    );
    assert!(
        lab.event_count("tuple_clash_port_rewritten") >= 2,
        "[{shape}] the clashes are counted as events: {:#}",
        lab.inspect_json("events")
    );
}

/// A server on `port` in `pod` that, for each of `n` connections, reads the request to EOF
/// (the client's FIN), waits for `go`, then sends `answer_len` bytes and closes.
fn late_answer_server(
    pod: &Pod,
    port: u16,
    n: usize,
    answer_len: usize,
    go: mpsc::Receiver<()>,
) -> std::thread::JoinHandle<Vec<String>> {
    let l = pod
        .run(|| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
        .unwrap_or_else(|e| panic!("bind :{port} in {}: {e}", pod.name));
    std::thread::spawn(move || {
        let mut conns = Vec::new();
        let mut log = Vec::new();
        for _ in 0..n {
            let (mut s, peer) = l.accept().expect("accept");
            let mut req = Vec::new();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let r = s.read_to_end(&mut req);
            log.push(format!("{peer}: request {} bytes, {r:?}", req.len()));
            conns.push(s);
        }
        let _ = go.recv_timeout(Duration::from_secs(60));
        let answer = vec![b'x'; answer_len];
        for mut s in conns {
            let r = s.write_all(&answer);
            log.push(format!("answer: {r:?}"));
        }
        log
    })
}

fn half_close(shape: Shape) {
    const PORT: u16 = 9090;
    const N: usize = 4;
    const ANSWER: usize = 256 * 1024;
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let pods: Vec<Pod> = (1..=8).map(|i| lab.add_pod(&format!("b{i}"))).collect();
    let late_vip = vip(12);
    let objects = |members: &[&Pod]| {
        let mut slice = EndpointSlice::new("late-1", "late").port("late", PORT, Protocol::Tcp);
        slice.endpoints = ready(members);
        Manifest::new()
            .with(Service::cluster_ip("late", late_vip).port("late", 81, Protocol::Tcp, PORT))
            .with(slice)
    };
    lab.write_manifest(&objects(&[&pods[0]]));
    let (go, wait) = mpsc::channel();
    let server = late_answer_server(&pods[0], PORT, N, ANSWER, wait);
    let mut lb = lab.start_lbproxy();
    let started = Instant::now();
    lb.expect_healthy(HEALTHY_WITHIN);

    let mut streams = Vec::new();
    for i in 0..N {
        let port = SRC_HALF_CLOSE + i as u16;
        let s = connect_from(
            &client,
            port,
            SocketAddrV4::new(late_vip, 81),
            &format!("[{shape}] connection {i}"),
        );
        (&s).write_all(b"request\n").unwrap();
        // The half-close: the client is done sending and waits for the answer.
        s.shutdown(Shutdown::Write).unwrap();
        streams.push(s);
    }
    // Past the second flow collection (every 10 s from the start), which finds the client's
    // FIN more than 10 s old; then the service grows, so a flow forgotten and selected
    // again by hash lands elsewhere.
    std::thread::sleep(
        (started + Duration::from_millis(21_500)).saturating_duration_since(Instant::now()),
    );
    let all: Vec<&Pod> = pods.iter().collect();
    lab.write_manifest(&objects(&all));
    std::thread::sleep(APPLY_WITHIN);
    let states = lab.inspect_flows();
    go.send(()).unwrap();
    for (i, s) in streams.iter().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let r = (&*s).read_to_end(&mut got);
        assert!(
            r.is_ok() && got.len() == ANSWER,
            "[{shape}] half-closed connection {i}: read {:?} after {} of {ANSWER} bytes \
             (flows before the answer: {states:#?})\n{}",
            r,
            got.len(),
            lb.log()
        );
    }
    let log = server.join().unwrap();
    assert_eq!(log.len(), 2 * N, "server: {log:?}");
    let half: Vec<_> = states.iter().filter(|f| f.state == "half_closed").collect();
    assert_eq!(
        half.len(),
        N,
        "[{shape}] inspect flows shows the half-closed flows: {states:#?}"
    );
}

fn stale_reply_direct(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();

    // TCP: a VIP connection from SRC_STALE_TCP, closed both ways.
    let via_vip = connect_from(
        &s.client,
        SRC_STALE_TCP,
        SocketAddrV4::new(WEB_VIP, WEB_TCP),
        &format!("[{shape}] via the VIP"),
    );
    ask(&via_vip).unwrap_or_else(|e| panic!("[{shape}] via the VIP: {e}"));
    via_vip.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    via_vip.set_read_timeout(Some(T)).unwrap();
    (&via_vip)
        .read_to_end(&mut rest)
        .expect("the backend closes too");
    drop(via_vip);
    // At once, the same source port straight to the pod.
    let direct = connect_from(
        &s.client,
        SRC_STALE_TCP,
        SocketAddrV4::new(b1.ip, BACKEND_TCP),
        &format!(
            "[{shape}] direct to the pod on the finished VIP flow's tuple (flows: {:#})",
            s.lab.inspect_json("flows")
        ),
    );
    let (id, seen) = ask(&direct).unwrap_or_else(|e| panic!("[{shape}] direct: {e}"));
    assert_eq!(
        (id.as_str(), seen),
        ("b1", format!("{}:{SRC_STALE_TCP}", s.client.ip))
    );

    // UDP: a VIP exchange from SRC_STALE_UDP, then the same port straight to the pod.
    let u = udp_connected(
        &s.client,
        SRC_STALE_UDP,
        SocketAddrV4::new(WEB_VIP, WEB_UDP),
    );
    udp_ask(&u).unwrap_or_else(|e| panic!("[{shape}] UDP via the VIP: {e}"));
    drop(u);
    s.client
        .run(|| lbproxy_tests::lab::wait_udp_port_released(SRC_STALE_UDP, Duration::from_secs(2)))
        .unwrap_or_else(|e| panic!("[{shape}] the client's socket: {e}"));
    let d = udp_connected(
        &s.client,
        SRC_STALE_UDP,
        SocketAddrV4::new(b1.ip, BACKEND_UDP),
    );
    let r = udp_ask(&d);
    assert!(
        matches!(&r, Ok((id, _)) if id == "b1"),
        "[{shape}] UDP direct to the pod on a VIP flow's tuple: {r:?} (a reply rewritten to \
         the VIP never reaches a socket connected to the pod)\n{}",
        s.lb.log()
    );
    assert!(
        s.lab.drop_count("stale_reply_removed") >= 2,
        "[{shape}] counted: {:#}",
        s.lab.inspect_json("drops")
    );
    assert!(
        s.lab.event_count("stale_reply_removed") >= 2,
        "[{shape}] counted as an event: {:#}",
        s.lab.inspect_json("events")
    );
}

/// The `LB_FLOWS_V3` key of the reply half of a flow from `client` to `backend`.
fn reply_key(backend: SocketAddrV4, client: SocketAddrV4, proto: u8) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[0..4].copy_from_slice(&backend.ip().octets());
    k[4..8].copy_from_slice(&client.ip().octets());
    k[8..10].copy_from_slice(&backend.port().to_be_bytes());
    k[10..12].copy_from_slice(&client.port().to_be_bytes());
    k[12] = proto;
    k[13] = 1; // FLOW_DIR_REPLY
    k
}

fn reply_half_recreated(shape: Shape) {
    let s = Setup::new(shape, &["b1"]);
    let b1 = s.backend("b1").clone();
    let conn = connect_from(
        &s.client,
        SRC_HALF,
        SocketAddrV4::new(WEB_VIP, WEB_TCP),
        &format!("[{shape}] connect"),
    );
    ask(&conn).unwrap_or_else(|e| panic!("[{shape}] first request: {e}"));
    let map = bpf::pinned_map(&s.lab.bpffs_dir().join("LB_FLOWS_V3"))
        .unwrap_or_else(|e| panic!("open LB_FLOWS_V3: {e}"));
    let key = reply_key(
        SocketAddrV4::new(b1.ip, BACKEND_TCP),
        SocketAddrV4::new(s.client.ip, SRC_HALF),
        6,
    );
    bpf::map_delete(&map, &key)
        .unwrap_or_else(|e| panic!("[{shape}] deleting the reply half: {e}"));
    let before = s.lab.drop_count("flow_half_recreated");
    let events_before = s.lab.event_count("flow_half_recreated");
    // The request recreates the reply half before the answer comes back.
    let r = ask(&conn);
    assert!(
        matches!(&r, Ok((id, _)) if id == "b1"),
        "[{shape}] request after the reply half was evicted: {r:?}\n{}",
        s.lb.log()
    );
    let mut v = [0u8; 48];
    bpf::map_lookup(&map, &key, &mut v)
        .unwrap_or_else(|e| panic!("[{shape}] the reply half is back: {e}"));
    assert_eq!(
        &v[0..4],
        &WEB_VIP.octets(),
        "[{shape}] the recreated reply half restores the VIP"
    );
    assert_eq!(
        s.lab.drop_count("flow_half_recreated"),
        before + 1,
        "[{shape}] counted once"
    );
    assert_eq!(
        s.lab.event_count("flow_half_recreated"),
        events_before + 1,
        "[{shape}] counted once as an event"
    );
}

mod v1_flows_are_migrated {
    #[test]
    fn routed() {
        super::flows_are_migrated(lbproxy_tests::lab::Shape::Routed, 1)
    }
}

mod v2_flows_are_migrated {
    #[test]
    fn routed() {
        super::flows_are_migrated(lbproxy_tests::lab::Shape::Routed, 2)
    }
}

/// CLOCK_MONOTONIC in ns, the flow table's clock.
fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes into the zeroed struct.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Hex bytes for bpftool.
fn hex(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An upgrade from a version with `LB_FLOWS_V1` (32-byte values) or `LB_FLOWS_V2` (40-byte
/// values, before source NAT): its flows are copied into `LB_FLOWS_V3` at start, both
/// halves, with the client's own address (and, from V1, port) as the peer, and a closed
/// flow (V1: CLOSING; V2: a FIN each way) still closed; the old map is unpinned.
fn flows_are_migrated(shape: Shape, version: u8) {
    let lab = Lab::new(shape);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let _srv = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    lab.write_manifest(&web_objects("web", WEB_VIP, ready(&[&b1])));
    let dir = lab.bpffs_dir().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    let old_name = format!("LB_FLOWS_V{version}");
    let v1 = dir.join(&old_name);
    let v1s = v1.display().to_string();
    let value_size = if version == 1 { 32 } else { 40 };
    let run = |args: &[&str]| {
        let out = std::process::Command::new("bpftool")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("bpftool {args:?}: {e}"));
        assert!(
            out.status.success(),
            "bpftool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "map",
        "create",
        &v1s,
        "type",
        "lru_hash",
        "key",
        "16",
        "value",
        &value_size.to_string(),
        "entries",
        "1024",
        "name",
        &old_name,
    ]);
    // (client port, V1 state): 2 = established, 3 = closing.
    for (port, state) in [(21041u16, 2u8), (21042, 3)] {
        let mut fk = [0u8; 16];
        fk[0..4].copy_from_slice(&client.ip.octets());
        fk[4..8].copy_from_slice(&WEB_VIP.octets());
        fk[8..10].copy_from_slice(&port.to_be_bytes());
        fk[10..12].copy_from_slice(&WEB_TCP.to_be_bytes());
        fk[12] = 6;
        let rk = reply_key(
            SocketAddrV4::new(b1.ip, BACKEND_TCP),
            SocketAddrV4::new(client.ip, port),
            6,
        );
        let value = |addr: Ipv4Addr, p: u16| {
            // Created and last seen now (the datapath's clock), so no collection at start
            // expires them.
            let now = monotonic_ns();
            if version == 1 {
                let mut v = vec![0u8; 32];
                v[0..4].copy_from_slice(&addr.octets());
                v[4..6].copy_from_slice(&p.to_be_bytes());
                v[6] = state;
                v[8..12].copy_from_slice(&1u32.to_ne_bytes());
                v[12..16].copy_from_slice(&1u32.to_ne_bytes());
                v[16..24].copy_from_slice(&now.to_ne_bytes());
                v[24..32].copy_from_slice(&now.to_ne_bytes());
                v
            } else {
                // nat, nat port, peer port (the client's own), state, flags (a FIN for
                // the "closing" flow), svc id, backend id, ifindex, created, last seen.
                let mut v = vec![0u8; 40];
                v[0..4].copy_from_slice(&addr.octets());
                v[4..6].copy_from_slice(&p.to_be_bytes());
                v[6..8].copy_from_slice(&port.to_be_bytes());
                v[8] = 2;
                v[9] = u8::from(state == 3);
                v[12..16].copy_from_slice(&1u32.to_ne_bytes());
                v[16..20].copy_from_slice(&1u32.to_ne_bytes());
                v[24..32].copy_from_slice(&now.to_ne_bytes());
                v[32..40].copy_from_slice(&now.to_ne_bytes());
                v
            }
        };
        for (k, v) in [
            (fk.to_vec(), value(b1.ip, BACKEND_TCP)),
            (rk.to_vec(), value(WEB_VIP, WEB_TCP)),
        ] {
            let mut args: Vec<String> = ["map", "update", "pinned", &v1s, "key", "hex"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            args.extend(hex(&k));
            args.extend(["value".to_string(), "hex".to_string()]);
            args.extend(hex(&v));
            run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }
    let mut lb = lab.start_lbproxy();
    lb.expect_healthy(HEALTHY_WITHIN);
    assert!(
        !v1.exists(),
        "[{shape}] {old_name} is unpinned after the migration"
    );
    let flows = lab.inspect_flows();
    let find = |port: u16| {
        flows
            .iter()
            .find(|f| f.client == format!("{}:{port}", client.ip))
            .unwrap_or_else(|| {
                panic!(
                    "[{shape}] flow from :{port} not migrated: {flows:#?}\n{}",
                    lb.log()
                )
            })
    };
    for (port, state) in [(21041u16, "established"), (21042, "closed")] {
        let f = find(port);
        assert_eq!(f.backend, format!("{}:{BACKEND_TCP}", b1.ip), "{f:#?}");
        assert_eq!(f.state, state, "[{shape}] {f:#?}");
        assert!(f.reply_half, "[{shape}] both halves migrated: {f:#?}");
        assert!(f.client_port_at_backend.is_none(), "[{shape}] {f:#?}");
    }
    assert!(
        lb.log()
            .contains(&format!("migrated {old_name} to LB_FLOWS_V3")),
        "[{shape}] the log says so:\n{}",
        lb.log()
    );
}
