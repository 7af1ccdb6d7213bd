//! Packet-level tests: the real datapath programs, attached by a real `lbproxy run` to a lab
//! pod's host-side veth, run with `BPF_PROG_TEST_RUN` on hand-built Ethernet frames.
//!
//! Each test asserts the exact bytes that come out, the TC action the program returns and
//! exactly how the datapath's drop/reject counters (`lbproxy inspect drops --json`) moved.
//! Expected frames are built from scratch by [`lbproxy_tests::frames`], with every checksum
//! computed in full (RFC 1071) over the expected bytes, never by replaying the datapath's
//! incremental updates. `docs/datapath-verdicts.md` is the table these tests pin down: a
//! change of verdict fails a test here and must be written down there.
//!
//! The stack bypass stays off (its FIB lookups would depend on the lab's routes), so a
//! translated packet always goes on to the stack: `TC_ACT_UNSPEC`.

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::Duration;

use common::{
    BACKEND_TCP, BACKEND_UDP, HEALTHY_WITHIN, WEB_TCP, WEB_UDP, WEB_VIP, merge, web_objects,
};
// The frame builder is this file's vocabulary: its constants, headers and decoders.
use lbproxy_tests::frames::*;
use lbproxy_tests::lab::{
    Endpoint, Inspect as _, Lab, Lbproxy, Pod, Shape, bpf, pod_ip, run_in_ns, vip, wait_for,
};

// ---------------------------------------------------------------------------------------
// TC actions (include/uapi/linux/pkt_cls.h).

const TC_ACT_UNSPEC: i32 = -1;
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;
const TC_ACT_REDIRECT: i32 = 7;

fn tc_name(rc: i32) -> String {
    match rc {
        TC_ACT_UNSPEC => "TC_ACT_UNSPEC(-1)".into(),
        TC_ACT_OK => "TC_ACT_OK(0)".into(),
        TC_ACT_SHOT => "TC_ACT_SHOT(2)".into(),
        TC_ACT_REDIRECT => "TC_ACT_REDIRECT(7)".into(),
        n => format!("unknown({n})"),
    }
}

// ---------------------------------------------------------------------------------------
// The lab's addresses.

/// The only endpoint of the `web` service. No pod has this address: the programs only ever
/// write it into packets.
const BACKEND: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 99);
/// A service with both ports but no endpoints: every packet to it is rejected.
fn empty_vip() -> Ipv4Addr {
    vip(20)
}
/// A service whose only endpoint is the client pod itself: its flows are hairpin flows.
fn self_vip() -> Ipv4Addr {
    vip(21)
}
/// The source a pod sees on its hairpin flows (`lbproxy_common::HAIRPIN_ADDR`).
const HAIRPIN: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// Not a service and not a pod.
const ELSEWHERE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 77);

// ---------------------------------------------------------------------------------------
// The rig: a lab, lbproxy, and the programs on the client pod's interface.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prog {
    /// tcx ingress on the pod's host-side veth: packets leaving the pod.
    FromPod,
    /// tcx egress on the pod's host-side veth: packets entering the pod.
    ToPod,
}

impl Prog {
    fn name(self) -> &'static str {
        match self {
            Prog::FromPod => "lb_from_pod",
            Prog::ToPod => "lb_to_pod",
        }
    }
}

/// Counter deltas, only the reasons that moved.
type Drops = BTreeMap<String, u64>;

/// What one program run gave.
struct Outcome {
    what: String,
    input: Vec<u8>,
    rc: i32,
    out: Vec<u8>,
    drops: Drops,
}

impl Outcome {
    /// Panics, showing everything observed, unless the run returned `rc`, left exactly
    /// `want` and moved exactly the counters in `drops` (by the amounts given).
    fn expect(&self, rc: i32, want: &[u8], drops: &[(&str, u64)]) {
        let want_drops: Drops = drops.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
        if self.rc == rc && self.out == want && self.drops == want_drops {
            return;
        }
        let mut msg = format!("{}:\n", self.what);
        if self.rc != rc {
            let _ = writeln!(
                msg,
                "  verdict: got {}, want {}",
                tc_name(self.rc),
                tc_name(rc)
            );
        }
        if self.drops != want_drops {
            let _ = writeln!(
                msg,
                "  drop counters moved: got {:?}, want {:?}",
                self.drops, want_drops
            );
        }
        if self.out != want {
            let _ = writeln!(msg, "  output differs: {}", diff(&self.out, want));
            let _ = writeln!(msg, "  got:\n{}", describe(&self.out));
            let _ = writeln!(msg, "  want:\n{}", describe(want));
        } else {
            let _ = writeln!(msg, "  output as expected:\n{}", describe(&self.out));
        }
        let _ = write!(
            msg,
            "  input:\n{}\n  input bytes  {}\n  output bytes {}",
            describe(&self.input),
            hex(&self.input),
            hex(&self.out)
        );
        panic!("{msg}");
    }

    /// [`Self::expect`] for a frame that must come out exactly as it went in.
    fn expect_untouched(&self, rc: i32, drops: &[(&str, u64)]) {
        let input = self.input.clone();
        self.expect(rc, &input, drops);
    }
}

/// One lab with one client pod, lbproxy running with the `web` service (one endpoint,
/// [`BACKEND`]) and the `empty` service (no endpoints), and the ids of the programs it
/// attached to the client's host-side veth.
struct Rig {
    // Dropped before the lab, which then cleans up the pinned maps and links.
    lb: Lbproxy,
    lab: Lab,
    client: Pod,
    ifindex: u32,
    from_pod: u32,
    to_pod: u32,
    /// The counters as last read.
    counters: RefCell<BTreeMap<String, u64>>,
}

impl Rig {
    fn new() -> Rig {
        Rig::with_extra("")
    }

    /// [`Rig::new`], with `extra` (YAML documents, each starting with `---`) beside the
    /// rig's own services.
    fn with_extra(extra: &str) -> Rig {
        let lab = Lab::new(Shape::Routed);
        let client = lab.add_pod("client");
        let own = merge([
            web_objects("web", WEB_VIP, vec![Endpoint::ready(BACKEND)]),
            web_objects("empty", empty_vip(), vec![]),
            web_objects("self", self_vip(), vec![Endpoint::ready(client.ip)]),
        ]);
        lab.write_manifest_text(&format!("{}{extra}", own.to_yaml()));
        let mut lb = lab.start_lbproxy();
        lb.expect_healthy(HEALTHY_WITHIN);
        let found = wait_for(Duration::from_secs(5), Duration::from_millis(20), || {
            let att = lab.tcx_attachments();
            let find = |dir: &str, name: &str| {
                att.iter()
                    .find(|a| {
                        a.ifname == client.host_if && a.direction == dir && a.prog_name == name
                    })
                    .map(|a| (a.ifindex, a.prog_id))
            };
            match (find("ingress", "lb_from_pod"), find("egress", "lb_to_pod")) {
                (Some((ifindex, from)), Some((_, to))) => Some((ifindex, from, to)),
                _ => None,
            }
        });
        let ((ifindex, from_pod, to_pod), _) = found.unwrap_or_else(|waited| {
            panic!(
                "lbproxy did not attach lb_from_pod (tcx ingress) and lb_to_pod (tcx egress) to \
                 {} within {waited:?}; attachments: {:?}\n{}",
                client.host_if,
                lab.tcx_attachments(),
                lb.log()
            )
        });
        let rig = Rig {
            lb,
            lab,
            client,
            ifindex,
            from_pod,
            to_pod,
            counters: RefCell::new(BTreeMap::new()),
        };
        *rig.counters.borrow_mut() = rig.read_counters();
        assert!(
            rig.counters.borrow().values().all(|&n| n == 0),
            "fresh datapath, yet counters are not all zero: {:?}",
            rig.counters.borrow()
        );
        rig
    }

