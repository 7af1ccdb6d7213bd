//! The writes the programmer makes, as a trait: [`crate::bpf::PinnedMaps`] is the real one,
//! [`mem::MemMaps`] the in-memory one tests drive the programmer and controller with.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lbproxy_common::{
    MaglevChunk, MaglevKey, MemberKey, ServiceValue, SlotKey, UnservedKey, UnservedValue,
};

use super::maglev::MaglevTable;
use super::{Programmed, ProgrammedFrontend};
use crate::desired::{BackendAddr, Frontend};
use crate::model::Family;
use crate::program::encode::{BackendValue, FrontendKey};

/// A map write that failed, naming the map and the entry, with the cause kept as a source
/// (the errno, for a write the kernel refused).
#[derive(Debug, thiserror::Error)]
#[error("{map}: {op} {entry}")]
pub struct MapWriteError {
    pub map: &'static str,
    pub op: &'static str,
    pub entry: String,
    #[source]
    pub cause: WriteCause,
}

impl MapWriteError {
    /// No id is free for a new entry of `map` (every id from 1 to `u32::MAX` in use).
    pub fn no_free_id(map: &'static str, entry: &str) -> Self {
        Self {
            map,
            op: "allocate an id for",
            entry: entry.to_string(),
            cause: WriteCause::NoFreeId,
        }
    }

    /// The errno the kernel answered, if the kernel refused the write.
    pub fn errno(&self) -> Option<i32> {
        match &self.cause {
            WriteCause::Kernel(e) => match &**e {
                aya::maps::MapError::SyscallError(s) => s.io_error.raw_os_error(),
                _ => None,
            },
            WriteCause::NoFreeId => None,
            #[cfg(test)]
            WriteCause::Injected => None,
        }
    }
}

/// Why a map write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteCause {
    /// The kernel refused it; the message says what the errno means for a map.
    #[error("{}", meaning(.0))]
    Kernel(#[source] Box<aya::maps::MapError>),
    /// Every id is in use; nothing was written.
    #[error("no free id")]
    NoFreeId,
    /// A failure injected by a test.
    #[cfg(test)]
    #[error("injected failure")]
    Injected,
}

/// What a refused map write means, in an operator's words, with the errno's name.
fn meaning(e: &aya::maps::MapError) -> String {
    let aya::maps::MapError::SyscallError(s) = e else {
        return "refused".to_string();
    };
    let Some(errno) = s.io_error.raw_os_error() else {
        return "refused".to_string();
    };
    let (what, name) = match errno {
        libc::E2BIG => ("map full", "E2BIG"),
        libc::ENOMEM => ("out of kernel memory", "ENOMEM"),
        libc::EPERM => ("not permitted", "EPERM"),
        libc::EACCES => ("not permitted", "EACCES"),
        libc::ENOENT => ("no such entry", "ENOENT"),
        libc::EBADF => ("the map is not open", "EBADF"),
        libc::EINVAL => ("invalid key or value for this map", "EINVAL"),
        libc::EBUSY => ("map busy", "EBUSY"),
        _ => ("refused", ""),
    };
    if name.is_empty() {
        format!("{what} (errno {errno})")
    } else {
        format!("{what} (errno {errno}, {name})")
    }
}

/// A read of what the maps hold that runs on another thread; `None` if it failed.
pub type ReadBack = Box<dyn FnOnce() -> Option<Programmed> + Send>;

