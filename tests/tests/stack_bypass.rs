//! The stack bypass (`--stack-bypass`): service traffic between pods on one node is
//! redirected straight into the destination pod, past the node's routing and netfilter.
//! Real `lbproxy run`, real TCP and UDP; the routed pods' test runs once per IP family.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::time::Duration;

use common::*;
use lbproxy_tests::lab::{Family, Inspect as _, Lab, Pod, Proto, Shape};

lbproxy_tests::both_families!(routed_pods_bypass_the_node_stack);

/// The IP TTL (IPv6: hop limit) of the answer to one UDP request from `client` to
/// `addr:port`, read with `IP_RECVTTL` (`IPV6_RECVHOPLIMIT`).
fn reply_ttl(client: &Pod, addr: IpAddr, port: u16) -> u8 {
    let (any, level, recv_opt, cmsg_type): (IpAddr, _, _, _) = match addr {
        IpAddr::V4(_) => (
            Ipv4Addr::UNSPECIFIED.into(),
            libc::IPPROTO_IP,
            libc::IP_RECVTTL,
            libc::IP_TTL,
        ),
        IpAddr::V6(_) => (
            Ipv6Addr::UNSPECIFIED.into(),
            libc::IPPROTO_IPV6,
            libc::IPV6_RECVHOPLIMIT,
            libc::IPV6_HOPLIMIT,
        ),
    };
    client.run(|| {
        let sock = UdpSocket::bind((any, 0)).expect("bind");
        sock.set_read_timeout(Some(T)).expect("timeout");
        let fd = sock.as_raw_fd();
        let on: libc::c_int = 1;
        // SAFETY: a valid socket and an int option of the right size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                recv_opt,
                (&raw const on).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(
            rc,
            0,
            "IP_RECVTTL/IPV6_RECVHOPLIMIT: {}",
            std::io::Error::last_os_error()
        );
        sock.send_to(b"ttl?", (addr, port)).expect("send");
        let mut buf = [0u8; 512];
        let mut cbuf = [0u64; 16];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&cbuf);
        // SAFETY: msg points at live buffers of the sizes given.
        let n = unsafe { libc::recvmsg(fd, &raw mut msg, 0) };
        assert!(
            n > 0,
            "no UDP answer from {}: {}",
            SocketAddr::from((addr, port)),
            std::io::Error::last_os_error()
        );
        // SAFETY: walking the control messages the kernel wrote into cbuf.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
            while !c.is_null() {
                if (*c).cmsg_level == level && (*c).cmsg_type == cmsg_type {
                    return *libc::CMSG_DATA(c).cast::<libc::c_int>() as u8;
                }
                c = libc::CMSG_NXTHDR(&raw const msg, c);
            }
        }
        panic!(
            "no TTL/hop limit control message on the answer from {}",
            SocketAddr::from((addr, port))
        );
    })
}

/// `lbproxy inspect delivery --json`'s counter for `path`.
fn delivered(lab: &Lab, path: &str) -> u64 {
    let v = lab.inspect_delivery();
    v.packets
        .get(path)
        .copied()
        .unwrap_or_else(|| panic!("inspect delivery: no packets.{path}: {v:#?}"))
}

/// Rules in the node namespace's FORWARD chain of `family` (iptables or ip6tables) that drop
/// the web service's backend traffic both ways, whatever its address: whatever the node's
/// stack forwards between the pods is lost.
fn drop_forwarded_backend_traffic(lab: &Lab, family: Family) {
    for (proto, port) in [("tcp", BACKEND_TCP), ("udp", BACKEND_UDP)] {
        for dir in ["--dport", "--sport"] {
            lab.node_run(&[
                iptables(family),
                "-A",
                "FORWARD",
                "-p",
                proto,
                dir,
                &port.to_string(),
                "-j",
                "DROP",
            ])
            .unwrap_or_else(|e| panic!("installing a {family} FORWARD drop rule: {e}"));
        }
    }
}

