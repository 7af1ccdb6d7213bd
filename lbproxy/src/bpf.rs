//! Loading the datapath, pinning its maps, attaching it to interfaces, and typed access to
//! the pinned maps (used by `run`, `inspect` and `cleanup` alike).
//!
//! Layout under `--bpffs-dir`:
//! - `LB_*_V1`: the maps, pinned by name;
//! - `links/<ifname>@<ifindex>:ingress|egress`: one pinned tcx link per program and
//!   interface (bpffs refuses `.` in names, so a `.` in an interface name is stored as `%`). A pinned link keeps its program attached after the controller exits; a new
//!   controller atomically swaps its own program into the same link (`bpf_link_update`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::EbpfLoader;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, MapType, PerCpuArray};
use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::{SchedClassifier, TcAttachType};
use globset::GlobSet;
use lbproxy_common::{
    Backend, CONFIG_F_STACK_BYPASS, DatapathConfig, Delivery, DropReason, FlowKey, FlowValue,
    PodIf, ServiceKey, ServiceLabel, ServiceValue, SlotKey, map_names, program_names,
};

use crate::ifaces::Link;

use crate::dataplane::{
    BackendAddr, Frontend, MapWriteError, Maps, Programmed, ProgrammedFrontend,
};

/// The datapath object, built by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lbproxy"));

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "{0} is not on a BPF filesystem; mount one (`mount -t bpf bpf /sys/fs/bpf`) or pass a --bpffs-dir under a bpffs mount"
    )]
    NotBpffs(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "pinned map {path} has layout {found}, but this lbproxy expects {expected}; it was made by an incompatible version. Run `lbproxy cleanup --bpffs-dir {dir}` (this drops existing flows) or use another --bpffs-dir"
    )]
    Layout {
        path: PathBuf,
        dir: PathBuf,
        found: String,
        expected: String,
    },
    #[error("map {name} at {path}: {source}")]
    Map {
        name: &'static str,
        path: PathBuf,
        source: MapError,
    },
    #[error("loading the datapath object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("interface {ifname} ({ifindex}), {direction}: {reason}")]
    Attach {
        ifname: String,
        ifindex: u32,
        direction: &'static str,
        reason: String,
    },
}

/// Fails unless `dir`'s nearest existing ancestor is on bpffs; then creates `dir` and
/// `dir/links`.
pub fn prepare_dir(dir: &Path) -> Result<(), BpfError> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            return Err(BpfError::NotBpffs(dir.to_path_buf()));
        }
    }
    if !is_bpffs(&probe) {
        return Err(BpfError::NotBpffs(dir.to_path_buf()));
    }
    let links = dir.join("links");
    std::fs::create_dir_all(&links).map_err(|source| BpfError::Io {
        path: links,
        source,
    })
}

#[expect(
    clippy::useless_conversion,
    reason = "statfs.f_type is i64 on x86_64 but another width on other architectures"
)]
fn is_bpffs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut st) };
    rc == 0 && i64::from(st.f_type) == BPF_FS_MAGIC
}

/// Expected shape of each pinned map: (type, key size, value size).
fn expected_layout(name: &str) -> Option<(MapType, u32, u32)> {
    use std::mem::size_of;
    let sz = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Some(match name {
        map_names::SERVICES => (
            MapType::Hash,
            sz(size_of::<ServiceKey>()),
            sz(size_of::<ServiceValue>()),
        ),
        map_names::SLOTS => (MapType::Hash, sz(size_of::<SlotKey>()), 4),
        map_names::BACKENDS => (MapType::Hash, 4, sz(size_of::<Backend>())),
        map_names::FLOWS => (
            MapType::LruHash,
            sz(size_of::<FlowKey>()),
            sz(size_of::<FlowValue>()),
        ),
        map_names::DROPS => (MapType::PerCpuArray, 4, 8),
        map_names::LABELS => (MapType::Hash, 4, sz(size_of::<ServiceLabel>())),
        map_names::MEMBERS => (MapType::Hash, sz(size_of::<lbproxy_common::MemberKey>()), 4),
        map_names::AFFINITY => (
            MapType::LruHash,
            sz(size_of::<lbproxy_common::AffinityKey>()),
            sz(size_of::<lbproxy_common::AffinityValue>()),
        ),
        map_names::CONFIG => (MapType::Array, 4, sz(size_of::<DatapathConfig>())),
        map_names::POD_IFS => (MapType::Hash, 4, sz(size_of::<PodIf>())),
        map_names::DELIVERY => (MapType::PerCpuArray, 4, 8),
        _ => return None,
    })
}

