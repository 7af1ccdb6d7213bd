//! DNAT in `lb_from_pod`, reverse NAT in `lb_to_pod`.

use super::*;

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
            && flows[0].backend == format!("{BACKEND}:{BACKEND_TCP}")
            && flows[0].frontend == format!("{WEB_VIP}:{WEB_TCP}/TCP")
            && flows[0].state == "syn_sent",
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
        flows.len() == 1 && flows[0].state == "established",
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
            && flows[0].backend == format!("{c}:{BACKEND_TCP}")
            && flows[0].snat == Some(format!("{HAIRPIN}:{port}")),
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
                && flows[0].state == want
                && flows[0].reply_half
                && flows[0].backend == format!("{BACKEND}:{BACKEND_TCP}"),
            "want one {want} flow to {BACKEND}:{BACKEND_TCP} with its reply half, got {flows:#?}"
        );
        flows[0].age_seconds
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
