//! Spread and disruption of backend selection, on unit-level tables: many 5-tuples, the
//! slot arrangement the controller produces, and the datapath's selection function, with
//! the node's hash seed.

use lbproxy_common::select::{flow_hash, jump};

/// A seed as `lbproxy run` creates one (any non-zero value).
const SEED: u64 = 0x9d1c_4b7e_2f03_a5c1;

/// Keys of `n` flows from many clients and source ports to one frontend, under `seed`.
fn keys_with(seed: u64, n: u32) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let src = [198, 18, (i >> 16) as u8, (i >> 8) as u8];
            flow_hash(
                seed,
                src,
                [198, 19, 0, 10],
                ((i & 0xff) as u16 + 1024).to_be(),
                80u16.to_be(),
                6,
            )
        })
        .collect()
}

fn keys(n: u32) -> Vec<u64> {
    keys_with(SEED, n)
}

/// Backend of each key, given the slot arrangement (`slots[i]` = backend in slot i).
fn assign(keys: &[u64], slots: &[u32]) -> Vec<u32> {
    keys.iter()
        .map(|k| slots[jump(*k, slots.len() as u32) as usize])
        .collect()
}

fn moved(a: &[u32], b: &[u32]) -> f64 {
    a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64
}

/// Panics unless `ks` spread uniformly over 1, 2, 3, 5, 10, 37 and 100 slots.
fn assert_uniform(ks: &[u64], ctx: &str) {
    for n in [1u32, 2, 3, 5, 10, 37, 100] {
        let slots: Vec<u32> = (0..n).collect();
        let mut count = vec![0u32; n as usize];
        for b in assign(ks, &slots) {
            count[b as usize] += 1;
        }
        let mean = ks.len() as f64 / f64::from(n);
        // A uniform choice deviates by about sqrt(mean) per backend; allow 5 of those.
        let bound = 5.0 / mean.sqrt();
        for (b, c) in count.iter().enumerate() {
            let dev = (f64::from(*c) - mean).abs() / mean;
            assert!(
                dev < bound,
                "{ctx}, n={n}: backend {b} got {c} of {} (mean {mean:.0}, {:.1}% off, bound {:.1}%)",
                ks.len(),
                dev * 100.0,
                bound * 100.0
            );
        }
    }
}

#[test]
fn spread_is_uniform() {
    assert_uniform(&keys(200_000), &format!("seed {SEED:#x}"));
}

#[test]
fn adding_a_backend_moves_about_one_nth() {
    let ks = keys(100_000);
    for n in [2u32, 3, 5, 10, 50] {
        let before: Vec<u32> = (0..n).collect();
        let mut after = before.clone();
        after.push(n); // the controller appends a new backend
        let m = moved(&assign(&ks, &before), &assign(&ks, &after));
        let ideal = 1.0 / f64::from(n + 1);
        assert!(
            (m - ideal).abs() < 0.02,
            "n={n}->{}: {:.3} of keys moved, ideal {ideal:.3}",
            n + 1,
            m
        );
        // And every moved key moved to the new backend.
        let a = assign(&ks, &before);
        let b = assign(&ks, &after);
        assert!(a.iter().zip(&b).all(|(x, y)| x == y || *y == n));
    }
}

#[test]
fn removing_a_backend_moves_about_two_nths_at_most() {
    let ks = keys(100_000);
    for n in [3u32, 5, 10, 50] {
        let before: Vec<u32> = (0..n).collect();
        // The controller removes backend 1 by moving the last slot into its hole.
        let mut after = before.clone();
        after.swap_remove(1);
        let a = assign(&ks, &before);
        let b = assign(&ks, &after);
        let m = moved(&a, &b);
        let bound = 2.0 / f64::from(n) + 0.02;
        assert!(m <= bound, "n={n}: {m:.3} of keys moved, bound {bound:.3}");
        // Keys on the removed backend all moved; none landed on it.
        assert!(b.iter().all(|x| *x != 1));
        // Keys on neither the removed backend nor the moved one stayed.
        let last = n - 1;
        assert!(
            a.iter()
                .zip(&b)
                .all(|(x, y)| *x == 1 || *x == last || x == y)
        );
    }
}

