//! lbproxy's ctnetlink module (`lbproxy::conntrack`) against the kernel, in the node
//! namespace of a lab of the test's own (no lbproxy running: the node translates with an
//! iptables DNAT rule, as kube-proxy would, or with entries the test writes).
//!
//! 1. **dump**: a TCP connection from a client pod to a VIP that a DNAT rule sends to
//!    backend b1 shows up in the dump with orig client -> VIP:80, reply b1:8080 -> client,
//!    `dnat()`, not `snat()`, ESTABLISHED, assured; the `conntrack` CLI sees the same entry.
//!    IPv4 and IPv6.
//! 2. **delete**: deleting it by its original tuple answers `true`, the next dump lacks it,
//!    and deleting it again answers `false`.
//! 3. **create translates**: with no DNAT rule, an entry written for client:port -> VIP:53
//!    with reply b1:5353 -> client:port makes the client's datagram from that port reach
//!    b1, and b1's answer come back from VIP:53 (a datagram from another port, with no
//!    entry, is not answered). Also masqueraded (reply b1:5353 -> node:masq_port: b1 sees
//!    the node's address). IPv4 and IPv6 (unmasqueraded).
//!    An entry's zone and mark are written and read back, and a delete is per zone.
//! 4. **hand-back of a live TCP connection**: an established connection's dumped entry,
//!    deleted and its DNAT rule removed, written back with `create` carries the
//!    connection's next request to b1 (mid-stream, no new handshake).
//! 5. **10,000 entries**: `create_many` writes 10,000 NAT'd entries, one dump returns all of
//!    them (a multi-part dump), `delete_many` removes them all; the times are printed.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use common::{T, iptables, pod_addr, vip_in};
use lbproxy::conntrack::{
    self as ct, Conntrack, Entry, IPPROTO_TCP, IPPROTO_UDP, IPS_ASSURED, IPS_CONFIRMED,
    IPS_DST_NAT, IPS_SEEN_REPLY, IPS_SRC_NAT, TCP_CONNTRACK_ESTABLISHED, Tuple,
};
use lbproxy_tests::lab::{
    Backend, Family, Lab, Pod, Shape, TcpConn, UPLINK_NODE_ADDR, run_in_ns, udp_request,
};

const VIP_TCP: u16 = 80;
const BACKEND_TCP: u16 = 8080;
const VIP_UDP: u16 = 53;
const BACKEND_UDP: u16 = 5353;

fn ct_family(family: Family) -> ct::Family {
    match family {
        Family::V4 => ct::Family::V4,
        Family::V6 => ct::Family::V6,
    }
}

/// A [`Conntrack`] socket in the lab's node namespace.
fn node_conntrack(lab: &Lab) -> Conntrack {
    run_in_ns(lab.node_ns(), Conntrack::open)
        .unwrap_or_else(|e| panic!("open conntrack in {}: {e}", lab.node_ns()))
}

/// `addr:port` as iptables' `--to-destination` wants it.
fn to_destination(addr: IpAddr, port: u16) -> String {
    SocketAddr::new(addr, port).to_string()
}

/// The node's `nat PREROUTING` DNAT rule `vip:VIP_TCP` -> `backend:BACKEND_TCP` (`-A` adds,
/// `-D` removes).
fn dnat_rule(lab: &Lab, family: Family, op: &str, vip: IpAddr, backend: IpAddr) {
    let vip = vip.to_string();
    let port = VIP_TCP.to_string();
    let to = to_destination(backend, BACKEND_TCP);
    let argv = [
        iptables(family),
        "-t",
        "nat",
        op,
        "PREROUTING",
        "-d",
        &vip,
        "-p",
        "tcp",
        "--dport",
        &port,
        "-j",
        "DNAT",
        "--to-destination",
        &to,
    ];
    lab.node_run(&argv)
        .unwrap_or_else(|e| panic!("DNAT rule {op}: {e}"));
}

/// The dumped entry whose original tuple is `orig`, if any.
fn find(c: &mut Conntrack, family: Family, orig: &Tuple) -> Option<Entry> {
    c.dump(ct_family(family))
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .find(|e| e.orig == *orig)
}

/// A lab with a client pod and b1 serving TCP 8080 and UDP 5353; the backend is dropped
/// before the lab.
struct Setup {
    _b1_srv: Backend,
    client: Pod,
    b1: Pod,
    lab: Lab,
}