/// The writes the programmer makes. Implemented over the pinned BPF maps, and in memory for
/// tests.
pub trait Maps {
    /// What the maps hold, read back: to adopt it at start-up, and to find drift.
    fn read_programmed(&self) -> Programmed;
    /// The same read, to run on another thread while this one goes on writing; `None`
    /// when the maps cannot be read that way.
    fn read_back(&self) -> Option<ReadBack>;
    /// Writes backend `id` into its family's backend map.
    fn put_backend(&mut self, id: u32, b: &BackendValue) -> Result<(), MapWriteError>;
    /// Removes backend `id` from `family`'s backend map.
    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapWriteError>;
    fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError>;
    fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError>;
    /// Writes one chunk of a frontend's Maglev table (`LB_MAGLEV_V1`).
    fn put_maglev_chunk(
        &mut self,
        key: MaglevKey,
        chunk: &MaglevChunk,
    ) -> Result<(), MapWriteError>;
    fn del_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), MapWriteError>;
    /// Writes backend `backend_id` as a member of service `svc_id`, with `how`
    /// (`MEMBER_SERVING` or `MEMBER_DRAINING`).
    fn put_member(&mut self, svc_id: u32, backend_id: u32, how: u32) -> Result<(), MapWriteError>;
    fn del_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError>;
    /// Writes a frontend into its family's frontend map.
    fn put_service(&mut self, key: FrontendKey, value: ServiceValue) -> Result<(), MapWriteError>;
    fn del_service(&mut self, key: FrontendKey) -> Result<(), MapWriteError>;
    fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError>;
    fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError>;
    /// Adds one of frontend `svc_id`'s `loadBalancerSourceRanges` (`LB_SRCRANGES_V1`, or
    /// `LB_SRCRANGE6_V1` for an IPv6 range).
    fn put_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError>;
    fn del_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError>;
    /// The frontends not served yet, as listed for `lbproxy inspect`.
    fn read_unserved(&self) -> BTreeMap<UnservedKey, UnservedValue>;
    fn put_unserved(
        &mut self,
        key: UnservedKey,
        value: &UnservedValue,
    ) -> Result<(), MapWriteError>;
    fn del_unserved(&mut self, key: UnservedKey) -> Result<(), MapWriteError>;
    /// The ServiceCIDR tables of both families (`LB_SVCCIDRS_V1`, `LB_SVCCIDR6_V1`): each
    /// prefix and its value (`CIDR_*`).
    fn read_service_cidrs(&self) -> BTreeMap<ipnet::IpNet, u32>;
    fn put_service_cidr(&mut self, net: ipnet::IpNet, value: u32) -> Result<(), MapWriteError>;
    fn del_service_cidr(&mut self, net: ipnet::IpNet) -> Result<(), MapWriteError>;
    /// Sets or clears `CONFIG_F_SERVICE_CIDRS` in `LB_CONFIG_V1`: whether the datapath looks
    /// the tries up at all.
    fn put_service_cidrs_flag(&mut self, on: bool) -> Result<(), MapWriteError>;
    /// `CONFIG_F_SERVICE_CIDRS` as the maps hold it (an earlier run's, at start).
    fn read_service_cidrs_flag(&self) -> bool;
    /// The id cursor persisted by [`Maps::put_id_cursor`] (0: none yet).
    fn read_id_cursor(&self) -> u32;
    /// Persists the id cursor: no id at or past `next` has been handed out since the ids
    /// last wrapped. Written before any id it covers reaches a map.
    fn put_id_cursor(&mut self, next: u32) -> Result<(), MapWriteError>;
}