#[test]
fn jump_is_in_range_and_deterministic() {
    for k in keys(1000) {
        for n in [1u32, 2, 7, 1000, u32::MAX] {
            let b = jump(k, n);
            assert!(b < n);
            assert_eq!(b, jump(k, n));
        }
    }
}

/// Seeds the tests below use besides [`SEED`]: 0 (none written yet), one bit, all ones,
/// and arbitrary values.
const OTHER_SEEDS: [u64; 5] = [0, 1, u64::MAX, 0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];

#[test]
fn every_seed_spreads_uniformly() {
    for seed in OTHER_SEEDS {
        assert_uniform(&keys_with(seed, 200_000), &format!("seed {seed:#x}"));
    }
}

#[test]
fn the_same_seed_gives_the_same_choices() {
    for seed in [SEED, 0, u64::MAX] {
        assert_eq!(
            keys_with(seed, 10_000),
            keys_with(seed, 10_000),
            "seed {seed:#x}"
        );
    }
    // And the hash is a function of the seed and the 5-tuple only.
    let h = |seed| {
        flow_hash(
            seed,
            [10, 0, 0, 1],
            [10, 96, 0, 10],
            4242u16.to_be(),
            53u16.to_be(),
            17,
        )
    };
    assert_eq!(h(SEED), h(SEED));
    assert_ne!(h(SEED), h(SEED ^ 1));
}

/// A hostile client choosing its source port: with another seed, the backend each port
/// leads to is a new, independent draw. Two seeds agree on a port's backend about 1/n of
/// the time, as two independent uniform choices do, so what a client learnt (or computed)
/// under one seed tells it nothing under another.
#[test]
fn different_seeds_give_independent_choices() {
    let client = [198, 18, 0, 7];
    let vip = [198, 19, 0, 10];
    let by_port = |seed: u64| -> Vec<u64> {
        (1024u16..=u16::MAX)
            .map(|p| flow_hash(seed, client, vip, p.to_be(), 53u16.to_be(), 17))
            .collect()
    };
    let mut seeds = vec![SEED];
    seeds.extend(OTHER_SEEDS);
    let tables: Vec<Vec<u64>> = seeds.iter().map(|s| by_port(*s)).collect();
    for n in [2u32, 3, 10, 100] {
        let slots: Vec<u32> = (0..n).collect();
        let choices: Vec<Vec<u32>> = tables.iter().map(|t| assign(t, &slots)).collect();
        for i in 0..seeds.len() {
            for j in i + 1..seeds.len() {
                let same = 1.0 - moved(&choices[i], &choices[j]);
                let ideal = 1.0 / f64::from(n);
                // Binomial over 64,512 ports: the standard deviation is below 0.2%.
                assert!(
                    (same - ideal).abs() < 0.01,
                    "n={n}: seeds {:#x} and {:#x} agree on {:.3} of source ports, want ~{ideal:.3}",
                    seeds[i],
                    seeds[j],
                    same
                );
            }
        }
    }
}

/// Seed 0 is the hash from before seeds existed, so a datapath reading a config written by
/// an older controller (seed fields 0) selects exactly as that version did.
#[test]
fn seed_zero_is_the_unseeded_hash() {
    fn fmix64(mut k: u64) -> u64 {
        k ^= k >> 33;
        k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
        k ^= k >> 33;
        k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        k ^ (k >> 33)
    }
    fn unseeded(src: [u8; 4], dst: [u8; 4], sport_be: u16, dport_be: u16, proto: u8) -> u64 {
        let a = u64::from(u32::from_ne_bytes(src)) << 32 | u64::from(u32::from_ne_bytes(dst));
        let b = u64::from(sport_be) << 32 | u64::from(dport_be) << 16 | u64::from(proto);
        fmix64(fmix64(a) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }
    for i in 0..10_000u32 {
        let src = [10, (i >> 16) as u8, (i >> 8) as u8, i as u8];
        let (sp, dp) = ((i as u16).to_be(), 443u16.to_be());
        assert_eq!(
            flow_hash(0, src, [10, 96, 0, 1], sp, dp, 6),
            unseeded(src, [10, 96, 0, 1], sp, dp, 6)
        );
    }
}
