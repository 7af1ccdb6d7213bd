//! Typed handles on the pinned maps, used by `run`, `inspect` and the flow collector alike,
//! and the real [`Maps`] the programmer writes through.

use std::path::Path;

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray};
use lbproxy_common::{
    Addr, Backend, Backend6, CONFIG_F_STACK_BYPASS, DatapathConfig, DatapathEvent, Delivery,
    DropReason, FlowKey, FlowKey6, FlowValue, FlowValue6, PodIf, ServiceKey, ServiceKey6,
    ServiceLabel, ServiceValue, SlotKey, UnservedKey, UnservedValue, map_names,
};

use super::batch::entries;
use super::{BpfError, check_pinned_layouts, open_pinned};
use crate::desired::{BackendAddr, Frontend};
use crate::model::Family;
use crate::program::encode::{BackendValue, FrontendKey};
use crate::program::{MapWriteError, Maps, Programmed, WriteCause, assemble};

/// Typed handles on the pinned maps.
pub struct PinnedMaps {
    pub services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: BpfHashMap<MapData, SlotKey, u32>,
    pub backends: BpfHashMap<MapData, u32, Backend>,
    pub flows: BpfHashMap<MapData, FlowKey, FlowValue>,
    /// The IPv6 frontends, backends and flows (`LB_*6_V1`).
    pub services6: BpfHashMap<MapData, ServiceKey6, ServiceValue>,
    pub backends6: BpfHashMap<MapData, u32, Backend6>,
    pub flows6: BpfHashMap<MapData, FlowKey6, FlowValue6>,
    pub affinity6: BpfHashMap<MapData, lbproxy_common::AffinityKey6, lbproxy_common::AffinityValue>,
    pub labels: BpfHashMap<MapData, u32, ServiceLabel>,
    pub members: BpfHashMap<MapData, lbproxy_common::MemberKey, u32>,
    pub affinity: BpfHashMap<MapData, lbproxy_common::AffinityKey, lbproxy_common::AffinityValue>,
    pub drops: PerCpuArray<MapData, u64>,
    /// `None` under maps an older lbproxy pinned, until this version's `run` creates it.
    pub dp_events: Option<PerCpuArray<MapData, u64>>,
    pub delivery: PerCpuArray<MapData, u64>,
    pub config: Array<MapData, DatapathConfig>,
    pub pod_ifs: BpfHashMap<MapData, u32, PodIf>,
    pub unserved: BpfHashMap<MapData, UnservedKey, UnservedValue>,
    pub node_ifs: BpfHashMap<MapData, u32, lbproxy_common::NodeIf>,
    pub src_ranges: aya::maps::LpmTrie<MapData, lbproxy_common::SrcRangeData, u32>,
    pub src_ranges6: aya::maps::LpmTrie<MapData, lbproxy_common::SrcRangeData6, u32>,
    pub snat_tries: PerCpuArray<MapData, u64>,
    pub sock_config: Array<MapData, lbproxy_common::SockConfig>,
    pub sock_events: PerCpuArray<MapData, u64>,
    pub sock_rev: BpfHashMap<MapData, lbproxy_common::SockRevKey, lbproxy_common::SockRevValue>,
    pub sock_rev6: BpfHashMap<MapData, lbproxy_common::SockRevKey6, lbproxy_common::SockRevValue6>,
    /// The ServiceCIDR tries of both families.
    pub service_cidrs: super::service_cidrs::CidrTries,
    /// The Maglev tables; `None` under maps an older lbproxy pinned, until this version's
    /// `run` creates it.
    pub maglev: Option<BpfHashMap<MapData, lbproxy_common::MaglevKey, lbproxy_common::MaglevChunk>>,
    /// The per-Service traffic counters; `None` under maps an older lbproxy pinned, until
    /// this version's `run` creates it.
    pub svc_stats: Option<aya::maps::PerCpuHashMap<MapData, lbproxy_common::SvcStatKey, u64>>,
    /// Where they are pinned (for [`Maps::read_back`], which opens its own handles).
    dir: std::path::PathBuf,
}

