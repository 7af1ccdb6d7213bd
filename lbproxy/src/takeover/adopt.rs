//! Which of kube-proxy's conntrack entries lbproxy adopts, and the two flow halves each one
//! becomes (`lbproxy_common::flows`). Pure: the maps are read and written by
//! [`super::Takeover`].
//!
//! An entry is kube-proxy's when it is destination-NATed (`IPS_DST_NAT`): its original
//! tuple is client -> frontend, its reply tuple backend -> client (or -> this node's address
//! and a port, when kube-proxy also masqueraded it). Such an entry becomes:
//! - a forward half keyed by the original tuple, translating to the backend, with the
//!   client's source as the backend sees it (the reply tuple's destination);
//! - a reply half keyed by the reply tuple, restoring the frontend and the client.
//!
//! Both are first written as [`FlowAdopted::Conntrack`] (the entry keeps translating: the
//! client's packets pass untranslated), before any frontend is served, so that no packet of
//! a live flow is ever balanced anew. [`decide`] then says, once the Services are programmed,
//! whether lbproxy can carry the flow on itself ([`Decision::Adopt`]) or leaves it to
//! conntrack, and why ([`Left`]).

use std::net::IpAddr;
use std::time::Duration;

use lbproxy_common::{
    Addr, FLOW_ADOPTED_CONNTRACK, FLOW_DIR_FORWARD, FLOW_DIR_REPLY, FLOW_F_FIN,
    FLOW_STATE_ESTABLISHED, FLOW_STATE_NONE, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf,
    IPPROTO_TCP,
};

use crate::bpf::flow_gc::Timeouts;
use crate::conntrack::{
    Entry, TCP_CONNTRACK_CLOSE, TCP_CONNTRACK_CLOSE_WAIT, TCP_CONNTRACK_FIN_WAIT,
    TCP_CONNTRACK_LAST_ACK, TCP_CONNTRACK_SYN_SENT, TCP_CONNTRACK_TIME_WAIT, Tuple,
};

/// Why an entry of kube-proxy's is left to conntrack (the metric's `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Left {
    /// From a process of this node (kube-proxy's `OUTPUT` DNAT): its socket is connected to
    /// the frontend, and no program of lbproxy's sees its packets before netfilter.
    NodeProcess,
    /// A pod's flow to itself through a frontend, which kube-proxy masquerades to the node's
    /// address and lbproxy to a link-local one.
    Hairpin,
    /// Closed (TCP TIME_WAIT or CLOSE): nothing left to carry on. With `--takeover` the
    /// entry is deleted with the others, not left.
    Closed,
    /// Its original destination is no frontend lbproxy serves.
    NotFrontend,
    /// Its backend is not an endpoint of that frontend's Service in lbproxy's model.
    BackendNotMember,
    /// Masqueraded where lbproxy would keep the client's source (a ClusterIP, or a backend
    /// on this node), or to an address that is not one of this node's SNAT addresses.
    Masquerade,
}

impl Left {
    pub fn reason(self) -> &'static str {
        match self {
            Left::NodeProcess => "node_process",
            Left::Hairpin => "hairpin",
            Left::Closed => "closed",
            Left::NotFrontend => "not_a_frontend",
            Left::BackendNotMember => "backend_not_a_member",
            Left::Masquerade => "masquerade_lbproxy_would_not_make",
        }
    }
}

/// The address types of the two flow maps, made from an [`IpAddr`] of their family.
pub trait FromIp: Addr {
    fn from_ip(ip: IpAddr) -> Option<Self>;
}

impl FromIp for [u8; 4] {
    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(a) => Some(a.octets()),
            IpAddr::V6(_) => None,
        }
    }
}

impl FromIp for [u8; 16] {
    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(a) => Some(a.octets()),
            IpAddr::V4(_) => None,
        }
    }
}

/// One flow of kube-proxy's: its conntrack entry and the two halves it becomes.
#[derive(Clone, Copy, Debug)]
pub struct Adopted<A: Addr> {
    pub orig: Tuple,
    pub reply_tuple: Tuple,
    pub zone: u16,
    pub forward_key: FlowKeyOf<A>,
    pub forward: FlowValueOf<A>,
    pub reply_key: FlowKeyOf<A>,
    pub reply: FlowValueOf<A>,
}