    fn client_ip(&self) -> Ipv4Addr {
        self.client.ip
    }

    fn read_counters(&self) -> BTreeMap<String, u64> {
        self.lab.drop_counts()
    }

    /// Runs `prog` once on `frame` and reads how the counters moved.
    fn run(&self, what: &str, prog: Prog, frame: &[u8]) -> Outcome {
        let id = match prog {
            Prog::FromPod => self.from_pod,
            Prog::ToPod => self.to_pod,
        };
        let r =
            bpf::prog_test_run(self.lab.node_ns(), id, self.ifindex, frame).unwrap_or_else(|e| {
                panic!(
                    "{what}: BPF_PROG_TEST_RUN of {} (prog id {id}) on {} bytes failed: {e}\n  {}",
                    prog.name(),
                    frame.len(),
                    hex(frame)
                )
            });
        let drops = self.take_deltas();
        Outcome {
            what: format!("{what} [{}]", prog.name()),
            input: frame.to_vec(),
            rc: r.retval,
            out: r.data,
            drops,
        }
    }

    /// Sends `frame` through the real veth so that `prog` sees it (from the pod's `eth0` for
    /// `lb_from_pod`, out of the host side for `lb_to_pod`, with an `AF_PACKET` socket), for
    /// frames `BPF_PROG_TEST_RUN` refuses to run. Returns the send's result and how the
    /// counters moved. A TC_ACT_SHOT at tcx egress makes the send itself fail with ENOBUFS
    /// (NET_XMIT_DROP); at the peer's ingress it is invisible to the sender.
    fn inject(&self, prog: Prog, frame: &[u8]) -> (Result<(), i32>, Drops) {
        let (ns, ifname) = match prog {
            Prog::FromPod => (self.client.netns.as_str(), "eth0"),
            Prog::ToPod => (self.lab.node_ns(), self.client.host_if.as_str()),
        };
        let sent =
            run_in_ns(ns, || send_raw(ifname, frame)).map_err(|e| e.raw_os_error().unwrap_or(-1));
        // The counters move while the frame crosses the veth; wait for the first change,
        // then a little longer so a second count would show too.
        let before = self.counters.borrow().clone();
        let _ = wait_for(Duration::from_secs(2), Duration::from_millis(10), || {
            (self.read_counters() != before).then_some(())
        });
        std::thread::sleep(Duration::from_millis(100));
        (sent, self.take_deltas())
    }

    /// How the counters moved since they were last read.
    fn take_deltas(&self) -> Drops {
        let now = self.read_counters();
        let before = self.counters.replace(now.clone());
        now.iter()
            .filter_map(|(k, &n)| {
                let was = before.get(k).copied().unwrap_or(0);
                let d = n
                    .checked_sub(was)
                    .unwrap_or_else(|| panic!("drop counter {k} went down: {was} -> {n}"));
                (d != 0).then(|| (k.clone(), d))
            })
            .collect()
    }

    /// The flows `lbproxy inspect flows --json` shows from `client_port` of the client.
    fn flows_from(&self, client_port: u16) -> Vec<serde_json::Value> {
        let client = format!("{}:{client_port}", self.client_ip());
        let v = self.lab.inspect_json("flows");
        v.as_array()
            .unwrap_or_else(|| panic!("inspect flows --json: not an array: {v}"))
            .iter()
            .filter(|f| f["client"] == client.as_str())
            .cloned()
            .collect()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "rig: client {} on {} (ifindex {}), lb_from_pod prog {}, lb_to_pod prog {}, \
                 lbproxy pid {}",
                self.client.ip,
                self.client.host_if,
                self.ifindex,
                self.from_pod,
                self.to_pod,
                self.lb.pid()
            );
        }
    }
}

/// Sends one raw Ethernet frame out of interface `ifname` of the calling thread's namespace.
fn send_raw(ifname: &str, frame: &[u8]) -> std::io::Result<()> {
    let name = std::ffi::CString::new(ifname).expect("interface name");
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Protocol 0: this socket only sends.
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = ifindex as i32;
    addr.sll_halen = 6;
    addr.sll_addr[..6].copy_from_slice(&frame[..6]);
    // SAFETY: `frame` and `addr` are valid for the lengths given.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    assert_eq!(n as usize, frame.len(), "AF_PACKET sent a partial frame");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 1-2. DNAT in lb_from_pod.

/// A TCP SYN and a UDP datagram to a frontend come out addressed to the backend's
/// ip:targetPort, with both checksums exactly right and every other byte as sent.
#[test]
fn dnat_tcp_syn_and_udp() {
    let rig = Rig::new();
    let c = rig.client_ip();

    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40001, WEB_TCP));
    let want = syn.with_dest(BACKEND, BACKEND_TCP).bytes();
    rig.run("TCP SYN to the VIP", Prog::FromPod, &syn.bytes())
        .expect(TC_ACT_UNSPEC, &want, &[]);

    let udp = Frame::udp(c, WEB_VIP, Udp::new(40002, WEB_UDP));
    let want = udp.with_dest(BACKEND, BACKEND_UDP).bytes();
    rig.run("UDP datagram to the VIP", Prog::FromPod, &udp.bytes())
        .expect(TC_ACT_UNSPEC, &want, &[]);

    // A segment with a payload and PSH|ACK: the whole segment is checksummed.
    let mut data = Tcp::new(40003, WEB_TCP, PSH | ACK);
    data.payload = b"GET / HTTP/1.1\r\n\r\n!".to_vec();
    let seg = Frame::tcp(c, WEB_VIP, data);
    let want = seg.with_dest(BACKEND, BACKEND_TCP).bytes();
    // No flow for it: it is sent to a backend all the same, and counted.
    rig.run(
        "TCP PSH|ACK with payload, no flow",
        Prog::FromPod,
        &seg.bytes(),
    )
    .expect(TC_ACT_UNSPEC, &want, &[("tcp_midstream_without_flow", 1)]);

    // Not a service: untouched, in both directions.
    let other = Frame::tcp(c, ELSEWHERE, Tcp::linux_syn(40004, WEB_TCP));
    rig.run(
        "TCP SYN to a non-service address",
        Prog::FromPod,
        &other.bytes(),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[]);
    let other = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40005, 81));
    rig.run(
        "TCP SYN to the VIP, on a port it does not serve",
        Prog::FromPod,
        &other.bytes(),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[]);
}

/// UDP checksum 0 means "no checksum" (RFC 768) and must stay 0 after DNAT; a checksum that
/// computes to 0 after DNAT must be sent as 0xffff.
#[test]
fn dnat_udp_checksum_zero_rules() {
    let rig = Rig::new();
    let c = rig.client_ip();

    let mut u = Udp::new(40011, WEB_UDP);
    u.no_csum = true;
    let f = Frame::udp(c, WEB_VIP, u);
    let input = f.bytes();
    assert_eq!(&input[40..42], &[0, 0], "test frame: UDP checksum not 0");
    let want = f.with_dest(BACKEND, BACKEND_UDP).bytes();
    rig.run("UDP with checksum 0 to the VIP", Prog::FromPod, &input)
        .expect(TC_ACT_UNSPEC, &want, &[]);

    // Choose the first payload word so that the translated datagram's sum is all ones:
    // with that word 0 the checksum is C, and adding C to the sum makes it 0xffff, whose
    // complement is 0, sent as 0xffff.
    let mut u = Udp::new(40012, WEB_UDP);
    u.payload[0..2].fill(0);
    let probe = Frame::udp(c, WEB_VIP, u.clone()).with_dest(BACKEND, BACKEND_UDP);
    let L4::Udp(pu) = &probe.l4 else {
        unreachable!()
    };
    let c0 = {
        let mut seg = pu.bytes(probe.ip.src, probe.ip.dst);
        seg[6..8].fill(0);
        l4_csum(probe.ip.src, probe.ip.dst, IPPROTO_UDP, &seg)
    };
    u.payload[0..2].copy_from_slice(&c0.to_be_bytes());
    let f = Frame::udp(c, WEB_VIP, u);
    let want = f.with_dest(BACKEND, BACKEND_UDP).bytes();
    let mut seg = want[34..].to_vec();
    seg[6..8].fill(0);
    assert_eq!(
        l4_csum(c, BACKEND, IPPROTO_UDP, &seg),
        0,
        "test frame: the translated checksum does not compute to 0"
    );
    assert_eq!(&want[40..42], &[0xff, 0xff], "test frame: expected 0xffff");
    let input = f.bytes();
    assert_ne!(&input[40..42], &[0, 0], "test frame: input checksum is 0");
    rig.run(
        "UDP whose translated checksum computes to 0",
        Prog::FromPod,
        &input,
    )
    .expect(TC_ACT_UNSPEC, &want, &[]);
}

