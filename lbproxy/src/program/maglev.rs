//! Maglev lookup tables (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, section 3.4), built by the controller for `--lb-algorithm maglev`.
//!
//! A table has `m` entries (a prime); entry `hash % m` names the backend of a new flow. Each
//! backend has a permutation of `0..m` (an offset and a skip, both from a hash of the
//! backend's address and port and the cluster's seed), and the backends take turns, in the
//! order of their addresses, claiming the next free entry of their permutation until the
//! table is full. So:
//! - the table depends only on the set of backends, `m` and the seed, never on the order in
//!   which a node learnt them or on lbproxy's ids: every node with the same seed builds the
//!   same table;
//! - each backend gets `m / n` entries, give or take one;
//! - removing a backend frees only its entries (the others keep theirs, and the freed ones
//!   go to the survivors' next free positions), and adding one takes about `1/(n+1)` of the
//!   entries; each change also moves a few other entries, fewer the larger `m` is against
//!   `n` (under 1% for `m > 100 n`, the paper's and Cilium's rule).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lbproxy_common::select::fmix64;
use lbproxy_common::{MAGLEV_CHUNK, MaglevChunk};

use crate::desired::BackendAddr;

/// The default table size: a prime, Cilium's default, > 100 × 163 backends.
pub const DEFAULT_M: u32 = 16_381;

/// The smallest table size accepted: below it a Service of more than a few backends moves
/// many flows on each change.
pub const MIN_M: u32 = 251;

/// The largest table size accepted: a table of this size costs 512 KiB per frontend.
pub const MAX_M: u32 = 131_071;

/// Why a table size is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("the Maglev table size must be between {MIN_M} and {MAX_M}, not {0}")]
    OutOfRange(u32),
    #[error(
        "the Maglev table size must be a prime (each backend's permutation must reach every entry), and {0} is not; 16381, 32749 and 65521 are"
    )]
    NotPrime(u32),
}

/// Checks a configured table size: a prime in `MIN_M..=MAX_M`.
pub fn check_size(m: u32) -> Result<u32, SizeError> {
    if !(MIN_M..=MAX_M).contains(&m) {
        return Err(SizeError::OutOfRange(m));
    }
    if !is_prime(m) {
        return Err(SizeError::NotPrime(m));
    }
    Ok(m)
}

fn is_prime(n: u32) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

/// A backend as the table sees it: its address and port. Nothing node-local (no id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member {
    pub addr: IpAddr,
    pub port: u16,
}

