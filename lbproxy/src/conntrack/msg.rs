//! ctnetlink messages: the requests [`super::Conntrack`] sends and the entries it reads back.
//!
//! Requests and replies are netlink-packet-netfilter's `NetfilterMessage`s. What that crate
//! does not name (`CTA_ZONE`, `CTA_NAT_SRC`/`CTA_NAT_DST`) is written as raw attributes with
//! the kernel's numbers (`linux/netfilter/nfnetlink_conntrack.h`).
//!
//! Check: `cargo test -p lbproxy conntrack` (encode/decode round trips and byte layouts).

use std::net::IpAddr;

use netlink_packet_core::{
    DecodeError, DefaultNla, Emitable, NLA_F_NESTED, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute as Cta, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple,
    Protocol, Status, TCPFlags, Tuple as NlTuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};

use super::{Entry, Family, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, Tuple};
use super::{
    IPS_CONFIRMED, IPS_DYING, IPS_EXPECTED, IPS_NAT_DONE_MASK, IPS_TEMPLATE, IPS_UNTRACKED,
    TCP_CONNTRACK_TIME_WAIT,
};

/// `enum ctattr_type` numbers the crate leaves as raw attributes.
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_DST: u16 = 13;
const CTA_ZONE: u16 = 18;
/// `enum ctattr_nat`.
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_NAT_V6_MAXIP: u16 = 5;
/// `enum ctattr_protonat`.
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;

/// `IP_CT_TCP_FLAG_*` (`linux/netfilter/nf_conntrack_tcp.h`).
const IP_CT_TCP_FLAG_SACK_PERM: u8 = 0x02;
const IP_CT_TCP_FLAG_CLOSE_INIT: u8 = 0x04;
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;

/// Status bits a create must not carry: the kernel refuses to change `EXPECTED`/`DYING`
/// (EBUSY) and silently ignores the rest; `CONFIRMED` it sets itself before applying ours.
const IPS_NOT_SETTABLE: u32 =
    IPS_EXPECTED | IPS_DYING | IPS_NAT_DONE_MASK | IPS_TEMPLATE | IPS_UNTRACKED;

