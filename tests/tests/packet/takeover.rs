//! The datapath's part in a takeover from kube-proxy and a hand-back to it
//! (docs/migration.md), switched by `LB_CONFIG_V1`'s flags as the controller switches them:
//! packets of no flow passed untranslated, to conntrack (`CONFIG_F_STRAYS_TO_CONNTRACK`,
//! `CONFIG_F_NEW_TO_CONNTRACK`), and packets of lbproxy's flows that go into the node's stack
//! marked for the untrack rule (`CONFIG_F_UNTRACK`, `UNTRACK_MARK`).

use lbproxy::bpf::PinnedMaps;
use lbproxy_common::{
    CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_STRAYS_TO_CONNTRACK, CONFIG_F_UNTRACK,
    CONFIG_F_UNTRACK_OWN, UNTRACK_MARK,
};

use super::*;

/// Turns `flags` on or off in the rig's pinned `LB_CONFIG_V1`.
fn set_flags(rig: &Rig, flags: u32, on: bool) {
    PinnedMaps::open(rig.lab.bpffs_dir())
        .expect("opening the rig's pinned maps")
        .set_config_flags(flags, on)
        .expect("writing LB_CONFIG_V1");
}

/// From the first dump of conntrack to the second, a TCP segment other than a SYN of no
/// flow passes untouched (a connection kube-proxy's rules opened meanwhile: conntrack
/// translates it) and makes no flow; a SYN and a UDP datagram are balanced as always.
/// Afterwards such a segment is balanced again.
#[test]
fn stray_segments_pass_to_conntrack_until_the_second_dump() {
    let rig = Rig::new();
    let c = rig.client_ip();
    set_flags(&rig, CONFIG_F_STRAYS_TO_CONNTRACK, true);

    let mut data = Tcp::new(40101, WEB_TCP, PSH | ACK);
    data.payload = b"GET / HTTP/1.1\r\n\r\n".to_vec();
    let stray = Frame::tcp(c, WEB_VIP, data);
    rig.run("TCP PSH|ACK of no flow", Prog::FromPod, &stray.bytes())
        .expect_untouched(TC_ACT_UNSPEC, &[]);
    assert!(
        rig.flows_from(40101).is_empty(),
        "a stray segment made a flow: {:?}",
        rig.flows_from(40101)
    );

    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40102, WEB_TCP));
    rig.run("TCP SYN", Prog::FromPod, &syn.bytes()).expect(
        TC_ACT_UNSPEC,
        &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
        &[],
    );
    let udp = Frame::udp(c, WEB_VIP, Udp::new(40103, WEB_UDP));
    rig.run("UDP datagram", Prog::FromPod, &udp.bytes()).expect(
        TC_ACT_UNSPEC,
        &udp.with_dest(BACKEND, BACKEND_UDP).bytes(),
        &[],
    );

    set_flags(&rig, CONFIG_F_STRAYS_TO_CONNTRACK, false);
    rig.run("the same segment, flag off", Prog::FromPod, &stray.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &stray.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[("tcp_midstream_without_flow", 1)],
        );
}

/// During a hand-back, every packet of no flow passes untouched, to kube-proxy's rules, and
/// makes no flow; a flow lbproxy already has goes on being translated.
#[test]
fn new_flows_pass_to_conntrack_during_a_hand_back() {
    let rig = Rig::new();
    let c = rig.client_ip();
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40111, WEB_TCP));
    rig.run("TCP SYN before", Prog::FromPod, &syn.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );
    set_flags(&rig, CONFIG_F_NEW_TO_CONNTRACK, true);

    let ack = Frame::tcp(c, WEB_VIP, Tcp::new(40111, WEB_TCP, ACK));
    rig.run("ACK of lbproxy's flow", Prog::FromPod, &ack.bytes())
        .expect(
            TC_ACT_UNSPEC,
            &ack.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );
    let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(40112, WEB_TCP));
    rig.run("new TCP SYN", Prog::FromPod, &syn.bytes())
        .expect_untouched(TC_ACT_UNSPEC, &[]);
    let udp = Frame::udp(c, WEB_VIP, Udp::new(40113, WEB_UDP));
    rig.run("new UDP datagram", Prog::FromPod, &udp.bytes())
        .expect_untouched(TC_ACT_UNSPEC, &[]);
    for port in [40112, 40113] {
        assert!(
            rig.flows_from(port).is_empty(),
            "a new connection from port {port} made a flow during the hand-back"
        );
    }
    set_flags(&rig, CONFIG_F_NEW_TO_CONNTRACK, false);
}

/// During a hand-back (untracking of own flows on), a client packet translated into the
/// stack gets `UNTRACK_MARK` (its other mark bits kept), and so does a backend's answer on
/// its way to be translated after the stack, from outside the node or from a pod's
/// interface. During a takeover (untracking alone) lbproxy's own flows are not marked: they
/// stay tracked, NATed by the node's other rules. A packet of no flow is never marked, and
/// with the flags off nothing is.
#[test]
fn packets_into_the_stack_are_marked_for_the_untrack_rule() {
    let rig = Rig::new();
    let c = rig.client_ip();
    const KUBE_MASQ: u32 = 0x4000;
    let syn_marked = |port: u16, mark: u32| {
        let syn = Frame::tcp(c, WEB_VIP, Tcp::linux_syn(port, WEB_TCP));
        let out = rig.run_marked("TCP SYN", Prog::FromPod, &syn.bytes(), KUBE_MASQ);
        out.expect(
            TC_ACT_UNSPEC,
            &syn.with_dest(BACKEND, BACKEND_TCP).bytes(),
            &[],
        );
        assert_eq!(
            out.mark,
            KUBE_MASQ | mark,
            "{} from port {port}: skb mark",
            out.what
        );
    };
    let answers_marked = |port: u16, mark: u32| {
        let answers = [
            (
                "the backend's SYN-ACK from outside",
                Prog::FromNode,
                BACKEND,
                SYN | ACK,
                mark,
            ),
            (
                "the backend's ACK from a pod",
                Prog::FromPod,
                BACKEND,
                ACK,
                mark,
            ),
            (
                "a packet of no flow from outside",
                Prog::FromNode,
                ELSEWHERE,
                ACK,
                0,
            ),
        ];
        for (what, prog, from, flags, mark) in answers {
            let f = Frame::tcp(from, c, Tcp::new(BACKEND_TCP, port, flags));
            untouched_with_mark(&rig, &format!("{what} to port {port}"), prog, &f, mark);
        }
    };

    // A takeover: own flows stay unmarked.
    set_flags(&rig, CONFIG_F_UNTRACK, true);
    syn_marked(40121, 0);
    answers_marked(40121, 0);

    // A hand-back: own flows are marked too.
    set_flags(&rig, CONFIG_F_UNTRACK_OWN, true);
    syn_marked(40122, UNTRACK_MARK);
    answers_marked(40122, UNTRACK_MARK);

    // Both off: nothing is marked.
    set_flags(&rig, CONFIG_F_UNTRACK | CONFIG_F_UNTRACK_OWN, false);
    syn_marked(40123, 0);
    answers_marked(40123, 0);
}

/// Runs `frame` through `prog`: it must come out untouched, with skb mark `mark`.
fn untouched_with_mark(rig: &Rig, what: &str, prog: Prog, frame: &Frame, mark: u32) {
    let out = rig.run(what, prog, &frame.bytes());
    out.expect_untouched(TC_ACT_UNSPEC, &[]);
    assert_eq!(out.mark, mark, "{}: skb mark", out.what);
}
