//! The parsers of one value each that the flags and the file share (durations are in
//! `durations.rs`): a bad value is refused naming its origin and field.

use std::net::{IpAddr, SocketAddr};

use super::*;

/// `--nodeport-addresses`: comma-separated CIDRs, or `primary`; empty means all.
pub(crate) fn parse_node_port_addresses(
    origin: &str,
    items: &[String],
) -> Result<NodePortAddresses, ConfigError> {
    let field = "nodePortAddresses";
    let items: Vec<&str> = items
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Ok(NodePortAddresses::All);
    }
    if items == ["primary"] {
        return Ok(NodePortAddresses::Primary);
    }
    if items.contains(&"primary") {
        return Err(err(
            origin,
            field,
            format!("can't use both \"primary\" and CIDRs (got {items:?})"),
        ));
    }
    let mut cidrs = Vec::new();
    for it in items {
        let net: ipnet::IpNet = it.parse().map_err(|_| {
            err(
                origin,
                field,
                format!("{it:?} is neither a CIDR (e.g. 192.0.2.0/24) nor \"primary\""),
            )
        })?;
        cidrs.push(net);
    }
    Ok(NodePortAddresses::Cidrs(cidrs))
}

/// `--snat-port-range`: `MIN-MAX`, 1024 <= MIN <= MAX <= 65535.
pub(crate) fn parse_port_range(origin: &str, text: &str) -> Result<(u16, u16), ConfigError> {
    let field = "snatPortRange";
    let bad = || {
        err(
            origin,
            field,
            format!("{text:?} is not MIN-MAX with 1024 <= MIN <= MAX <= 65535"),
        )
    };
    let (a, b) = text.split_once('-').ok_or_else(bad)?;
    let a: u16 = a.trim().parse().map_err(|_| bad())?;
    let b: u16 = b.trim().parse().map_err(|_| bad())?;
    if a < 1024 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// `IP:port`, or an IP alone (then `default_port`), as kube-proxy's bind addresses.
pub(crate) fn parse_addr(
    origin: &str,
    field: &str,
    s: &str,
    default_port: u16,
) -> Result<SocketAddr, ConfigError> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    Err(err(
        origin,
        field,
        format!("{s:?} is not an IP:port address (for example 0.0.0.0:{default_port})"),
    ))
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_lowercase())
        .unwrap_or_default()
}