/// Checks every existing pin under `dir` against the layout this binary was built with, so
/// a restart never runs on maps of the wrong shape.
pub fn check_pinned_layouts(dir: &Path) -> Result<(), BpfError> {
    for name in map_names::PINNED {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let data = MapData::from_pin(&path).map_err(|source| BpfError::Map {
            name,
            path: path.clone(),
            source,
        })?;
        let info = data.info().map_err(|source| BpfError::Map {
            name,
            path: path.clone(),
            source,
        })?;
        let Some((ty, k, v)) = expected_layout(name) else {
            continue;
        };
        let found_ty = info.map_type().ok();
        if found_ty != Some(ty) || info.key_size() != k || info.value_size() != v {
            return Err(BpfError::Layout {
                path,
                dir: dir.to_path_buf(),
                found: format!(
                    "{:?} key {} value {}",
                    found_ty,
                    info.key_size(),
                    info.value_size()
                ),
                expected: format!("{ty:?} key {k} value {v}"),
            });
        }
    }
    Ok(())
}

/// The loaded datapath: programs ready to attach, maps pinned under `dir`.
pub struct Datapath {
    pub ebpf: Ebpf,
    pub dir: PathBuf,
}

impl Datapath {
    /// Loads the object, reusing maps already pinned under `dir` (their entries, and so every
    /// flow, survive a restart) and pinning new ones.
    pub fn load(dir: &Path, flow_map_size: u32) -> Result<Self, BpfError> {
        prepare_dir(dir)?;
        for old in map_names::RETIRED {
            let p = dir.join(old);
            if p.exists() {
                tracing::info!(
                    map = old,
                    "removing a map layout this version no longer uses"
                );
                std::fs::remove_file(&p).map_err(|source| BpfError::Io { path: p, source })?;
            }
        }
        check_pinned_layouts(dir)?;
        let flows_pin = dir.join(map_names::FLOWS);
        if flows_pin.exists()
            && let Ok(info) = MapData::from_pin(&flows_pin).and_then(|d| d.info())
            && info.max_entries() != flow_map_size
        {
            tracing::warn!(
                existing = info.max_entries(),
                requested = flow_map_size,
                "the pinned flow map keeps its size; --flow-map-size applies after `lbproxy cleanup`"
            );
        }
        let pins: Vec<(&'static str, PathBuf)> = map_names::PINNED
            .iter()
            .map(|n| (*n, dir.join(n)))
            .collect();
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(map_names::FLOWS, flow_map_size);
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(OBJECT)?;
        migrate_services_v1(dir)?;
        for name in [program_names::FROM_POD, program_names::TO_POD] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| BpfError::Program {
                    name,
                    source: aya::programs::ProgramError::UnexpectedProgramType,
                })?
                .try_into()
                .map_err(|source| BpfError::Program { name, source })?;
            prog.load()
                .map_err(|source| BpfError::Program { name, source })?;
        }
        Ok(Self {
            ebpf,
            dir: dir.to_path_buf(),
        })
    }
}

