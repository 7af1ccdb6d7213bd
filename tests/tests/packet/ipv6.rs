//! IPv6: what the datapath must never touch, and DNAT and its reply through extension
//! headers.

use super::*;

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
        rig.lab
            .inspect_services()
            .iter()
            .any(|r| r.vip == hex6(VIP6) && !r.backends.is_empty())
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
