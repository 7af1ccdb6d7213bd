//! Writes a [`NodeState`] into the node maps: reads what each map holds, removes stale
//! entries first (so an interface or address that left is never used), then writes new and
//! changed ones. What the maps hold is read back on every sync, so an entry changed by hand
//! is repaired by the next one, as a listing is.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;

use lbproxy_common::{
    Addr, NODE_ADDR_F_NODEPORT, PodIf, SrcCheck,
    family::{V4, V6},
};

use super::desired::NodeState;
use super::family::NodeFamily;
use super::maps::{Key, NodeMap, NodeMaps, Store, Value};
use crate::bpf::BpfError;

/// Keeps the node maps at the desired [`NodeState`], logging what changes once.
pub struct NodeProgrammer<S: Store> {
    pub maps: NodeMaps<S>,
    /// The node's primary address of each family (by `FAMILY_*`) as last logged; absent
    /// before the first listing.
    primary_logged: BTreeMap<u8, Option<IpAddr>>,
    /// Pod interfaces already logged as not source-checked, so each is logged once.
    unchecked: BTreeSet<u32>,
}

fn map_error(name: &'static str) -> impl Fn(aya::maps::MapError) -> BpfError {
    move |source| BpfError::Map {
        name,
        path: PathBuf::from(name),
        source,
    }
}

impl<S: Store> NodeProgrammer<S> {
    pub fn new(maps: NodeMaps<S>) -> Self {
        Self {
            maps,
            primary_logged: BTreeMap::new(),
            unchecked: BTreeSet::new(),
        }
    }

    /// The source checks, then their fast path (`LB_PODADDRS_V1`). Source checks of the
    /// interfaces `keep` (missing from this listing only) stay. Returns the errors; a
    /// failed source check does not stop the others.
    pub fn program_pods(&mut self, state: &NodeState, keep: &BTreeSet<u32>) -> Vec<BpfError> {
        let mut errors = Vec::new();
        for u in &state.unchecked {
            if self.unchecked.insert(u.iface.index) {
                tracing::info!(
                    interface = %u.iface.name,
                    ifindex = u.iface.index,
                    master = u.master,
                    "not source-checked: enslaved to a device that is not a bridge"
                );
            }
        }
        self.unchecked.retain(|i| state.pods.contains(i));
        if let Err(e) = self.sync_src_checks(&state.src_checks, keep) {
            errors.push(e);
        }
        // An address missing here costs a FIB lookup, never a drop, so these follow the
        // routes as they are listed now.
        match sync_exact(&mut self.maps.pod_addrs, &state.pod_addrs) {
            Ok(w) if !w.is_empty() => tracing::debug!(
                written = w.len(),
                addresses = state.pod_addrs.len(),
                "pod addresses for the source check"
            ),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
        errors
    }

    /// The node interfaces and addresses of both families, IPv4 first. Stops at the first
    /// failed write.
    pub fn program_node(&mut self, state: &NodeState) -> Result<(), BpfError> {
        if state.follows_primary {
            self.log_primary::<V4>(state);
            self.log_primary::<V6>(state);
        }
        self.program_family::<V4>(state)?;
        self.program_family::<V6>(state)
    }

    /// `LB_PODIFS_V1` (see [`super::desired::pod_ifs`]).
    pub fn program_pod_ifs(&mut self, want: &BTreeMap<u32, PodIf>) -> Result<(), BpfError> {
        sync_exact(&mut self.maps.pod_ifs, want).map(|_| ())
    }

    fn log_primary<A: NodeFamily>(&mut self, state: &NodeState) {
        let primary = A::state(state).primary;
        let ip = primary.map(Addr::ip);
        if self.primary_logged.get(&A::FAMILY) != Some(&ip) {
            A::log_primary(primary);
            self.primary_logged.insert(A::FAMILY, ip);
        }
    }

    fn program_family<A: NodeFamily>(&mut self, state: &NodeState) -> Result<(), BpfError> {
        let want = A::state(state);
        let maps = A::maps(&mut self.maps);
        for (k, v) in sync_exact(&mut maps.ifs, &want.ifs)? {
            tracing::info!(ifindex = k, snat_address = %A::snat_of(&v).ip(), "{}", A::SNAT_LOG);
        }
        for (k, v) in sync_exact(&mut maps.addrs, &want.addrs)? {
            if v.flags & NODE_ADDR_F_NODEPORT != 0 {
                tracing::info!(address = %k.ip(), "{}", A::NODEPORT_LOG);
            }
        }
        Ok(())
    }

    /// Makes `LB_SRCCHECK_V1` hold exactly `want`, apart from entries of `keep`: stale
    /// entries first, then new and changed ones. A write that fails does not stop the
    /// others; the first error is returned (the interface it concerns is then not checked
    /// until a later sync writes its entry).
    fn sync_src_checks(
        &mut self,
        want: &BTreeMap<u32, SrcCheck>,
        keep: &BTreeSet<u32>,
    ) -> Result<(), BpfError> {
        let map = &mut self.maps.src_checks;
        let err = map_error(map.name());
        let mut first = Ok(());
        let have = map.entries();
        for ifindex in have
            .keys()
            .filter(|i| !want.contains_key(i) && !keep.contains(i))
        {
            if let Err(e) = map.del(ifindex) {
                first = first.and(Err(err(e)));
            }
        }
        for (ifindex, v) in want {
            if have.get(ifindex) == Some(v) {
                continue;
            }
            match map.put(ifindex, v) {
                Ok(()) => tracing::debug!(
                    ifindex,
                    expected = v.expected_ifindex,
                    "source check: the route to a packet's source must use this interface"
                ),
                Err(e) => first = first.and(Err(err(e))),
            }
        }
        first
    }
}

/// Makes `map` hold exactly `want`: stale entries first, then new and changed ones. Stops
/// at the first failed write. Returns the entries it wrote.
fn sync_exact<K: Key, V: Value>(
    map: &mut impl NodeMap<K, V>,
    want: &BTreeMap<K, V>,
) -> Result<Vec<(K, V)>, BpfError> {
    let err = map_error(map.name());
    let have = map.entries();
    for k in have.keys().filter(|k| !want.contains_key(k)) {
        map.del(k).map_err(&err)?;
    }
    let mut written = Vec::new();
    for (k, v) in want {
        if have.get(k) != Some(v) {
            map.put(k, v).map_err(&err)?;
            written.push((*k, *v));
        }
    }
    Ok(written)
}