/// Copies a `LB_SERVICES_V1` pinned by an earlier version into `LB_SERVICES_V2`, keeping
/// every svc_id so its flows stay valid, then unpins V1. Programs of the earlier version keep
/// their reference to V1 until their links are swapped to the new programs.
fn migrate_services_v1(dir: &Path) -> Result<(), BpfError> {
    let old_path = dir.join(map_names::SERVICES_V1);
    if !old_path.exists() {
        return Ok(());
    }
    let old: BpfHashMap<MapData, ServiceKey, lbproxy_common::ServiceValueV1> =
        open_pinned(dir, map_names::SERVICES_V1, Map::HashMap)?;
    let mut new: BpfHashMap<MapData, ServiceKey, ServiceValue> =
        open_pinned(dir, map_names::SERVICES, Map::HashMap)?;
    let new_path = dir.join(map_names::SERVICES);
    let map_err = |path: &Path, source| BpfError::Map {
        name: map_names::SERVICES,
        path: path.to_path_buf(),
        source,
    };
    let mut n = 0;
    for (k, v) in old.iter().flatten() {
        if new.get(&k, 0).is_err() {
            let value = ServiceValue {
                svc_id: v.svc_id,
                count: v.count,
                affinity_timeout_s: 0,
                flags: 0,
                kind: 0,
                _pad: 0,
            };
            new.insert(k, value, 0).map_err(|e| map_err(&new_path, e))?;
            n += 1;
        }
    }
    std::fs::remove_file(&old_path).map_err(|source| BpfError::Io {
        path: old_path.clone(),
        source,
    })?;
    tracing::info!(frontends = n, "migrated LB_SERVICES_V1 to LB_SERVICES_V2");
    Ok(())
}

/// An interface in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interface {
    pub index: u32,
    pub name: String,
}

const DIRECTIONS: [(&str, &str, TcAttachType); 2] = [
    ("ingress", program_names::FROM_POD, TcAttachType::Ingress),
    ("egress", program_names::TO_POD, TcAttachType::Egress),
];

fn link_pin(dir: &Path, iface: &Interface, direction: &str) -> PathBuf {
    dir.join("links").join(format!(
        "{}@{}:{direction}",
        iface.name.replace('.', "%"),
        iface.index
    ))
}

/// Parses `<ifname>@<ifindex>:<direction>`.
fn parse_link_pin(file: &str) -> Option<(Interface, String)> {
    let (rest, direction) = file.rsplit_once(':')?;
    let (name, index) = rest.rsplit_once('@')?;
    Some((
        Interface {
            index: index.parse().ok()?,
            name: name.replace('%', "."),
        },
        direction.to_string(),
    ))
}

/// The interfaces that have pinned links under `dir`.
pub fn pinned_interfaces(dir: &Path) -> BTreeMap<Interface, Vec<PathBuf>> {
    let mut out: BTreeMap<Interface, Vec<PathBuf>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir.join("links")) else {
        return out;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        if let Some((iface, _)) = parse_link_pin(&file) {
            out.entry(iface).or_default().push(e.path());
        }
    }
    out
}

/// Writes the datapath settings (`LB_CONFIG_V1`). The programs read them on every packet, so
/// a change applies at once, also to programs a previous run left attached.
pub fn write_config(dir: &Path, stack_bypass: bool) -> Result<(), BpfError> {
    let mut map: Array<MapData, DatapathConfig> = open_pinned(dir, map_names::CONFIG, Map::Array)?;
    let config = DatapathConfig {
        flags: if stack_bypass {
            CONFIG_F_STACK_BYPASS
        } else {
            0
        },
        _reserved: [0; 3],
    };
    map.set(0, config, 0).map_err(|source| BpfError::Map {
        name: map_names::CONFIG,
        path: dir.join(map_names::CONFIG),
        source,
    })
}

/// Keeps the programs attached to exactly the pod interfaces that exist and match the globs,
/// and `LB_PODIFS_V1` listing exactly the attached ones the datapath may redirect into (none
/// when the stack bypass is off).
pub struct Attacher {
    globs: GlobSet,
    attached: BTreeSet<Interface>,
    pod_ifs: BpfHashMap<MapData, u32, PodIf>,
    stack_bypass: bool,
}

impl Attacher {
    pub fn new(globs: GlobSet, dir: &Path, stack_bypass: bool) -> Result<Self, BpfError> {
        Ok(Self {
            globs,
            attached: BTreeSet::new(),
            pod_ifs: open_pinned(dir, map_names::POD_IFS, Map::HashMap)?,
            stack_bypass,
        })
    }

    pub fn attached(&self) -> &BTreeSet<Interface> {
        &self.attached
    }