// ---------------------------------------------------------------------------------------
// 3. Reverse NAT in lb_to_pod.

/// After a client's SYN created the flow, the backend's SYN-ACK going into the client pod
/// comes out from VIP:port, checksums exact; the flow moves from syn_sent to established.
#[test]
fn rev_nat_tcp() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let port = 40021;

    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(port, WEB_TCP));
    rig.run("client SYN", Prog::FromPod, &syn.bytes()).expect(
        TC_ACT_UNSPEC,
        &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
        &[],
    );
    let flows = rig.flows_from(port);
    assert!(
        flows.len() == 1
            && flows[0]["backend"] == format!("{BACKEND}:{BACKEND_TCP}").as_str()
            && flows[0]["frontend"] == format!("{WEB_VIP}:{WEB_TCP}/TCP").as_str()
            && flows[0]["state"] == "syn_sent",
        "after the SYN: want one syn_sent flow to {BACKEND}:{BACKEND_TCP}, got {flows:#?}"
    );

    // The backend answers from its own address; the stack sends it into the client pod.
    let mut sa = Tcp::linux_syn(BACKEND_TCP, port);
    sa.flags = SYN | ACK;
    sa.seq = 0x7a69_0000;
    sa.ack = syn.tcp_hdr().seq.wrapping_add(1);
    let mut synack = Frame::tcp(BACKEND, c, sa);
    (synack.dst_mac, synack.src_mac) = (POD_MAC, GW_MAC);
    synack.ip.id = 0;
    rig.run("backend SYN-ACK", Prog::ToPod, &synack.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &synack.with_source(WEB_VIP, WEB_TCP).bytes(),
            &[],
        );
    let flows = rig.flows_from(port);
    assert!(
        flows.len() == 1 && flows[0]["state"] == "established",
        "after the SYN-ACK: want the flow established, got {flows:#?}"
    );

    // The same packet to another client port has no flow: untouched.
    let stray = synack.with_dest(c, port + 1);
    rig.run("backend packet without a flow", Prog::ToPod, &stray.bytes())
        .expect_untouched(TC_ACT_UNSPEC, &[]);
    // lb_from_pod leaves a reply alone when the bypass is off: lb_to_pod translates it.
    rig.run(
        "backend SYN-ACK through lb_from_pod",
        Prog::FromPod,
        &synack.bytes(),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[]);
}

/// Hairpin (issue 12): the client is its own backend. Its SYN comes out as a packet from
/// `HAIRPIN` (its own port) to itself, and its SYN-ACK to `HAIRPIN` comes out from the VIP
/// to the client's port: each with the MACs swapped and the TTL one less, as the node's hop
/// back out of the pod's interface would leave them, checksums exact, and redirected
/// (`TC_ACT_REDIRECT`, `bpf_redirect_peer`) back into the pod instead of going to the stack.
/// The same reply to `HAIRPIN` from another source, or on a port with no flow, is left alone.
#[test]
fn hairpin_sent_back_into_the_pod() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let port = 40071;
    let back = |f: Frame| {
        let mut f = f;
        (f.dst_mac, f.src_mac) = (f.src_mac, f.dst_mac);
        f.ip.ttl -= 1;
        f
    };

    let syn = Frame::tcp(c, self_vip(), Tcp::linux_syn(port, WEB_TCP));
    let want = back(syn.with_dest(c, BACKEND_TCP).with_source(HAIRPIN, port));
    rig.run("hairpin SYN", Prog::FromPod, &syn.bytes())
        .expect(TC_ACT_REDIRECT, &want.bytes(), &[]);
    let flows = rig.flows_from(port);
    assert!(
        flows.len() == 1
            && flows[0]["backend"] == format!("{c}:{BACKEND_TCP}").as_str()
            && flows[0]["snat"] == format!("{HAIRPIN}:{port}").as_str(),
        "after the hairpin SYN: want one flow to {c}:{BACKEND_TCP} seen from {HAIRPIN}:{port}, \
         got {flows:#?}"
    );

    let mut sa = Tcp::linux_syn(BACKEND_TCP, port);
    sa.flags = SYN | ACK;
    sa.ack = syn.tcp_hdr().seq.wrapping_add(1);
    let synack = Frame::tcp(c, HAIRPIN, sa);
    let want = back(synack.with_source(self_vip(), WEB_TCP).with_dest(c, port));
    rig.run("hairpin SYN-ACK", Prog::FromPod, &synack.bytes())
        .expect(TC_ACT_REDIRECT, &want.bytes(), &[]);

    rig.run(
        "a packet to HAIRPIN on a port with no flow",
        Prog::FromPod,
        &synack.with_dest(HAIRPIN, port + 1).bytes(),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[]);
    rig.run(
        "the hairpin SYN-ACK from an address the node does not route to the pod",
        Prog::FromPod,
        &synack.with_source(ELSEWHERE, BACKEND_TCP).bytes(),
    )
    .expect_untouched(TC_ACT_SHOT, &[("spoofed_source", 1)]);
}

/// A client port reused after its flow closed (FINs both ways), towards the same backend:
/// the new SYN starts a new flow in the old one's halves (`flow::reopen`). It is translated
/// as before, the flow is syn_sent again with neither half's FIN left (else the collector
/// would expire it as closed), its age starts over, and the new SYN-ACK makes it
/// established, with no half recreated or replaced.
#[test]
fn port_reused_after_close_starts_over() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let port = 40061;
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(port, WEB_TCP));
    let mut sa = Tcp::linux_syn(BACKEND_TCP, port);
    sa.flags = SYN | ACK;
    let mut synack = Frame::tcp(BACKEND, c, sa);
    (synack.dst_mac, synack.src_mac) = (POD_MAC, GW_MAC);
    let fin = Frame::tcp(c, WEB_VIP, Tcp::new(port, WEB_TCP, FIN | ACK));
    let mut back_fin = Frame::tcp(BACKEND, c, Tcp::new(BACKEND_TCP, port, FIN | ACK));
    (back_fin.dst_mac, back_fin.src_mac) = (POD_MAC, GW_MAC);
    let state = |want: &str| {
        let flows = rig.flows_from(port);
        assert!(
            flows.len() == 1
                && flows[0]["state"] == want
                && flows[0]["reply_half"] == true
                && flows[0]["backend"] == format!("{BACKEND}:{BACKEND_TCP}").as_str(),
            "want one {want} flow to {BACKEND}:{BACKEND_TCP} with its reply half, got {flows:#?}"
        );
        flows[0]["age_seconds"].as_f64().unwrap_or(f64::NAN)
    };

    for (what, prog, frame, want) in [
        (
            "client SYN",
            Prog::FromPod,
            &syn,
            syn.with_dest(BACKEND, BACKEND_TCP),
        ),
        (
            "backend SYN-ACK",
            Prog::ToPod,
            &synack,
            synack.with_source(WEB_VIP, WEB_TCP),
        ),
        (
            "client FIN",
            Prog::FromPod,
            &fin,
            fin.with_dest(BACKEND, BACKEND_TCP),
        ),
        (
            "backend FIN",
            Prog::ToPod,
            &back_fin,
            back_fin.with_source(WEB_VIP, WEB_TCP),
        ),
    ] {
        rig.run(what, prog, &frame.bytes())
            .expect(TC_ACT_UNSPEC, &want.bytes(), &[]);
    }
    let closed_age = state("closed");
    std::thread::sleep(Duration::from_millis(600));

    rig.run("client SYN on the reused port", Prog::FromPod, &syn.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );
    let age = state("syn_sent");
    assert!(
        age < closed_age + 0.5,
        "the reopened flow's age did not start over: {age:.3} s, {closed_age:.3} s before the \
         600 ms pause"
    );
    rig.run(
        "backend SYN-ACK of the new connection",
        Prog::ToPod,
        &synack.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &synack.with_source(WEB_VIP, WEB_TCP).bytes(),
        &[],
    );
    state("established");
}

