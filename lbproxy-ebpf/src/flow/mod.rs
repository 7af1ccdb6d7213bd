//! Stage 3: the flow table. lbproxy's own state, not the kernel's conntrack.
//!
//! Written once for both families (`family::Family`): `LB_FLOWS_V3` holds the IPv4 flows,
//! `LB_FLOWS6_V1` the IPv6 ones, with the same halves.
//!
//! A flow is two entries in `LB_FLOWS_V3`, its halves: a forward entry keyed by the client's
//! packet (client -> VIP) that names the backend, and a reply entry keyed by the backend's
//! packet (backend -> client) that names the VIP to restore. Each half names its partner
//! (`lbproxy_common::flows`), and the halves live and die together:
//! - every packet that hits one half looks up the other; a missing partner (evicted by the
//!   LRU alone) is recreated from this half and counted (`flow_half_recreated`);
//! - the collector in userspace expires both halves at once, by the state of both.
//!
//! A forward entry whose backend is no longer a member of its service (`LB_MEMBERS_V1`:
//! gone from every slice of that service, even if another service still has the same
//! address and port), or whose service was replaced, is treated as a new flow on its next
//! packet.
//!
//! **Tuple clash.** Two VIPs can share a backend, and a client may use one source port
//! towards both at once (a source port need only be unique per destination). After DNAT both
//! flows would be the same tuple, client:port -> backend. As netfilter does, the second flow
//! gets another source port (`peer_port_be`), which its reply half restores, and the clash
//! is counted (`tuple_clash_port_rewritten`).
//!
//! **Source NAT.** A flow from outside the node to a backend on another node leaves with the
//! node's address (`peer_addr`) and a port of the SNAT range, so the backend's replies come
//! back here. The port is claimed by inserting the reply half with `BPF_NOEXIST`: it is
//! unique per (SNAT address, backend address and port, protocol), so the range is a
//! per-destination port space. The client's own port is tried first (when it is in the
//! range), then random ports, then a linear scan, each bounded.
//!
//! Entries are never written whole in place: a new flow on a known tuple replaces its entries
//! with a map update, which another CPU sees entirely or not at all. Live entries only get
//! single-field writes (`state`, `flags`, `last_seen_ns`, `created_ns`, `ifindex`), and only
//! of fields no translation reads: a new flow that makes the same choice as the tuple's
//! previous one (same service, backend and reply tuple) is started in place that way.

use aya_ebpf::bindings::BPF_ANY;
use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;
use lbproxy_common::{
    Addr, CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_STRAYS_TO_CONNTRACK, DropReason,
    FLOW_ADOPTED_CONNTRACK, FLOW_DIR_FORWARD, FLOW_DIR_REPLY, FLOW_DISPATCH_DSR,
    FLOW_STATE_ESTABLISHED, FLOW_STATE_NONE, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf, FlowWork,
    IPPROTO_TCP, IPPROTO_UDP, ServiceValue,
};

mod halves;
mod new;

use self::{
    halves::{insert, key_of, note_close, pairs, recreate_partner, reply_key, touch},
    new::{Previous, Reusable, create},
};
use crate::{
    family::Family,
    lb::{affinity, select},
    maps,
    packet::Packet,
    reason::count,
    stage::{NatTarget, Source, Verdict},
    svc_stats,
};

// The histogram's slots cover every try count: the client's own port, then these.

