//! The pinned ServiceCIDR tries (`LB_SVCCIDRS_V1`, `LB_SVCCIDR6_V1`): read back, written and
//! removed by prefix, for [`super::pinned::PinnedMaps`]'s `Maps` implementation.

use std::collections::BTreeMap;

use aya::maps::{LpmTrie, MapData, MapError, lpm_trie::Key};
use ipnet::IpNet;
use lbproxy_common::map_names;

use crate::program::MapWriteError;

/// Both families' tries. `None` under maps an older lbproxy pinned, until this version's
/// `run` creates them.
pub struct CidrTries {
    pub v4: Option<LpmTrie<MapData, [u8; 4], u32>>,
    pub v6: Option<LpmTrie<MapData, [u8; 16], u32>>,
}

/// [`super::pinned::werr`] of a write of prefix `net`.
fn werr(map: &'static str, op: &'static str, net: IpNet, e: MapError) -> MapWriteError {
    super::pinned::werr(map, op, net.to_string(), e)
}

/// The trie a family's prefix goes in, or the error of a write to a trie not pinned.
fn missing(map: &'static str, op: &'static str, net: IpNet) -> MapWriteError {
    werr(
        map,
        op,
        net,
        MapError::InvalidName {
            name: format!("{map} is not pinned (maps of an older lbproxy: restart `run`)"),
        },
    )
}

impl CidrTries {
    /// Every prefix of both tries and its value.
    pub fn read(&self) -> BTreeMap<IpNet, u32> {
        let mut out = BTreeMap::new();
        if let Some(t) = &self.v4 {
            for k in t.keys().flatten() {
                let net = IpNet::new(k.data().into(), u8::try_from(k.prefix_len()).unwrap_or(32));
                if let (Ok(net), Ok(v)) = (net, t.get(&k, 0)) {
                    out.insert(net, v);
                }
            }
        }
        if let Some(t) = &self.v6 {
            for k in t.keys().flatten() {
                let ip = std::net::Ipv6Addr::from(k.data());
                let net = IpNet::new(ip.into(), u8::try_from(k.prefix_len()).unwrap_or(128));
                if let (Ok(net), Ok(v)) = (net, t.get(&k, 0)) {
                    out.insert(net, v);
                }
            }
        }
        out
    }

    pub fn put(&mut self, net: IpNet, value: u32) -> Result<(), MapWriteError> {
        match net {
            IpNet::V4(n) => {
                let map = map_names::SERVICE_CIDRS;
                let t = self
                    .v4
                    .as_mut()
                    .ok_or_else(|| missing(map, "update", net))?;
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                t.insert(&key, value, 0)
                    .map_err(|e| werr(map, "update", net, e))
            }
            IpNet::V6(n) => {
                let map = map_names::SERVICE_CIDRS6;
                let t = self
                    .v6
                    .as_mut()
                    .ok_or_else(|| missing(map, "update", net))?;
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                t.insert(&key, value, 0)
                    .map_err(|e| werr(map, "update", net, e))
            }
        }
    }

    pub fn del(&mut self, net: IpNet) -> Result<(), MapWriteError> {
        match net {
            IpNet::V4(n) => {
                let map = map_names::SERVICE_CIDRS;
                let Some(t) = self.v4.as_mut() else {
                    return Ok(());
                };
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                super::pinned::del_ok(t.remove(&key)).map_err(|e| werr(map, "delete", net, e))
            }
            IpNet::V6(n) => {
                let map = map_names::SERVICE_CIDRS6;
                let Some(t) = self.v6.as_mut() else {
                    return Ok(());
                };
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                super::pinned::del_ok(t.remove(&key)).map_err(|e| werr(map, "delete", net, e))
            }
        }
    }
}
