//! Backend selection: jump consistent hashing (Lamping and Veach, 2014) over a service's
//! slots, keyed by the flow's 5-tuple and the node's secret seed.
//!
//! Chosen instead of a Maglev table because it gives the same guarantees with no table:
//! - uniform spread over the `n` slots;
//! - appending a backend (slot `n`) moves only the ~1/(n+1) of keys that now belong to it;
//! - the controller removes a backend by moving the last slot into its hole, which moves ~2/n
//!   of keys (the removed backend's, and a share of the last slot's) instead of Maglev's ~1/n.
//!
//! There is no per-service table to size, store or rebuild: a service costs one slot per
//! backend, and the datapath runs at most [`JUMP_MAX_STEPS`] iterations of integer arithmetic
//! per new flow.

use crate::family::Addr;

/// Bound on the loop, for the verifier. The expected number of steps is ln(n) + 1;
/// 64 steps reach beyond n = 10^20.
pub const JUMP_MAX_STEPS: u32 = 64;

/// Maps `key` to a bucket in `0..n` (`n` > 0).
#[inline(always)]
pub fn jump(mut key: u64, n: u32) -> u32 {
    let n = i64::from(n);
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    let mut steps = 0;
    while j < n && steps < JUMP_MAX_STEPS {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (b + 1) * 2^31 / ((key >> 33) + 1), in integers.
        j = (((b as u64) + 1) << 31).wrapping_div((key >> 33) + 1) as i64;
        steps += 1;
    }
    if b < 0 { 0 } else { b as u32 }
}