/// Forward direction: the backend this client packet goes to. Reuses the flow's backend while
/// it is live; otherwise selects one and records both halves.
///
/// A flow whose backend left its service (no longer a member of it in `LB_MEMBERS_V1`, or
/// the service replaced) is noticed here, on its next packet:
/// - UDP and a TCP SYN are treated as a new flow and go to a live backend;
/// - any other TCP segment is answered with a RST (`Reject`), so the client reconnects
///   instead of hanging, and the flow is forgotten.
///
/// A TCP flow still in SYN_SENT (the backend never answered) that sees another SYN, a
/// retransmission from the same source port, is also treated as new: it is never pinned to a
/// backend that did not answer. So is a SYN on a flow that saw a FIN or RST (the source
/// port reused).
///
/// `seed` is the node's flow-hash seed (`DatapathConfig::hash_seed`), used only when a
/// backend (or a port for a clashing tuple) is chosen.
///
/// `source` says, for the backend a new flow selects, whether the flow keeps the client's
/// source or is source-NATed (see [`Source`]); a pod's flows always keep it.
///
/// `verify` is the source check (`source::check`) of the packet, arriving on interface
/// `ingress`. It runs before anything is created, changed or answered, except for a packet
/// of a flow whose client packets already passed it on the same interface (the forward
/// half's `ifindex`), or of a new flow on such a flow's tuple (a SYN retransmitted, a port
/// reused): a pod cannot send on another pod's interface, so the check is paid once per
/// tuple and interface, not per packet.
#[inline(always)]
pub fn forward<A: Family>(
    pkt: &Packet<A>,
    svc: &ServiceValue,
    seed: u64,
    ingress: u32,
    verify: impl Fn() -> Result<(), DropReason>,
    source: impl Fn(A, u16) -> Result<Source<A>, DropReason>,
) -> Result<NatTarget<A>, Verdict> {
    let Some(w) = A::work() else {
        return Err(Verdict::Drop(DropReason::FlowInsertFailed));
    };
    w.key = key_of(pkt, FLOW_DIR_FORWARD);
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let mut prev = Previous {
        verified: false,
        has_old: false,
        reusable: None,
    };
    if let Some(target) = established(pkt, svc, ingress, &verify, w, now, &mut prev)? {
        return Ok(target);
    }
    if !prev.verified {
        verify().map_err(Verdict::Drop)?;
    }
    if to_conntrack(pkt) {
        return Ok(NatTarget::conntrack());
    }
    let (backend_id, backend) = if svc.affinity_timeout_s != 0 {
        affinity::select(pkt, svc, now, seed)?
    } else {
        select::select(svc, pkt, seed)?
    };
    let state = if pkt.proto != IPPROTO_TCP {
        FLOW_STATE_NONE
    } else if pkt.is_syn() {
        FLOW_STATE_SYN_SENT
    } else {
        // Mid-stream without an entry (evicted from a full table, or older than lbproxy):
        // counted, and the new backend will answer or reset it.
        count(DropReason::MidstreamWithoutFlow);
        FLOW_STATE_ESTABLISHED
    };
    w.backend = backend;
    let nat_source = source(w.backend.addr, w.backend.port_be).map_err(Verdict::Drop)?;
    let target = create(
        pkt,
        svc,
        seed,
        ingress,
        w,
        now,
        &prev,
        backend_id,
        state,
        &nat_source,
    )?;
    svc_stats::new_flow(svc.svc_id);
    Ok(target)
}

/// Whether a packet of no flow is conntrack's, passed untranslated (no flow made): any one
/// while a hand-back gives the node back to kube-proxy's rules
/// (`CONFIG_F_NEW_TO_CONNTRACK`), a TCP packet other than a SYN while connections that
/// kube-proxy's rules opened may not be adopted yet (`CONFIG_F_STRAYS_TO_CONNTRACK`).
#[inline(always)]
fn to_conntrack<A: Family>(pkt: &Packet<A>) -> bool {
    let flags = maps::config().flags;
    flags & CONFIG_F_NEW_TO_CONNTRACK != 0
        || (flags & CONFIG_F_STRAYS_TO_CONNTRACK != 0 && pkt.proto == IPPROTO_TCP && !pkt.is_syn())
}