fn nf_family(family: Family) -> NetfilterProtoFamily {
    match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn family_of(addr: IpAddr) -> Family {
    if addr.is_ipv4() {
        Family::V4
    } else {
        Family::V6
    }
}

/// One serialized request: `conntrack` subsystem message `inner` for `family`, with `flags`
/// and sequence number `seq`.
fn request(family: Family, inner: ConntrackMessage, flags: u16, seq: u32) -> Vec<u8> {
    let nf = NetfilterMessage::new(NetfilterHeader::new(nf_family(family), 0, 0), inner);
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    hdr.sequence_number = seq;
    let mut msg = NetlinkMessage::new(hdr, NetlinkPayload::InnerMessage(nf));
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

/// `IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`: every entry of `family`.
pub(super) fn dump_request(family: Family, seq: u32) -> Vec<u8> {
    request(
        family,
        ConntrackMessage::Get(Vec::new()),
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
    )
}

/// `IPCTNL_MSG_CT_DELETE` of the entry whose original tuple is `orig` in `zone`, acked.
pub(super) fn delete_request(orig: &Tuple, zone: u16, seq: u32) -> Vec<u8> {
    let mut attrs = vec![Cta::CtaTupleOrig(tuple_attrs(orig))];
    attrs.extend(zone_attr(zone));
    request(
        family_of(orig.src),
        ConntrackMessage::Delete(attrs),
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
    )
}

/// `IPCTNL_MSG_CT_NEW` with `NLM_F_CREATE|NLM_F_EXCL` writing `e`, acked. See
/// [`create_attrs`] for how its NAT is expressed.
pub(super) fn create_request(e: &Entry, seq: u32) -> Vec<u8> {
    request(
        family_of(e.orig.src),
        ConntrackMessage::New(create_attrs(e)),
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        seq,
    )
}

/// The attributes of a create.
///
/// The kernel does not take `IPS_SRC_NAT`/`IPS_DST_NAT` from `CTA_STATUS` (they are in its
/// `IPS_UNCHANGEABLE_MASK`), and a packet is translated only when those bits are set. So a
/// NAT'd entry is written the way `conntrack -I --dst-nat/--src-nat` writes one: the reply
/// tuple is the plain inverse of the original, and `CTA_NAT_DST` (the backend: `e.reply`'s
/// source) and `CTA_NAT_SRC` (the masquerade address: `e.reply`'s destination) make the
/// kernel compute `e.reply` itself and set the bits. A TCP entry gets its state and, as
/// `conntrack -I` does, `BE_LIBERAL|SACK_PERM` (plus `CLOSE_INIT` from TIME_WAIT on) in
/// both directions so that it accepts a stream picked up in the middle.
pub(super) fn create_attrs(e: &Entry) -> Vec<Cta> {
    let nat = e.dnat() || e.snat();
    let reply = if nat { e.orig.inverse() } else { e.reply };
    let mut attrs = vec![
        Cta::CtaTupleOrig(tuple_attrs(&e.orig)),
        Cta::CtaTupleReply(tuple_attrs(&reply)),
    ];
    if e.dnat() {
        attrs.push(nat_attr(CTA_NAT_DST, e.reply.src, e.reply.src_port));
    }
    if e.snat() {
        attrs.push(nat_attr(CTA_NAT_SRC, e.reply.dst, e.reply.dst_port));
    }
    attrs.push(Cta::CtaStatus(Status::from_bits_retain(
        (e.status | IPS_CONFIRMED) & !IPS_NOT_SETTABLE,
    )));
    attrs.push(Cta::CtaTimeout(e.timeout_s));
    if e.mark != 0 {
        attrs.push(Cta::CtaMark(e.mark));
    }
    attrs.extend(zone_attr(e.zone));
    if let Some(state) = e.tcp_state.filter(|_| e.orig.proto == IPPROTO_TCP) {
        attrs.push(Cta::CtaProtoInfo(vec![ProtoInfo::TCP(tcp_protoinfo(
            state,
        ))]));
    }
    attrs
}

fn tcp_protoinfo(state: u8) -> Vec<ProtoInfoTCP> {
    let mut flags = IP_CT_TCP_FLAG_BE_LIBERAL | IP_CT_TCP_FLAG_SACK_PERM;
    if state >= TCP_CONNTRACK_TIME_WAIT {
        flags |= IP_CT_TCP_FLAG_CLOSE_INIT;
    }
    // `struct nf_ct_tcp_flags { flags, mask }`; the crate builds one only by parsing.
    let both = || TCPFlags::parse(&[flags, flags]).expect("two bytes are a TCPFlags");
    vec![
        ProtoInfoTCP::State(state),
        ProtoInfoTCP::OriginalFlags(both()),
        ProtoInfoTCP::ReplyFlags(both()),
    ]
}

/// `CTA_TUPLE_IP` and `CTA_TUPLE_PROTO` of `t`.
fn tuple_attrs(t: &Tuple) -> Vec<NlTuple> {
    vec![
        NlTuple::Ip(vec![
            IPTuple::SourceAddress(t.src),
            IPTuple::DestinationAddress(t.dst),
        ]),
        NlTuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::from(t.proto)),
            ProtoTuple::SourcePort(t.src_port),
            ProtoTuple::DestinationPort(t.dst_port),
        ]),
    ]
}

/// `CTA_ZONE` (big-endian u16), left out for the default zone 0.
fn zone_attr(zone: u16) -> Option<Cta> {
    (zone != 0).then(|| Cta::Other(DefaultNla::new(CTA_ZONE, zone.to_be_bytes().to_vec())))
}

/// `CTA_NAT_SRC`/`CTA_NAT_DST` (`kind`) mapping to exactly `addr`:`port`.
fn nat_attr(kind: u16, addr: IpAddr, port: u16) -> Cta {
    let (min, max, octets) = match addr {
        IpAddr::V4(a) => (CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP, a.octets().to_vec()),
        IpAddr::V6(a) => (CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP, a.octets().to_vec()),
    };
    let ports = [
        DefaultNla::new(CTA_PROTONAT_PORT_MIN, port.to_be_bytes().to_vec()),
        DefaultNla::new(CTA_PROTONAT_PORT_MAX, port.to_be_bytes().to_vec()),
    ];
    let nat = [
        DefaultNla::new(min, octets.clone()),
        DefaultNla::new(max, octets),
        DefaultNla::new(CTA_NAT_PROTO | NLA_F_NESTED, emit_all(&ports)),
    ];
    Cta::Other(DefaultNla::new(kind | NLA_F_NESTED, emit_all(&nat)))
}

