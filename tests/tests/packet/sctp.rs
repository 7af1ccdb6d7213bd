//! SCTP (issue 28, section 4): DNAT and reverse NAT of ClusterIPs from a pod, and of
//! NodePorts and externalIPs from outside the node, in both families; a flow's later packets
//! to its backend; the reject where there is no endpoint. This kernel has no SCTP sockets
//! (`socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP)` fails with EPROTONOSUPPORT), so SCTP is
//! tested here only, byte for byte: every expected packet carries the CRC32c computed in
//! full by the test's own bitwise CRC32c ([`crc32c`]), never the datapath's update.
//!
//! The ports always change (service port 99 or NodePort 30099 to targetPort 9999, and back),
//! so the CRC32c always changes; packets of several lengths (one chunk, several chunks,
//! 1,400 bytes) check that the update by difference holds whatever the length.

use std::net::{IpAddr, Ipv6Addr};

use super::*;

const SIG_PORT: u16 = 99;
const SIG_TARGET: u16 = 9999;
const SIG_NODE_PORT: u16 = 30099;
/// The ClusterIP of `sig` (two endpoints, [`BACKEND`] and [`BACKEND_B`]).
fn sig_vip() -> Ipv4Addr {
    vip(30)
}
/// The ClusterIP of `sigext`, which also has a NodePort and [`EXT_IP`]; its only endpoint
/// is the client pod, so from outside its backend is on this node.
fn sigext_vip() -> Ipv4Addr {
    vip(31)
}
/// The ClusterIP of `sigempty`: no endpoint.
fn sigempty_vip() -> Ipv4Addr {
    vip(32)
}
const BACKEND_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 98);
/// The endpoint that replaces the one a flow chose ([`drain_into`]).
const FRESH: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 97);
const FRESH6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, 0x97);
const EXT_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 30);
/// A client outside the node, behind the uplink.
const OUTSIDE: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 2);
/// The node's uplink address, where NodePorts are served.
const NODE_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 255, 1);

const SIG_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc613, 0, 0, 0, 0, 0, 0x30);
const SIGEMPTY_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc613, 0, 0, 0, 0, 0, 0x32);
const SIGEXT_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc613, 0, 0, 0, 0, 0, 0x31);
const BACKEND6_A: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, 0x99);
const BACKEND6_B: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0, 0, 0, 0, 0, 0x98);
const EXT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x30);
const OUTSIDE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 2);

/// An endpoint of an SCTP slice: ready, or (`false`) terminating but still serving, so that
/// it keeps its flows and gets no new one while another is ready (KEP-1669).
#[derive(Clone, Copy)]
struct Ep(IpAddr, bool);

/// A Service `name` of one family with SCTP port 99 -> 9999 (`extra`: more spec lines, each
/// starting with two spaces and ending with a newline) and its slice with `endpoints`.
fn sctp_service(name: &str, vip: IpAddr, extra: &str, endpoints: &[Ep]) -> String {
    let (family, q) = if vip.is_ipv4() {
        ("IPv4", "")
    } else {
        ("IPv6", "\"")
    };
    let eps: Vec<String> = endpoints
        .iter()
        .map(|Ep(a, ready)| {
            let conditions = if *ready {
                "ready: true"
            } else {
                "ready: false, serving: true, terminating: true"
            };
            format!("{{addresses: [\"{a}\"], conditions: {{{conditions}}}}}")
        })
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  clusterIP: {q}{vip}{q}\n  clusterIPs: [{q}{vip}{q}]\n  ipFamilies: [{family}]\n{extra}  ports:\n  - {{name: sig, port: {SIG_PORT}, protocol: SCTP, targetPort: {SIG_TARGET}NODEPORT}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: {family}\nports: [{{name: sig, port: {SIG_TARGET}, protocol: SCTP}}]\nendpoints: [{}]\n",
        eps.join(", ")
    )
}