/// The kernel tracks connections in a namespace only while a rule there uses conntrack,
/// and translates only while a NAT chain is hooked. So the node namespace gets a `nat`
/// chain of the test's own with a rule that only matches on conntrack state (and accepts
/// anyway), present whatever DNAT rules come and go: on a node, kube-proxy's chains are
/// that. Without it, deleting the last DNAT rule turns conntrack off, and created entries
/// do nothing.
fn hook_nat(lab: &Lab) {
    let chain = "{ type nat hook prerouting priority dstnat; policy accept; }";
    for argv in [
        &["nft", "add", "table", "inet", "lbt_ct"][..],
        &["nft", "add", "chain", "inet", "lbt_ct", "pre", chain][..],
        &[
            "nft", "add", "rule", "inet", "lbt_ct", "pre", "ct", "state", "invalid", "counter",
        ][..],
    ] {
        lab.node_run(argv).unwrap_or_else(|e| panic!("{e}"));
    }
}

fn setup() -> Setup {
    let lab = Lab::new(Shape::Routed);
    hook_nat(&lab);
    let client = lab.add_pod("client");
    let b1 = lab.add_pod("b1");
    let srv = b1.serve(&[BACKEND_TCP, BACKEND_UDP]);
    Setup {
        _b1_srv: srv,
        client,
        b1,
        lab,
    }
}

/// An established connection client -> vip:80 through the DNAT rule, answered by b1.
fn connect_through_dnat(s: &Setup, family: Family, vip: IpAddr) -> TcpConn {
    dnat_rule(&s.lab, family, "-A", vip, pod_addr(&s.b1, family));
    let mut conn = TcpConn::connect(&s.client.netns, vip, VIP_TCP, T)
        .unwrap_or_else(|e| panic!("[{family}] connect to {vip}:{VIP_TCP}: {e}"));
    let r = conn
        .request()
        .unwrap_or_else(|e| panic!("[{family}] request: {e}"));
    assert_eq!(r.backend, "b1", "[{family}] through the DNAT rule");
    conn
}

fn orig_of(conn: &TcpConn, family: Family, client: &Pod, vip: IpAddr) -> Tuple {
    Tuple {
        src: pod_addr(client, family),
        dst: vip,
        src_port: conn.local.port(),
        dst_port: VIP_TCP,
        proto: IPPROTO_TCP,
    }
}

/// 1 and 2.
fn dump_and_delete(family: Family) {
    let s = setup();
    let vip = vip_in(family, 10);
    let conn = connect_through_dnat(&s, family, vip);
    let orig = orig_of(&conn, family, &s.client, vip);
    let mut c = node_conntrack(&s.lab);

    let e = find(&mut c, family, &orig)
        .unwrap_or_else(|| panic!("[{family}] no entry for {orig} in the dump"));
    let want_reply = Tuple {
        src: pod_addr(&s.b1, family),
        dst: orig.src,
        src_port: BACKEND_TCP,
        dst_port: orig.src_port,
        proto: IPPROTO_TCP,
    };
    assert_eq!(e.reply, want_reply, "[{family}] reply tuple: {e:?}");
    assert!(e.dnat(), "[{family}] dnat(): {e:?}");
    assert!(!e.snat(), "[{family}] snat(): {e:?}");
    assert_eq!(
        e.tcp_state,
        Some(TCP_CONNTRACK_ESTABLISHED),
        "[{family}] {e:?}"
    );
    let bits = IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED;
    assert_eq!(e.status & bits, bits, "[{family}] status {:#x}", e.status);
    assert!(
        e.timeout_s > 3600,
        "[{family}] ESTABLISHED timeout {}",
        e.timeout_s
    );
    assert_eq!((e.mark, e.zone), (0, 0), "[{family}] {e:?}");

    // Cross-check with the conntrack CLI.
    let f = match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    };
    let sport = orig.src_port.to_string();
    let cli = s
        .lab
        .node_run(&["conntrack", "-L", "-f", f, "-p", "tcp", "--sport", &sport])
        .unwrap_or_else(|e| panic!("{e}"));
    let b1 = pod_addr(&s.b1, family).to_string();
    assert!(
        cli.contains("ESTABLISHED") && cli.contains(&format!("src={b1}")),
        "[{family}] conntrack -L: {cli}"
    );

    assert!(
        c.delete(&e.orig, e.zone).unwrap_or_else(|e| panic!("{e}")),
        "[{family}] delete of a present entry answers true"
    );
    assert_eq!(
        find(&mut c, family, &orig),
        None,
        "[{family}] gone after delete"
    );
    assert!(
        !c.delete(&e.orig, e.zone).unwrap_or_else(|e| panic!("{e}")),
        "[{family}] delete of an absent entry answers false"
    );
}