/// Held by every read-modify-write of `LB_CONFIG_V1` in this process: the controller's
/// (`Maps::put_id_cursor`, `Maps::put_service_cidrs_flag`) and a takeover's
/// ([`PinnedMaps::set_config_flags`]) run on different threads.
static CONFIG_WRITE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn config_write() -> std::sync::MutexGuard<'static, ()> {
    CONFIG_WRITE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl PinnedMaps {
    /// Turns the `CONFIG_F_*` bits `flags` on or off in `LB_CONFIG_V1`, keeping the rest.
    pub fn set_config_flags(&mut self, flags: u32, on: bool) -> Result<(), MapWriteError> {
        let entry = || format!("flags {flags:#x} {}", if on { "on" } else { "off" });
        let _held = config_write();
        let current = self
            .config
            .get(&0, 0)
            .map_err(|e| werr(map_names::CONFIG, "lookup", entry(), e))?;
        let flags = if on {
            current.flags | flags
        } else {
            current.flags & !flags
        };
        self.config
            .set(0, DatapathConfig { flags, ..current }, 0)
            .map_err(|e| werr(map_names::CONFIG, "update", entry(), e))
    }

    pub fn open(dir: &Path) -> Result<Self, BpfError> {
        check_pinned_layouts(dir)?;
        Ok(Self {
            services: open_pinned(dir, map_names::SERVICES, Map::HashMap)?,
            slots: open_pinned(dir, map_names::SLOTS, Map::HashMap)?,
            backends: open_pinned(dir, map_names::BACKENDS, Map::HashMap)?,
            flows: open_pinned(dir, map_names::FLOWS, Map::LruHashMap)?,
            services6: open_pinned(dir, map_names::SERVICES6, Map::HashMap)?,
            backends6: open_pinned(dir, map_names::BACKENDS6, Map::HashMap)?,
            flows6: open_pinned(dir, map_names::FLOWS6, Map::LruHashMap)?,
            affinity6: open_pinned(dir, map_names::AFFINITY6, Map::LruHashMap)?,
            labels: open_pinned(dir, map_names::LABELS, Map::HashMap)?,
            members: open_pinned(dir, map_names::MEMBERS, Map::HashMap)?,
            affinity: open_pinned(dir, map_names::AFFINITY, Map::LruHashMap)?,
            drops: open_pinned(dir, map_names::DROPS, Map::PerCpuArray)?,
            dp_events: if dir.join(map_names::DP_EVENTS).exists() {
                Some(open_pinned(dir, map_names::DP_EVENTS, Map::PerCpuArray)?)
            } else {
                None
            },
            delivery: open_pinned(dir, map_names::DELIVERY, Map::PerCpuArray)?,
            config: open_pinned(dir, map_names::CONFIG, Map::Array)?,
            pod_ifs: open_pinned(dir, map_names::POD_IFS, Map::HashMap)?,
            unserved: open_pinned(dir, map_names::UNSERVED, Map::HashMap)?,
            node_ifs: open_pinned(dir, map_names::NODE_IFS, Map::HashMap)?,
            src_ranges: open_pinned(dir, map_names::SRC_RANGES, Map::LpmTrie)?,
            src_ranges6: open_pinned(dir, map_names::SRC_RANGES6, Map::LpmTrie)?,
            snat_tries: open_pinned(dir, map_names::SNAT_TRIES, Map::PerCpuArray)?,
            sock_config: open_pinned(dir, map_names::SOCK_CONFIG, Map::Array)?,
            sock_events: open_pinned(dir, map_names::SOCK_EVENTS, Map::PerCpuArray)?,
            sock_rev: open_pinned(dir, map_names::SOCK_REV, Map::LruHashMap)?,
            sock_rev6: open_pinned(dir, map_names::SOCK_REV6, Map::LruHashMap)?,
            service_cidrs: super::service_cidrs::CidrTries {
                v4: open_if_pinned(dir, map_names::SERVICE_CIDRS)?,
                v6: open_if_pinned(dir, map_names::SERVICE_CIDRS6)?,
            },
            svc_stats: if dir.join(map_names::SVC_STATS).exists() {
                Some(open_pinned(
                    dir,
                    map_names::SVC_STATS,
                    Map::PerCpuLruHashMap,
                )?)
            } else {
                None
            },
            maglev: if dir.join(map_names::MAGLEV).exists() {
                Some(open_pinned(dir, map_names::MAGLEV, Map::HashMap)?)
            } else {
                None
            },
            dir: dir.to_path_buf(),
        })
    }

    /// Every backend of both families, by id.
    pub fn all_backends(&self) -> impl Iterator<Item = (u32, BackendValue)> + use<> {
        entries(&self.backends)
            .into_iter()
            .map(|(id, b)| (id, BackendValue::V4(b)))
            .chain(
                entries(&self.backends6)
                    .into_iter()
                    .map(|(id, b)| (id, BackendValue::V6(b))),
            )
    }

    /// Every frontend entry of both families.
    pub fn all_services(&self) -> impl Iterator<Item = (FrontendKey, ServiceValue)> + use<> {
        entries(&self.services)
            .into_iter()
            .map(|(k, v)| (FrontendKey::V4(k), v))
            .chain(
                entries(&self.services6)
                    .into_iter()
                    .map(|(k, v)| (FrontendKey::V6(k), v)),
            )
    }

    /// The backend with this id, in either family's map.
    pub fn backend(&self, id: u32) -> Option<BackendAddr> {
        let v = match self.backends.get(&id, 0) {
            Ok(b) => BackendValue::V4(b),
            Err(_) => BackendValue::V6(self.backends6.get(&id, 0).ok()?),
        };
        BackendAddr::from_value(&v)
    }

    /// The (service id, backend id) of every forward flow half, of both families.
    pub fn forward_flows(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let fwd = lbproxy_common::FLOW_DIR_FORWARD;
        self.flows
            .iter()
            .flatten()
            .filter(move |(k, _)| k.dir == fwd)
            .map(|(_, v)| (v.svc_id, v.backend_id))
            .chain(
                self.flows6
                    .iter()
                    .flatten()
                    .filter(move |(k, _)| k.dir == fwd)
                    .map(|(_, v)| (v.svc_id, v.backend_id)),
            )
    }

    /// Datapath drop counters, summed over CPUs, by reason.
    pub fn drop_counts(&self) -> Vec<(DropReason, u64)> {
        DropReason::ALL
            .iter()
            .map(|r| (*r, cpu_sum(&self.drops, *r as u32)))
            .collect()
    }

    /// The datapath's events that are not drops, summed over CPUs; `None` when the map is
    /// not pinned yet (maps of an older lbproxy).
    pub fn event_counts(&self) -> Option<Vec<(DatapathEvent, u64)>> {
        let map = self.dp_events.as_ref()?;
        Some(
            DatapathEvent::ALL
                .iter()
                .map(|e| (*e, cpu_sum(map, *e as u32)))
                .collect(),
        )
    }

    /// How translated packets were delivered, summed over CPUs.
    pub fn delivery_counts(&self) -> Vec<(Delivery, u64)> {
        Delivery::ALL
            .iter()
            .map(|d| (*d, cpu_sum(&self.delivery, *d as u32)))
            .collect()
    }

    /// SNAT port allocations by the tries they took, summed over CPUs: index 0 counts the
    /// ones that found no port, index `n` those that found one on try `n`
    /// (`lbproxy_common::snat_tries`).
    pub fn snat_tries(&self) -> Vec<u64> {
        (0..lbproxy_common::snat_tries::SLOTS)
            .map(|i| cpu_sum(&self.snat_tries, i))
            .collect()
    }

    /// What the socket-level programs did, summed over CPUs.
    pub fn sock_counts(&self) -> Vec<(lbproxy_common::SockEvent, u64)> {
        lbproxy_common::SockEvent::ALL
            .iter()
            .map(|e| (*e, cpu_sum(&self.sock_events, *e as u32)))
            .collect()
    }

    /// The per-Service traffic counters (`LB_SVCSTATS_V1`), summed over CPUs, by key;
    /// empty when the map is not pinned yet.
    pub fn service_stats(&self) -> Vec<(lbproxy_common::SvcStatKey, u64)> {
        self.svc_stats
            .iter()
            .flat_map(|m| m.iter().flatten())
            .map(|(k, v)| (k, v.iter().sum()))
            .collect()
    }

    /// Every service id's label (`namespace/name:port-name`).
    pub fn labels_by_id(&self) -> std::collections::BTreeMap<u32, String> {
        label_map(&self.labels)
    }

    /// The service's `namespace/name[:port]` label, if it has one.
    pub fn label(&self, svc_id: u32) -> Option<String> {
        self.labels.get(&svc_id, 0).ok().map(|l| label_str(&l))
    }

    /// What the maps hold, put together ([`assemble`]); entries that do not fit together
    /// are logged when `report`.
    fn read_maps(&self, report: bool) -> Programmed {
        let labels = self.labels_by_id();
        assemble(
            report,
            self.all_backends(),
            entries(&self.slots).into_iter(),
            entries(&self.members).into_iter(),
            self.all_services(),
            src_ranges_in(&self.src_ranges).chain(src_ranges_in(&self.src_ranges6)),
            // The chunks' keys only: their content is not read back (see `MaglevTable`).
            self.maglev.iter().flat_map(|m| m.keys().flatten()),
            |svc_id| labels.get(&svc_id).cloned().unwrap_or_default(),
        )
    }

    /// Whether the stack bypass is on, as the datapath sees it.
    pub fn stack_bypass(&self) -> bool {
        self.config
            .get(&0, 0)
            .is_ok_and(|c| c.flags & CONFIG_F_STACK_BYPASS != 0)
    }
}