/// The SCTP services of both families, `sig` and `sig6` over the endpoints given.
fn sctp_services(sig: &[Ep], sig6: &[Ep]) -> String {
    let client4 = IpAddr::V4(pod_ip(0));
    let client6 = IpAddr::V6(lbproxy_tests::lab::pod_ip6(0));
    let none = |s: String| s.replace("NODEPORT", "");
    [
        none(sctp_service("sig", sig_vip().into(), "", sig)),
        sctp_service(
            "sigext",
            sigext_vip().into(),
            &format!("  type: NodePort\n  externalIPs: [{EXT_IP}]\n"),
            &[Ep(client4, true)],
        )
        .replace("NODEPORT", &format!(", nodePort: {SIG_NODE_PORT}")),
        none(sctp_service("sigempty", sigempty_vip().into(), "", &[])),
        none(sctp_service("sig6", SIG_VIP6.into(), "", sig6)),
        none(sctp_service(
            "sigext6",
            SIGEXT_VIP6.into(),
            &format!("  externalIPs: [\"{EXT_IP6}\"]\n"),
            &[Ep(client6, true)],
        )),
        none(sctp_service("sigempty6", SIGEMPTY_VIP6.into(), "", &[])),
    ]
    .concat()
}

/// `sig`'s and `sig6`'s endpoints at the start: two ready backends each.
fn two_ready() -> (Vec<Ep>, Vec<Ep>) {
    (
        vec![Ep(BACKEND.into(), true), Ep(BACKEND_B.into(), true)],
        vec![Ep(BACKEND6_A.into(), true), Ep(BACKEND6_B.into(), true)],
    )
}

/// Rewrites `sig` (or `sig6`, for an IPv6 `chosen`) so that `chosen` is terminating and
/// `fresh` is the one ready endpoint, and waits until the datapath has it so: `chosen`
/// draining (its flows kept, no new one), `fresh` the one backend.
fn drain_into(rig: &Rig, chosen: IpAddr, fresh: IpAddr) {
    let (mut sig, mut sig6) = two_ready();
    let (list, vip) = if chosen.is_ipv4() {
        (&mut sig, sig_vip().to_string())
    } else {
        (&mut sig6, SIG_VIP6.to_string())
    };
    *list = vec![Ep(chosen, false), Ep(fresh, true)];
    rig.rewrite_extra(&sctp_services(&sig, &sig6));
    let done = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        rig.lab
            .inspect_services()
            .iter()
            .any(|r| {
                r.vip == vip
                    && r.protocol == "SCTP"
                    && r.backends.len() == 1
                    && r.backends[0].addr == fresh.to_string()
                    && r.draining.len() == 1
                    && r.draining[0].addr == chosen.to_string()
            })
            .then_some(())
    });
    assert!(
        done.is_ok(),
        "{vip}: {chosen} never draining with {fresh} the one backend: {:#?}",
        rig.lab
            .inspect_services()
            .into_iter()
            .filter(|r| r.vip == vip)
            .collect::<Vec<_>>()
    );
}

/// The rig with the SCTP services of both families.
fn sctp_rig() -> Rig {
    let (sig, sig6) = two_ready();
    let rig = Rig::with_extra(&sctp_services(&sig, &sig6));
    assert_eq!(rig.client.ip6, Some(lbproxy_tests::lab::pod_ip6(0)));
    // Every SCTP frontend programmed (with its endpoints, where it has some) before the
    // first packet.
    let want = [
        (sig_vip().to_string(), 2),
        (sigext_vip().to_string(), 1),
        (EXT_IP.to_string(), 1),
        (sigempty_vip().to_string(), 0),
        (SIG_VIP6.to_string(), 2),
        (EXT_IP6.to_string(), 1),
        (SIGEMPTY_VIP6.to_string(), 0),
    ];
    let ready = wait_for(Duration::from_secs(5), Duration::from_millis(50), || {
        let rows = rig.lab.inspect_services();
        want.iter()
            .all(|(vip, n)| {
                rows.iter().any(|r| {
                    r.vip == *vip && r.protocol == "SCTP" && r.served && r.backends.len() == *n
                })
            })
            .then_some(())
    });
    assert!(
        ready.is_ok(),
        "the SCTP frontends were never all served with their endpoints ({want:?}): {:#?}",
        rig.lab
            .inspect_services()
            .into_iter()
            .filter(|r| r.protocol == "SCTP")
            .collect::<Vec<_>>()
    );
    rig
}

