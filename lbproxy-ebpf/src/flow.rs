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

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::generated::bpf_ktime_get_coarse_ns,
};
use lbproxy_common::{
    Addr, DropReason, FLOW_DIR_FORWARD, FLOW_DIR_REPLY, FLOW_F_FIN, FLOW_F_RST,
    FLOW_STATE_ESTABLISHED, FLOW_STATE_NONE, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf,
    IPPROTO_TCP, IPPROTO_UDP, ServiceValue,
    select::{CLASH_PORT_ATTEMPTS, clash_port},
};

use crate::{
    family::Family,
    lb::{affinity, select},
    maps::LB_SNATTRIES_V1,
    parse::{Packet, TCP_FLAG_FIN, TCP_FLAG_RST},
    reason::{Verdict, count},
};

/// `last_seen_ns` is refreshed at most this often, to keep writes off the hot path.
const TOUCH_INTERVAL_NS: u64 = 1_000_000_000;

/// Where a packet is translated to.
#[derive(Clone, Copy)]
pub struct NatTarget<A = [u8; 4]> {
    /// Forward: the backend. Reply: the VIP.
    pub addr: A,
    pub port_be: u16,
    /// The client's port on the far side of the translation. Forward: the source port the
    /// backend sees (the client's own, unless the tuple clashed or the flow is
    /// source-NATed). Reply: the client's own port, restored as the destination port.
    pub peer_port_be: u16,
    /// The same for the address. Forward: the source address the backend sees (the
    /// client's own, or the node's when source-NATed). Reply: the client's own address.
    pub peer_addr: A,
}

impl<A: Addr> NatTarget<A> {
    #[inline(always)]
    fn of(v: &FlowValueOf<A>) -> NatTarget<A> {
        NatTarget {
            addr: v.nat_addr,
            port_be: v.nat_port_be,
            peer_port_be: v.peer_port_be,
            peer_addr: v.peer_addr,
        }
    }
}

/// Where a new flow's packets come from as the backend sees them: the client itself
/// ([`Source::CLIENT`]); source-NATed (`snat`) to the node's address `addr` on the interface
/// towards the backend with a port of the SNAT range (`min..=max`, host order); or, without
/// `snat`, from another address `addr` with the client's own port (a pod's flow to itself,
/// `hairpin`), moved like a clashing tuple's when another flow holds it.
///
/// A struct whose every field is always set, not an enum with payload: the fields of an
/// enum variant not taken are undefined, and LLVM may then compute with whatever register
/// it likes, a map pointer included, which the verifier refuses. A caller whose sources
/// never set `snat` (`lb_from_pod`) has the SNAT port search folded away.
#[derive(Clone, Copy)]
pub struct Source<A = [u8; 4]> {
    pub snat: bool,
    /// The source address the backend sees; the unspecified address: the client's own.
    pub addr: A,
    pub min: u16,
    pub max: u16,
}

impl<A: Addr> Source<A> {
    pub const CLIENT: Source<A> = Source {
        snat: false,
        addr: A::ZERO,
        min: 0,
        max: 0,
    };
}

/// Tries for a SNAT port: random ones first, then linear.
const SNAT_ATTEMPTS: u32 = 16;
// The histogram's slots cover every try count: the client's own port, then these.
const _: () = assert!(lbproxy_common::snat_tries::MAX_SNAT_TRIES == SNAT_ATTEMPTS + 1);
const SNAT_RANDOM_ATTEMPTS: u32 = 8;

#[inline(always)]
fn touch<A: Addr>(entry: *mut FlowValueOf<A>, now: u64) {
    // SAFETY: `entry` came from a successful lookup; a racing writer can only store another
    // timestamp, which is harmless.
    unsafe {
        if now.wrapping_sub((*entry).last_seen_ns) > TOUCH_INTERVAL_NS {
            (*entry).last_seen_ns = now;
        }
    }
}

/// Records this packet's FIN or RST in its own half's `flags` (a single-byte write, and only
/// when it changes).
#[inline(always)]
fn note_close<A: Addr>(entry: *mut FlowValueOf<A>, pkt: &Packet<A>) {
    if pkt.proto != IPPROTO_TCP {
        return;
    }
    let mut seen = 0;
    if pkt.tcp_flags & TCP_FLAG_FIN != 0 {
        seen |= FLOW_F_FIN;
    }
    if pkt.tcp_flags & TCP_FLAG_RST != 0 {
        seen |= FLOW_F_RST;
    }
    // SAFETY: `entry` came from a successful lookup; only this direction writes `flags`.
    unsafe {
        let flags = (*entry).flags;
        if seen & !flags != 0 {
            (*entry).flags = flags | seen;
        }
    }
}