fn emit_all(nlas: &[DefaultNla]) -> Vec<u8> {
    let mut buf = vec![0; nlas.buffer_len()];
    nlas.emit(&mut buf);
    buf
}

/// What one message of a reply stream is.
#[derive(Debug)]
pub(super) enum Reply {
    /// A dumped entry (`None`: one of another protocol or family, skipped).
    Entry(Option<Entry>),
    /// `NLMSG_DONE`: the end of a dump.
    Done,
    /// An ack (`0`) or error (negative errno) for request `seq`.
    Ack { seq: u32, errno: i32 },
    /// Anything else (noop, other subsystems).
    Other,
}

/// Parses the netlink messages in `buf` (one datagram) in order; `each` gets each one.
pub(super) fn parse_datagram(
    buf: &[u8],
    family: Option<Family>,
    mut each: impl FnMut(Reply),
) -> Result<(), DecodeError> {
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes")) as usize;
        if len < 16 || off + len > buf.len() {
            return Err(DecodeError::from(format!(
                "netlink message of length {len} at offset {off} in a datagram of {}",
                buf.len()
            )));
        }
        each(parse_message(&buf[off..off + len], family)?);
        off += (len + 3) & !3;
    }
    Ok(())
}

fn parse_message(buf: &[u8], family: Option<Family>) -> Result<Reply, DecodeError> {
    let msg = NetlinkMessage::<NetfilterMessage>::deserialize(buf)?;
    let seq = msg.header.sequence_number;
    Ok(match msg.payload {
        NetlinkPayload::Done(_) => Reply::Done,
        NetlinkPayload::Error(e) => Reply::Ack {
            seq,
            errno: e.code.map_or(0, |c| -c.get()),
        },
        NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
            ..
        }) => Reply::Entry(entry_of(&attrs).filter(|e| {
            family.is_none_or(|f| family_of(e.orig.src) == f)
                && matches!(e.orig.proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)
        })),
        _ => Reply::Other,
    })
}

/// The entry a dumped message's attributes describe; `None` without both tuples.
pub(super) fn entry_of(attrs: &[Cta]) -> Option<Entry> {
    let mut orig = None;
    let mut reply = None;
    let mut e = Entry {
        orig: Tuple::default(),
        reply: Tuple::default(),
        status: 0,
        timeout_s: 0,
        tcp_state: None,
        mark: 0,
        zone: 0,
    };
    for a in attrs {
        match a {
            Cta::CtaTupleOrig(t) => orig = tuple_of(t),
            Cta::CtaTupleReply(t) => reply = tuple_of(t),
            Cta::CtaStatus(s) => e.status = s.bits(),
            Cta::CtaTimeout(t) => e.timeout_s = *t,
            Cta::CtaMark(m) => e.mark = *m,
            Cta::CtaProtoInfo(p) => e.tcp_state = tcp_state_of(p),
            Cta::Other(nla) if nla.kind() == CTA_ZONE => e.zone = zone_of(nla),
            _ => {}
        }
    }
    e.orig = orig?;
    e.reply = reply?;
    Some(e)
}

/// A `CTA_ZONE`'s big-endian u16 (0 if it is not two bytes).
fn zone_of(nla: &DefaultNla) -> u16 {
    let mut v = [0u8; 2];
    if nla.value_len() != v.len() {
        return 0;
    }
    nla.emit_value(&mut v);
    u16::from_be_bytes(v)
}

fn tcp_state_of(infos: &[ProtoInfo]) -> Option<u8> {
    infos.iter().find_map(|i| match i {
        ProtoInfo::TCP(tcp) => tcp.iter().find_map(|t| match t {
            ProtoInfoTCP::State(s) => Some(*s),
            _ => None,
        }),
        _ => None,
    })
}