/// The same for UDP: the backend's answer comes out from VIP:53.
#[test]
fn rev_nat_udp() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let port = 40031;

    let q = Frame::udp(c, WEB_VIP, Udp::new(port, WEB_UDP));
    rig.run("client datagram", Prog::FromPod, &q.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &q.with_dest(BACKEND, BACKEND_UDP).bytes(),
            &[],
        );
    let mut a = Udp::new(BACKEND_UDP, port);
    a.payload = b"answer from the backend".to_vec();
    let mut answer = Frame::udp(BACKEND, c, a);
    (answer.dst_mac, answer.src_mac) = (POD_MAC, GW_MAC);
    rig.run("backend answer", Prog::ToPod, &answer.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &answer.with_source(WEB_VIP, WEB_UDP).bytes(),
            &[],
        );

    // A zero checksum stays zero on the way back too.
    let mut a = Udp::new(BACKEND_UDP, port);
    a.no_csum = true;
    let mut answer = Frame::udp(BACKEND, c, a);
    (answer.dst_mac, answer.src_mac) = (POD_MAC, GW_MAC);
    rig.run(
        "backend answer with checksum 0",
        Prog::ToPod,
        &answer.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &answer.with_source(WEB_VIP, WEB_UDP).bytes(),
        &[],
    );
}

// ---------------------------------------------------------------------------------------
// 4. Rejects: a service without endpoints answers at once.

/// A SYN to a service with no endpoints becomes a RST|ACK (seq 0, ack = ISN + 1) from the
/// VIP:port back to the client, redirected out of the interface it came in on.
#[test]
fn reject_tcp_syn_with_rst() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let syn = Frame::tcp(c, empty_vip(), Tcp::linux_syn(40041, WEB_TCP));
    let rule = rfc793_reset(syn.tcp_hdr()).unwrap();
    assert_eq!(rule, (0, 0x9a3b_c2d2, RST | ACK));
    let want = reset_frame(&syn, rule).bytes();
    assert_eq!(want.len(), 14 + 20 + 20);
    rig.run(
        "TCP SYN to a service without endpoints",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect(TC_ACT_REDIRECT, &want, &[("no_backend_tcp_reset", 1)]);
}

/// Every kind of segment to a service with no endpoints gets the RST RFC 793 gives it, except
/// a RST, which RFC 793 says to drop silently, and a segment whose header is shorter than 20
/// bytes (data offset below 5), which is malformed.
#[test]
fn reject_tcp_segment_kinds() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let cases: [(&str, u8, usize); 5] = [
        ("SYN with 10 bytes of data (TFO)", SYN, 10),
        ("ACK with 100 bytes of data", PSH | ACK, 100),
        ("FIN|ACK", FIN | ACK, 0),
        ("FIN|PSH without ACK, 3 bytes", FIN | PSH, 3),
        ("bare ACK", ACK, 0),
    ];
    for (i, (what, flags, payload)) in cases.into_iter().enumerate() {
        let mut t = Tcp::new(40051 + i as u16, WEB_TCP, flags);
        t.seq = 0xffff_fffa; // seq + length wraps for the SYN with data
        t.payload = vec![0xab; payload];
        let f = Frame::tcp(c, empty_vip(), t);
        let rule = rfc793_reset(f.tcp_hdr()).unwrap();
        let want = reset_frame(&f, rule).bytes();
        rig.run(
            &format!("{what} to a service without endpoints"),
            Prog::FromPod,
            &f.bytes(),
        )
        .expect(TC_ACT_REDIRECT, &want, &[("no_backend_tcp_reset", 1)]);
    }

    // A data offset of 4 (16 bytes, shorter than the fixed header): no header to translate
    // or answer (TCP itself drops such a segment), so it is dropped as malformed.
    let mut t = Tcp::new(40060, WEB_TCP, SYN);
    t.payload = vec![0xcd; 4];
    let f = Frame::tcp(c, empty_vip(), t);
    let bytes = with_tcp_doff(&f.bytes(), 4, c, empty_vip());
    rig.run(
        "SYN with TCP data offset 4 to a service without endpoints",
        Prog::FromPod,
        &bytes,
    )
    .expect_untouched(TC_ACT_SHOT, &[("malformed", 1)]);

    // RFC 793 drops an incoming RST without answering: so does the datapath.
    for (i, flags) in [RST, RST | ACK].into_iter().enumerate() {
        let f = Frame::tcp(c, empty_vip(), Tcp::new(40061 + i as u16, WEB_TCP, flags));
        assert_eq!(rfc793_reset(f.tcp_hdr()), None);
        rig.run(
            &format!("{} to a service without endpoints", tcp_flags(flags)),
            Prog::FromPod,
            &f.bytes(),
        )
        .expect_untouched(TC_ACT_SHOT, &[("reject_not_answered", 1)]);
    }
}

/// The ICMP port unreachable the datapath should answer `input` (a UDP datagram from
/// `client` to the endpoint-less VIP) with: from the VIP, quoting the IP header and the first
/// 8 bytes as sent, every checksum computed in full.
fn port_unreachable_for(input: &[u8], client: Ipv4Addr) -> Vec<u8> {
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 20 + 8]);
    let csum = inet_csum(&icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut ip = Ip::new(empty_vip(), client);
    ip.id = 0;
    Frame {
        dst_mac: POD_MAC,
        src_mac: GW_MAC,
        ip,
        l4: L4::Raw {
            proto: IPPROTO_ICMP,
            bytes: icmp,
        },
    }
    .bytes()
}

/// A UDP datagram to a service with no endpoints becomes an ICMP port unreachable from the
/// VIP, quoting the datagram's IP header and first 8 bytes (RFC 792, RFC 1122 3.2.2).
#[test]
fn reject_udp_with_icmp_port_unreachable() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let f = Frame::udp(c, empty_vip(), Udp::new(40071, WEB_UDP));
    let input = f.bytes();
    let want = port_unreachable_for(&input, c);
    assert_eq!(want.len(), 14 + 20 + 8 + 28);
    rig.run("UDP to a service without endpoints", Prog::FromPod, &input)
        .expect(
            TC_ACT_REDIRECT,
            &want,
            &[("no_backend_icmp_unreachable", 1)],
        );

    // Checksum 0 in the datagram changes nothing: the quote is the bytes as sent.
    let mut u = Udp::new(40072, WEB_UDP);
    u.no_csum = true;
    let f = Frame::udp(c, empty_vip(), u);
    let input = f.bytes();
    let want = port_unreachable_for(&input, c);
    rig.run(
        "UDP with checksum 0 to a service without endpoints",
        Prog::FromPod,
        &input,
    )
    .expect(
        TC_ACT_REDIRECT,
        &want,
        &[("no_backend_icmp_unreachable", 1)],
    );
}

