//! Go's duration syntax, as kube-proxy's flags and file take it.

use std::time::Duration;

use super::*;

/// A Go (`metav1.Duration`) duration: `1h2m3.5s`, `500ms`, `24h0m0s`, `0`.
pub fn parse_go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    if s.is_empty() {
        return None;
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    Duration::try_from_secs_f64(total).ok()
}

/// A duration as Go prints it (`24h0m0s`, `1m30s`, `500ms`), which kube-proxy reads back.
pub fn go_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d < Duration::from_secs(1) {
        let ms = d.as_secs_f64() * 1e3;
        return if ms.fract() == 0.0 {
            format!("{ms}ms")
        } else {
            format!("{}us", d.as_micros())
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let frac = d.subsec_nanos();
    let s = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{:09}", frac);
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => s,
        (0, m) => format!("{m}m{s}"),
        (h, m) => format!("{h}h{m}m{s}"),
    }
}

/// A duration field: Go's form first (kube-proxy's), then humantime's (`1 day`, `2m 30s`).
pub fn parse_duration(origin: &str, field: &str, s: &str) -> Result<Duration, ConfigError> {
    parse_go_duration(s)
        .or_else(|| humantime::parse_duration(s.trim()).ok())
        .ok_or_else(|| {
            err(
                origin,
                field,
                format!("{s:?} is not a duration (for example 30s, 1m, 500ms, 24h0m0s)"),
            )
        })
}