    /// Attaches to new matching interfaces (adopting links an earlier run pinned), and
    /// forgets pins of interfaces that are gone. Returns one error per interface that could
    /// not be attached; the others are still attached.
    pub fn sync(&mut self, dp: &mut Datapath, present: &[Link]) -> Vec<BpfError> {
        let mut errors = Vec::new();
        let want: BTreeSet<Interface> = present
            .iter()
            .map(|l| &l.iface)
            .filter(|i| self.globs.is_match(&i.name))
            .cloned()
            .collect();
        // Pins for interfaces that vanished (or were renamed, or left the globs).
        for (iface, paths) in pinned_interfaces(&dp.dir) {
            if !want.contains(&iface) {
                for p in paths {
                    let _ = std::fs::remove_file(&p);
                }
                if self.attached.remove(&iface) {
                    tracing::info!(interface = %iface.name, ifindex = iface.index, "interface gone; forgotten");
                }
            }
        }
        self.attached.retain(|i| want.contains(i));
        for iface in want {
            if self.attached.contains(&iface) {
                continue;
            }
            match attach_interface(dp, &iface) {
                Ok(adopted) => {
                    tracing::info!(
                        interface = %iface.name,
                        ifindex = iface.index,
                        adopted,
                        "attached"
                    );
                    self.attached.insert(iface);
                }
                Err(e) => errors.push(e),
            }
        }
        let redirectable: BTreeMap<u32, PodIf> = present
            .iter()
            .filter(|l| self.stack_bypass && self.attached.contains(&l.iface))
            .filter_map(|l| Some((l.iface.index, PodIf { kind: l.peer_kind? })))
            .collect();
        if let Err(e) = self.sync_pod_ifs(&redirectable) {
            errors.push(e);
        }
        errors
    }

    /// Makes `LB_PODIFS_V1` hold exactly `want`: stale entries first, so an interface that
    /// left is never a redirect target, then new ones.
    fn sync_pod_ifs(&mut self, want: &BTreeMap<u32, PodIf>) -> Result<(), BpfError> {
        let err = |source| BpfError::Map {
            name: map_names::POD_IFS,
            path: PathBuf::from(map_names::POD_IFS),
            source,
        };
        let have: BTreeMap<u32, PodIf> = self.pod_ifs.iter().flatten().collect();
        for ifindex in have.keys().filter(|i| !want.contains_key(i)) {
            del_ok(self.pod_ifs.remove(ifindex)).map_err(err)?;
        }
        for (ifindex, v) in want {
            if have.get(ifindex) != Some(v) {
                self.pod_ifs.insert(ifindex, v, 0).map_err(err)?;
                tracing::debug!(
                    ifindex,
                    kind = v.kind,
                    "redirects into this interface's pod"
                );
            }
        }
        Ok(())
    }
}

/// Attaches both programs to one interface. Returns whether existing pinned links were
/// adopted (their program swapped atomically) rather than created.
fn attach_interface(dp: &mut Datapath, iface: &Interface) -> Result<bool, BpfError> {
    let mut adopted = false;
    for (direction, prog_name, attach_type) in DIRECTIONS {
        let err = |reason: String| BpfError::Attach {
            ifname: iface.name.clone(),
            ifindex: iface.index,
            direction,
            reason,
        };
        let pin = link_pin(&dp.dir, iface, direction);
        let prog: &mut SchedClassifier = dp
            .ebpf
            .program_mut(prog_name)
            .ok_or_else(|| err(format!("program {prog_name} missing from the object")))?
            .try_into()
            .map_err(|e| err(error_chain(&e)))?;
        if pin.exists() {
            let replaced = PinnedLink::from_pin(&pin)
                .map_err(|e| error_chain(&e))
                .and_then(|old| {
                    SchedClassifierLink::try_from(FdLink::from(old)).map_err(|e| error_chain(&e))
                })
                .and_then(|link| prog.attach_to_link(link).map_err(|e| error_chain(&e)));
            match replaced {
                Ok(id) => {
                    // The pin keeps the link; this process's fd can go.
                    drop(prog.take_link(id));
                    adopted = true;
                    continue;
                }
                Err(reason) => {
                    tracing::warn!(pin = %pin.display(), %reason, "stale link pin; attaching anew");
                    let _ = std::fs::remove_file(&pin);
                }
            }
        }
        let id = prog
            .attach_with_options(
                &iface.name,
                attach_type,
                TcAttachOptions::TcxOrder(LinkOrder::default()),
            )
            .map_err(|e| err(format!("tcx attach: {}", error_chain(&e))))?;
        let link = prog
            .take_link(id)
            .map_err(|e| err(format!("taking the link: {}", error_chain(&e))))?;
        let fd: FdLink = link
            .try_into()
            .map_err(|e| err(format!("not a tcx link: {}", error_chain(&e))))?;
        fd.pin(&pin)
            .map_err(|e| err(format!("pinning {}: {}", pin.display(), error_chain(&e))))?;
    }
    Ok(adopted)
}