// ---------------------------------------------------------------------------------------
// 5. Edge cases. Each verdict here is a row of docs/datapath-verdicts.md.

/// An IPv4 header cut short or with an impossible IHL is dropped and counted as `malformed`
/// by both programs (the stack drops it too). A TCP or UDP header cut short (or a TCP data
/// offset below 5) is dropped as `malformed` only by `lb_from_pod` and only when it is
/// addressed to a frontend (its ports are needed to tell); anything else passes untouched,
/// counted as `l4_header_bad_passed`: lbproxy never drops traffic that is not its own for
/// being hard to parse.
#[test]
fn edge_truncated_headers() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let syn = Frame::tcp(c, WEB_VIP, Tcp::new(40081, WEB_TCP, SYN)).bytes();
    let syn_elsewhere = Frame::tcp(c, ELSEWHERE, Tcp::new(40082, WEB_TCP, SYN)).bytes();
    let udp = Frame::udp(c, WEB_VIP, Udp::new(40083, WEB_UDP)).bytes();
    let udp_elsewhere = Frame::udp(c, ELSEWHERE, Udp::new(40084, WEB_UDP)).bytes();
    let mut ihl4 = syn.clone();
    ihl4[14] = 0x44;
    let mut ihl15 = syn.clone();
    ihl15[14] = 0x4f;
    for (what, frame) in [
        ("IPv4 IHL 4 (a 16-byte header)", ihl4),
        ("IPv4 IHL 15 (60 bytes) in a 40-byte packet", ihl15),
    ] {
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(what, prog, &frame)
                .expect_untouched(TC_ACT_SHOT, &[("malformed", 1)]);
        }
    }

    let doff4 = |frame: &[u8], dst| with_tcp_doff(frame, 4, c, dst);
    let to_frontend: Vec<(&str, Vec<u8>)> = vec![
        (
            "TCP header cut at 12 of 20 bytes, to a frontend",
            syn[..14 + 20 + 12].to_vec(),
        ),
        (
            "UDP header cut at 4 of 8 bytes, to a frontend",
            udp[..14 + 20 + 4].to_vec(),
        ),
        ("TCP data offset 4, to a frontend", doff4(&syn, WEB_VIP)),
    ];
    for (what, frame) in &to_frontend {
        rig.run(what, Prog::FromPod, frame)
            .expect_untouched(TC_ACT_SHOT, &[("malformed", 1)]);
        // lb_to_pod never looks frontends up: not its own either.
        rig.run(what, Prog::ToPod, frame)
            .expect_untouched(TC_ACT_UNSPEC, &[("l4_header_bad_passed", 1)]);
    }
    let not_ours: Vec<(&str, Vec<u8>)> = vec![
        (
            "TCP header cut at 12 of 20 bytes, to a non-service address",
            syn_elsewhere[..14 + 20 + 12].to_vec(),
        ),
        (
            "UDP header cut at 4 of 8 bytes, to a non-service address",
            udp_elsewhere[..14 + 20 + 4].to_vec(),
        ),
        (
            "TCP data offset 4, to a non-service address",
            doff4(&syn_elsewhere, ELSEWHERE),
        ),
        (
            "TCP header cut at 2 bytes (before the ports), to the VIP",
            syn[..14 + 20 + 2].to_vec(),
        ),
        (
            "UDP header cut at 3 bytes (before the ports), to the VIP",
            udp[..14 + 20 + 3].to_vec(),
        ),
        (
            "IPv4 header only, protocol TCP, to the VIP",
            syn[..14 + 20].to_vec(),
        ),
    ];
    for (what, frame) in &not_ours {
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(what, prog, frame)
                .expect_untouched(TC_ACT_UNSPEC, &[("l4_header_bad_passed", 1)]);
        }
    }

    // Shorter than an IPv4 header: BPF_PROG_TEST_RUN refuses these (see `rig_sanity`), so
    // they go through the real veth, and the verdict shows only as the counter (`malformed`
    // is counted only on the way to TC_ACT_SHOT).
    let cut: [(&str, &[u8]); 2] = [
        ("Ethernet header only, EtherType IPv4", &syn[..14]),
        ("IPv4 header cut at 12 of 20 bytes", &syn[..14 + 12]),
    ];
    for (what, frame) in cut {
        for (prog, send) in [(Prog::FromPod, Ok(())), (Prog::ToPod, Err(libc::ENOBUFS))] {
            let (sent, drops) = rig.inject(prog, frame);
            let want = Drops::from([("malformed".to_owned(), 1)]);
            assert!(
                sent == send && drops == want,
                "{what} [{}] sent on the veth: send {sent:?} (want {send:?}), drop counters \
                 moved {drops:?} (want {want:?})\n  {}",
                prog.name(),
                hex(frame)
            );
        }
    }
}

/// IPv4 options: translated correctly (the L4 header is found after them), but a reject
/// cannot be written, so the packet is dropped and counted as `reject_failed` only (no
/// answer was sent, so the reject's own counter does not move).
#[test]
fn edge_ipv4_options() {
    let rig = Rig::new();
    let c = rig.client_ip();
    // Router Alert (RFC 2113): 4 bytes, IHL 6.
    let options = vec![0x94, 0x04, 0x00, 0x00];

    let mut syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40091, WEB_TCP));
    syn.ip.options.clone_from(&options);
    rig.run(
        "TCP SYN with IP options to the VIP",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
        &[],
    );

    let mut udp = Frame::udp(c, WEB_VIP, Udp::new(40092, WEB_UDP));
    udp.ip.options.clone_from(&options);
    rig.run(
        "UDP with IP options to the VIP",
        Prog::FromPod,
        &udp.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &udp.with_dest(BACKEND, BACKEND_UDP).bytes(),
        &[],
    );

    // The reply direction too.
    let mut sa = Tcp::new(BACKEND_TCP, 40091, SYN | ACK);
    sa.ack = syn.tcp_hdr().seq.wrapping_add(1);
    let mut synack = Frame::tcp(BACKEND, c, sa);
    synack.ip.options.clone_from(&options);
    rig.run(
        "backend SYN-ACK with IP options",
        Prog::ToPod,
        &synack.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &synack.with_source(WEB_VIP, WEB_TCP).bytes(),
        &[],
    );

    let mut syn = Frame::tcp(c, empty_vip(), Tcp::linux_syn(40093, WEB_TCP));
    syn.ip.options.clone_from(&options);
    rig.run(
        "TCP SYN with IP options to a service without endpoints",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect_untouched(TC_ACT_SHOT, &[("reject_failed", 1)]);
    let mut udp = Frame::udp(c, empty_vip(), Udp::new(40094, WEB_UDP));
    udp.ip.options.clone_from(&options);
    rig.run(
        "UDP with IP options to a service without endpoints",
        Prog::FromPod,
        &udp.bytes(),
    )
    .expect_untouched(TC_ACT_SHOT, &[("reject_failed", 1)]);
}