/// Puts together what the maps hold, entry by entry, as a [`Programmed`] state. Entries that
/// do not fit together (a slot without its service, a frontend with a missing slot) are
/// repaired by the first apply, and reported when `report` (not for a read made while
/// syncs write, which sees frontends mid-write).
#[allow(clippy::too_many_arguments)]
pub fn assemble(
    report: bool,
    backends: impl Iterator<Item = (u32, BackendValue)>,
    slots: impl Iterator<Item = (SlotKey, u32)>,
    members: impl Iterator<Item = (MemberKey, u32)>,
    services: impl Iterator<Item = (FrontendKey, ServiceValue)>,
    src_ranges: impl Iterator<Item = (u32, ipnet::IpNet)>,
    maglev: impl Iterator<Item = MaglevKey>,
    label: impl Fn(u32) -> String,
) -> Programmed {
    let mut tables_of: HashMap<u32, BTreeSet<u32>> = HashMap::new();
    for k in maglev {
        tables_of.entry(k.svc_id).or_default().insert(k.chunk);
    }
    let mut ranges_of: HashMap<u32, BTreeSet<ipnet::IpNet>> = HashMap::new();
    for (svc_id, r) in src_ranges {
        ranges_of.entry(svc_id).or_default().insert(r);
    }
    let mut p = Programmed::default();
    for (id, b) in backends {
        if let Some(addr) = BackendAddr::from_value(&b) {
            p.backends.insert(id, addr);
        }
    }
    let mut by_svc: HashMap<u32, BTreeMap<u32, u32>> = HashMap::new();
    for (k, id) in slots {
        by_svc.entry(k.svc_id).or_default().insert(k.slot, id);
    }
    let mut members_of: HashMap<u32, BTreeMap<u32, u32>> = HashMap::new();
    for (k, how) in members {
        members_of
            .entry(k.svc_id)
            .or_default()
            .insert(k.backend_id, how);
    }
    for (k, v) in services {
        let Some(fe) = Frontend::from_key(&k) else {
            continue;
        };
        let svc_slots = by_svc.remove(&v.svc_id).unwrap_or_default();
        // Slots 0..n, as long as they are contiguous and point at known backends; extra
        // slots past the count are kept too so they get deleted.
        let mut list = Vec::new();
        for (i, (slot, id)) in svc_slots.iter().enumerate() {
            if usize::try_from(*slot).ok() != Some(i) || !p.backends.contains_key(id) {
                if report {
                    tracing::warn!(frontend = %fe, slot, "inconsistent slot found in the maps; it will be rewritten");
                }
                break;
            }
            list.push(*id);
        }
        p.frontends.insert(
            fe,
            ProgrammedFrontend {
                svc_id: v.svc_id,
                label: label(v.svc_id),
                slots: list,
                value: Some(v),
                draining: Vec::new(),
                src_ranges: ranges_of.remove(&v.svc_id).unwrap_or_default(),
                members: members_of.remove(&v.svc_id).unwrap_or_default(),
                maglev: tables_of
                    .remove(&v.svc_id)
                    .map(MaglevTable::from_chunk_numbers)
                    .unwrap_or_default(),
            },
        );
    }
    p
}

#[cfg(test)]
pub mod mem {
    use super::*;

    /// The maps in memory. After every write it checks the invariant the datapath relies
    /// on: every service's slots `0..count` exist and point at existing backends.
    #[derive(Clone, Default, Debug)]
    pub struct MemMaps {
        pub services: BTreeMap<FrontendKey, ServiceValue>,
        pub slots: BTreeMap<SlotKey, u32>,
        pub backends: BTreeMap<u32, BackendValue>,
        pub labels: BTreeMap<u32, String>,
        pub members: BTreeMap<(u32, u32), u32>,
        pub unserved: BTreeMap<UnservedKey, UnservedValue>,
        pub src_ranges: std::collections::BTreeSet<(u32, ipnet::IpNet)>,
        pub service_cidrs: BTreeMap<ipnet::IpNet, u32>,
        pub service_cidrs_flag: bool,
        pub maglev: BTreeMap<MaglevKey, MaglevChunk>,
        /// The Maglev table size the datapath would read (`LB_MAGCFG_V1`), for [`check`].
        pub maglev_m: u32,
        /// The persisted id cursor (`LB_CONFIG_V1`'s `next_id` in the real maps).
        pub id_cursor: u32,
        pub ops: usize,
        /// Fail the n-th write from now (for failure tests).
        pub fail_at: Option<usize>,
        /// The most entries each of the services, slots and backends maps holds: a write
        /// of a new key past it is refused with E2BIG, as the kernel does.
        pub capacity: Option<usize>,
    }

    /// The kernel's answer to a new key in a full map.
    pub fn map_full(map: &'static str) -> MapWriteError {
        MapWriteError {
            map,
            op: "update",
            entry: String::new(),
            cause: WriteCause::Kernel(Box::new(aya::maps::MapError::SyscallError(
                aya::sys::SyscallError {
                    call: "bpf_map_update_elem",
                    io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
                },
            ))),
        }
    }