/// An error with its sources, since aya's syscall errors keep the errno in `source()`.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A typed handle on the map pinned as `dir/name`; `wrap` says what kind of map it is.
pub fn open_pinned<T: TryFrom<Map, Error = MapError>>(
    dir: &Path,
    name: &'static str,
    wrap: fn(MapData) -> Map,
) -> Result<T, BpfError> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|source| BpfError::Map {
        name,
        path: path.clone(),
        source,
    })?;
    T::try_from(wrap(data)).map_err(|source| BpfError::Map { name, path, source })
}

/// Typed handles on the pinned maps.
pub struct PinnedMaps {
    pub services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: BpfHashMap<MapData, SlotKey, u32>,
    pub backends: BpfHashMap<MapData, u32, Backend>,
    pub flows: BpfHashMap<MapData, FlowKey, FlowValue>,
    pub labels: BpfHashMap<MapData, u32, ServiceLabel>,
    pub members: BpfHashMap<MapData, lbproxy_common::MemberKey, u32>,
    pub drops: PerCpuArray<MapData, u64>,
    pub delivery: PerCpuArray<MapData, u64>,
    pub config: Array<MapData, DatapathConfig>,
    pub pod_ifs: BpfHashMap<MapData, u32, PodIf>,
}

impl PinnedMaps {
    pub fn open(dir: &Path) -> Result<Self, BpfError> {
        check_pinned_layouts(dir)?;
        Ok(Self {
            services: open_pinned(dir, map_names::SERVICES, Map::HashMap)?,
            slots: open_pinned(dir, map_names::SLOTS, Map::HashMap)?,
            backends: open_pinned(dir, map_names::BACKENDS, Map::HashMap)?,
            flows: open_pinned(dir, map_names::FLOWS, Map::LruHashMap)?,
            labels: open_pinned(dir, map_names::LABELS, Map::HashMap)?,
            members: open_pinned(dir, map_names::MEMBERS, Map::HashMap)?,
            drops: open_pinned(dir, map_names::DROPS, Map::PerCpuArray)?,
            delivery: open_pinned(dir, map_names::DELIVERY, Map::PerCpuArray)?,
            config: open_pinned(dir, map_names::CONFIG, Map::Array)?,
            pod_ifs: open_pinned(dir, map_names::POD_IFS, Map::HashMap)?,
        })
    }

    /// Reads back what the maps hold, to adopt it. Entries that do not fit together (a slot
    /// without its service, a frontend with a missing slot) are reported, and repaired by the
    /// first apply.
    pub fn read_programmed(&self) -> Programmed {
        let mut p = Programmed::default();
        for (id, b) in self.backends.iter().flatten() {
            if let Some(addr) = BackendAddr::from_value(&b) {
                p.backends.insert(id, addr);
            }
        }
        let mut slots: HashMap<u32, BTreeMap<u32, u32>> = HashMap::new();
        for (k, id) in self.slots.iter().flatten() {
            slots.entry(k.svc_id).or_default().insert(k.slot, id);
        }
        let mut members: HashMap<u32, std::collections::BTreeSet<u32>> = HashMap::new();
        for k in self.members.keys().flatten() {
            members.entry(k.svc_id).or_default().insert(k.backend_id);
        }
        for (k, v) in self.services.iter().flatten() {
            let Some(fe) = Frontend::from_key(&k) else {
                continue;
            };
            let svc_slots = slots.remove(&v.svc_id).unwrap_or_default();
            // Slots 0..n, as long as they are contiguous and point at known backends; extra
            // slots past the count are kept too so they get deleted.
            let mut list = Vec::new();
            for (i, (slot, id)) in svc_slots.iter().enumerate() {
                if usize::try_from(*slot).ok() != Some(i) || !p.backends.contains_key(id) {
                    tracing::warn!(frontend = %fe, slot, "inconsistent slot found at start-up; it will be rewritten");
                    break;
                }
                list.push(*id);
            }
            let label = self
                .labels
                .get(&v.svc_id, 0)
                .map(|l| label_str(&l))
                .unwrap_or_default();
            p.frontends.insert(
                fe,
                ProgrammedFrontend {
                    svc_id: v.svc_id,
                    label,
                    slots: list,
                    count: Some(v.count),
                    draining: Vec::new(),
                    affinity_timeout_s: v.affinity_timeout_s,
                    members: members.remove(&v.svc_id).unwrap_or_default(),
                },
            );
        }
        p
    }

