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