impl<A: Addr> Adopted<A> {
    /// Whether kube-proxy also masqueraded the flow: the backend sees another source than
    /// the client's.
    pub fn masqueraded(&self) -> bool {
        self.reply_tuple.dst != self.orig.src
    }

    /// Both halves marked `adopted`, naming the service and backend ids lbproxy gave them.
    pub fn with(&mut self, adopted: u8, svc_id: u32, backend_id: u32) {
        for v in [&mut self.forward, &mut self.reply] {
            v.adopted = adopted;
            v.svc_id = svc_id;
            v.backend_id = backend_id;
        }
    }
}

/// The flow an entry of kube-proxy's becomes, written [`FlowAdopted::Conntrack`]
/// (`lbproxy_common::FlowAdopted`) with no service yet; `Err` when it is left to conntrack
/// without one (a node process's, a hairpin, a closed one). `None`: not kube-proxy's (not
/// destination-NATed) or not of this family.
///
/// The halves' idle clocks start where conntrack's stood: a flow with `t` of its timeout
/// left in conntrack is made idle for (lbproxy's timeout for its state - `t`), so it expires
/// about when conntrack would have expired it, and never earlier than `now`.
pub fn flow_of<A: FromIp>(
    e: &Entry,
    now_ns: u64,
    timeouts: &Timeouts,
    is_local: impl Fn(IpAddr) -> bool,
) -> Option<Result<Adopted<A>, Left>> {
    if !e.dnat() {
        return None;
    }
    let (o, r) = (&e.orig, &e.reply);
    let (client, vip) = (A::from_ip(o.src)?, A::from_ip(o.dst)?);
    let (backend, peer) = (A::from_ip(r.src)?, A::from_ip(r.dst)?);
    if is_local(o.src) {
        return Some(Err(Left::NodeProcess));
    }
    if o.src == r.src {
        return Some(Err(Left::Hairpin));
    }
    let (state, fin) = state_of(e);
    let forward_key = key(
        client,
        vip,
        o.src_port,
        o.dst_port,
        o.proto,
        FLOW_DIR_FORWARD,
    );
    let reply_key = key(
        backend,
        peer,
        r.src_port,
        r.dst_port,
        o.proto,
        FLOW_DIR_REPLY,
    );
    let mut forward = value(backend, r.src_port, peer, r.dst_port, state, now_ns);
    let mut reply = value(vip, o.dst_port, client, o.src_port, state, now_ns);
    forward.flags = if fin { FLOW_F_FIN } else { 0 };
    let idle = idle_already(&forward_key, &forward, timeouts, e.timeout_s);
    let since = now_ns.saturating_sub(u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX));
    forward.last_seen_ns = since;
    reply.last_seen_ns = since;
    let closed = e
        .tcp_state
        .is_some_and(|s| (TCP_CONNTRACK_TIME_WAIT..=TCP_CONNTRACK_CLOSE).contains(&s));
    let a = Adopted {
        orig: *o,
        reply_tuple: *r,
        zone: e.zone,
        forward_key,
        forward,
        reply_key,
        reply,
    };
    Some(if closed { Err(Left::Closed) } else { Ok(a) })
}

/// What lbproxy does with an adopted flow once its Services are programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Carry it on: service and backend ids.
    Adopt { svc_id: u32, backend_id: u32 },
    /// Leave it to conntrack; its halves stay [`FlowAdopted::Conntrack`] so that lbproxy
    /// never balances its packets anew.
    Keep(Left),
    /// Not a frontend of lbproxy's: its halves are removed, the entry left to conntrack.
    Forget(Left),
}

/// What [`decide`] needs to know of the programmed maps about one flow.
#[derive(Clone, Copy, Debug)]
pub struct Facts {
    /// The frontend's service id and whether it is a ClusterIP, if the original
    /// destination is a frontend.
    pub frontend: Option<(u32, bool)>,
    /// The backend's id among that service's members.
    pub member: Option<u32>,
    /// The masquerade address is a SNAT address of this node.
    pub peer_is_snat_address: bool,
    /// The backend is a pod of this node.
    pub backend_is_local_pod: bool,
}