/// IPv4 fragments, both directions. The first fragment (MF, offset 0) carries the ports: it
/// is translated like a whole datagram (its L4 checksum covers the whole datagram, so the
/// update is exact) and its ports are recorded. Each later fragment (offset > 0) gets the
/// recorded ports, so the same flow and backend: only its IP header is translated (address
/// and header checksum), its bytes are payload. A later fragment whose first was not seen
/// passes untouched, counted as `fragment_without_first`. A reject answers the first
/// fragment only.
#[test]
fn edge_fragments() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let port = 40101;
    // A 48-byte UDP datagram (8 header + 40 payload) in three fragments.
    let pieces = [(0, 24, true), (24, 40, true), (40, 48, false)];
    let mut u = Udp::new(port, WEB_UDP);
    u.payload = (0u8..40).collect();
    let sent = u.bytes(c, WEB_VIP);
    let translated = Udp {
        dport: BACKEND_UDP,
        ..u.clone()
    }
    .bytes(c, BACKEND);
    assert_eq!(sent[8..], translated[8..], "test datagram: payload differs");
    for (lo, hi, mf) in pieces {
        rig.run(
            &format!("UDP fragment at offset {lo} (MF {mf}) to the VIP"),
            Prog::FromPod,
            &fragment((c, WEB_VIP), IPPROTO_UDP, 0x1c46, mf, lo, &sent[lo..hi]),
        )
        .expect(
            TC_ACT_UNSPEC,
            &fragment(
                (c, BACKEND),
                IPPROTO_UDP,
                0x1c46,
                mf,
                lo,
                &translated[lo..hi],
            ),
            &[],
        );
    }
    let flows = rig.flows_from(port);
    assert!(
        flows.len() == 1 && flows[0]["backend"] == format!("{BACKEND}:{BACKEND_UDP}").as_str(),
        "after the fragments: want one flow to {BACKEND}:{BACKEND_UDP}, got {flows:#?}"
    );

    // The backend's answer, fragmented too, comes out from the VIP, every fragment.
    let mut a = Udp::new(BACKEND_UDP, port);
    a.payload = (100u8..140).collect();
    let answer = a.bytes(BACKEND, c);
    let answer_from_vip = Udp {
        sport: WEB_UDP,
        ..a.clone()
    }
    .bytes(WEB_VIP, c);
    for (lo, hi, mf) in pieces {
        rig.run(
            &format!("backend's UDP fragment at offset {lo} (MF {mf})"),
            Prog::ToPod,
            &fragment((BACKEND, c), IPPROTO_UDP, 0x2b01, mf, lo, &answer[lo..hi]),
        )
        .expect(
            TC_ACT_UNSPEC,
            &fragment(
                (WEB_VIP, c),
                IPPROTO_UDP,
                0x2b01,
                mf,
                lo,
                &answer_from_vip[lo..hi],
            ),
            &[],
        );
    }

    // A TCP SYN sent as a first fragment: translated like any SYN.
    let mut syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40102, WEB_TCP));
    (syn.ip.df, syn.ip.mf) = (false, true);
    rig.run(
        "TCP SYN as a first fragment (MF) to the VIP",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
        &[],
    );

    // A later fragment whose first fragment was never seen: its ports are unknown.
    let orphan = fragment((c, WEB_VIP), IPPROTO_UDP, 0x3c01, false, 24, &sent[24..]);
    for prog in [Prog::FromPod, Prog::ToPod] {
        rig.run(
            "UDP later fragment without a first, to the VIP",
            prog,
            &orphan,
        )
        .expect_untouched(TC_ACT_UNSPEC, &[("fragment_without_first", 1)]);
    }

    // Not a service: every fragment untouched, uncounted (the first one's ports are
    // recorded, so the later one is known).
    let mut u = Udp::new(40103, WEB_UDP);
    u.payload = (0u8..40).collect();
    let other = u.bytes(c, ELSEWHERE);
    for (lo, hi, mf) in pieces {
        let f = fragment((c, ELSEWHERE), IPPROTO_UDP, 0x4d01, mf, lo, &other[lo..hi]);
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(
                &format!("UDP fragment at offset {lo} to a non-service address"),
                prog,
                &f,
            )
            .expect_untouched(TC_ACT_UNSPEC, &[]);
        }
    }

    // A service without endpoints: the first fragment is answered (ICMP port unreachable
    // quoting it), a later one is not (it carries no header to quote or answer).
    let mut u = Udp::new(40104, WEB_UDP);
    u.payload = (0u8..40).collect();
    let refused = u.bytes(c, empty_vip());
    let first = fragment(
        (c, empty_vip()),
        IPPROTO_UDP,
        0x5e01,
        true,
        0,
        &refused[..24],
    );
    rig.run(
        "UDP first fragment to a service without endpoints",
        Prog::FromPod,
        &first,
    )
    .expect(
        TC_ACT_REDIRECT,
        &port_unreachable_for(&first, c),
        &[("no_backend_icmp_unreachable", 1)],
    );
    let later = fragment(
        (c, empty_vip()),
        IPPROTO_UDP,
        0x5e01,
        false,
        24,
        &refused[24..],
    );
    rig.run(
        "UDP later fragment to a service without endpoints",
        Prog::FromPod,
        &later,
    )
    .expect_untouched(TC_ACT_SHOT, &[("reject_not_answered", 1)]);
}

/// Frames that are not IPv4 pass untouched, uncounted, even when what they carry is addressed
/// to a frontend: other EtherTypes, a VLAN tag in the frame, IPv6, ARP.
#[test]
fn edge_not_ipv4() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40111, WEB_TCP)).bytes();

    let mut vlan = eth(GW_MAC, POD_MAC, ETH_P_8021Q);
    vlan.extend_from_slice(&[0x00, 0x64]); // VLAN 100
    vlan.extend_from_slice(&syn[12..]); // EtherType IPv4 and the packet

    let mut experimental = eth(GW_MAC, POD_MAC, ETH_P_EXPERIMENTAL);
    experimental.extend_from_slice(&syn[14..]);

    // IPv6 TCP SYN fd00::2 -> fd00::10 port 80 (checksum left 0: nothing reads it).
    let mut v6 = eth(GW_MAC, POD_MAC, ETH_P_IPV6);
    v6.extend_from_slice(&[0x60, 0, 0, 0, 0, 20, IPPROTO_TCP, 64]);
    v6.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    v6.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10]);
    v6.extend_from_slice(&Tcp::new(40112, WEB_TCP, SYN).bytes(c, WEB_VIP));

    // ARP who-has VIP tell client.
    let mut arp = eth([0xff; 6], POD_MAC, ETH_P_ARP);
    arp.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&POD_MAC);
    arp.extend_from_slice(&c.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&WEB_VIP.octets());

    let cases: [(&str, Vec<u8>); 5] = [
        ("802.1Q-tagged TCP SYN to the VIP", vlan),
        ("unknown EtherType 0x88b5", experimental),
        (
            "unknown EtherType 0x88b5, Ethernet header only",
            eth(GW_MAC, POD_MAC, ETH_P_EXPERIMENTAL),
        ),
        ("IPv6 TCP SYN", v6),
        ("ARP request for the VIP", arp),
    ];
    for (what, frame) in &cases {
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(what, prog, frame)
                .expect_untouched(TC_ACT_UNSPEC, &[]);
        }
    }

    // On the real veth the stack takes the tag out of the frame (into skb->vlan_tci) before
    // tcx ingress, so lb_from_pod does see the inner SYN there: it creates a flow.
    let port = 40113;
    let mut tagged = eth(GW_MAC, POD_MAC, ETH_P_8021Q);
    tagged.extend_from_slice(&[0x00, 0x64]);
    tagged.extend_from_slice(&Frame::tcp(c, WEB_VIP, Tcp::linux_syn(port, WEB_TCP)).bytes()[12..]);
    run_in_ns(&rig.client.netns, || send_raw("eth0", &tagged))
        .unwrap_or_else(|e| panic!("AF_PACKET send of the tagged SYN from the pod: {e}"));
    let flows = wait_for(Duration::from_secs(2), Duration::from_millis(20), || {
        let f = rig.flows_from(port);
        (!f.is_empty()).then_some(f)
    });
    let backend = format!("{BACKEND}:{BACKEND_TCP}");
    assert!(
        matches!(&flows, Ok((f, _)) if f.len() == 1 && f[0]["backend"] == backend.as_str()),
        "802.1Q-tagged SYN from the pod through the veth: want one flow to {backend}, got \
         {flows:?}"
    );
    let drops = rig.take_deltas();
    assert!(
        drops.is_empty(),
        "802.1Q-tagged SYN through the veth: drop counters moved {drops:?}"
    );
}