    /// Datapath drop counters, summed over CPUs, by reason.
    pub fn drop_counts(&self) -> Vec<(DropReason, u64)> {
        DropReason::ALL
            .iter()
            .map(|r| (*r, cpu_sum(&self.drops, *r as u32)))
            .collect()
    }

    /// How translated packets were delivered, summed over CPUs.
    pub fn delivery_counts(&self) -> Vec<(Delivery, u64)> {
        Delivery::ALL
            .iter()
            .map(|d| (*d, cpu_sum(&self.delivery, *d as u32)))
            .collect()
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

pub fn label_str(l: &ServiceLabel) -> String {
    let end = l.name.iter().position(|b| *b == 0).unwrap_or(l.name.len());
    String::from_utf8_lossy(&l.name[..end]).into_owned()
}

fn label_value(s: &str) -> ServiceLabel {
    let mut name = [0u8; 128];
    // Keep room for the NUL; cut on a char boundary.
    let mut end = s.len().min(127);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].copy_from_slice(&s.as_bytes()[..end]);
    ServiceLabel { name }
}

fn werr(map: &'static str, op: &'static str, entry: String, e: &MapError) -> MapWriteError {
    MapWriteError {
        map,
        op,
        entry,
        reason: e.to_string(),
    }
}

/// Deleting an entry that is already gone is not an error.
fn del_ok(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

impl Maps for PinnedMaps {
    fn put_backend(&mut self, id: u32, b: &Backend) -> Result<(), MapWriteError> {
        self.backends
            .insert(id, *b, 0)
            .map_err(|e| werr(map_names::BACKENDS, "update", format!("id {id}"), &e))
    }
    fn del_backend(&mut self, id: u32) -> Result<(), MapWriteError> {
        del_ok(self.backends.remove(&id))
            .map_err(|e| werr(map_names::BACKENDS, "delete", format!("id {id}"), &e))
    }
    fn put_slot(&mut self, key: SlotKey, backend_id: u32) -> Result<(), MapWriteError> {
        self.slots.insert(key, backend_id, 0).map_err(|e| {
            werr(
                map_names::SLOTS,
                "update",
                format!("svc {} slot {}", key.svc_id, key.slot),
                &e,
            )
        })
    }
    fn del_slot(&mut self, key: SlotKey) -> Result<(), MapWriteError> {
        del_ok(self.slots.remove(&key)).map_err(|e| {
            werr(
                map_names::SLOTS,
                "delete",
                format!("svc {} slot {}", key.svc_id, key.slot),
                &e,
            )
        })
    }
    fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> Result<(), MapWriteError> {
        self.services.insert(key, value, 0).map_err(|e| {
            werr(
                map_names::SERVICES,
                "update",
                Frontend::from_key(&key).map_or_else(String::new, |f| f.to_string()),
                &e,
            )
        })
    }
    fn del_service(&mut self, key: ServiceKey) -> Result<(), MapWriteError> {
        del_ok(self.services.remove(&key)).map_err(|e| {
            werr(
                map_names::SERVICES,
                "delete",
                Frontend::from_key(&key).map_or_else(String::new, |f| f.to_string()),
                &e,
            )
        })
    }
    fn put_member(&mut self, svc_id: u32, backend_id: u32) -> Result<(), MapWriteError> {
        let key = lbproxy_common::MemberKey { svc_id, backend_id };
        self.members.insert(key, 1, 0).map_err(|e| {
            werr(
                map_names::MEMBERS,
                "update",
                format!("svc {svc_id} backend {backend_id}"),
                &e,
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
                &e,
            )
        })
    }
    fn put_label(&mut self, svc_id: u32, label: &str) -> Result<(), MapWriteError> {
        self.labels
            .insert(svc_id, label_value(label), 0)
            .map_err(|e| werr(map_names::LABELS, "update", format!("svc {svc_id}"), &e))
    }
    fn del_label(&mut self, svc_id: u32) -> Result<(), MapWriteError> {
        del_ok(self.labels.remove(&svc_id))
            .map_err(|e| werr(map_names::LABELS, "delete", format!("svc {svc_id}"), &e))
    }
}

/// Detaches the link pinned at `pin` now (`BPF_LINK_DETACH`). Removing the pin alone frees
/// the link only after an RCU grace period and a kernel workqueue pass: up to hundreds of
/// milliseconds on a busy node, during which the programs keep translating with the flow
/// table as it was. A connection from a source port that an old flow used could then have
/// its SYN-ACK reverse-NATed, and be reset, right after `cleanup` returned (seen in the
/// datapath benchmark).
fn detach_pinned_link(pin: &Path) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    use std::os::unix::ffi::OsStrExt as _;
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_DETACH: libc::c_long = 34;
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())?;
    // union bpf_attr for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags, path_fd.
    let mut get = [0u64; 3];
    get[0] = path.as_ptr() as u64;
    // SAFETY: the attr buffer and the path outlive the call; the size matches the buffer.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, get.as_mut_ptr(), 24) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned, owned from here on.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // union bpf_attr for BPF_LINK_DETACH: link_fd.
    let mut detach = [0u32; 4];
    detach[0] = link.as_raw_fd() as u32;
    // SAFETY: as above.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_DETACH, detach.as_mut_ptr(), 16) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `lbproxy cleanup`: detaches and unpins every link, unpins every map, then removes the
/// directory. Returns what it removed.
pub fn cleanup(dir: &Path) -> Result<Vec<String>, BpfError> {
    let mut removed = Vec::new();
    if !dir.exists() {
        return Ok(removed);
    }
    for (iface, paths) in pinned_interfaces(dir) {
        for p in paths {
            if let Err(e) = detach_pinned_link(&p) {
                tracing::warn!(pin = %p.display(), "detaching at once failed ({e}); the link goes when its pin is removed");
            }
            std::fs::remove_file(&p).map_err(|source| BpfError::Io {
                path: p.clone(),
                source,
            })?;
        }
        removed.push(format!("links of {}@{}", iface.name, iface.index));
    }
    let links = dir.join("links");
    if links.exists() {
        // Anything else left there (e.g. a half-written pin) goes too.
        std::fs::remove_dir_all(&links).map_err(|source| BpfError::Io {
            path: links.clone(),
            source,
        })?;
    }
    for name in map_names::PINNED
        .iter()
        .chain(map_names::RETIRED.iter())
        .chain([map_names::SERVICES_V1].iter())
    {
        let p = dir.join(name);
        if p.exists() {
            std::fs::remove_file(&p).map_err(|source| BpfError::Io {
                path: p.clone(),
                source,
            })?;
            removed.push(format!("map {name}"));
        }
    }
    std::fs::remove_dir(dir).map_err(|source| BpfError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pin_names_round_trip() {
        let i = Interface {
            index: 42,
            name: "cali.a@b".into(),
        };
        let p = link_pin(Path::new("/x"), &i, "ingress");
        let file = p.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(parse_link_pin(&file), Some((i, "ingress".to_string())));
    }

    #[test]
    fn labels_are_cut_safely() {
        let long = "é".repeat(100);
        let l = label_value(&long);
        assert!(label_str(&l).len() <= 127);
        assert_eq!(label_str(&label_value("ns/a:http")), "ns/a:http");
    }
}