/// The key of a packet as it travels, in direction `dir`.
#[inline(always)]
fn key_of<A: Addr>(pkt: &Packet<A>, dir: u8) -> FlowKeyOf<A> {
    FlowKeyOf {
        src_addr: pkt.src_addr,
        dst_addr: pkt.dst_addr,
        src_port_be: pkt.src_port_be,
        dst_port_be: pkt.dst_port_be,
        proto: pkt.proto,
        dir,
        _pad: [0; 2],
    }
}

/// The reply key of a flow from `client` (at port `client_port_be` as the backend sees it)
/// to `backend`.
#[inline(always)]
fn reply_key<A: Addr>(
    backend: A,
    backend_port_be: u16,
    client: A,
    client_port_be: u16,
    proto: u8,
) -> FlowKeyOf<A> {
    FlowKeyOf {
        src_addr: backend,
        dst_addr: client,
        src_port_be: backend_port_be,
        dst_port_be: client_port_be,
        proto,
        dir: FLOW_DIR_REPLY,
        _pad: [0; 2],
    }
}

/// Whether the reply entry `r` is the partner of the forward entry `f` keyed `fkey`.
#[inline(always)]
fn pairs<A: Addr>(fkey: &FlowKeyOf<A>, f: &FlowValueOf<A>, r: &FlowValueOf<A>) -> bool {
    r.nat_addr == fkey.dst_addr
        && r.peer_addr == fkey.src_addr
        && r.nat_port_be == fkey.dst_port_be
        && r.peer_port_be == fkey.src_port_be
        && r.svc_id == f.svc_id
        && r.backend_id == f.backend_id
}

