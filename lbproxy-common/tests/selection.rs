//! Spread and disruption of backend selection, on unit-level tables: many 5-tuples, the
//! slot arrangement the controller produces, and the datapath's selection function.

use lbproxy_common::select::{flow_hash, jump};

fn keys(n: u32) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let src = [198, 18, (i >> 16) as u8, (i >> 8) as u8];
            flow_hash(
                src,
                [198, 19, 0, 10],
                ((i & 0xff) as u16 + 1024).to_be(),
                80u16.to_be(),
                6,
            )
        })
        .collect()
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

#[test]
fn spread_is_uniform() {
    let ks = keys(200_000);
    for n in [1u32, 2, 3, 5, 10, 37, 100] {
        let slots: Vec<u32> = (0..n).collect();
        let mut count = vec![0u32; n as usize];
        for b in assign(&ks, &slots) {
            count[b as usize] += 1;
        }
        let mean = ks.len() as f64 / f64::from(n);
        // A uniform choice deviates by about sqrt(mean) per backend; allow 5 of those.
        let bound = 5.0 / mean.sqrt();
        for (b, c) in count.iter().enumerate() {
            let dev = (f64::from(*c) - mean).abs() / mean;
            assert!(
                dev < bound,
                "n={n}: backend {b} got {c} of {} (mean {mean:.0}, {:.1}% off, bound {:.1}%)",
                ks.len(),
                dev * 100.0,
                bound * 100.0
            );
        }
    }
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