/// One per-CPU counter, summed over CPUs (0 if unreadable).
fn cpu_sum(map: &PerCpuArray<MapData, u64>, index: u32) -> u64 {
    map.get(&index, 0).map(|v| v.iter().sum()).unwrap_or(0)
}

/// Every service id's label (`namespace/name:port-name`) in the `LB_LABELS` map pinned under
/// `dir`; empty if it cannot be read.
pub fn labels(dir: &Path) -> std::collections::BTreeMap<u32, String> {
    open_pinned::<BpfHashMap<MapData, u32, ServiceLabel>>(dir, map_names::LABELS, Map::HashMap)
        .map(|m| label_map(&m))
        .unwrap_or_default()
}

/// Every entry of a labels map, as id -> label.
fn label_map(
    m: &BpfHashMap<MapData, u32, ServiceLabel>,
) -> std::collections::BTreeMap<u32, String> {
    entries(m)
        .into_iter()
        .map(|(id, l)| (id, label_str(&l)))
        .collect()
}

pub fn label_str(l: &ServiceLabel) -> String {
    label_bytes(&l.name)
}

/// A NUL-padded string field.
pub fn label_bytes(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn label_value(s: &str) -> ServiceLabel {
    ServiceLabel {
        name: lbproxy_common::nul_padded(s),
    }
}

pub(super) fn werr(
    map: &'static str,
    op: &'static str,
    entry: String,
    e: MapError,
) -> MapWriteError {
    MapWriteError {
        map,
        op,
        entry,
        cause: WriteCause::Kernel(Box::new(e)),
    }
}

/// Deleting an entry that is already gone is not an error.
pub(super) fn del_ok(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// An LPM trie pinned under `dir` as `name`, or `None` when it is not pinned (maps of an
/// older lbproxy).
fn open_if_pinned<K: aya::Pod>(
    dir: &Path,
    name: &'static str,
) -> Result<Option<aya::maps::LpmTrie<MapData, K, u32>>, BpfError> {
    if !dir.join(name).exists() {
        return Ok(None);
    }
    Ok(Some(open_pinned(dir, name, Map::LpmTrie)?))
}

/// The source-range trie key of frontend `svc_id`'s range `addr/prefix`: the whole id,
/// then the range (`LB_SRCRANGES_V1` or `LB_SRCRANGE6_V1`, by `A`).
fn src_range_key<A: Addr>(
    svc_id: u32,
    addr: A,
    prefix: u8,
) -> aya::maps::lpm_trie::Key<lbproxy_common::SrcRangeDataOf<A>>
where
    lbproxy_common::SrcRangeDataOf<A>: aya::Pod,
{
    aya::maps::lpm_trie::Key::new(
        lbproxy_common::SrcRangeDataOf::<A>::prefix_len(prefix),
        lbproxy_common::SrcRangeDataOf {
            svc_id_be: svc_id.to_be_bytes(),
            addr,
        },
    )
}

/// Every (service id, range) in one family's source-range trie.
fn src_ranges_in<A: Addr>(
    trie: &aya::maps::LpmTrie<MapData, lbproxy_common::SrcRangeDataOf<A>, u32>,
) -> impl Iterator<Item = (u32, ipnet::IpNet)> + '_
where
    lbproxy_common::SrcRangeDataOf<A>: aya::Pod,
{
    trie.keys().flatten().filter_map(|k| {
        let d = k.data();
        let prefix = u8::try_from(k.prefix_len().checked_sub(32)?).ok()?;
        let net = ipnet::IpNet::new(d.addr.ip(), prefix).ok()?;
        Some((u32::from_be_bytes(d.svc_id_be), net))
    })
}

impl Maps for PinnedMaps {
    fn read_back(&self) -> Option<crate::program::ReadBack> {
        let dir = self.dir.clone();
        Some(Box::new(move || match PinnedMaps::open(&dir) {
            Ok(maps) => Some(maps.read_maps(false)),
            Err(e) => {
                tracing::warn!("cannot open the maps to read them back: {e}");
                None
            }
        }))
    }

    fn read_programmed(&self) -> Programmed {
        self.read_maps(true)
    }

    fn put_backend(&mut self, id: u32, b: &BackendValue) -> Result<(), MapWriteError> {
        match b {
            BackendValue::V4(b) => self
                .backends
                .insert(id, *b, 0)
                .map_err(|e| werr(map_names::BACKENDS, "update", format!("id {id}"), e)),
            BackendValue::V6(b) => self
                .backends6
                .insert(id, *b, 0)
                .map_err(|e| werr(map_names::BACKENDS6, "update", format!("id {id}"), e)),
        }
    }
    fn del_backend(&mut self, id: u32, family: Family) -> Result<(), MapWriteError> {
        match family {
            Family::V4 => del_ok(self.backends.remove(&id))
                .map_err(|e| werr(map_names::BACKENDS, "delete", format!("id {id}"), e)),
            Family::V6 => del_ok(self.backends6.remove(&id))
                .map_err(|e| werr(map_names::BACKENDS6, "delete", format!("id {id}"), e)),
        }
    }
    fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError> {
        self.slots.insert(key, backend_id, 0).map_err(|e| {
            werr(
                map_names::SLOTS,
                "update",
                format!("svc {} slot {}", key.svc_id, key.slot),
                e,
            )
        })
    }
    fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError> {
        del_ok(self.slots.remove(&key)).map_err(|e| {
            werr(
                map_names::SLOTS,
                "delete",
                format!("svc {} slot {}", key.svc_id, key.slot),
                e,
            )
        })
    }
    fn put_maglev_chunk(
        &mut self,
        key: lbproxy_common::MaglevKey,
        chunk: &lbproxy_common::MaglevChunk,
    ) -> Result<(), MapWriteError> {
        let entry = || format!("svc {} chunk {}", key.svc_id, key.chunk);
        let Some(map) = self.maglev.as_mut() else {
            let e = MapError::InvalidName {
                name: format!(
                    "{} is not pinned (maps of an older lbproxy: restart `run`)",
                    map_names::MAGLEV
                ),
            };
            return Err(werr(map_names::MAGLEV, "update", entry(), e));
        };
        map.insert(key, *chunk, 0)
            .map_err(|e| werr(map_names::MAGLEV, "update", entry(), e))
    }
    fn del_maglev_chunk(&mut self, key: lbproxy_common::MaglevKey) -> Result<(), MapWriteError> {
        let entry = || format!("svc {} chunk {}", key.svc_id, key.chunk);
        let Some(map) = self.maglev.as_mut() else {
            return Ok(());
        };
        del_ok(map.remove(&key)).map_err(|e| werr(map_names::MAGLEV, "delete", entry(), e))
    }
    fn put_service(&mut self, key: FrontendKey, value: ServiceValue) -> Result<(), MapWriteError> {
        let name = Frontend::from_key(&key).map_or_else(String::new, |f| f.to_string());
        match key {
            FrontendKey::V4(k) => self
                .services
                .insert(k, value, 0)
                .map_err(|e| werr(map_names::SERVICES, "update", name, e)),
            FrontendKey::V6(k) => self
                .services6
                .insert(k, value, 0)
                .map_err(|e| werr(map_names::SERVICES6, "update", name, e)),
        }
    }
    fn del_service(&mut self, key: FrontendKey) -> Result<(), MapWriteError> {
        let name = Frontend::from_key(&key).map_or_else(String::new, |f| f.to_string());
        match key {
            FrontendKey::V4(k) => del_ok(self.services.remove(&k))
                .map_err(|e| werr(map_names::SERVICES, "delete", name, e)),
            FrontendKey::V6(k) => del_ok(self.services6.remove(&k))
                .map_err(|e| werr(map_names::SERVICES6, "delete", name, e)),
        }
    }
    fn read_service_cidrs(&self) -> std::collections::BTreeMap<ipnet::IpNet, u32> {
        self.service_cidrs.read()
    }
    fn put_service_cidr(&mut self, net: ipnet::IpNet, value: u32) -> Result<(), MapWriteError> {
        self.service_cidrs.put(net, value)
    }
    fn del_service_cidr(&mut self, net: ipnet::IpNet) -> Result<(), MapWriteError> {
        self.service_cidrs.del(net)
    }
    fn put_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError> {
        let (map, r) = match range {
            ipnet::IpNet::V4(n) => (
                map_names::SRC_RANGES,
                self.src_ranges.insert(
                    &src_range_key(svc_id, n.network().octets(), n.prefix_len()),
                    1,
                    0,
                ),
            ),
            ipnet::IpNet::V6(n) => (
                map_names::SRC_RANGES6,
                self.src_ranges6.insert(
                    &src_range_key(svc_id, n.network().octets(), n.prefix_len()),
                    1,
                    0,
                ),
            ),
        };
        r.map_err(|e| werr(map, "update", format!("svc {svc_id} {range}"), e))
    }
    fn del_src_range(&mut self, svc_id: u32, range: ipnet::IpNet) -> Result<(), MapWriteError> {
        let (map, r) = match range {
            ipnet::IpNet::V4(n) => (
                map_names::SRC_RANGES,
                del_ok(self.src_ranges.remove(&src_range_key(
                    svc_id,
                    n.network().octets(),
                    n.prefix_len(),
                ))),
            ),
            ipnet::IpNet::V6(n) => (
                map_names::SRC_RANGES6,
                del_ok(self.src_ranges6.remove(&src_range_key(
                    svc_id,
                    n.network().octets(),
                    n.prefix_len(),
                ))),
            ),
        };
        r.map_err(|e| werr(map, "delete", format!("svc {svc_id} {range}"), e))
    }
    fn put_member(&mut self, svc_id: u32, backend_id: u32, how: u32) -> Result<(), MapWriteError> {
        let key = lbproxy_common::MemberKey { svc_id, backend_id };
        self.members.insert(key, how, 0).map_err(|e| {
            werr(
                map_names::MEMBERS,
                "update",
                format!("svc {svc_id} backend {backend_id}"),
                e,
            )
        })
    }
    fn del_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError> {
        let key = lbproxy_common::MemberKey { svc_id, backend_id };
        del_ok(self.members.remove(&key)).map_err(|e| {
            werr(
                map_names::MEMBERS,
                "delete",
                format!("svc {svc_id} backend {backend_id}"),
                e,
            )
        })
    }
    fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError> {
        self.labels
            .insert(svc_id, label_value(label), 0)
            .map_err(|e| werr(map_names::LABELS, "update", format!("svc {svc_id}"), e))
    }
    fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError> {
        del_ok(self.labels.remove(&svc_id))
            .map_err(|e| werr(map_names::LABELS, "delete", format!("svc {svc_id}"), e))
    }
    fn read_unserved(&self) -> std::collections::BTreeMap<UnservedKey, UnservedValue> {
        self.unserved.iter().flatten().collect()
    }
    fn put_unserved(
        &mut self,
        key: UnservedKey,
        value: &UnservedValue,
    ) -> Result<(), MapWriteError> {
        self.unserved
            .insert(key, *value, 0)
            .map_err(|e| werr(map_names::UNSERVED, "update", label_bytes(&value.label), e))
    }
    fn read_id_cursor(&self) -> u32 {
        self.config.get(&0, 0).map_or(0, |c| c.next_id)
    }
    fn read_service_cidrs_flag(&self) -> bool {
        self.config
            .get(&0, 0)
            .is_ok_and(|c| c.flags & lbproxy_common::CONFIG_F_SERVICE_CIDRS != 0)
    }
    fn put_service_cidrs_flag(&mut self, on: bool) -> Result<(), MapWriteError> {
        self.set_config_flags(lbproxy_common::CONFIG_F_SERVICE_CIDRS, on)
    }
    fn put_id_cursor(&mut self, next: u32) -> Result<(), MapWriteError> {
        let entry = || format!("next_id {next}");
        // The controller and a takeover write the config entry once running (`write_config`
        // runs before either starts): each read-modify-write holds `CONFIG_WRITE`.
        let _held = config_write();
        let current = self
            .config
            .get(&0, 0)
            .map_err(|e| werr(map_names::CONFIG, "lookup", entry(), e))?;
        self.config
            .set(
                0,
                DatapathConfig {
                    next_id: next,
                    ..current
                },
                0,
            )
            .map_err(|e| werr(map_names::CONFIG, "update", entry(), e))
    }
    fn del_unserved(&mut self, key: UnservedKey) -> Result<(), MapWriteError> {
        del_ok(self.unserved.remove(&key)).map_err(|e| {
            werr(
                map_names::UNSERVED,
                "delete",
                format!("port {}", u16::from_be(key.port_be)),
                e,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_cut_safely() {
        let long = "é".repeat(100);
        let l = label_value(&long);
        assert!(label_str(&l).len() <= 127);
        assert_eq!(label_str(&label_value("ns/a:http")), "ns/a:http");
    }
}
