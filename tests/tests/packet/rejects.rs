//! Rejects: a service without endpoints answers at once (RST, ICMP port unreachable).

use super::*;

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
pub(crate) fn port_unreachable_for(input: &[u8], client: Ipv4Addr) -> Vec<u8> {
    port_unreachable_from(input, empty_vip(), client)
}

/// [`port_unreachable_for`] a datagram to `vip`: the answer comes from `vip`.
pub(crate) fn port_unreachable_from(input: &[u8], vip: Ipv4Addr, client: Ipv4Addr) -> Vec<u8> {
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 20 + 8]);
    let csum = inet_csum(&icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut ip = Ip::new(vip, client);
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