    impl MemMaps {
        /// Refuses a new key in a map holding `capacity` entries already.
        fn room(&self, map: &'static str, len: usize, exists: bool) -> Result<(), MapWriteError> {
            match self.capacity {
                Some(cap) if !exists && len >= cap => Err(map_full(map)),
                _ => Ok(()),
            }
        }

        fn step(&mut self, map: &'static str) -> Result<(), MapWriteError> {
            self.ops += 1;
            if let Some(n) = self.fail_at.as_mut() {
                if *n == 0 {
                    self.fail_at = None;
                    return Err(MapWriteError {
                        map,
                        op: "update",
                        entry: String::new(),
                        cause: WriteCause::Injected,
                    });
                }
                *n -= 1;
            }
            Ok(())
        }

        pub fn check(&self) {
            for (k, v) in &self.services {
                for slot in 0..v.count {
                    let key = SlotKey {
                        svc_id: v.svc_id,
                        slot,
                    };
                    let id = self.slots.get(&key).unwrap_or_else(|| {
                        panic!("service {k:?} count {} but slot {slot} missing", v.count)
                    });
                    assert!(
                        self.backends.contains_key(id),
                        "slot {key:?} points at missing backend {id}"
                    );
                }
                if v.flags & lbproxy_common::SVC_F_MAGLEV != 0 {
                    assert!(v.count > 0, "service {k:?} flagged Maglev with no backend");
                    for i in 0..self.maglev_m {
                        let (chunk, pos) =
                            lbproxy_common::maglev::position(u64::from(i), self.maglev_m);
                        let key = MaglevKey {
                            svc_id: v.svc_id,
                            chunk,
                        };
                        let c = self.maglev.get(&key).unwrap_or_else(|| {
                            panic!("service {k:?} flagged Maglev but chunk {chunk} missing")
                        });
                        let id = c.backend_ids[pos as usize];
                        assert!(
                            self.backends.contains_key(&id),
                            "Maglev entry {i} of {k:?} points at missing backend {id}"
                        );
                    }
                }
            }
        }
    }

