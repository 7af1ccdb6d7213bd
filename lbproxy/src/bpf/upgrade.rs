//! Upgrading maps written by an earlier version, before the new programs are attached.
//!
//! Maps written before `MEMBER_DRAINING` (605351c and older) list only the serving members
//! of each service in `LB_MEMBERS_V1`. A draining backend (terminating, or not ready, still
//! listed in a slice) was kept alive by its `LB_BACKENDS_V1` entry alone, which was enough
//! for its flows then. The new programs take a flow as live only while its backend is a
//! member of the flow's service, so until the first sync writes the draining members, those
//! flows would be taken for flows whose backend left: a TCP connection to a terminating pod
//! would be reset by the upgrade. [`restore_draining_members`] closes that window.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::{MEMBER_DRAINING, MemberKey, map_names};

use super::{BpfError, open_pinned, pinned::PinnedMaps};

/// The (service id, backend id) pairs to write as draining members: for every backend that
/// is in no slot and no member entry (only maps of an older version have one: this version
/// makes every backend it keeps a member of some service), the services of the flows that
/// name it, where that service still exists. `flows` is only called when such a backend
/// exists, so a restart of the same version never scans the flow table.
pub fn draining_to_restore<F, I>(
    backends: impl Iterator<Item = u32>,
    in_slots: impl Iterator<Item = u32>,
    members: impl Iterator<Item = MemberKey>,
    services: impl Iterator<Item = u32>,
    flows: F,
) -> BTreeSet<(u32, u32)>
where
    F: FnOnce() -> I,
    I: Iterator<Item = (u32, u32)>,
{
    let mut held: HashSet<u32> = in_slots.collect();
    held.extend(members.map(|m| m.backend_id));
    let orphans: HashSet<u32> = backends.filter(|id| !held.contains(id)).collect();
    if orphans.is_empty() {
        return BTreeSet::new();
    }
    let services: HashSet<u32> = services.collect();
    flows()
        .filter(|(svc_id, backend_id)| orphans.contains(backend_id) && services.contains(svc_id))
        .collect()
}

/// Writes the draining members [`draining_to_restore`] finds in the pinned maps of `dir`.
/// The first sync then keeps them (the backend is still listed) or removes them (it left),
/// as any member.
pub fn restore_draining_members(dir: &Path) -> Result<(), BpfError> {
    let maps = PinnedMaps::open(dir)?;
    let todo = draining_to_restore(
        maps.all_backends().map(|(id, _)| id),
        maps.slots.iter().flatten().map(|(_, id)| id),
        maps.members.keys().flatten(),
        maps.all_services().map(|(_, v)| v.svc_id),
        || maps.forward_flows(),
    );
    if todo.is_empty() {
        return Ok(());
    }
    let mut members: BpfHashMap<MapData, MemberKey, u32> =
        open_pinned(dir, map_names::MEMBERS, Map::HashMap)?;
    for (svc_id, backend_id) in &todo {
        let key = MemberKey {
            svc_id: *svc_id,
            backend_id: *backend_id,
        };
        members
            .insert(key, MEMBER_DRAINING, 0)
            .map_err(|source| BpfError::Map {
                name: map_names::MEMBERS,
                path: dir.join(map_names::MEMBERS),
                source,
            })?;
    }
    tracing::info!(
        members = todo.len(),
        "maps of an earlier version: the flows' draining backends are written as members before the programs change"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(svc_id: u32, backend_id: u32) -> MemberKey {
        MemberKey { svc_id, backend_id }
    }

    /// Old maps: backend 7 is kept for its flows only (no slot, no member). Its flows'
    /// services that still exist get it back as a draining member; a flow of a service that
    /// is gone does not create one.
    #[test]
    fn a_backend_kept_only_for_its_flows_becomes_a_draining_member() {
        let got = draining_to_restore(
            [5, 6, 7].into_iter(),
            [5, 6].into_iter(),
            [m(1, 5), m(2, 6)].into_iter(),
            [1, 2].into_iter(),
            || [(1, 7), (2, 7), (9, 7), (1, 5)].into_iter(),
        );
        assert_eq!(got, BTreeSet::from([(1, 7), (2, 7)]));
    }

    /// Maps of this version: every kept backend is a member somewhere, so nothing is
    /// written and the flow table is not read.
    #[test]
    fn maps_of_this_version_need_nothing_and_no_flow_scan() {
        let got = draining_to_restore(
            [5, 7].into_iter(),
            [5].into_iter(),
            [m(1, 5), m(1, 7)].into_iter(),
            [1].into_iter(),
            || -> std::vec::IntoIter<(u32, u32)> { panic!("the flow table was scanned") },
        );
        assert!(got.is_empty());
    }
}