/// A 64-bit hash of a flow's 5-tuple (addresses and ports as raw network-order bytes), keyed
/// by the node's `seed` (`DatapathConfig::hash_seed`).
///
/// Unseeded, the hash is public, so a client could compute offline which source port lands
/// on which backend and pick its backend. The seed is mixed into the addresses before the
/// first finalizer: for a given client and frontend, `fmix64(a ^ seed)` is a secret 64-bit
/// value that every source port's hash then depends on. This costs one XOR per new flow. It
/// is not a cryptographic MAC: a client can still learn its own port-to-backend mapping by
/// trying ports, as with any deterministic choice, but cannot predict it, nor carry what it
/// learnt to another node (another seed) or another client address.
///
/// Seed 0 gives the hash lbproxy used before seeds existed. An IPv6 address is folded to 32
/// bits first ([`Addr::fold`]); an IPv4 address is hashed as it is.
#[inline(always)]
pub fn flow_hash<A: Addr>(
    seed: u64,
    src: A,
    dst: A,
    sport_be: u16,
    dport_be: u16,
    proto: u8,
) -> u64 {
    let a = u64::from(src.fold()) << 32 | u64::from(dst.fold());
    let b = u64::from(sport_be) << 32 | u64::from(dport_be) << 16 | u64::from(proto);
    fmix64(fmix64(a ^ seed) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// MurmurHash3's 64-bit finalizer (also the controller's, for Maglev tables).
#[inline(always)]
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// Attempts at another source port when a new flow's tuple towards its backend is already
/// taken (a tuple clash), before the packet is dropped.
pub const CLASH_PORT_ATTEMPTS: u32 = 8;

/// The lowest port [`clash_port`] gives; the highest is 65535.
pub const CLASH_PORT_MIN: u16 = 1024;

/// The source port (network order) to try for attempt `attempt` when a client's flow
/// `src:sport -> backend` clashes with a live flow through another VIP. Spread over
/// 1024..=65535 by the seeded hash, as netfilter picks a free port in that range for the
/// same clash; deterministic, so the attempts of one flow are the same on every retry.
#[inline(always)]
pub fn clash_port<A: Addr>(seed: u64, src: A, backend: A, sport_be: u16, attempt: u32) -> u16 {
    let h = fmix64(
        flow_hash(seed, src, backend, sport_be, 0, 0)
            ^ u64::from(attempt + 1).wrapping_mul(0x9e37_79b9),
    );
    let port = CLASH_PORT_MIN + (h % (65536 - u64::from(CLASH_PORT_MIN))) as u16;
    port.to_be()
}

/// Why a packet to a frontend gets no backend, when the answer needs no map read beyond the
/// frontend's own entry: a frontend with no usable endpoint. Shared by the datapath's
/// selection stage and `lbproxy explain`, so that the two cannot disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Dropped silently, counted under the reason.
    Drop(crate::DropReason),
    /// Answered (TCP RST, ICMP unreachable), counted under the reason.
    Reject(crate::DropReason),
}

/// What a new flow of frontend `svc` meets before any backend is looked up: `None` when it
/// has a usable endpoint; a drop for `externalTrafficPolicy: Local` with every endpoint on
/// other nodes (`no_local_endpoint`, as kube-proxy drops it); otherwise, with no usable
/// endpoint, a reject at once (`no_backend_tcp_reset`, `no_backend_udp_unreachable`) rather
/// than leave the client to time out.
#[inline(always)]
pub fn no_endpoint(svc: &crate::ServiceValue, proto: u8) -> Option<Refusal> {
    if svc.count != 0 {
        return None;
    }
    if svc.flags & crate::SVC_F_LOCAL_ONLY != 0 {
        return Some(Refusal::Drop(crate::DropReason::NoLocalEndpoint));
    }
    Some(Refusal::Reject(if proto == crate::IPPROTO_TCP {
        crate::DropReason::NoBackendTcpReset
    } else {
        crate::DropReason::NoBackendUdpUnreachable
    }))
}

/// The map reads a backend selection makes, so that one selection ([`backend_id`]) runs
/// against the kernel's maps in the datapath and against the pinned maps in `lbproxy
/// explain`. Each returns a backend id, or 0 (never an id) for an entry that is missing.
pub trait SelectionMaps {
    /// The backend id in entry [`maglev::position`](crate::maglev::position) of frontend
    /// `svc_id`'s Maglev table for `hash`.
    fn maglev_backend(&self, svc_id: u32, hash: u64) -> u32;
    /// The backend id in slot [`slot_of`]`(hash, count)` of frontend `svc_id`.
    fn slot_backend(&self, svc_id: u32, count: u32, hash: u64) -> u32;
}

/// The slot a flow of hash `hash` gets among a frontend's `count` slots (`count` > 0).
#[inline(always)]
pub fn slot_of(hash: u64, count: u32) -> u32 {
    jump(hash, count)
}

/// Where entry `pos` of a Maglev chunk is in [`crate::MaglevChunk::backend_ids`] (masked,
/// so the verifier sees the index in bounds).
#[inline(always)]
pub fn maglev_index(pos: u32) -> usize {
    pos as usize & (crate::MAGLEV_CHUNK as usize - 1)
}

/// The backend id a new flow of hash `hash` gets at frontend `svc`, which has at least one
/// slot, or 0 when the maps are inconsistent (`slot_missing`). A Maglev frontend's table
/// entry; where the table has none (its size changed at a restart and the table is not
/// rewritten yet), the jump hash over its slots, which are always complete.
#[inline(always)]
pub fn backend_id<M: SelectionMaps>(maps: &M, svc: &crate::ServiceValue, hash: u64) -> u32 {
    let mut id = 0;
    if svc.flags & crate::SVC_F_MAGLEV != 0 {
        id = maps.maglev_backend(svc.svc_id, hash);
    }
    if id == 0 {
        id = maps.slot_backend(svc.svc_id, svc.count, hash);
    }
    id
}

/// Whether a service cidr trie's answer `kind` (`CIDR_*`) for a packet to no frontend
/// rejects or drops it, and why; `None`: the address is in no ServiceCIDR.
#[inline(always)]
pub fn cidr_refusal(kind: u32, proto: u8) -> Option<Refusal> {
    match kind {
        crate::CIDR_ALLOCATED => Some(Refusal::Reject(if proto == crate::IPPROTO_TCP {
            crate::DropReason::ClusterIpPortTcpReset
        } else {
            crate::DropReason::ClusterIpPortUdpUnreachable
        })),
        crate::CIDR_SERVICE_RANGE => Some(Refusal::Drop(crate::DropReason::ServiceCidrUnallocated)),
        _ => None,
    }
}
