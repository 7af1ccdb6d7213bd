//! The node's UDP sockets connected to a frontend's own address, untranslated.
//!
//! The `connect4`/`connect6` programs translate a socket when it connects, and only then. A
//! socket that connected to a ClusterIP (or an externalIP, an LB IP) while no frontend was
//! there (the Service deleted and not yet created again, say: the reaper destroyed the
//! socket when its backend went, and the application connected again during the gap) is
//! connected to the bare address. Its datagrams go where the node routes that address,
//! usually nowhere, and nothing translates them once the Service is back: a one-way sender
//! (a statsd client) would be blackholed until it restarts. kube-proxy deletes the UDP
//! conntrack entries of a service IP when a Service port appears or gains endpoints, for
//! the same reason.
//!
//! So when a UDP frontend appears (a service id not seen at the previous look), the node's
//! UDP sockets connected to its address and port are destroyed (`SOCK_DESTROY`, as the
//! reaper does): the application's next send fails, and it connects again, translated this
//! time. A translated socket is connected to a backend, never to a frontend, so it is never
//! touched; a NodePort's entry (the any-address) names no address a socket connects to.

use std::collections::BTreeSet;
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::{IPPROTO_UDP, ServiceKey, ServiceKey6, ServiceValue, map_names};

use super::open_pinned;
use super::sock::SockError;
use super::sock_diag::SockDiag;

/// A UDP frontend with an address of its own: its address, host-order port, and service
/// id (a frontend created again gets a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum UdpFrontend {
    V4([u8; 4], u16, u32),
    V6([u8; 16], u16, u32),
}

/// The UDP frontends in the pinned maps under `dir`, NodePorts' any-address entries left
/// out.
pub fn udp_frontends(dir: &Path) -> Result<BTreeSet<UdpFrontend>, SockError> {
    let v4: BpfHashMap<MapData, ServiceKey, ServiceValue> =
        open_pinned(dir, map_names::SERVICES, Map::HashMap)?;
    let v6: BpfHashMap<MapData, ServiceKey6, ServiceValue> =
        open_pinned(dir, map_names::SERVICES6, Map::HashMap)?;
    let mut out = BTreeSet::new();
    for (k, v) in super::batch::entries(&v4) {
        if k.proto == IPPROTO_UDP && k.addr != [0; 4] {
            out.insert(UdpFrontend::V4(k.addr, u16::from_be(k.port_be), v.svc_id));
        }
    }
    for (k, v) in super::batch::entries(&v6) {
        if k.proto == IPPROTO_UDP && k.addr != [0; 16] {
            out.insert(UdpFrontend::V6(k.addr, u16::from_be(k.port_be), v.svc_id));
        }
    }
    Ok(out)
}

/// What one look at new frontends did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Destroyed {
    /// Sockets connected to a new frontend's address, destroyed.
    pub destroyed: usize,
    /// Destroys the kernel refused (the socket closed meanwhile, say).
    pub failed: usize,
}

/// Destroys the node's UDP sockets connected to the address and port of a frontend in
/// `fresh` (see the module docs). Dumps the sockets only when `fresh` is not empty.
pub fn destroy_connected_to(fresh: &BTreeSet<UdpFrontend>) -> Result<Destroyed, SockError> {
    let mut out = Destroyed::default();
    if fresh.is_empty() {
        return Ok(out);
    }
    let v4: BTreeSet<([u8; 4], u16)> = fresh
        .iter()
        .filter_map(|f| match *f {
            UdpFrontend::V4(a, p, _) => Some((a, p)),
            UdpFrontend::V6(..) => None,
        })
        .collect();
    let v6: BTreeSet<([u8; 16], u16)> = fresh
        .iter()
        .filter_map(|f| match *f {
            UdpFrontend::V6(a, p, _) => Some((a, p)),
            UdpFrontend::V4(..) => None,
        })
        .collect();
    let diag = SockDiag::open().map_err(|e| SockError::Diag("open", e))?;
    let mut socks = Vec::new();
    if !v4.is_empty() {
        socks.extend(
            diag.dump(IPPROTO_UDP)
                .map_err(|e| SockError::Diag("dump", e))?,
        );
    }
    // IPv6 sockets: those talking IPv6, and those talking IPv4 through mapped addresses.
    socks.extend(
        diag.dump6(IPPROTO_UDP)
            .map_err(|e| SockError::Diag("dump", e))?,
    );
    for s in socks {
        let to = match (s.remote(), s.remote6()) {
            (Some(r), _) if v4.contains(&r) => std::net::SocketAddr::from(r),
            (_, Some(r)) if v6.contains(&r) => std::net::SocketAddr::from(r),
            _ => continue,
        };
        match diag.destroy(IPPROTO_UDP, &s) {
            Ok(()) => {
                out.destroyed += 1;
                tracing::info!(
                    cookie = s.cookie,
                    frontend = %to,
                    "destroyed a node UDP socket connected to a frontend's address before the frontend existed"
                );
            }
            Err(e) => {
                out.failed += 1;
                tracing::warn!(
                    cookie = s.cookie,
                    frontend = %to,
                    "destroying a node UDP socket connected to a new frontend's address: {e}"
                );
            }
        }
    }
    Ok(out)
}

/// Follows the UDP frontends from one look to the next: [`NewFrontends::look`] destroys the
/// sockets connected to the addresses of those that appeared since the last look (every
/// one, the first time: sockets connected before lbproxy started).
#[derive(Debug, Default)]
pub struct NewFrontends {
    seen: BTreeSet<UdpFrontend>,
}

impl NewFrontends {
    pub fn look(&mut self, dir: &Path) -> Result<Destroyed, SockError> {
        let now = udp_frontends(dir)?;
        let fresh: BTreeSet<UdpFrontend> = now.difference(&self.seen).copied().collect();
        let out = destroy_connected_to(&fresh)?;
        self.seen = now;
        Ok(out)
    }
}
