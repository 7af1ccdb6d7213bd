//! A paced load for restart tests: one request per tick, each recorded with when it started
//! and how long it took, and the failures shown relative to the moment of a kill.

use std::fmt;
use std::time::{Duration, Instant};

/// One request: when it started (since the load began), how long it took, and the backend
/// that answered or the error.
pub struct Attempt {
    pub at: Duration,
    pub took: Duration,
    pub result: Result<String, String>,
}

/// An instant since the load began (`.0`), shown relative to the kill (`.1`): `-12ms`,
/// `+340ms`.
pub struct SinceKill(pub Duration, pub Duration);

impl fmt::Display for SinceKill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (at, kill) = (self.0, self.1);
        if at >= kill {
            write!(f, "+{}ms", (at - kill).as_millis())
        } else {
            write!(f, "-{}ms", (kill - at).as_millis())
        }
    }
}

/// Runs `f` every `tick` from `start` until `start + dur` (late ticks are not made up in a
/// burst), recording each result.
pub fn paced(
    start: Instant,
    dur: Duration,
    tick: Duration,
    mut f: impl FnMut() -> Result<String, String>,
) -> Vec<Attempt> {
    let mut v = Vec::new();
    let mut next = start;
    while next < start + dur {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let t = Instant::now();
        let result = f();
        v.push(Attempt {
            at: t - start,
            took: t.elapsed(),
            result,
        });
        next = (next + tick).max(Instant::now());
    }
    v
}

/// The failures among `v`: errors, and answers from anything but `ok`.
pub fn failures<'a>(v: &'a [Attempt], ok: &dyn Fn(&str) -> bool) -> Vec<&'a Attempt> {
    v.iter()
        .filter(|a| a.result.as_deref().map_or(true, |b| !ok(b)))
        .collect()
}

/// `v`, one line each, times relative to `kill`.
pub fn show(v: &[&Attempt], kill: Duration) -> String {
    v.iter()
        .map(|a| {
            let r = match &a.result {
                Ok(b) => format!("answered by {b:?}"),
                Err(e) => e.clone(),
            };
            format!("at {} (took {:?}): {r}", SinceKill(a.at, kill), a.took)
        })
        .collect::<Vec<_>>()
        .join("\n  ")
}
