//! Packet-level tests: the real datapath programs, attached by a real `lbproxy run` to a lab
//! pod's host-side veth, run with `BPF_PROG_TEST_RUN` on hand-built Ethernet frames.
//!
//! Each test asserts the exact bytes that come out, the TC action the program returns and
//! exactly how the datapath's drop/reject counters (`lbproxy inspect drops --json`) moved,
//! and its event counters (`lbproxy inspect events --json`) with them.
//! Expected frames are built from scratch by [`lbproxy_tests::frames`], with every checksum
//! computed in full (RFC 1071) over the expected bytes, never by replaying the datapath's
//! incremental updates. `docs/datapath-verdicts.md` is the table these tests pin down: a
//! change of verdict fails a test here and must be written down there.
//!
//! The cases, by subject: [`nat`] (DNAT and reverse NAT), [`rejects`], [`service_cidrs`],
//! [`edges`] (IPv4), [`ipv6`] and [`sctp`] (both families, both hooks, the CRC32c),
//! [`takeover`] (the flags of a takeover from kube-proxy and a hand-back), [`maglev`] (the
//! table lookup of `--lb-algorithm maglev`); [`rig`] runs them.
//!
//! The stack bypass stays off (its FIB lookups would depend on the lab's routes), so a
//! translated packet always goes on to the stack: `TC_ACT_UNSPEC`.

#[path = "../common/mod.rs"]
mod common;
mod edges;
mod ipv6;
mod maglev;
mod nat;
mod rejects;
mod rig;
mod sctp;
mod service_cidrs;
mod takeover;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Duration;

use common::{
    BACKEND_TCP, BACKEND_UDP, HEALTHY_WITHIN, WEB_TCP, WEB_UDP, WEB_VIP, merge, web_objects,
};
// The frame builder is this file's vocabulary: its constants, headers and decoders.
use lbproxy_tests::frames::*;
use lbproxy_tests::lab::inspect::rows::FlowRow;
use lbproxy_tests::lab::{
    DATAPATH_EVENTS, Endpoint, Inspect as _, Lab, Lbproxy, METRICS_ADDR, Pod, Shape, UPLINK_IF,
    bpf, http_get_full, pod_ip, run_in_ns, vip, wait_for,
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

use rejects::port_unreachable_for;
use rig::{Drops, Prog, Rig, send_raw};

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