/// The flow stage's lookup (`w.key`, the packet's forward key): the translation of an
/// established flow, or `None` when the packet starts a new one (what the tuple's previous
/// flow leaves for it is then in `prev`). A TCP packet other than a SYN of a flow whose
/// backend left is rejected (`BackendGoneReset`), both halves forgotten.
#[inline(always)]
fn established<A: Family>(
    pkt: &Packet<A>,
    svc: &ServiceValue,
    ingress: u32,
    verify: &impl Fn() -> Result<(), DropReason>,
    w: &mut FlowWork<A>,
    now: u64,
    prev: &mut Previous<A>,
) -> Result<Option<NatTarget<A>>, Verdict> {
    let key = &w.key;
    let Some(entry) = A::flow(key) else {
        return Ok(None);
    };
    // SAFETY: a successful lookup. Fields are only written one at a time elsewhere, so
    // each one read here is whole.
    let f = unsafe { &*entry };
    if f.ifindex != ingress {
        verify().map_err(Verdict::Drop)?;
        // SAFETY: a single-field write to an entry from a successful lookup.
        unsafe { (*entry).ifindex = ingress };
    }
    // Checked now, or passed before on this same interface with this same source (the
    // key's): a new flow on this tuple (a SYN retransmitted, a port reused) is not
    // checked again.
    prev.verified = true;
    // Live while its backend is still a member (serving or draining) of this very
    // service: a backend that left it is not, even if another service still holds the
    // same address and port (and so its backend id). A member's id is held by the
    // service, so it still names the address the flow was translated to.
    //
    // A flow adopted from conntrack and still translated by its entry is live whatever
    // lbproxy's model says (its ids are not known before the first sync): its packets pass
    // untranslated (the hook sees `FlowAdopted::Conntrack` in the target).
    let live = f.adopted == FLOW_ADOPTED_CONNTRACK || serves(f, svc);
    w.rkey = key.partner(f);
    let rkey = &w.rkey;
    let partner = A::flow(rkey);
    // SAFETY: as above.
    let (ours, partner_flags) = match partner {
        Some(r) => unsafe { (pairs(key, f, &*r), (*r).flags) },
        None => (false, 0),
    };
    // A SYN on a flow that never got an answer, or that saw a FIN or RST either way
    // (source port reused), starts over.
    let syn_retry =
        pkt.is_syn() && (f.state == FLOW_STATE_SYN_SENT || (f.flags | partner_flags) != 0);
    let target = NatTarget::of(f);
    if live && !syn_retry && (ours || partner.is_none()) {
        touch(entry, now);
        note_close(entry, pkt);
        dsr_established(entry, partner, pkt);
        if partner.is_none() {
            // The reply half was evicted alone: recreate it from this one, or the
            // backend's answers would leave untranslated.
            recreate_partner(
                rkey,
                entry,
                (pkt.dst_addr, pkt.dst_port_be),
                (pkt.src_addr, pkt.src_port_be),
                f.state,
                now,
                &mut w.value,
            );
        }
        return Ok(Some(target));
    }
    if ours {
        w.old_reply = *rkey;
        prev.has_old = true;
        if let Some(r) = partner {
            prev.reusable = Some(Reusable {
                forward: entry,
                reply: r,
                svc_id: f.svc_id,
                backend_id: f.backend_id,
            });
        }
    }
    if !live && pkt.proto == IPPROTO_TCP && !pkt.is_syn() {
        // Forget both halves of the old flow.
        if ours {
            A::flow_remove(rkey);
        }
        A::flow_remove(key);
        return Err(Verdict::Reject(DropReason::BackendGoneReset));
    }
    if live && !syn_retry {
        // Live, but its reply tuple now belongs to another flow: this flow lost its
        // reply half and starts over.
        count(DropReason::FlowHalfRecreated);
    }
    Ok(None)
}

/// Whether flow half `f` still translates for frontend `svc`: its backend is still a member
/// (serving or draining) of this very service.
#[inline(always)]
fn serves<A: Family>(f: &FlowValueOf<A>, svc: &ServiceValue) -> bool {
    f.svc_id == svc.svc_id && select::is_member(svc.svc_id, f.backend_id)
}

/// [`forward`]'s fast path alone, for the XDP program (`xdp`): the translation of a packet
/// whose flow is established and needs nothing decided, or `None` for any other (a SYN, a
/// flow not lbproxy's own or not live, a missing or foreign partner, another ingress
/// interface), which is left untouched for the TC program's whole flow stage. What it
/// writes is what every packet of such a flow writes there (`touch`, `note_close`), so a
/// packet it answered `None` for can go through [`forward`] as if it had never run.
#[inline(always)]
pub fn established_only<A: Family>(
    pkt: &Packet<A>,
    svc: &ServiceValue,
    ingress: u32,
) -> Option<NatTarget<A>> {
    if pkt.is_syn() {
        return None;
    }
    let w = A::work()?;
    w.key = key_of(pkt, FLOW_DIR_FORWARD);
    let entry = A::flow(&w.key)?;
    // SAFETY: a successful lookup; see `established`.
    let f = unsafe { &*entry };
    if f.ifindex != ingress || f.adopted != 0 || !serves(f, svc) {
        return None;
    }
    w.rkey = w.key.partner(f);
    let r = A::flow(&w.rkey)?;
    // SAFETY: as above.
    if !pairs(&w.key, f, unsafe { &*r }) {
        return None;
    }
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    touch(entry, now);
    note_close(entry, pkt);
    dsr_established(entry, Some(r), pkt);
    Some(NatTarget::of(f))
}