/// Whether lbproxy carries a flow of kube-proxy's on (`masqueraded`: see
/// [`Adopted::masqueraded`]). lbproxy source-NATs only traffic from outside the node to a
/// backend on another node, to a SNAT address of the node; a flow kube-proxy masqueraded
/// otherwise would reach its backend from another source under lbproxy, so it stays
/// conntrack's.
pub fn decide(masqueraded: bool, f: &Facts) -> Decision {
    let Some((svc_id, cluster_ip)) = f.frontend else {
        return Decision::Forget(Left::NotFrontend);
    };
    let Some(backend_id) = f.member else {
        return Decision::Keep(Left::BackendNotMember);
    };
    if masqueraded && (cluster_ip || !f.peer_is_snat_address || f.backend_is_local_pod) {
        return Decision::Keep(Left::Masquerade);
    }
    Decision::Adopt { svc_id, backend_id }
}

/// lbproxy's state for a conntrack entry, and whether one side has sent its FIN. Conntrack's
/// SYN_RECV (the backend answered) is established here, as lbproxy moves a flow on at the
/// backend's first answer.
fn state_of(e: &Entry) -> (u8, bool) {
    if e.orig.proto != IPPROTO_TCP {
        return (FLOW_STATE_NONE, false);
    }
    match e.tcp_state {
        Some(TCP_CONNTRACK_SYN_SENT) => (FLOW_STATE_SYN_SENT, false),
        Some(TCP_CONNTRACK_FIN_WAIT | TCP_CONNTRACK_CLOSE_WAIT | TCP_CONNTRACK_LAST_ACK) => {
            (FLOW_STATE_ESTABLISHED, true)
        }
        _ => (FLOW_STATE_ESTABLISHED, false),
    }
}

/// How long the flow is to count as idle already: lbproxy's timeout for it less what
/// conntrack had left (0 when conntrack had more left).
fn idle_already<A: Addr>(
    k: &FlowKeyOf<A>,
    v: &FlowValueOf<A>,
    timeouts: &Timeouts,
    left_s: u32,
) -> Duration {
    timeouts
        .for_flow(k, v, None)
        .saturating_sub(Duration::from_secs(u64::from(left_s)))
}

fn key<A: Addr>(src: A, dst: A, sport: u16, dport: u16, proto: u8, dir: u8) -> FlowKeyOf<A> {
    FlowKeyOf {
        src_addr: src,
        dst_addr: dst,
        src_port_be: sport.to_be(),
        dst_port_be: dport.to_be(),
        proto,
        dir,
        _pad: [0; 2],
    }
}