lbproxy_tests::both_families!(dump_and_delete);

/// A UDP entry for `client`:`sport` -> vip:53, translated to b1:5353 and, when `masq` is
/// given, masqueraded to that address and port.
fn udp_entry(s: &Setup, family: Family, sport: u16, masq: Option<(IpAddr, u16)>) -> Entry {
    let client = pod_addr(&s.client, family);
    let orig = Tuple {
        src: client,
        dst: vip_in(family, 10),
        src_port: sport,
        dst_port: VIP_UDP,
        proto: IPPROTO_UDP,
    };
    let (to, to_port) = masq.unwrap_or((client, sport));
    Entry {
        orig,
        reply: Tuple {
            src: pod_addr(&s.b1, family),
            dst: to,
            src_port: BACKEND_UDP,
            dst_port: to_port,
            proto: IPPROTO_UDP,
        },
        status: IPS_CONFIRMED | IPS_DST_NAT | if masq.is_some() { IPS_SRC_NAT } else { 0 },
        timeout_s: 120,
        tcp_state: None,
        mark: 0,
        zone: 0,
    }
}

/// Writes `e`, checks the dump shows it as written, and sends one datagram over it from
/// the client: it must reach b1, which sees `seen`, and come back from VIP:53.
fn create_and_send(s: &Setup, family: Family, e: &Entry, seen: SocketAddr) {
    let mut c = node_conntrack(&s.lab);
    c.create(e).unwrap_or_else(|err| panic!("[{family}] {err}"));
    let got = find(&mut c, family, &e.orig)
        .unwrap_or_else(|| panic!("[{family}] created {} not in the dump", e.orig));
    assert_eq!(got.reply, e.reply, "[{family}] reply as written: {got:?}");
    assert_eq!(got.dnat(), e.dnat(), "[{family}] {got:?}");
    assert_eq!(got.snat(), e.snat(), "[{family}] {got:?}");

    let (reply, from) = udp_request(
        &s.client.netns,
        e.orig.dst,
        VIP_UDP,
        T,
        Some(e.orig.src_port),
    )
    .unwrap_or_else(|err| panic!("[{family}] over the created {}: {err}", e.orig));
    assert_eq!(reply.backend, "b1", "[{family}] {reply}");
    assert_eq!(reply.client_seen, seen.to_string(), "[{family}] {reply}");
    assert_eq!(
        from,
        SocketAddr::new(e.orig.dst, VIP_UDP),
        "[{family}] answer's source"
    );
    assert!(
        c.delete(&e.orig, e.zone)
            .unwrap_or_else(|err| panic!("{err}")),
        "[{family}] the created entry deletes"
    );
}

/// 3.
fn create_translates(family: Family) {
    let s = setup();
    let vip = vip_in(family, 10);
    // Without an entry (and no rule) the VIP answers nothing.
    let none = udp_request(
        &s.client.netns,
        vip,
        VIP_UDP,
        Duration::from_millis(300),
        Some(21000),
    );
    assert!(
        none.is_err(),
        "[{family}] VIP answered without an entry: {none:?}"
    );

    let e = udp_entry(&s, family, 21001, None);
    create_and_send(&s, family, &e, SocketAddr::new(e.orig.src, e.orig.src_port));

    if family == Family::V4 {
        let masq = (IpAddr::from(UPLINK_NODE_ADDR), 61001);
        let e = udp_entry(&s, family, 21002, Some(masq));
        create_and_send(&s, family, &e, SocketAddr::new(masq.0, masq.1));
    }
}

lbproxy_tests::both_families!(create_translates);