/// A TCP flow dispatched with direct server return never shows this node the backend's
/// answer: the client's first packet after its SYN (the handshake's ACK) says the backend
/// answered, and moves the flow from SYN_SENT to ESTABLISHED, both halves, as the answer
/// does for any other flow ([`reply`]).
#[inline(always)]
fn dsr_established<A: Addr>(
    entry: *mut FlowValueOf<A>,
    partner: Option<*mut FlowValueOf<A>>,
    pkt: &Packet<A>,
) {
    // SAFETY: entries from successful lookups in this run; single-byte writes.
    unsafe {
        if (*entry).dispatch != FLOW_DISPATCH_DSR
            || (*entry).state != FLOW_STATE_SYN_SENT
            || pkt.proto != IPPROTO_TCP
            || pkt.is_syn()
        {
            return;
        }
        (*entry).state = FLOW_STATE_ESTABLISHED;
        if let Some(r) = partner {
            (*r).state = FLOW_STATE_ESTABLISHED;
        }
    }
}

/// On the backend's node: records the flow of `pkt` (client -> backend, translated by the
/// node that received it) that another node dispatched here with direct server return,
/// carrying frontend `fe` (`dsr`). Both halves are written as this node would write a flow
/// of its own to a backend on this node, so the backend's replies are translated back to
/// come from `fe` as they leave the node (`lb_to_node`), and so are ICMP errors about the
/// client's packets; `inspect flows` lists it. The backend is known by its address (its id
/// here is 0: the receiving node chose it). A packet of a flow already recorded with the
/// same frontend only touches it. `Err(FlowInsertFailed)` when a half could not be
/// written, as for any new flow (`halves::insert`).
#[inline(always)]
pub fn record_dispatched<A: Family>(
    pkt: &Packet<A>,
    fe: (&A, u16),
    svc_id: u32,
) -> Result<(), DropReason> {
    let Some(w) = A::work() else {
        return Err(DropReason::FlowInsertFailed);
    };
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    w.rkey = reply_key(
        pkt.dst_addr,
        pkt.dst_port_be,
        pkt.src_addr,
        pkt.src_port_be,
        pkt.proto,
    );
    if let Some(r) = A::flow(&w.rkey) {
        // SAFETY: a successful lookup.
        let v = unsafe { &*r };
        if v.dispatch == FLOW_DISPATCH_DSR
            && v.nat_addr == *fe.0
            && v.nat_port_be == fe.1
            && v.peer_addr == pkt.src_addr
            && v.peer_port_be == pkt.src_port_be
            && !pkt.is_syn()
        {
            touch(r, now);
            return Ok(());
        }
    }
    let v = &mut w.value;
    v.nat_addr = *fe.0;
    v.nat_port_be = fe.1;
    v.peer_port_be = pkt.src_port_be;
    v.state = if pkt.proto != IPPROTO_TCP {
        FLOW_STATE_NONE
    } else if pkt.is_syn() {
        FLOW_STATE_SYN_SENT
    } else {
        FLOW_STATE_ESTABLISHED
    };
    v.flags = 0;
    v._pad = [0; 2];
    v.svc_id = svc_id;
    v.backend_id = 0;
    v.ifindex = 0;
    v._pad_a = A::PAD;
    v.created_ns = now;
    v.last_seen_ns = now;
    v.peer_addr = pkt.src_addr;
    v.adopted = 0;
    v.dispatch = FLOW_DISPATCH_DSR;
    v._reserved = [0; 2];
    v._pad_b = A::PAD;
    insert(&w.rkey, v, BPF_ANY).map_err(|v| v.reason())?;
    // The forward half: client -> frontend, naming the backend.
    w.key = FlowKeyOf {
        src_addr: pkt.src_addr,
        dst_addr: *fe.0,
        src_port_be: pkt.src_port_be,
        dst_port_be: fe.1,
        proto: pkt.proto,
        dir: FLOW_DIR_FORWARD,
        _pad: [0; 2],
    };
    v.nat_addr = pkt.dst_addr;
    v.nat_port_be = pkt.dst_port_be;
    insert(&w.key, v, BPF_ANY).map_err(|v| v.reason())
}