/// Routed pods (the shape the bypass serves), over IPv4 and over IPv6 (the dual-stack
/// `web`): with the FORWARD chain (iptables, ip6tables) dropping all backend traffic, the
/// pods cannot reach each other directly, yet every request through the VIP is answered, by
/// every backend, from the VIP, and the datapath counts a redirect for every packet.
/// Restarted without the bypass, the same requests are dropped by the node.
fn routed_pods_bypass_the_node_stack(family: Family) {
    let mut s = Setup::with_args(Shape::Routed, &["b1", "b2"], &["--stack-bypass"]);
    let (b1, b2) = (s.backend("b1").clone(), s.backend("b2").clone());
    serve_family(&s, family, &[&b1, &b2]);
    let vip = web_vip(family);
    let v = s.lab.inspect_delivery();
    assert!(v.stack_bypass, "[{family}] inspect delivery: {v:#?}");
    let ifs = v.redirect_interfaces.len();
    assert_eq!(
        ifs, 3,
        "[{family}] one redirect target per pod interface: {v:#?}"
    );

    // Cold neighbours: the node has not talked to the backends yet, so the first packets
    // take the stack, which resolves them; later ones are redirected.
    let (t, u) = traffic_ok(&s, family, &format!("[{family}] bypass, open node"), 30);
    assert!(
        t.len() == 2 && u.len() == 2,
        "[{family}] both backends answer: TCP {t:?} UDP {u:?}"
    );

    // A redirect makes the hop the node would have made: the TTL (hop limit) drops by one,
    // as on the direct path through the node.
    let before = delivered(&s.lab, "redirect_to_client");
    let via_vip = reply_ttl(&s.client, vip, WEB_UDP);
    assert!(
        delivered(&s.lab, "redirect_to_client") > before,
        "[{family}] the TTL probe's answer was not redirected"
    );
    let direct = reply_ttl(&s.client, pod_addr(&b1, family), BACKEND_UDP);
    assert_eq!(
        via_vip, direct,
        "[{family}] TTL of an answer through the VIP (redirected) vs. straight from b1 (routed \
         by the node)"
    );
    eprintln!("[{family}] reply TTL through the VIP {via_vip}, straight from b1 {direct}");

    drop_forwarded_backend_traffic(&s.lab, family);
    let direct = s.client.tcp_request(
        pod_addr(&b1, family),
        BACKEND_TCP,
        Duration::from_millis(500),
    );
    assert!(
        direct.is_err(),
        "[{family}] the FORWARD drop rule must stop direct pod-to-pod traffic, but b1 \
         answered: {direct:?}"
    );

    let (to_backend, to_client) = (
        delivered(&s.lab, "redirect_to_backend"),
        delivered(&s.lab, "redirect_to_client"),
    );
    let n = 40;
    let (t, u) = traffic_ok(
        &s,
        family,
        &format!("[{family}] bypass, FORWARD dropping"),
        n,
    );
    assert!(
        t.len() == 2 && u.len() == 2,
        "[{family}] both backends answer: TCP {t:?} UDP {u:?}"
    );
    // A TCP request is at least SYN, ACK, request, FIN out and SYN-ACK, reply, FIN back;
    // a UDP one is one packet each way.
    let (fwd, rev) = (
        delivered(&s.lab, "redirect_to_backend") - to_backend,
        delivered(&s.lab, "redirect_to_client") - to_client,
    );
    assert!(
        fwd >= 4 * n as u64 + n as u64 && rev >= 3 * n as u64 + n as u64,
        "[{family}] redirects during {n} TCP and {n} UDP requests: {fwd} to backends, {rev} to \
         the client"
    );

    // The control: the same lab without the bypass goes through FORWARD, and is dropped.
    s.lb.terminate(EXIT_WITHIN);
    let mut lb = s.lab.start_lbproxy_with(&["--stack-bypass=false"]);
    lb.expect_healthy(HEALTHY_WITHIN);
    let v = s.lab.inspect_delivery();
    assert!(!v.stack_bypass, "[{family}] inspect delivery: {v:#?}");
    assert_eq!(
        v.redirect_interfaces.len(),
        0,
        "[{family}] no redirect target with the bypass off: {v:#?}"
    );
    let t = s
        .client
        .tally(Proto::Tcp, vip, WEB_TCP, 5, Duration::from_millis(500));
    assert_eq!(
        t.replies(),
        0,
        "[{family}] without the bypass, the FORWARD rule must drop service traffic too: {t}"
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