fn tuple_of(attrs: &[NlTuple]) -> Option<Tuple> {
    let (mut src, mut dst, mut proto) = (None, None, None);
    let (mut src_port, mut dst_port) = (0, 0);
    for a in attrs {
        match a {
            NlTuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            NlTuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(port) => src_port = *port,
                        ProtoTuple::DestinationPort(port) => dst_port = *port,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        src: src?,
        dst: dst?,
        src_port,
        dst_port,
        proto: proto?,
    })
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use netlink_packet_core::{NLMSG_DONE, NLMSG_ERROR};

    use super::super::{IPS_ASSURED, IPS_DST_NAT, IPS_SEEN_REPLY, IPS_SRC_NAT};
    use super::super::{TCP_CONNTRACK_ESTABLISHED, TCP_CONNTRACK_TIME_WAIT};
    use super::*;

    const NFNL_SUBSYS_CTNETLINK: u16 = 1;

    fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Tuple {
        Tuple {
            src: Ipv4Addr::from(src).into(),
            dst: Ipv4Addr::from(dst).into(),
            src_port: sport,
            dst_port: dport,
            proto: IPPROTO_TCP,
        }
    }

    /// client 10.0.0.1:40000 -> VIP 10.96.0.10:80, DNAT'd to 10.1.0.5:8080 and
    /// masqueraded to node 10.0.0.100:61000.
    fn nat_entry() -> Entry {
        Entry {
            orig: tcp([10, 0, 0, 1], 40000, [10, 96, 0, 10], 80),
            reply: tcp([10, 1, 0, 5], 8080, [10, 0, 0, 100], 61000),
            status: IPS_SEEN_REPLY
                | IPS_ASSURED
                | IPS_CONFIRMED
                | IPS_DST_NAT
                | IPS_SRC_NAT
                | IPS_NAT_DONE_MASK,
            timeout_s: 431999,
            tcp_state: Some(TCP_CONNTRACK_ESTABLISHED),
            mark: 0x4000,
            zone: 7,
        }
    }

    /// The attributes after the 16-byte netlink and 4-byte nfgenmsg headers of `req`,
    /// checking those headers on the way.
    fn body(req: &[u8], msg_type: u8, flags: u16, seq: u32, family: u8) -> Vec<Cta> {
        assert_eq!(
            u32::from_ne_bytes(req[0..4].try_into().unwrap()) as usize,
            req.len()
        );
        let ty = u16::from_ne_bytes(req[4..6].try_into().unwrap());
        assert_eq!(ty, NFNL_SUBSYS_CTNETLINK << 8 | u16::from(msg_type));
        assert_eq!(u16::from_ne_bytes(req[6..8].try_into().unwrap()), flags);
        assert_eq!(u32::from_ne_bytes(req[8..12].try_into().unwrap()), seq);
        assert_eq!(
            &req[16..20],
            &[family, 0, 0, 0],
            "nfgenmsg: family, v0, res_id 0"
        );
        let msg = NetlinkMessage::<NetfilterMessage>::deserialize(req).unwrap();
        match msg.payload {
            NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::Conntrack(m),
                ..
            }) => match m {
                ConntrackMessage::New(a)
                | ConntrackMessage::Get(a)
                | ConntrackMessage::Delete(a) => a,
                other => panic!("unexpected {other:?}"),
            },
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn dump_request_is_a_bare_get_dump() {
        let req = dump_request(Family::V6, 9);
        assert_eq!(req.len(), 20);
        let attrs = body(&req, 1, NLM_F_REQUEST | NLM_F_DUMP, 9, 10);
        assert!(attrs.is_empty());
    }

    #[test]
    fn delete_request_names_the_original_tuple_and_zone() {
        let t = tcp([10, 0, 0, 1], 40000, [10, 96, 0, 10], 80);
        let req = delete_request(&t, 7, 3);
        let attrs = body(&req, 2, NLM_F_REQUEST | NLM_F_ACK, 3, 2);
        assert_eq!(attrs.len(), 2);
        assert_eq!(attrs[0], Cta::CtaTupleOrig(tuple_attrs(&t)));
        assert_eq!(tuple_of(&tuple_attrs(&t)), Some(t));
        // CTA_ZONE: len 6, type 18, big-endian 7, two bytes of padding.
        let zone_at = req.len() - 8;
        assert_eq!(&req[zone_at..], &[6, 0, 18, 0, 0, 7, 0, 0]);
        // Zone 0 is not sent.
        let req0 = delete_request(&t, 0, 3);
        assert_eq!(req0.len(), req.len() - 8);
    }

    #[test]
    fn tuple_bytes_are_nested_and_big_endian() {
        let t = tcp([10, 0, 0, 1], 0x1234, [10, 96, 0, 10], 80);
        let req = delete_request(&t, 0, 1);
        let a = &req[20..];
        // CTA_TUPLE_ORIG (nested) { CTA_TUPLE_IP (nested) { V4_SRC, V4_DST }, CTA_TUPLE_PROTO
        // (nested) { NUM, SRC_PORT, DST_PORT } }
        let expect: &[u8] = &[
            52, 0, 0x01, 0x80, //
            20, 0, 0x01, 0x80, 8, 0, 1, 0, 10, 0, 0, 1, 8, 0, 2, 0, 10, 96, 0, 10, //
            28, 0, 0x02, 0x80, 5, 0, 1, 0, 6, 0, 0, 0, 6, 0, 2, 0, 0x12, 0x34, 0, 0, 6, 0, 3, 0, 0,
            80, 0, 0,
        ];
        assert_eq!(a, expect);
    }

    #[test]
    fn create_of_a_nat_entry_sends_the_plain_inverse_and_nat_ranges() {
        let e = nat_entry();
        let req = create_request(&e, 5);
        let attrs = body(
            &req,
            0,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            5,
            2,
        );
        assert_eq!(attrs.len(), create_attrs(&e).len());
        assert_eq!(attrs[0], Cta::CtaTupleOrig(tuple_attrs(&e.orig)));
        assert_eq!(
            attrs[1],
            Cta::CtaTupleReply(tuple_attrs(&tcp([10, 96, 0, 10], 80, [10, 0, 0, 1], 40000)))
        );
        let Cta::Other(dnat) = &attrs[2] else {
            panic!("{:?}", attrs[2])
        };
        assert_eq!(dnat.kind() & !NLA_F_NESTED, CTA_NAT_DST);
        let mut v = vec![0; dnat.value_len()];
        dnat.emit_value(&mut v);
        let expect: &[u8] = &[
            8, 0, 1, 0, 10, 1, 0, 5, // MINIP
            8, 0, 2, 0, 10, 1, 0, 5, // MAXIP
            20, 0, 0x03, 0x80, 6, 0, 1, 0, 0x1f, 0x90, 0, 0, 6, 0, 2, 0, 0x1f, 0x90, 0, 0,
        ];
        assert_eq!(v, expect);
        let Cta::Other(snat) = &attrs[3] else {
            panic!("{:?}", attrs[3])
        };
        assert_eq!(snat.kind() & !NLA_F_NESTED, CTA_NAT_SRC);
        let mut v = vec![0; snat.value_len()];
        snat.emit_value(&mut v);
        assert_eq!(&v[4..8], &[10, 0, 0, 100]);
        assert_eq!(&v[24..26], &61000u16.to_be_bytes());
        // Status: CONFIRMED kept, NAT_DONE dropped; NAT bits are sent but the kernel ignores them.
        assert_eq!(
            attrs[4],
            Cta::CtaStatus(Status::from_bits_retain(
                IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED | IPS_DST_NAT | IPS_SRC_NAT
            ))
        );
        assert_eq!(attrs[5], Cta::CtaTimeout(431999));
        assert_eq!(attrs[6], Cta::CtaMark(0x4000));
        assert_eq!(
            zone_of(match &attrs[7] {
                Cta::Other(n) => n,
                a => panic!("{a:?}"),
            }),
            7
        );
        assert_eq!(
            tcp_state_of(match &attrs[8] {
                Cta::CtaProtoInfo(p) => p,
                a => panic!("{a:?}"),
            }),
            Some(TCP_CONNTRACK_ESTABLISHED)
        );
        // BE_LIBERAL|SACK_PERM both ways, flags and mask alike.
        let tail = &req[req.len() - 8..];
        assert_eq!(tail, &[6, 0, 5, 0, 0x0a, 0x0a, 0, 0]);
    }

    #[test]
    fn create_from_time_wait_adds_close_init() {
        let info = tcp_protoinfo(TCP_CONNTRACK_TIME_WAIT);
        let f = TCPFlags::parse(&[0x0e, 0x0e]).unwrap();
        assert_eq!(info[1], ProtoInfoTCP::OriginalFlags(f.clone()));
        assert_eq!(info[2], ProtoInfoTCP::ReplyFlags(f));
    }

    #[test]
    fn create_without_nat_sends_the_reply_as_given() {
        let mut e = nat_entry();
        e.status = IPS_SEEN_REPLY;
        e.orig.proto = IPPROTO_UDP;
        e.reply.proto = IPPROTO_UDP;
        let attrs = create_attrs(&e);
        assert_eq!(attrs[1], Cta::CtaTupleReply(tuple_attrs(&e.reply)));
        assert!(attrs.iter().all(|a| !matches!(a, Cta::CtaProtoInfo(_))));
        assert_eq!(
            attrs[2],
            Cta::CtaStatus(Status::from_bits_retain(IPS_SEEN_REPLY | IPS_CONFIRMED))
        );
    }

    /// A kernel-style dump reply: the entry's attributes as a `IPCTNL_MSG_CT_NEW`, then
    /// `NLMSG_DONE`, in one datagram.
    fn dump_datagram(entries: &[Entry]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in entries {
            let mut attrs = vec![
                Cta::CtaTupleOrig(tuple_attrs(&e.orig)),
                Cta::CtaTupleReply(tuple_attrs(&e.reply)),
                Cta::CtaStatus(Status::from_bits_retain(e.status)),
                Cta::CtaTimeout(e.timeout_s),
                Cta::CtaMark(e.mark),
                // CTA_USE and CTA_ID: ignored.
                Cta::Other(DefaultNla::new(11, vec![0, 0, 0, 1])),
                Cta::Other(DefaultNla::new(12, vec![1, 2, 3, 4])),
            ];
            attrs.extend(zone_attr(e.zone));
            if let Some(s) = e.tcp_state {
                attrs.push(Cta::CtaProtoInfo(vec![ProtoInfo::TCP(tcp_protoinfo(s))]));
            }
            let fam = family_of(e.orig.src);
            let mut m = request(fam, ConntrackMessage::New(attrs), 2, 77);
            out.append(&mut m);
        }
        let mut done = vec![0u8; 20];
        done[0..4].copy_from_slice(&20u32.to_ne_bytes());
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        out.extend(done);
        out
    }

    #[test]
    fn dump_replies_decode_to_entries_and_done() {
        let a = nat_entry();
        let mut b = nat_entry();
        b.orig = Tuple {
            src: Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1).into(),
            dst: Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10).into(),
            src_port: 5000,
            dst_port: 53,
            proto: IPPROTO_UDP,
        };
        b.reply = b.orig.inverse();
        b.status = IPS_SEEN_REPLY | IPS_CONFIRMED;
        b.tcp_state = None;
        b.zone = 0;
        let mut icmp = nat_entry();
        icmp.orig.proto = 1;
        icmp.reply.proto = 1;
        icmp.tcp_state = None;
        let dgram = dump_datagram(&[a.clone(), b.clone(), icmp]);

        let mut got = Vec::new();
        parse_datagram(&dgram, None, |r| got.push(r)).unwrap();
        assert_eq!(got.len(), 4);
        assert!(
            matches!(&got[0], Reply::Entry(Some(e)) if *e == a),
            "{:?}",
            got[0]
        );
        assert!(
            matches!(&got[1], Reply::Entry(Some(e)) if *e == b),
            "{:?}",
            got[1]
        );
        assert!(
            matches!(&got[2], Reply::Entry(None)),
            "ICMP skipped: {:?}",
            got[2]
        );
        assert!(matches!(&got[3], Reply::Done));

        let mut v4 = Vec::new();
        parse_datagram(&dgram, Some(Family::V4), |r| {
            if let Reply::Entry(Some(e)) = r {
                v4.push(e)
            }
        })
        .unwrap();
        assert_eq!(v4, vec![a.clone()]);
        assert!(a.dnat() && a.snat());
        assert!(!b.dnat() && !b.snat());
    }

    #[test]
    fn acks_and_errors_carry_their_sequence_number() {
        let mut dgram = Vec::new();
        for (seq, code) in [(10u32, 0i32), (11, -libc::ENOENT)] {
            let mut m = vec![0u8; 36];
            m[0..4].copy_from_slice(&36u32.to_ne_bytes());
            m[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
            m[8..12].copy_from_slice(&seq.to_ne_bytes());
            m[16..20].copy_from_slice(&code.to_ne_bytes());
            m[20..24].copy_from_slice(&16u32.to_ne_bytes());
            dgram.extend(m);
        }
        let mut got = Vec::new();
        parse_datagram(&dgram, None, |r| got.push(r)).unwrap();
        assert!(
            matches!(got[0], Reply::Ack { seq: 10, errno: 0 }),
            "{:?}",
            got[0]
        );
        assert!(
            matches!(got[1], Reply::Ack { seq: 11, errno } if errno == libc::ENOENT),
            "{:?}",
            got[1]
        );
    }

    #[test]
    fn a_truncated_message_is_an_error() {
        let dgram = dump_datagram(&[nat_entry()]);
        let err = parse_datagram(&dgram[..40], None, |_| {}).unwrap_err();
        assert!(err.to_string().contains("length"), "{err}");
    }
}
