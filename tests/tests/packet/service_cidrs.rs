//! ServiceCIDRs: with a ServiceCIDR, a packet to no frontend inside it is rejected (an
//! allocated ClusterIP's undefined port) or dropped (an unallocated address); outside it,
//! untouched.

use super::*;

/// The ServiceCIDR of the rig's VIPs.
const SERVICE_CIDR: &str = "---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\n\
                            metadata: {name: kubernetes}\nspec: {cidrs: [198.19.0.0/16]}\n";

/// Not a ClusterIP, inside the ServiceCIDR.
fn unallocated() -> Ipv4Addr {
    vip(99)
}

/// TCP to `web`'s ClusterIP on a port it does not define gets the RST a service without
/// endpoints gets (from the ClusterIP and that port), UDP the ICMP port unreachable; each
/// counted under its own reason.
#[test]
fn undefined_port_of_a_cluster_ip_is_rejected() {
    let rig = Rig::with_extra(SERVICE_CIDR);
    let c = rig.client_ip();
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40201, 81));
    let rule = rfc793_reset(syn.tcp_hdr()).unwrap();
    let want = reset_frame(&syn, rule).bytes();
    rig.run(
        "TCP SYN to web's ClusterIP, port 81",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect(TC_ACT_REDIRECT, &want, &[("cluster_ip_port_tcp_reset", 1)]);

    let f = Frame::udp(c, WEB_VIP, Udp::new(40202, 54));
    let input = f.bytes();
    let want = rejects::port_unreachable_from(&input, WEB_VIP, c);
    rig.run("UDP to web's ClusterIP, port 54", Prog::FromPod, &input)
        .expect(
            TC_ACT_REDIRECT,
            &want,
            &[("cluster_ip_port_icmp_unreachable", 1)],
        );
}

/// TCP and UDP to an address of the ServiceCIDR no Service holds: dropped, untranslated,
/// counted. An address outside it passes untouched, and `web`'s own port is translated.
#[test]
fn unallocated_address_is_dropped() {
    let rig = Rig::with_extra(SERVICE_CIDR);
    let c = rig.client_ip();
    let syn = Frame::tcp(c, unallocated(), Tcp::linux_syn(40211, WEB_TCP));
    rig.run(
        "TCP SYN to an unallocated address",
        Prog::FromPod,
        &syn.bytes(),
    )
    .expect_untouched(TC_ACT_SHOT, &[("service_cidr_unallocated", 1)]);
    let udp = Frame::udp(c, unallocated(), Udp::new(40212, WEB_UDP));
    rig.run("UDP to an unallocated address", Prog::FromPod, &udp.bytes())
        .expect_untouched(TC_ACT_SHOT, &[("service_cidr_unallocated", 1)]);

    let out = Frame::tcp(c, ELSEWHERE, Tcp::linux_syn(40213, WEB_TCP));
    rig.run(
        "TCP SYN outside the ServiceCIDR",
        Prog::FromPod,
        &out.bytes(),
    )
    .expect_untouched(TC_ACT_UNSPEC, &[]);

    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40214, WEB_TCP));
    let want = syn.with_dest(BACKEND, BACKEND_TCP).bytes();
    rig.run("TCP SYN to web's port", Prog::FromPod, &syn.bytes())
        .expect(TC_ACT_UNSPEC, &want, &[]);
}