fn value<A: Addr>(
    nat: A,
    nat_port: u16,
    peer: A,
    peer_port: u16,
    state: u8,
    now_ns: u64,
) -> FlowValueOf<A> {
    FlowValueOf {
        nat_addr: nat,
        nat_port_be: nat_port.to_be(),
        peer_port_be: peer_port.to_be(),
        state,
        flags: 0,
        _pad: [0; 2],
        svc_id: 0,
        backend_id: 0,
        ifindex: 0,
        _pad_a: A::PAD,
        created_ns: now_ns,
        last_seen_ns: now_ns,
        peer_addr: peer,
        adopted: FLOW_ADOPTED_CONNTRACK,
        dispatch: 0,
        _reserved: [0; 2],
        _pad_b: A::PAD,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conntrack::{IPS_DST_NAT, IPS_SRC_NAT, TCP_CONNTRACK_ESTABLISHED};
    use std::net::Ipv4Addr;

    fn t(src: [u8; 4], sp: u16, dst: [u8; 4], dp: u16, proto: u8) -> Tuple {
        Tuple {
            src: Ipv4Addr::from(src).into(),
            dst: Ipv4Addr::from(dst).into(),
            src_port: sp,
            dst_port: dp,
            proto,
        }
    }

    fn entry(reply_dst: [u8; 4], reply_dport: u16, status: u32) -> Entry {
        Entry {
            orig: t([10, 0, 0, 5], 40000, [10, 96, 0, 10], 80, IPPROTO_TCP),
            reply: t([10, 0, 1, 7], 8080, reply_dst, reply_dport, IPPROTO_TCP),
            status,
            timeout_s: 86_000,
            tcp_state: Some(TCP_CONNTRACK_ESTABLISHED),
            mark: 0,
            zone: 0,
        }
    }

    #[test]
    fn halves_name_each_other_and_translate_as_the_entry() {
        let e = entry([10, 0, 0, 5], 40000, IPS_DST_NAT);
        let a = flow_of::<[u8; 4]>(&e, 1_000_000_000_000, &Timeouts::default(), |_| false)
            .unwrap()
            .unwrap();
        assert_eq!(a.forward_key.partner(&a.forward), a.reply_key);
        assert_eq!(a.reply_key.partner(&a.reply), a.forward_key);
        assert_eq!(a.forward.nat_addr, [10, 0, 1, 7]);
        assert_eq!(u16::from_be(a.forward.nat_port_be), 8080);
        assert_eq!(a.reply.nat_addr, [10, 96, 0, 10]);
        assert_eq!(a.forward.adopted, FLOW_ADOPTED_CONNTRACK);
        assert_eq!(a.forward.state, FLOW_STATE_ESTABLISHED);
        assert!(!a.masqueraded());
        // 86,000 s of 86,400 left: idle for 400 s already.
        assert_eq!(a.forward.last_seen_ns, 1_000_000_000_000 - 400_000_000_000);
    }

    #[test]
    fn masqueraded_flows_keep_their_source_nat() {
        let e = entry([192, 168, 0, 1], 61000, IPS_DST_NAT | IPS_SRC_NAT);
        let a = flow_of::<[u8; 4]>(&e, 0, &Timeouts::default(), |_| false)
            .unwrap()
            .unwrap();
        assert!(a.masqueraded());
        assert_eq!(a.forward.peer_addr, [192, 168, 0, 1]);
        assert_eq!(u16::from_be(a.forward.peer_port_be), 61000);
        assert_eq!(a.reply.peer_addr, [10, 0, 0, 5]);
    }

    #[test]
    fn not_kube_proxys_or_left_to_conntrack() {
        let plain = entry([10, 0, 0, 5], 40000, 0);
        assert!(flow_of::<[u8; 4]>(&plain, 0, &Timeouts::default(), |_| false).is_none());
        let e = entry([10, 0, 0, 5], 40000, IPS_DST_NAT);
        assert!(flow_of::<[u8; 16]>(&e, 0, &Timeouts::default(), |_| false).is_none());
        let node = flow_of::<[u8; 4]>(&e, 0, &Timeouts::default(), |_| true).unwrap();
        assert_eq!(node.unwrap_err(), Left::NodeProcess);
        let mut closed = e;
        closed.tcp_state = Some(TCP_CONNTRACK_TIME_WAIT);
        let c = flow_of::<[u8; 4]>(&closed, 0, &Timeouts::default(), |_| false).unwrap();
        assert_eq!(c.unwrap_err(), Left::Closed);
    }

    #[test]
    fn decisions() {
        let f = Facts {
            frontend: Some((7, false)),
            member: Some(3),
            peer_is_snat_address: true,
            backend_is_local_pod: false,
        };
        assert_eq!(
            decide(true, &f),
            Decision::Adopt {
                svc_id: 7,
                backend_id: 3
            }
        );
        let local = Facts {
            backend_is_local_pod: true,
            ..f
        };
        assert_eq!(decide(true, &local), Decision::Keep(Left::Masquerade));
        assert_eq!(
            decide(false, &local),
            Decision::Adopt {
                svc_id: 7,
                backend_id: 3
            }
        );
        let cip = Facts {
            frontend: Some((7, true)),
            ..f
        };
        assert_eq!(decide(true, &cip), Decision::Keep(Left::Masquerade));
        let gone = Facts { member: None, ..f };
        assert_eq!(decide(false, &gone), Decision::Keep(Left::BackendNotMember));
        let none = Facts {
            frontend: None,
            ..f
        };
        assert_eq!(decide(false, &none), Decision::Forget(Left::NotFrontend));
    }
}