/// IPv6 of every kind the datapath must never touch, with or without extension headers:
/// neighbour discovery, link-local traffic, ICMPv6, and TCP or UDP behind hop-by-hop,
/// routing, destination-options and fragment headers, some to the address a service's IPv6
/// frontend would have. Until lbproxy serves IPv6, every one passes both programs untouched
/// and uncounted; when it does, these stay the frames that must still pass (issue 14).
#[test]
fn edge_ipv6_never_touched() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let link_local = |last: u8| {
        let mut a = [0u8; 16];
        a[0] = 0xfe;
        a[1] = 0x80;
        a[15] = last;
        a
    };
    let ula = |last: u8| {
        let mut a = [0u8; 16];
        a[0] = 0xfd;
        a[15] = last;
        a
    };
    let solicited_node = {
        let mut a = [0u8; 16];
        a[0] = 0xff;
        a[1] = 0x02;
        a[11] = 1;
        a[12] = 0xff;
        a[15] = 1;
        a
    };
    const NEXT_HOP_BY_HOP: u8 = 0;
    const NEXT_ROUTING: u8 = 43;
    const NEXT_FRAGMENT: u8 = 44;
    const NEXT_ICMPV6: u8 = 58;
    const NEXT_DEST_OPTS: u8 = 60;
    // Checksums are left as built: nothing may read, let alone fix, them.
    let tcp = Tcp::new(40120, WEB_TCP, SYN).bytes(c, WEB_VIP);
    let udp = Udp::new(40121, WEB_UDP).bytes(c, WEB_VIP);
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&link_local(1));
    ns.extend_from_slice(&[1, 1]);
    ns.extend_from_slice(&POD_MAC);
    let rs = vec![133, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 0, 0xc6, 0x12, 0, 2];
    let echo = vec![128, 0, 0, 0, 0x12, 0x34, 0, 1, b'p', b'i', b'n', b'g'];
    let chain = |exts: &[u8], upper: &[u8]| [exts, upper].concat();
    let mut routing = vec![NEXT_DEST_OPTS, 2, 0, 0, 0, 0, 0, 0];
    routing.extend_from_slice(&ula(7)); // type 0 routing, one address (deprecated, still parsed)
    let first_fragment = |upper: &[u8], next: u8| {
        let mut h = vec![next, 0, 0, 1]; // offset 0, M set
        h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
        [h.as_slice(), upper].concat()
    };
    let later_fragment = {
        let mut h = vec![IPPROTO_UDP, 0, 0x00, 0x10]; // offset 2 (16 bytes), last
        h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
        h.extend_from_slice(&[0xab; 16]);
        h
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "neighbour solicitation, link-local to solicited-node multicast",
            ipv6(link_local(2), solicited_node, NEXT_ICMPV6, &ns),
        ),
        (
            "neighbour solicitation behind a hop-by-hop header",
            ipv6(
                link_local(2),
                solicited_node,
                NEXT_HOP_BY_HOP,
                &chain(&ext8(NEXT_ICMPV6), &ns),
            ),
        ),
        (
            "router solicitation to ff02::2",
            ipv6(
                link_local(2),
                {
                    let mut a = solicited_node;
                    a[11] = 0;
                    a[12] = 0;
                    a[15] = 2;
                    a
                },
                NEXT_ICMPV6,
                &rs,
            ),
        ),
        (
            "ICMPv6 echo request",
            ipv6(ula(2), ula(0x10), NEXT_ICMPV6, &echo),
        ),
        (
            "link-local TCP SYN",
            ipv6(link_local(2), link_local(1), IPPROTO_TCP, &tcp),
        ),
        ("TCP SYN", ipv6(ula(2), ula(0x10), IPPROTO_TCP, &tcp)),
        ("UDP", ipv6(ula(2), ula(0x10), IPPROTO_UDP, &udp)),
        (
            "TCP SYN behind hop-by-hop and destination options",
            ipv6(
                ula(2),
                ula(0x10),
                NEXT_HOP_BY_HOP,
                &chain(&[ext8(NEXT_DEST_OPTS), ext8(IPPROTO_TCP)].concat(), &tcp),
            ),
        ),
        (
            "UDP behind a routing header and destination options",
            ipv6(
                ula(2),
                ula(0x10),
                NEXT_ROUTING,
                &chain(
                    &[routing.clone(), ext8(IPPROTO_UDP).to_vec()].concat(),
                    &udp,
                ),
            ),
        ),
        (
            "first fragment of a UDP datagram",
            ipv6(
                ula(2),
                ula(0x10),
                NEXT_FRAGMENT,
                &first_fragment(&udp, IPPROTO_UDP),
            ),
        ),
        (
            "later fragment (no UDP header)",
            ipv6(ula(2), ula(0x10), NEXT_FRAGMENT, &later_fragment),
        ),
        (
            "an unknown next header (253, for experiments) then TCP bytes",
            ipv6(ula(2), ula(0x10), 253, &chain(&ext8(IPPROTO_TCP), &tcp)),
        ),
        (
            "a chain of 10 destination-options headers, then UDP",
            ipv6(ula(2), ula(0x10), NEXT_DEST_OPTS, &{
                let mut h: Vec<u8> = Vec::new();
                for i in 0..10 {
                    h.extend_from_slice(&ext8(if i == 9 { IPPROTO_UDP } else { NEXT_DEST_OPTS }));
                }
                [h, udp.clone()].concat()
            }),
        ),
        (
            "UDP with checksum 0 (invalid in IPv6)",
            ipv6(ula(2), ula(0x10), IPPROTO_UDP, &{
                let mut u = udp.clone();
                u[6] = 0;
                u[7] = 0;
                u
            }),
        ),
    ];
    for (what, frame) in &cases {
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(&format!("IPv6: {what}"), prog, frame)
                .expect_untouched(TC_ACT_UNSPEC, &[]);
        }
    }
}