impl Member {
    /// The bytes the permutation is hashed from: the address as 16 bytes (IPv4 mapped) and
    /// the port, big-endian.
    fn key(&self) -> [u8; 18] {
        let a = match self.addr {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        let mut k = [0u8; 18];
        k[..16].copy_from_slice(&a);
        k[16..].copy_from_slice(&self.port.to_be_bytes());
        k
    }
}

/// The table for `members` (any order, duplicates ignored): entry `i` is the index, in
/// `sorted(members)`, of the backend that serves hash `i`. Empty for no member.
///
/// `O(m log m)` expected: each backend walks its permutation past the entries others took.
pub fn build(members: &[Member], m: u32, seed: u64) -> (Vec<Member>, Vec<u32>) {
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.is_empty() {
        return (sorted, Vec::new());
    }
    let m64 = u64::from(m);
    // Each backend's next position in its permutation, and its skip.
    let (mut pos, skip): (Vec<u64>, Vec<u64>) = sorted
        .iter()
        .map(|b| {
            let k = b.key();
            let offset = hash(seed, &k, 1) % m64;
            let skip = hash(seed, &k, 2) % (m64 - 1) + 1;
            (offset, skip)
        })
        .unzip();
    const FREE: u32 = u32::MAX;
    let mut table = vec![FREE; m as usize];
    let mut filled = 0u32;
    'fill: loop {
        for i in 0..sorted.len() {
            // A permutation of a prime `m` with a skip in 1..m reaches every entry, so this
            // ends within `m` steps.
            let mut c = pos[i];
            while table[c as usize] != FREE {
                c = (c + skip[i]) % m64;
            }
            table[c as usize] = i as u32;
            pos[i] = (c + skip[i]) % m64;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    (sorted, table)
}

/// The smallest seed file accepted (`--hash-seed-file`).
pub const MIN_SEED_BYTES: usize = 8;

/// The flow-hash seed from a seed file's whole content (at least [`MIN_SEED_BYTES`]), never
/// 0 (0 means "no seed" in `LB_CONFIG_V1`). Every byte counts, a trailing newline too: the
/// nodes must read the same bytes, as a Secret mounted on each gives them.
pub fn seed_from_bytes(bytes: &[u8]) -> Result<u64, String> {
    if bytes.len() < MIN_SEED_BYTES {
        return Err(format!(
            "holds {} bytes; at least {MIN_SEED_BYTES} are needed (e.g. `openssl rand -hex 16`)",
            bytes.len()
        ));
    }
    Ok(match hash(0, bytes, 3) {
        0 => 1,
        s => s,
    })
}

/// A seeded 64-bit hash of `bytes` for one of the two permutation parameters (`salt`):
/// FNV-1a, then MurmurHash3's finalizer over it and the seed. Fixed here, so that nodes of
/// different lbproxy builds with one seed build one table.
fn hash(seed: u64, bytes: &[u8], salt: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    fmix64(h ^ seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// What a frontend's table was built from: the table size, the seed and the backend ids of
/// its slots, sorted. An apply with the same inputs leaves the table alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Built {
    pub m: u32,
    pub seed: u64,
    pub ids: Vec<u32>,
}

/// A frontend's Maglev table as the maps hold it (`LB_MAGLEV_V1`, by chunk). Only a
/// fingerprint of each chunk is kept, not its 16 KiB: at 10,000 frontends the tables are
/// over half a GiB, which the controller neither holds nor reads back.
#[derive(Clone, Debug, Default, Eq)]
pub struct MaglevTable {
    /// The chunks written, by number, with a fingerprint of their content ([`fingerprint`]);
    /// 0 when read back from the maps (the content is not read), so the next write of that
    /// chunk happens whatever it holds.
    pub chunks: BTreeMap<u32, u64>,
    /// What the chunks were built from; `None` when read back at start-up (or when a write
    /// failed half-way), so the next apply builds it again and writes what differs.
    pub built: Option<Built>,
    /// The backend ids the table holds a reference on: those it was built from, and after
    /// a failed write also those it was about to write, so none is deleted while an entry
    /// may name it.
    pub held: BTreeSet<u32>,
}

/// Tables are compared by the chunks present only: that is what reading the maps back
/// sees, and a chunk deleted by hand is the drift it can find.
impl PartialEq for MaglevTable {
    fn eq(&self, other: &Self) -> bool {
        self.chunks.keys().eq(other.chunks.keys())
    }
}

impl MaglevTable {
    /// A table read back from the maps: the numbers of its chunks.
    pub fn from_chunk_numbers(numbers: impl IntoIterator<Item = u32>) -> MaglevTable {
        MaglevTable {
            chunks: numbers.into_iter().map(|n| (n, 0)).collect(),
            built: None,
            held: BTreeSet::new(),
        }
    }
}

/// A fingerprint of a chunk's content, never 0.
pub fn fingerprint(c: &MaglevChunk) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for id in &c.backend_ids {
        h = fmix64(h ^ u64::from(*id));
    }
    h | 1
}

/// The chunks of the table for the backends `ids` (with their addresses `addr_of`), `m`
/// entries and `seed`: entry `i` in chunk `i / 4096` at `i % 4096`; the last chunk's tail,
/// past `m`, is 0 (never read).
pub fn chunks(
    ids: &[u32],
    addr_of: impl Fn(u32) -> Option<BackendAddr>,
    m: u32,
    seed: u64,
) -> BTreeMap<u32, MaglevChunk> {
    let mut by_member: BTreeMap<Member, u32> = BTreeMap::new();
    for id in ids {
        if let Some(a) = addr_of(*id) {
            by_member.insert(
                Member {
                    addr: a.addr,
                    port: a.port,
                },
                *id,
            );
        }
    }
    let members: Vec<Member> = by_member.keys().copied().collect();
    let (sorted, table) = build(&members, m, seed);
    let id_of: Vec<u32> = sorted.iter().map(|s| by_member[s]).collect();
    table
        .chunks(MAGLEV_CHUNK as usize)
        .enumerate()
        .map(|(no, entries)| {
            let mut c = MaglevChunk {
                backend_ids: [0; MAGLEV_CHUNK as usize],
            };
            for (slot, owner) in c.backend_ids.iter_mut().zip(entries) {
                *slot = id_of[*owner as usize];
            }
            (no as u32, c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: u8) -> Vec<Member> {
        (1..=n)
            .map(|i| Member {
                addr: IpAddr::from([10, 0, 0, i]),
                port: 8080,
            })
            .collect()
    }

    /// The backend (by member) of each entry.
    fn owners(members: &[Member], m: u32, seed: u64) -> Vec<Member> {
        let (sorted, t) = build(members, m, seed);
        t.iter().map(|i| sorted[*i as usize]).collect()
    }

    #[test]
    fn a_seed_file_needs_eight_bytes_and_every_byte_counts() {
        assert!(seed_from_bytes(b"1234567").is_err());
        let a = seed_from_bytes(b"0123456789abcdef").unwrap();
        assert_ne!(a, 0);
        assert_eq!(a, seed_from_bytes(b"0123456789abcdef").unwrap());
        assert_ne!(a, seed_from_bytes(b"0123456789abcdef\n").unwrap());
    }

    #[test]
    fn sizes_are_primes_in_range() {
        assert_eq!(check_size(DEFAULT_M), Ok(DEFAULT_M));
        assert_eq!(check_size(16_383), Err(SizeError::NotPrime(16_383)));
        assert_eq!(check_size(7), Err(SizeError::OutOfRange(7)));
        assert_eq!(check_size(MAX_M), Ok(MAX_M));
        assert_eq!(check_size(MAX_M + 2), Err(SizeError::OutOfRange(MAX_M + 2)));
    }

    #[test]
    fn every_entry_is_filled_and_the_share_is_even() {
        for n in [1u8, 2, 3, 8, 100] {
            let (sorted, t) = build(&members(n), DEFAULT_M, 7);
            assert_eq!(t.len(), DEFAULT_M as usize);
            let mut count = vec![0u32; sorted.len()];
            for i in &t {
                count[*i as usize] += 1;
            }
            let even = DEFAULT_M / u32::from(n);
            for c in count {
                assert!(c.abs_diff(even) <= 1, "n {n}: {c} entries, want {even}±1");
            }
        }
    }

    #[test]
    fn the_table_ignores_the_order_learnt() {
        let a = members(8);
        let mut b = a.clone();
        b.reverse();
        b.push(a[3]);
        assert_eq!(owners(&a, DEFAULT_M, 42), owners(&b, DEFAULT_M, 42));
        assert_ne!(owners(&a, DEFAULT_M, 42), owners(&a, DEFAULT_M, 43));
    }

    #[test]
    fn removing_a_backend_moves_little_besides_its_own() {
        let all = members(8);
        let before = owners(&all, DEFAULT_M, 1);
        let mut rest = all.clone();
        let gone = rest.remove(3);
        let after = owners(&rest, DEFAULT_M, 1);
        let others_moved = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **b != gone && b != a)
            .count();
        // Each remaining backend keeps its entries but for a few (the paper's ~1%).
        assert!(
            others_moved * 100 <= DEFAULT_M as usize,
            "{others_moved} of {DEFAULT_M} entries of other backends moved"
        );
    }

    #[test]
    fn adding_a_backend_takes_about_its_share() {
        let mut all = members(8);
        let before = owners(&all, DEFAULT_M, 1);
        all.push(Member {
            addr: IpAddr::from([10, 0, 1, 1]),
            port: 8080,
        });
        let after = owners(&all, DEFAULT_M, 1);
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
        let share = DEFAULT_M as usize / 9;
        assert!(
            moved <= share + DEFAULT_M as usize / 100,
            "{moved} entries moved, share {share}"
        );
    }
}