/// Reply direction: the VIP:port a backend's packet to a client must appear to come from
/// (and the client's own port), or `None` when the packet is not a reply of a load-balanced
/// flow, or of one adopted from conntrack whose entry still translates it (in every hook:
/// its answers are that entry's), unless the packet is `untracked`: an answer marked for the
/// untrack rule (`untrack::marked`, read after the stack) while its flow was lbproxy's, whose
/// flow a hand-back gave to conntrack as it crossed the stack; conntrack translated none of
/// it. The first TCP answer from the backend moves the flow from SYN_SENT to ESTABLISHED.
#[inline(always)]
pub fn reply<A: Family>(pkt: &Packet<A>, untracked: bool) -> Option<NatTarget<A>> {
    let w = A::work()?;
    w.key = key_of(pkt, FLOW_DIR_REPLY);
    let key = &w.key;
    let entry = A::flow(key)?;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // SAFETY: a successful lookup; see `forward`.
    let r = unsafe { &*entry };
    w.rkey = key.partner(r);
    let fkey = &w.rkey;
    let established = pkt.proto == IPPROTO_TCP && r.state == FLOW_STATE_SYN_SENT;
    match A::flow(fkey) {
        Some(f) => {
            // SAFETY: as above.
            let fv = unsafe { &*f };
            if fv.nat_addr != pkt.src_addr
                || fv.nat_port_be != pkt.src_port_be
                || fv.peer_port_be != pkt.dst_port_be
                || fv.peer_addr != pkt.dst_addr
            {
                // The client's tuple now belongs to another flow (a new connection from the
                // same port went to another backend): this half is left over from the old
                // one. Forget it; the packet passes as it is.
                A::flow_remove(key);
                count(DropReason::StaleReplyRemoved);
                return None;
            }
            if established {
                // SAFETY: single-byte writes to entries from successful lookups.
                unsafe {
                    (*f).state = FLOW_STATE_ESTABLISHED;
                    (*entry).state = FLOW_STATE_ESTABLISHED;
                }
            }
        }
        None => {
            // The forward half was evicted alone: recreate it, so the client's next packet
            // keeps this backend.
            let state = if established {
                FLOW_STATE_ESTABLISHED
            } else {
                r.state
            };
            recreate_partner(
                fkey,
                entry,
                (pkt.src_addr, pkt.src_port_be),
                (pkt.dst_addr, pkt.dst_port_be),
                state,
                now,
                &mut w.value,
            );
            if established {
                // SAFETY: as above.
                unsafe { (*entry).state = FLOW_STATE_ESTABLISHED };
            }
        }
    }
    touch(entry, now);
    note_close(entry, pkt);
    if r.adopted == FLOW_ADOPTED_CONNTRACK && !untracked {
        // Adopted, and its conntrack entry still translates it: the client's packets pass
        // to that entry, so the answers must too. Translated by lbproxy, past netfilter, they
        // would leave the entry's TCP window behind (it never saw the data they
        // acknowledge): the client's next ACK would be INVALID, delivered untranslated and
        // reset. Kept alive (touched) all the same, as long as the connection is.
        return None;
    }
    Some(NatTarget::of(r))
}