/// IPv6 TCP and UDP to an IPv6 ClusterIP, with and without extension headers: the frame
/// comes out with only the destination address and port changed to the backend's and the
/// L4 checksum right (computed here in full over the new pseudo-header), the extension
/// headers in place; the backend's reply comes out from the ClusterIP and port, checksum
/// right. Nothing is counted.
#[test]
fn ipv6_dnat_and_reply_through_extension_headers() {
    const VIP6: [u8; 16] = [
        0xfd, 0, 0xc6, 0x12, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
    ];
    const BACKEND6: [u8; 16] = [0xfd, 0, 0xc6, 0x12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x99];
    let hex6 = |a: [u8; 16]| std::net::Ipv6Addr::from(a).to_string();
    let extra = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web6, namespace: default}}\nspec:\n  clusterIP: \"{vip}\"\n  clusterIPs: [\"{vip}\"]\n  ipFamilies: [IPv6]\n  ports:\n  - {{name: http, port: {WEB_TCP}, protocol: TCP, targetPort: {BACKEND_TCP}}}\n  - {{name: dns, port: {WEB_UDP}, protocol: UDP, targetPort: {BACKEND_UDP}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web6-1, namespace: default, labels: {{kubernetes.io/service-name: web6}}}}\naddressType: IPv6\nports: [{{name: http, port: {BACKEND_TCP}, protocol: TCP}}, {{name: dns, port: {BACKEND_UDP}, protocol: UDP}}]\nendpoints: [{{addresses: [\"{backend}\"], conditions: {{ready: true}}}}]\n",
        vip = hex6(VIP6),
        backend = hex6(BACKEND6),
    );
    let rig = Rig::with_extra(&extra);
    let served = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        let rows = rig.lab.inspect_json("services");
        rows.as_array()?
            .iter()
            .any(|r| {
                r["vip"] == hex6(VIP6).as_str()
                    && r["backends"].as_array().is_some_and(|b| !b.is_empty())
            })
            .then_some(())
    });
    assert!(served.is_ok(), "the IPv6 frontend was never programmed");
    let client = rig.client.ip6.unwrap().octets();
    const NEXT_HOP_BY_HOP: u8 = 0;
    const NEXT_DEST_OPTS: u8 = 60;
    let v4 = rig.client_ip();
    let tcp = |sport: u16, dport: u16, flags: u8| Tcp::new(sport, dport, flags).bytes(v4, WEB_VIP);
    let udp = |sport: u16, dport: u16| Udp::new(sport, dport).bytes(v4, WEB_VIP);
    let exts = [ext8(NEXT_DEST_OPTS), ext8(IPPROTO_TCP)].concat();
    let exts_udp = ext8(IPPROTO_UDP).to_vec();
    // (what, first next header, extension headers, protocol, client segment, service port,
    // backend port)
    type Case = (&'static str, u8, Vec<u8>, u8, Vec<u8>, u16, u16);
    let cases: Vec<Case> = vec![
        (
            "TCP SYN",
            IPPROTO_TCP,
            vec![],
            IPPROTO_TCP,
            tcp(40130, WEB_TCP, SYN),
            WEB_TCP,
            BACKEND_TCP,
        ),
        (
            "TCP SYN behind hop-by-hop and destination options",
            NEXT_HOP_BY_HOP,
            exts,
            IPPROTO_TCP,
            tcp(40131, WEB_TCP, SYN),
            WEB_TCP,
            BACKEND_TCP,
        ),
        (
            "UDP",
            IPPROTO_UDP,
            vec![],
            IPPROTO_UDP,
            udp(40132, WEB_UDP),
            WEB_UDP,
            BACKEND_UDP,
        ),
        (
            "UDP behind destination options",
            NEXT_DEST_OPTS,
            exts_udp,
            IPPROTO_UDP,
            udp(40133, WEB_UDP),
            WEB_UDP,
            BACKEND_UDP,
        ),
    ];
    for (what, next, exts, proto, seg, svc_port, be_port) in cases {
        let sport = u16::from_be_bytes([seg[0], seg[1]]);
        let seg = with_csum6(seg, client, VIP6, proto);
        let input = ipv6(client, VIP6, next, &[exts.clone(), seg.clone()].concat());
        let want_seg = with_csum6(
            with_ports(seg.clone(), sport, be_port),
            client,
            BACKEND6,
            proto,
        );
        let want = ipv6(client, BACKEND6, next, &[exts.clone(), want_seg].concat());
        rig.run(
            &format!("IPv6 {what} to the ClusterIP"),
            Prog::FromPod,
            &input,
        )
        .expect(TC_ACT_UNSPEC, &want, &[]);
        // The backend answers (a SYN-ACK, or a datagram) without extension headers.
        let answer = if proto == IPPROTO_TCP {
            Tcp::new(be_port, sport, SYN | 0x10).bytes(v4, WEB_VIP)
        } else {
            Udp::new(be_port, sport).bytes(v4, WEB_VIP)
        };
        let reply = ipv6(
            BACKEND6,
            client,
            proto,
            &with_csum6(answer.clone(), BACKEND6, client, proto),
        );
        let want_reply = ipv6(
            VIP6,
            client,
            proto,
            &with_csum6(with_ports(answer, svc_port, sport), VIP6, client, proto),
        );
        rig.run(
            &format!("IPv6 {what}: the backend's answer"),
            Prog::ToPod,
            &reply,
        )
        .expect(TC_ACT_UNSPEC, &want_reply, &[]);
    }
}

/// IPv4 that is neither TCP nor UDP (ICMP, SCTP) passes untouched, uncounted; so does an IPv4
/// EtherType frame whose header has another version number.
#[test]
fn edge_ipv4_other_protocols_and_version() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let mut echo = vec![8, 0, 0, 0, 0x12, 0x34, 0, 1];
    echo.extend_from_slice(b"ping");
    let csum = inet_csum(&echo);
    echo[2..4].copy_from_slice(&csum.to_be_bytes());
    let icmp = Frame::from_pod(
        Ip::new(c, WEB_VIP),
        L4::Raw {
            proto: IPPROTO_ICMP,
            bytes: echo,
        },
    );
    // SCTP common header to port 80 and an INIT chunk; the CRC32c is not checked by anyone.
    let mut sctp_bytes = vec![0x9c, 0x41, 0x00, 0x50, 0, 0, 0, 0, 0, 0, 0, 0];
    sctp_bytes.extend_from_slice(&[
        1, 0, 0, 20, 0, 0, 0, 1, 0, 0, 0xff, 0xff, 0, 1, 0, 1, 0, 0, 0, 1,
    ]);
    let sctp = Frame::from_pod(
        Ip::new(c, WEB_VIP),
        L4::Raw {
            proto: IPPROTO_SCTP,
            bytes: sctp_bytes,
        },
    );
    for (what, frame) in [
        ("ICMP echo to the VIP", &icmp),
        ("SCTP INIT to the VIP:80", &sctp),
    ] {
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(what, prog, &frame.bytes())
                .expect_untouched(TC_ACT_UNSPEC, &[]);
        }
    }

    // Version 6 (or 5, or 0) in an IPv4 EtherType frame, otherwise a valid SYN to the VIP:
    // not IPv4, so not lbproxy's; the stack drops it.
    for version in [6, 5, 0] {
        let mut syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40121, WEB_TCP));
        syn.ip.version = version;
        for prog in [Prog::FromPod, Prog::ToPod] {
            rig.run(
                &format!("IPv4 EtherType, version {version} in the header, TCP SYN to the VIP"),
                prog,
                &syn.bytes(),
            )
            .expect_untouched(TC_ACT_UNSPEC, &[]);
        }
    }
}

/// The rig itself, and what `BPF_PROG_TEST_RUN` accepts: the kernel refuses a frame whose
/// EtherType is IPv4 but which is shorter than an IPv4 header (34 bytes), or IPv6 and shorter
/// than an IPv6 header (54 bytes), or shorter than an Ethernet header. Frames cut before
/// the end of the IP header therefore go through a real veth instead ([`Rig::inject`]).
#[test]
fn rig_sanity() {
    let rig = Rig::new();
    assert_eq!(rig.client_ip(), pod_ip(0));
    let syn = Frame::tcp(rig.client_ip(), WEB_VIP, Tcp::new(40131, WEB_TCP, SYN)).bytes();
    let mut v6 = syn.clone();
    v6[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
    let mut other = syn.clone();
    other[12..14].copy_from_slice(&ETH_P_EXPERIMENTAL.to_be_bytes());
    let cases: [(&str, &[u8], bool); 7] = [
        ("13 bytes", &other[..13], false),
        ("EtherType 0x88b5, 14 bytes", &other[..14], true),
        ("EtherType IPv4, 14 bytes", &syn[..14], false),
        ("EtherType IPv4, 33 bytes", &syn[..33], false),
        ("EtherType IPv4, 34 bytes", &syn[..34], true),
        ("EtherType IPv6, 53 bytes", &v6[..53], false),
        ("EtherType IPv6, 54 bytes", &v6[..54], true),
    ];
    for (what, frame, runs) in cases {
        let r = bpf::prog_test_run(rig.lab.node_ns(), rig.from_pod, rig.ifindex, frame);
        if runs {
            assert!(r.is_ok(), "BPF_PROG_TEST_RUN on {what}: {r:?}");
        } else {
            assert_eq!(
                r.as_ref().map_err(|e| e.raw_os_error()),
                Err(Some(libc::EINVAL)),
                "BPF_PROG_TEST_RUN on {what}: {r:?}"
            );
        }
    }
}