/// The chunks of the packets of one association, after its INIT: one chunk (a
/// COOKIE-ECHO), several (a SACK and two DATA), and one DATA chunk that makes the SCTP
/// packet 1,400 bytes.
/// An association from `port` to `svc_port` as the tests send it: its INIT, then the packets
/// of [`later_chunks`] (verification tag 0x5c7a11f0).
fn association(port: u16, svc_port: u16) -> Vec<(&'static str, Sctp)> {
    let mut packets = vec![("INIT", Sctp::init(port, svc_port))];
    for (what, chunks) in later_chunks() {
        packets.push((what, Sctp::with_chunks(port, svc_port, 0x5c7a_11f0, chunks)));
    }
    packets
}

fn later_chunks() -> Vec<(&'static str, Vec<u8>)> {
    let sack = chunk(3, 0, &[0x2f, 0x1e, 0x0d, 0x3b, 0, 2, 0, 0, 0, 0, 0, 0]);
    let several = [
        sack,
        data_chunk(0x1000, b"first message"),
        data_chunk(0x1001, b"second"),
    ]
    .concat();
    let big = data_chunk(0x1002, &vec![0xa5; 1400 - 12 - 16]);
    assert_eq!(12 + big.len(), 1400);
    vec![
        ("COOKIE-ECHO (one chunk)", chunk(10, 0, &[0x42; 36])),
        ("SACK and two DATA (three chunks)", several),
        ("DATA, 1,400 bytes", big),
    ]
}

/// An IPv6 frame of the SCTP packet `sctp` from `src` to `dst` (no extension headers).
fn sctp6(src: Ipv6Addr, dst: Ipv6Addr, sctp: &Sctp) -> Vec<u8> {
    ipv6(src.octets(), dst.octets(), IPPROTO_SCTP, &sctp.bytes())
}

/// `frame` with its two MACs swapped: a reply's.
fn swap_macs(mut frame: Vec<u8>) -> Vec<u8> {
    let (dst, src) = (frame[0..6].to_vec(), frame[6..12].to_vec());
    frame[0..6].copy_from_slice(&src);
    frame[6..12].copy_from_slice(&dst);
    frame
}

/// The IPv4 address a translated IPv4 frame is sent to, and its destination port.
fn dest4(frame: &[u8]) -> (Ipv4Addr, u16) {
    (
        Ipv4Addr::new(frame[30], frame[31], frame[32], frame[33]),
        u16::from_be_bytes([frame[36], frame[37]]),
    )
}

/// An SCTP INIT to a ClusterIP from the pod is DNATed to one of the two backends at the
/// targetPort, CRC32c right, and `inspect flows` shows the SCTP flow. That backend then
/// terminates (serving, no new flows) and another is the one ready: the association's
/// later packets (one chunk, several, 1,400 bytes) still go to the backend its flow holds,
/// and the backend's answers come back from the ClusterIP and the service port; a new
/// association goes to the new backend. IPv4.
#[test]
fn sctp_cluster_ip_ipv4_dnat_flow_and_reverse_nat() {
    let rig = sctp_rig();
    let c = rig.client_ip();
    let port = 40201;
    let init = Frame::from_pod(Ip::new(c, sig_vip()), L4::Sctp(Sctp::init(port, SIG_PORT)));
    let input = init.bytes();
    assert!(sctp_crc_ok(&input[34..]), "test frame: INIT CRC32c");
    let out = rig.run("SCTP INIT to the ClusterIP", Prog::FromPod, &input);
    let (backend, _) = dest4(&out.out);
    assert!(
        backend == BACKEND || backend == BACKEND_B,
        "the INIT went to neither backend: {}",
        describe(&out.out)
    );
    let want = init.with_dest(backend, SIG_TARGET).bytes();
    assert!(sctp_crc_ok(&want[34..]) && want[34..38] != input[34..38]);
    out.expect(TC_ACT_UNSPEC, &want, &[]);
    let flows = rig.flows_from(port);
    assert!(
        flows.len() == 1
            && flows[0].backend == format!("{backend}:{SIG_TARGET}")
            && flows[0].frontend == format!("{}:{SIG_PORT}/SCTP", sig_vip())
            && flows[0].protocol == "SCTP"
            && flows[0].state == "-"
            && flows[0].reply_half,
        "after the INIT: want one SCTP flow to {backend}:{SIG_TARGET}, got {flows:#?}"
    );
    drain_into(&rig, backend.into(), FRESH.into());

    for (what, chunks) in later_chunks() {
        let tag = 0x5c7a_11f0;
        let p = Frame::from_pod(
            Ip::new(c, sig_vip()),
            L4::Sctp(Sctp::with_chunks(port, SIG_PORT, tag, chunks.clone())),
        );
        let want = p.with_dest(backend, SIG_TARGET).bytes();
        rig.run(
            &format!("SCTP {what} to the ClusterIP"),
            Prog::FromPod,
            &p.bytes(),
        )
        .expect(TC_ACT_UNSPEC, &want, &[]);
        // The backend answers with the same chunks, from its own address and targetPort.
        let mut answer = Frame::from_pod(
            Ip::new(backend, c),
            L4::Sctp(Sctp::with_chunks(SIG_TARGET, port, 0x0bad_cafe, chunks)),
        );
        (answer.dst_mac, answer.src_mac) = (POD_MAC, GW_MAC);
        let want = answer.with_source(sig_vip(), SIG_PORT).bytes();
        rig.run(
            &format!("the backend's SCTP {what}"),
            Prog::ToPod,
            &answer.bytes(),
        )
        .expect(TC_ACT_UNSPEC, &want, &[]);
    }
    assert_eq!(rig.flows_from(port).len(), 1, "{:#?}", rig.flows_from(port));
    let other = Frame::from_pod(
        Ip::new(c, sig_vip()),
        L4::Sctp(Sctp::init(port + 100, SIG_PORT)),
    );
    rig.run(
        "SCTP INIT of a new association",
        Prog::FromPod,
        &other.bytes(),
    )
    .expect(
        TC_ACT_UNSPEC,
        &other.with_dest(FRESH, SIG_TARGET).bytes(),
        &[],
    );
}