/// A packet from a pod that is not addressed to a frontend: a direct connection. When its
/// tuple is exactly the backend side of a recent VIP flow, that flow's reply half would
/// rewrite the direct connection's replies to the VIP. The old flow is forgotten when it is
/// over (TCP: this is a SYN and the VIP flow saw a RST, FINs both ways, or lost its forward
/// half) or, for UDP, always: the client now talks to the backend directly from that port.
/// Counted as `stale_reply_removed`. Only a TCP SYN or a UDP packet costs a lookup.
#[inline(always)]
pub fn direct<A: Family>(pkt: &Packet<A>) {
    if !(pkt.is_syn() || pkt.proto == IPPROTO_UDP) {
        return;
    }
    let rkey = reply_key(
        pkt.dst_addr,
        pkt.dst_port_be,
        pkt.src_addr,
        pkt.src_port_be,
        pkt.proto,
    );
    let Some(r) = A::flow(&rkey) else {
        return;
    };
    // SAFETY: a successful lookup.
    let r = unsafe { &*r };
    let fkey = rkey.partner(r);
    let over = pkt.proto == IPPROTO_UDP
        || match A::flow(&fkey) {
            // SAFETY: as above.
            Some(f) => unsafe { r.closed_with((*f).flags) },
            None => true,
        };
    if over {
        A::flow_remove(&rkey);
        A::flow_remove(&fkey);
        count(DropReason::StaleReplyRemoved);
    }
}

/// The reply half of the flow whose translated forward packet was `src:sport -> dst:dport`
/// (client -> backend), as quoted by an ICMP error: the VIP and the client's own port. Read
/// only; `icmp` uses it.
#[inline(always)]
pub fn quoted_reply<A: Family>(
    proto: u8,
    dst: A,
    dport: u16,
    src: A,
    sport: u16,
) -> Option<NatTarget<A>> {
    let key = reply_key(dst, dport, src, sport, proto);
    let r = A::flow(&key)?;
    // SAFETY: a successful lookup; the fields are read once each.
    Some(NatTarget::of(unsafe { &*r }))
}

/// [`quoted_reply`] (`reply`) or [`quoted_forward`] as the flow entry itself, its key built
/// in the family's working state (`Family::work`): nothing of either takes stack room (the
/// ICMPv6 path is short of it). The addresses are read from `quote`, an IPv6 header as an
/// ICMPv6 error quotes it (source at 8, destination at 24).
#[inline(always)]
pub fn quoted_entry6(
    reply: bool,
    proto: u8,
    quote: &[u8; 48],
    sport: u16,
    dport: u16,
) -> Option<&'static FlowValueOf<[u8; 16]>> {
    let w = <[u8; 16]>::work()?;
    let (src, dst) = (&quote[8..24], &quote[24..40]);
    if reply {
        // The quote is client -> backend: its reply half is keyed backend -> client.
        w.key.src_addr.copy_from_slice(dst);
        w.key.dst_addr.copy_from_slice(src);
        w.key.src_port_be = dport;
        w.key.dst_port_be = sport;
        w.key.dir = FLOW_DIR_REPLY;
    } else {
        // The quote is VIP -> client: its forward half is keyed client -> VIP.
        w.key.src_addr.copy_from_slice(dst);
        w.key.dst_addr.copy_from_slice(src);
        w.key.src_port_be = dport;
        w.key.dst_port_be = sport;
        w.key.dir = FLOW_DIR_FORWARD;
    }
    w.key.proto = proto;
    w.key._pad = [0; 2];
    let e = <[u8; 16]>::flow(&w.key)?;
    // SAFETY: a successful lookup; read only, field by field.
    Some(unsafe { &*e })
}

/// The forward half of the flow whose reverse-translated reply was `src:sport -> dst:dport`
/// (VIP -> client), as quoted by an ICMP error: the backend and the client's port as the
/// backend knows it. Read only; `icmp` uses it.
#[inline(always)]
pub fn quoted_forward<A: Family>(
    proto: u8,
    dst: A,
    dport: u16,
    src: A,
    sport: u16,
) -> Option<NatTarget<A>> {
    let key = FlowKeyOf {
        src_addr: dst,
        dst_addr: src,
        src_port_be: dport,
        dst_port_be: sport,
        proto,
        dir: FLOW_DIR_FORWARD,
        _pad: [0; 2],
    };
    let f = A::flow(&key)?;
    // SAFETY: as above.
    Some(NatTarget::of(unsafe { &*f }))
}