#[inline(always)]
fn insert<A: Family>(
    key: &FlowKeyOf<A>,
    value: &FlowValueOf<A>,
    flags: u32,
) -> Result<(), Verdict> {
    A::flow_insert(key, value, u64::from(flags))
        .map_err(|_| Verdict::Drop(DropReason::FlowInsertFailed))
}

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
    let key = &w.key;
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    let mut verified = false;
    // The reply key of this tuple's previous flow, when it is that flow's own partner: it is
    // removed or replaced below, never left behind.
    // (`w.old_reply`, when `has_old`.)
    let mut has_old = false;
    // That previous flow's two halves and its choice (service, backend), when the new flow
    // may reuse them in place (see `reopen`).
    let mut reusable: Option<Reusable<A>> = None;
    if let Some(entry) = A::flow(key) {
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
        verified = true;
        // Live while its backend is still a member (serving or draining) of this very
        // service: a backend that left it is not, even if another service still holds the
        // same address and port (and so its backend id). A member's id is held by the
        // service, so it still names the address the flow was translated to.
        let live = f.svc_id == svc.svc_id && select::is_member(svc.svc_id, f.backend_id);
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
            return Ok(target);
        }
        if ours {
            w.old_reply = *rkey;
            has_old = true;
            if let Some(r) = partner {
                reusable = Some(Reusable {
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
    }

    if !verified {
        verify().map_err(Verdict::Drop)?;
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
    let backend = &w.backend;
    let nat_source = source(backend.addr, backend.port_be).map_err(Verdict::Drop)?;
    w.peer = if nat_source.addr == A::ZERO {
        pkt.src_addr
    } else {
        nat_source.addr
    };
    let peer_addr = &w.peer;
    // The port the backend sees: the client's own, or, when this tuple's previous flow went
    // to the same backend from the same address, that flow's (a source-NATed or clash
    // port), so that the new flow can start in its halves below instead of searching for a
    // port and allocating both halves again. At tens of thousands of connections a second
    // from one client, its ports come round again within a second or two.
    let o = &w.old_reply;
    let port_be = if has_old
        && o.src_addr == backend.addr
        && o.src_port_be == backend.port_be
        && o.dst_addr == *peer_addr
        && (!nat_source.snat
            || (u16::from_be(o.dst_port_be) >= nat_source.min
                && u16::from_be(o.dst_port_be) <= nat_source.max))
    {
        o.dst_port_be
    } else {
        pkt.src_port_be
    };
    w.rkey = reply_key(
        backend.addr,
        backend.port_be,
        *peer_addr,
        port_be,
        pkt.proto,
    );
    let rkey = &mut w.rkey;
    // Whether the new flow's reply tuple is its tuple's previous flow's.
    let same_reply = has_old && *o == *rkey;
    if let Some(old) = reusable
        && same_reply
        && old.svc_id == svc.svc_id
        && old.backend_id == backend_id
    {
        // The same service, backend and reply tuple as the tuple's previous flow (a SYN
        // retransmitted, a port reused towards the same backend): every field a translation
        // reads is already right, so only the flow's state is reset, in place.
        reopen(&old, state, now);
        if nat_source.snat {
            // The previous flow's SNAT port, kept: one try.
            count_snat_tries(1);
        }
        return Ok(NatTarget {
            addr: backend.addr,
            port_be: backend.port_be,
            peer_port_be: rkey.dst_port_be,
            peer_addr: *peer_addr,
        });
    }
    let reply = &mut w.value;
    reply.nat_addr = pkt.dst_addr;
    reply.nat_port_be = pkt.dst_port_be;
    reply.peer_port_be = pkt.src_port_be;
    reply.state = state;
    reply.flags = 0;
    reply._pad = [0; 2];
    reply.svc_id = svc.svc_id;
    reply.backend_id = backend_id;
    reply.ifindex = 0;
    reply._pad_a = A::PAD;
    reply.created_ns = now;
    reply.last_seen_ns = now;
    reply.peer_addr = pkt.src_addr;
    reply._reserved = 0;
    reply._pad_b = A::PAD;
    if has_old && !same_reply {
        A::flow_remove(o);
    }
    // Reply half first, so the backend's first answer always finds it. The client's own port
    // is used unless another live flow holds that tuple towards this backend.
    let claimed = if same_reply {
        insert(rkey, reply, BPF_ANY).is_ok()
    } else if nat_source.snat {
        let port = u16::from_be(pkt.src_port_be);
        port >= nat_source.min
            && port <= nat_source.max
            && (insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, key))
    } else {
        insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, key)
    };
    if nat_source.snat && claimed {
        // The client's own port (or this tuple's previous flow's): the first try.
        count_snat_tries(1);
    } else if nat_source.snat {
        // The client's own port was tried above when it is in the range.
        let port = u16::from_be(pkt.src_port_be);
        let own_tried = u32::from(port >= nat_source.min && port <= nat_source.max);
        rkey.dst_port_be = snat_port(rkey, reply, key, nat_source.min, nat_source.max, own_tried)?;
    } else if !claimed {
        let mut found = false;
        let mut attempt = 0;
        while attempt < CLASH_PORT_ATTEMPTS {
            rkey.dst_port_be =
                clash_port(seed, pkt.src_addr, backend.addr, pkt.src_port_be, attempt);
            if insert(rkey, reply, BPF_NOEXIST).is_ok() {
                found = true;
                break;
            }
            attempt += 1;
        }
        if !found {
            return Err(Verdict::Drop(DropReason::TupleClashNoPort));
        }
        count(DropReason::TupleClashPortRewritten);
    }
    // The forward half is the reply half with the other ends: built in the same place, which
    // keeps an IPv6 flow's two 80-byte values from both taking room on the stack.
    let forward = reply;
    forward.nat_addr = backend.addr;
    forward.nat_port_be = backend.port_be;
    forward.peer_port_be = rkey.dst_port_be;
    forward.peer_addr = *peer_addr;
    forward.ifindex = ingress;
    // A map update: a CPU reading this key meanwhile sees the old entry or the new one.
    insert(key, forward, BPF_ANY)?;
    Ok(NatTarget::of(forward))
}

/// Recreates the half `key` (evicted alone) of the flow whose other half is `entry`: its
/// translation goes to `nat` and back to `peer` (address, port), with `state`; the rest is
/// `entry`'s. Built in `v`, the working state's value (`Family::work`).
#[inline(always)]
fn recreate_partner<A: Family>(
    key: &FlowKeyOf<A>,
    entry: *const FlowValueOf<A>,
    nat: (A, u16),
    peer: (A, u16),
    state: u8,
    now: u64,
    v: &mut FlowValueOf<A>,
) {
    // SAFETY: `entry` came from a successful lookup in this run of the program.
    let e = unsafe { &*entry };
    v.nat_addr = nat.0;
    v.nat_port_be = nat.1;
    v.peer_port_be = peer.1;
    v.state = state;
    v.flags = 0;
    v._pad = [0; 2];
    v.svc_id = e.svc_id;
    v.backend_id = e.backend_id;
    v.ifindex = 0;
    v._pad_a = A::PAD;
    v.created_ns = e.created_ns;
    v.last_seen_ns = now;
    v.peer_addr = peer.0;
    v._reserved = 0;
    v._pad_b = A::PAD;
    if insert(key, v, BPF_NOEXIST).is_ok() {
        count(DropReason::FlowHalfRecreated);
    }
}

/// The two halves of a tuple's previous flow, found by `forward`, and the service and
/// backend they name.
#[derive(Clone, Copy)]
struct Reusable<A: Addr> {
    forward: *mut FlowValueOf<A>,
    reply: *mut FlowValueOf<A>,
    svc_id: u32,
    backend_id: u32,
}

/// Starts a new flow in the halves of the previous one on its tuple, which name the same
/// service, backend and reply tuple: single-field writes of the fields a new flow sets
/// (times, state, close flags), the clock first so that the collector never finds a
/// reset flow with an old timestamp. No field a translation reads changes, so a CPU that
/// reads either half meanwhile translates exactly as it would with the old flow or the new
/// one; and no entry is freed or allocated (two LRU updates, about half of a new flow's cost
/// on a reused port, measured with `cargo xtask bench programs`).
#[inline(always)]
fn reopen<A: Addr>(old: &Reusable<A>, state: u8, now: u64) {
    for half in [old.reply, old.forward] {
        // SAFETY: both came from successful lookups in this run of the program; each write
        // is one aligned field.
        unsafe {
            (*half).last_seen_ns = now;
            (*half).created_ns = now;
            (*half).state = state;
            (*half).flags = 0;
        }
    }
}

/// Counts one SNAT port allocation that took `tries` tries (0: it found no port) in
/// `LB_SNATTRIES_V1`.
#[inline(always)]
fn count_snat_tries(tries: u32) {
    if let Some(c) = LB_SNATTRIES_V1.get_ptr_mut(tries) {
        // SAFETY: a per-CPU slot: no other writer.
        unsafe { *c += 1 };
    }
}

/// Claims a free SNAT port in `min..=max` for the reply half `reply` keyed `rkey` (whose
/// destination port is changed while trying): [`SNAT_RANDOM_ATTEMPTS`] random ports, then a
/// linear scan from the last one, [`SNAT_ATTEMPTS`] tries in all (one loop, which keeps the
/// verifier's path short), after `own_tried` (0 or 1) tries of the client's own port. A
/// port held by a flow that is over (a RST, or FINs both ways) is taken over, as netfilter
/// and Cilium reuse a closed connection's tuple: at tens of thousands of connections a
/// second towards one backend, closed flows would otherwise hold most of the range until
/// the collector removes them. `own` is the new flow's forward key. Returns the port
/// (network order); dropped as `SnatNoPort` when every try found its port held by a live
/// flow. The tries are counted in `LB_SNATTRIES_V1`.
#[inline(always)]
fn snat_port<A: Family>(
    rkey: &mut FlowKeyOf<A>,
    reply: &FlowValueOf<A>,
    own: &FlowKeyOf<A>,
    min: u16,
    max: u16,
    own_tried: u32,
) -> Result<u16, Verdict> {
    let span = u32::from(max.saturating_sub(min)) + 1;
    let mut port = min;
    let mut attempt = 0;
    while attempt < SNAT_ATTEMPTS {
        port = if attempt < SNAT_RANDOM_ATTEMPTS {
            // SAFETY: a helper call without arguments.
            let r = unsafe { aya_ebpf::helpers::generated::bpf_get_prandom_u32() };
            min + (r % span) as u16
        } else if port >= max {
            min
        } else {
            port + 1
        };
        rkey.dst_port_be = port.to_be();
        if insert(rkey, reply, BPF_NOEXIST).is_ok() || replace_if_stale(rkey, reply, own) {
            count_snat_tries(own_tried + attempt + 1);
            return Ok(port.to_be());
        }
        attempt += 1;
    }
    count_snat_tries(0);
    Err(Verdict::Drop(DropReason::SnatNoPort))
}

/// The reply tuple `rkey` is taken. Takes it over (and forgets the flow holding it) when
/// that flow is over (it saw a RST, or a FIN both ways) or is this tuple's own previous flow
/// (forward key `own`, being replaced now, e.g. after its service was re-created). Returns
/// whether `reply` is now in place.
#[inline(always)]
fn replace_if_stale<A: Family>(
    rkey: &FlowKeyOf<A>,
    reply: &FlowValueOf<A>,
    own: &FlowKeyOf<A>,
) -> bool {
    let Some(r) = A::flow(rkey) else {
        // Removed meanwhile.
        return insert(rkey, reply, BPF_NOEXIST).is_ok();
    };
    // SAFETY: a successful lookup.
    let r = unsafe { &*r };
    let fkey = rkey.partner(r);
    if fkey == *own {
        return insert(rkey, reply, BPF_ANY).is_ok();
    }
    let closed = match A::flow(&fkey) {
        // SAFETY: as above.
        Some(f) => unsafe { r.closed_with((*f).flags) },
        None => r.closed_with(0),
    };
    if !closed {
        return false;
    }
    A::flow_remove(&fkey);
    insert(rkey, reply, BPF_ANY).is_ok()
}

/// Reply direction: the VIP:port a backend's packet to a client must appear to come from
/// (and the client's own port), or `None` when the packet is not a reply of a load-balanced
/// flow. The first TCP answer from the backend moves the flow from SYN_SENT to ESTABLISHED.
#[inline(always)]
pub fn reply<A: Family>(pkt: &Packet<A>) -> Option<NatTarget<A>> {
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