/// [`sctp_cluster_ip_ipv4_dnat_flow_and_reverse_nat`] over IPv6, without extension headers.
#[test]
fn sctp_cluster_ip_ipv6_dnat_flow_and_reverse_nat() {
    let rig = sctp_rig();
    let c = rig.client.ip6.unwrap();
    let port = 40202;
    let init = Sctp::init(port, SIG_PORT);
    let input = sctp6(c, SIG_VIP6, &init);
    let out = rig.run("IPv6 SCTP INIT to the ClusterIP", Prog::FromPod, &input);
    let backend = Ipv6Addr::from(<[u8; 16]>::try_from(&out.out[38..54]).unwrap());
    assert!(
        backend == BACKEND6_A || backend == BACKEND6_B,
        "the INIT went to neither backend: {}",
        hex(&out.out)
    );
    let mut to = init.clone();
    to.dport = SIG_TARGET;
    out.expect(TC_ACT_UNSPEC, &sctp6(c, backend, &to), &[]);
    let flows: Vec<FlowRow> = rig
        .lab
        .inspect_flows()
        .into_iter()
        .filter(|f| f.client == format!("[{c}]:{port}"))
        .collect();
    assert!(
        flows.len() == 1
            && flows[0].backend == format!("[{backend}]:{SIG_TARGET}")
            && flows[0].frontend == format!("[{SIG_VIP6}]:{SIG_PORT}/SCTP"),
        "after the IPv6 INIT: want one SCTP flow to [{backend}]:{SIG_TARGET}, got {flows:#?}"
    );
    drain_into(&rig, backend.into(), FRESH6.into());

    for (what, chunks) in later_chunks() {
        let p = Sctp::with_chunks(port, SIG_PORT, 0x5c7a_11f0, chunks.clone());
        let mut to = p.clone();
        to.dport = SIG_TARGET;
        rig.run(
            &format!("IPv6 SCTP {what} to the ClusterIP"),
            Prog::FromPod,
            &sctp6(c, SIG_VIP6, &p),
        )
        .expect(TC_ACT_UNSPEC, &sctp6(c, backend, &to), &[]);
        let answer = Sctp::with_chunks(SIG_TARGET, port, 0x0bad_cafe, chunks);
        let mut from = answer.clone();
        from.sport = SIG_PORT;
        rig.run(
            &format!("the backend's IPv6 SCTP {what}"),
            Prog::ToPod,
            &sctp6(backend, c, &answer),
        )
        .expect(TC_ACT_UNSPEC, &sctp6(SIG_VIP6, c, &from), &[]);
    }
    let other = Sctp::init(port + 100, SIG_PORT);
    let mut to = other.clone();
    to.dport = SIG_TARGET;
    rig.run(
        "IPv6 SCTP INIT of a new association",
        Prog::FromPod,
        &sctp6(c, SIG_VIP6, &other),
    )
    .expect(TC_ACT_UNSPEC, &sctp6(c, FRESH6, &to), &[]);
}