    impl Maps for MemMaps {
        fn read_back(&self) -> Option<ReadBack> {
            // What the maps hold now: the read sees no write made after it started.
            let now = self.read_programmed();
            Some(Box::new(move || Some(now)))
        }
        fn read_programmed(&self) -> Programmed {
            assemble(
                true,
                self.backends.iter().map(|(k, v)| (*k, *v)),
                self.slots.iter().map(|(k, v)| (*k, *v)),
                self.members.iter().map(|((svc_id, backend_id), how)| {
                    (
                        MemberKey {
                            svc_id: *svc_id,
                            backend_id: *backend_id,
                        },
                        *how,
                    )
                }),
                self.services.iter().map(|(k, v)| (*k, *v)),
                self.src_ranges.iter().copied(),
                self.maglev.keys().copied(),
                |id| self.labels.get(&id).cloned().unwrap_or_default(),
            )
        }
        fn put_backend(&mut self, id: u32, b: &BackendValue) -> Result<(), MapWriteError> {
            self.step("backends")?;
            self.room(
                "backends",
                self.backends.len(),
                self.backends.contains_key(&id),
            )?;
            self.backends.insert(id, *b);
            self.check();
            Ok(())
        }
        fn del_backend(&mut self, id: u32, _family: Family) -> Result<(), MapWriteError> {
            self.step("backends")?;
            self.backends.remove(&id);
            self.check();
            Ok(())
        }
        fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError> {
            self.step("slots")?;
            self.room("slots", self.slots.len(), self.slots.contains_key(&key))?;
            self.slots.insert(key, backend_id);
            self.check();
            Ok(())
        }
        fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError> {
            self.step("slots")?;
            self.slots.remove(&key);
            self.check();
            Ok(())
        }
        fn put_maglev_chunk(
            &mut self,
            key: MaglevKey,
            chunk: &MaglevChunk,
        ) -> Result<(), MapWriteError> {
            self.step("maglev")?;
            self.maglev.insert(key, *chunk);
            self.check();
            Ok(())
        }
        fn del_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), MapWriteError> {
            self.step("maglev")?;
            self.maglev.remove(&key);
            self.check();
            Ok(())
        }
        fn put_service(
            &mut self,
            key: FrontendKey,
            value: ServiceValue,
        ) -> Result<(), MapWriteError> {
            self.step("services")?;
            self.room(
                "services",
                self.services.len(),
                self.services.contains_key(&key),
            )?;
            self.services.insert(key, value);
            self.check();
            Ok(())
        }
        fn del_service(&mut self, key: FrontendKey) -> Result<(), MapWriteError> {
            self.step("services")?;
            self.services.remove(&key);
            self.check();
            Ok(())
        }
        fn put_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError> {
            self.step("src_ranges")?;
            self.src_ranges.insert((svc_id, range));
            Ok(())
        }
        fn del_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError> {
            self.step("src_ranges")?;
            self.src_ranges.remove(&(svc_id, range));
            Ok(())
        }
        fn put_member(
            &mut self,
            svc_id: u32,
            backend_id: u32,
            how: u32,
        ) -> Result<(), MapWriteError> {
            self.step("members")?;
            self.members.insert((svc_id, backend_id), how);
            Ok(())
        }
        fn del_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError> {
            self.step("members")?;
            self.members.remove(&(svc_id, backend_id));
            Ok(())
        }
        fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError> {
            self.step("labels")?;
            self.labels.insert(svc_id, label.to_string());
            Ok(())
        }
        fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError> {
            self.step("labels")?;
            self.labels.remove(&svc_id);
            Ok(())
        }
        fn read_unserved(&self) -> BTreeMap<UnservedKey, UnservedValue> {
            self.unserved.clone()
        }
        fn put_unserved(
            &mut self,
            key: UnservedKey,
            value: &UnservedValue,
        ) -> Result<(), MapWriteError> {
            self.step("unserved")?;
            self.unserved.insert(key, *value);
            Ok(())
        }
        fn del_unserved(&mut self, key: UnservedKey) -> Result<(), MapWriteError> {
            self.step("unserved")?;
            self.unserved.remove(&key);
            Ok(())
        }
        fn read_service_cidrs(&self) -> BTreeMap<ipnet::IpNet, u32> {
            self.service_cidrs.clone()
        }
        fn put_service_cidr(&mut self, net: ipnet::IpNet, value: u32) -> Result<(), MapWriteError> {
            self.step("service_cidrs")?;
            self.service_cidrs.insert(net, value);
            Ok(())
        }
        fn del_service_cidr(&mut self, net: ipnet::IpNet) -> Result<(), MapWriteError> {
            self.step("service_cidrs")?;
            self.service_cidrs.remove(&net);
            Ok(())
        }
        fn read_service_cidrs_flag(&self) -> bool {
            self.service_cidrs_flag
        }
        fn put_service_cidrs_flag(&mut self, on: bool) -> Result<(), MapWriteError> {
            self.step("config")?;
            self.service_cidrs_flag = on;
            Ok(())
        }
        fn read_id_cursor(&self) -> u32 {
            self.id_cursor
        }
        fn put_id_cursor(&mut self, next: u32) -> Result<(), MapWriteError> {
            self.step("config")?;
            self.id_cursor = next;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_write_says_what_the_errno_means() {
        let e = MapWriteError {
            map: "LB_SERVICES_V2",
            op: "update",
            entry: "198.19.0.10:80/TCP".into(),
            cause: WriteCause::Kernel(Box::new(aya::maps::MapError::SyscallError(
                aya::sys::SyscallError {
                    call: "bpf_map_update_elem",
                    io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
                },
            ))),
        };
        assert_eq!(e.errno(), Some(libc::E2BIG));
        let chain = crate::bpf::error_chain(&e);
        assert!(
            chain.starts_with(
                "LB_SERVICES_V2: update 198.19.0.10:80/TCP: map full (errno 7, E2BIG): "
            ),
            "{chain}"
        );
    }
}