/// 3b. An entry created in zone 5 is dumped with zone 5, is not deleted by its tuple in zone
/// 0, and is by its tuple in zone 5; its mark is kept.
#[test]
fn zone_and_mark_are_kept() {
    let s = setup();
    let mut e = udp_entry(&s, Family::V4, 22000, None);
    e.zone = 5;
    e.mark = 0x4000;
    let mut c = node_conntrack(&s.lab);
    c.create(&e).unwrap_or_else(|err| panic!("{err}"));
    let got = find(&mut c, Family::V4, &e.orig).unwrap_or_else(|| panic!("no {}", e.orig));
    assert_eq!((got.zone, got.mark), (5, 0x4000), "{got:?}");
    assert!(
        !c.delete(&e.orig, 0).unwrap_or_else(|err| panic!("{err}")),
        "zone 0 has none"
    );
    assert!(
        c.delete(&e.orig, 5).unwrap_or_else(|err| panic!("{err}")),
        "zone 5 has it"
    );
    assert_eq!(find(&mut c, Family::V4, &e.orig), None);
}

/// 4.
fn hand_back_live_tcp(family: Family) {
    let s = setup();
    let vip = vip_in(family, 10);
    let mut conn = connect_through_dnat(&s, family, vip);
    let orig = orig_of(&conn, family, &s.client, vip);
    let mut c = node_conntrack(&s.lab);
    let e = find(&mut c, family, &orig).unwrap_or_else(|| panic!("[{family}] no {orig}"));

    dnat_rule(&s.lab, family, "-D", vip, pod_addr(&s.b1, family));
    assert!(
        c.delete(&e.orig, e.zone)
            .unwrap_or_else(|err| panic!("{err}"))
    );
    c.create(&e)
        .unwrap_or_else(|err| panic!("[{family}] {err}"));
    let back = find(&mut c, family, &orig).unwrap_or_else(|| panic!("[{family}] no {orig}"));
    assert_eq!(back.reply, e.reply, "[{family}] {back:?}");
    assert_eq!(
        back.tcp_state,
        Some(TCP_CONNTRACK_ESTABLISHED),
        "[{family}] {back:?}"
    );

    let r = conn
        .request()
        .unwrap_or_else(|err| panic!("[{family}] request over the re-created entry: {err}"));
    assert_eq!(r.backend, "b1", "[{family}] {r}");
}

lbproxy_tests::both_families!(hand_back_live_tcp);

/// 5.
#[test]
fn ten_thousand_entries() {
    const N: usize = 10_000;
    let s = setup();
    let family = Family::V4;
    let vip = vip_in(family, 20);
    let entries: Vec<Entry> = (0..N)
        .map(|i| {
            // Each its own source port; half TCP, half UDP.
            let mut e = udp_entry(&s, family, 30_000 + i as u16, None);
            e.orig.dst = vip;
            if i % 2 == 0 {
                e.orig.proto = IPPROTO_TCP;
                e.reply.proto = IPPROTO_TCP;
                e.tcp_state = Some(TCP_CONNTRACK_ESTABLISHED);
                e.status |= IPS_SEEN_REPLY | IPS_ASSURED;
            }
            e
        })
        .collect();
    let mut c = node_conntrack(&s.lab);

    let t = Instant::now();
    let results = c.create_many(&entries).unwrap_or_else(|e| panic!("{e}"));
    let create = t.elapsed();
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .take(5)
        .collect();
    assert!(failed.is_empty(), "create_many: {failed:#?}");

    let t = Instant::now();
    let dumped: Vec<Entry> = c
        .dump(ct::Family::V4)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|e| e.orig.dst == vip)
        .collect();
    let dump = t.elapsed();
    assert_eq!(dumped.len(), N, "dump after create_many");
    assert!(dumped.iter().all(|e| e.dnat()), "every entry DNAT'd");

    let t = Instant::now();
    let items: Vec<(Tuple, u16)> = dumped.iter().map(|e| (e.orig, e.zone)).collect();
    let gone = c.delete_many(&items).unwrap_or_else(|e| panic!("{e}"));
    let delete = t.elapsed();
    assert_eq!(gone.iter().filter(|g| **g).count(), N, "delete_many");
    let left = c
        .dump(ct::Family::V4)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|e| e.orig.dst == vip)
        .count();
    assert_eq!(left, 0, "entries left after delete_many");
    eprintln!(
        "conntrack at {N} entries: create_many {create:?}, dump {dump:?}, delete_many {delete:?}"
    );
}