/// From outside the node (`lb_from_node` on the uplink): an SCTP INIT to the externalIP and
/// one to the NodePort on the node's address are DNATed to the backend on this node (the
/// client pod) at the targetPort, the client's address kept, CRC32c right, and go up the
/// stack; a later packet of each follows; the backend's answers leaving the node
/// (`lb_to_node`) come from the externalIP:99 and the node's address:30099. IPv4, then the
/// externalIP over IPv6.
#[test]
fn sctp_node_port_and_external_ip_from_outside_both_families() {
    let rig = sctp_rig();
    let pod = rig.client_ip();
    let cases = [
        ("externalIP", EXT_IP, SIG_PORT, 40301),
        ("NodePort", NODE_ADDR, SIG_NODE_PORT, 40302),
    ];
    for (what, addr, svc_port, port) in cases {
        for (p_what, p) in association(port, svc_port) {
            let f = Frame::from_pod(Ip::new(OUTSIDE, addr), L4::Sctp(p.clone()));
            rig.run(
                &format!("SCTP {p_what} from outside to the {what}"),
                Prog::FromNode,
                &f.bytes(),
            )
            .expect(TC_ACT_UNSPEC, &f.with_dest(pod, SIG_TARGET).bytes(), &[]);
            let mut answer = p.clone();
            (answer.sport, answer.dport) = (SIG_TARGET, port);
            let a = Frame::from_pod(Ip::new(pod, OUTSIDE), L4::Sctp(answer));
            rig.run(
                &format!("the backend's SCTP {p_what} leaving for the {what}'s client"),
                Prog::ToNode,
                &a.bytes(),
            )
            .expect(TC_ACT_UNSPEC, &a.with_source(addr, svc_port).bytes(), &[]);
        }
        let flows: Vec<FlowRow> = rig
            .lab
            .inspect_flows()
            .into_iter()
            .filter(|f| f.client == format!("{OUTSIDE}:{port}"))
            .collect();
        assert!(
            flows.len() == 1
                && flows[0].backend == format!("{pod}:{SIG_TARGET}")
                && flows[0].protocol == "SCTP"
                && flows[0].snat.is_none(),
            "{what}: want one SCTP flow to {pod}:{SIG_TARGET}, client address kept, got \
             {flows:#?}"
        );
    }

    let pod6 = rig.client.ip6.unwrap();
    let port = 40303;
    for (p_what, p) in association(port, SIG_PORT) {
        let mut to = p.clone();
        to.dport = SIG_TARGET;
        rig.run(
            &format!("IPv6 SCTP {p_what} from outside to the externalIP"),
            Prog::FromNode,
            &sctp6(OUTSIDE6, EXT_IP6, &p),
        )
        .expect(TC_ACT_UNSPEC, &sctp6(OUTSIDE6, pod6, &to), &[]);
        let mut answer = p.clone();
        (answer.sport, answer.dport) = (SIG_TARGET, port);
        let mut from = answer.clone();
        from.sport = SIG_PORT;
        rig.run(
            &format!("the backend's IPv6 SCTP {p_what} leaving the node"),
            Prog::ToNode,
            &sctp6(pod6, OUTSIDE6, &answer),
        )
        .expect(TC_ACT_UNSPEC, &sctp6(EXT_IP6, OUTSIDE6, &from), &[]);
    }
}

/// SCTP to a frontend without endpoints is answered at once with an ICMP (ICMPv6) port
/// unreachable from the frontend, quoting the IP header and the first 8 bytes of the SCTP
/// packet as sent, as for UDP (kube-proxy's `reject`), sent back out of the interface it
/// came in on; counted as `no_backend_icmp_unreachable`. Both families.
#[test]
fn sctp_without_endpoints_gets_port_unreachable_both_families() {
    let rig = sctp_rig();
    let c = rig.client_ip();
    let f = Frame::from_pod(
        Ip::new(c, sigempty_vip()),
        L4::Sctp(Sctp::init(40401, SIG_PORT)),
    );
    let input = f.bytes();
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 20 + 8]);
    let csum = inet_csum(&icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let mut ip = Ip::new(sigempty_vip(), c);
    ip.id = 0;
    let want = Frame {
        dst_mac: POD_MAC,
        src_mac: GW_MAC,
        ip,
        l4: L4::Raw {
            proto: IPPROTO_ICMP,
            bytes: icmp,
        },
    }
    .bytes();
    rig.run(
        "SCTP INIT to a ClusterIP without endpoints",
        Prog::FromPod,
        &input,
    )
    .expect(
        TC_ACT_REDIRECT,
        &want,
        &[("no_backend_icmp_unreachable", 1)],
    );
    assert!(
        rig.flows_from(40401).is_empty(),
        "a rejected packet left a flow"
    );

    let c6 = rig.client.ip6.unwrap();
    let input = sctp6(c6, SIGEMPTY_VIP6, &Sctp::init(40402, SIG_PORT));
    let mut icmp = vec![1, 4, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 40 + 8]);
    let csum = l4_csum6(SIGEMPTY_VIP6.octets(), c6.octets(), 58, &icmp);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    let want = swap_macs(ipv6(SIGEMPTY_VIP6.octets(), c6.octets(), 58, &icmp));
    rig.run(
        "IPv6 SCTP INIT to a ClusterIP without endpoints",
        Prog::FromPod,
        &input,
    )
    .expect(
        TC_ACT_REDIRECT,
        &want,
        &[("no_backend_icmp_unreachable", 1)],
    );
}

/// What the SCTP path leaves alone: an IPv4 or IPv6 fragment of an SCTP packet to a
/// frontend (no fragment holds the whole packet its CRC32c covers; docs/sctp.md) and SCTP
/// to a ClusterIP's port that only TCP and UDP serve pass untouched, uncounted; an SCTP
/// header cut short of its 12 bytes passes counted, as a TCP or UDP one, and is malformed
/// to a frontend.
#[test]
fn sctp_edges_pass_or_drop() {
    let rig = sctp_rig();
    let c = rig.client_ip();
    let whole = Sctp::init(40501, SIG_PORT).bytes();
    let first = fragment((c, sig_vip()), IPPROTO_SCTP, 0x4242, true, 0, &whole[..16]);
    let later = fragment(
        (c, sig_vip()),
        IPPROTO_SCTP,
        0x4242,
        false,
        16,
        &whole[16..],
    );
    let to_web = Frame::from_pod(Ip::new(c, WEB_VIP), L4::Sctp(Sctp::init(40502, WEB_TCP)));
    // IPv6: a first fragment (offset 0, M set) of an INIT to the IPv6 ClusterIP.
    let c6 = rig.client.ip6.unwrap();
    let mut frag6 = vec![IPPROTO_SCTP, 0, 0, 1];
    frag6.extend_from_slice(&0x0042_4242u32.to_be_bytes());
    frag6.extend_from_slice(&whole[..16]);
    let first6 = ipv6(c6.octets(), SIG_VIP6.octets(), 44, &frag6);
    let short = |dst: Ipv4Addr| {
        Frame::from_pod(
            Ip::new(c, dst),
            L4::Raw {
                proto: IPPROTO_SCTP,
                bytes: whole[..8].to_vec(),
            },
        )
        .bytes()
    };
    for (what, frame) in [
        ("first fragment of an SCTP INIT to the ClusterIP", first),
        ("later fragment of that INIT", later),
        (
            "IPv6 first fragment of an SCTP INIT to the ClusterIP",
            first6,
        ),
        ("SCTP INIT to a port only TCP serves", to_web.bytes()),
    ] {
        rig.run(what, Prog::FromPod, &frame)
            .expect_untouched(TC_ACT_UNSPEC, &[]);
    }
    // As a TCP or UDP header cut short: not lbproxy's to judge, passed, counted.
    rig.run(
        "SCTP header of 8 bytes to no frontend",
        Prog::FromPod,
        &short(ELSEWHERE),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[("l4_header_bad_passed", 1)]);
    rig.run(
        "SCTP header of 8 bytes to the ClusterIP",
        Prog::FromPod,
        &short(sig_vip()),
    )
    .expect_untouched(TC_ACT_SHOT, &[("malformed", 1)]);
}
