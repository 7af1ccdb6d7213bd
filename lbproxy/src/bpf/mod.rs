//! The datapath in the kernel: loading the object, checking and migrating pinned map
//! layouts, attaching to interfaces ([`attach`]), typed access to the pinned maps
//! ([`pinned`]), the flow collector ([`flow_gc`]) and `lbproxy cleanup` ([`cleanup`]).
//!
//! Layout under `--bpffs-dir`:
//! - `LB_*_V<n>`: the maps, pinned by name (see `lbproxy_common`'s map specs);
//! - `links/`: one pinned tcx link per program and interface (see [`attach`]);
//! - `cgroup-links/`: one pinned cgroup link per socket-level program (see [`sock`]).

pub mod attach;
pub mod batch;
pub mod cleanup;
pub mod flow_gc;
pub mod flow_top;
pub mod ifaces;
pub mod node;
pub mod pinned;
pub mod service_cidrs;
pub mod sock;
pub mod sock_diag;
pub mod sock_vip;
pub mod upgrade;

pub use attach::Attacher;
pub use pinned::{PinnedMaps, label_str};

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::EbpfLoader;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError};
use aya::programs::{CgroupSockAddr, SchedClassifier, Xdp};
use lbproxy_common::{
    CONFIG_F_STACK_BYPASS, DatapathConfig, ServiceKey, ServiceValue, map_names, program_names,
};
use prometheus_client::metrics::{counter::Counter, family::Family};

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
    #[error("reading the kernel's randomness for the flow hash seed: {0}")]
    Random(#[source] std::io::Error),
    #[error("loading the datapath object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("interface {ifname} ({ifindex}), {direction}: {step}")]
    Attach {
        ifname: String,
        ifindex: u32,
        direction: &'static str,
        /// The step that failed: "tcx attach", "pinning the link", ...
        step: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("interface {ifname} ({ifindex}) refuses XDP (xdpAcceleration): {step}")]
    XdpRefused {
        ifname: String,
        ifindex: u32,
        step: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
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

fn is_bpffs(path: &Path) -> bool {
    fs_type_is(path, BPF_FS_MAGIC)
}

/// Whether `path` is on a filesystem of type `magic` (statfs `f_type`).
#[expect(
    clippy::useless_conversion,
    reason = "statfs.f_type is i64 on x86_64 but another width on other architectures"
)]
fn fs_type_is(path: &Path, magic: i64) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut st) };
    rc == 0 && i64::from(st.f_type) == magic
}

/// Checks every existing pin under `dir` against the layout this binary was built with, so
/// a restart never runs on maps of the wrong shape.
pub fn check_pinned_layouts(dir: &Path) -> Result<(), BpfError> {
    for spec in lbproxy_common::MAPS {
        let name = spec.name;
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
        let ty = spec.kind.map_type();
        let (k, v) = (spec.key_size, spec.value_size);
        let found_ty = info.map_type().ok();
        let flags = spec.flags;
        if found_ty != Some(ty)
            || info.key_size() != k
            || info.value_size() != v
            || info.map_flags() != flags
        {
            return Err(BpfError::Layout {
                path,
                dir: dir.to_path_buf(),
                found: format!(
                    "{:?} key {} value {} flags {:#x}",
                    found_ty,
                    info.key_size(),
                    info.value_size(),
                    info.map_flags()
                ),
                expected: format!("{ty:?} key {k} value {v} flags {flags:#x}"),
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
        for old in lbproxy_common::RETIRED {
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
        let pins: Vec<(&'static str, PathBuf)> = lbproxy_common::MAPS
            .iter()
            .map(|spec| (spec.name, dir.join(spec.name)))
            .collect();
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(map_names::FLOWS, flow_map_size);
        for (name, path) in &pins {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(OBJECT)?;
        migrate_services_v1(dir)?;
        migrate_flows(dir)?;
        upgrade::restore_draining_members(dir)?;
        load_programs::<SchedClassifier>(&mut ebpf, &program_names::TC, SchedClassifier::load)?;
        load_programs::<CgroupSockAddr>(&mut ebpf, &program_names::SOCK, CgroupSockAddr::load)?;
        // Loaded (and so verified) at every start, attached only with `--xdp-acceleration`.
        load_programs::<Xdp>(&mut ebpf, &[program_names::XDP], Xdp::load)?;
        Ok(Self {
            ebpf,
            dir: dir.to_path_buf(),
        })
    }
}

/// Loads the programs `names`, each of type `P`, into the kernel.
fn load_programs<P>(
    ebpf: &mut Ebpf,
    names: &[&'static str],
    load: fn(&mut P) -> Result<(), aya::programs::ProgramError>,
) -> Result<(), BpfError>
where
    for<'a> &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    for &name in names {
        let prog: &mut P = ebpf
            .program_mut(name)
            .ok_or(BpfError::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?
            .try_into()
            .map_err(|source| BpfError::Program { name, source })?;
        load(prog).map_err(|source| BpfError::Program { name, source })?;
    }
    Ok(())
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

/// Copies the flows of an older layout pinned by an earlier version (`LB_FLOWS_V1`, then
/// `LB_FLOWS_V2`) into `LB_FLOWS_V3`, so every live flow keeps its backend across the
/// upgrade, then unpins the old map. Neither older layout knew source NAT, so a half's peer
/// address is the client's own (the key's source for a forward half, its destination for a
/// reply half). A V1 entry had no rewritten client port either (its `peer_port_be` is the
/// client's own) and one CLOSING state for a FIN or RST either way, which becomes a FIN on
/// both halves (closed). Entries the new programs already wrote win.
fn migrate_flows(dir: &Path) -> Result<(), BpfError> {
    use lbproxy_common::{
        FLOW_DIR_FORWARD, FLOW_F_FIN, FLOW_STATE_CLOSING_V1, FLOW_STATE_ESTABLISHED, FlowKey,
        FlowValue, FlowValueV1, FlowValueV2,
    };
    let peer = |k: &FlowKey| {
        if k.dir == FLOW_DIR_FORWARD {
            (k.src_addr, k.src_port_be)
        } else {
            (k.dst_addr, k.dst_port_be)
        }
    };
    migrate_flow_map::<FlowValueV1>(dir, map_names::FLOWS_V1, |k, v| {
        let closing = v.state == FLOW_STATE_CLOSING_V1;
        let (peer_addr, peer_port_be) = peer(k);
        FlowValue {
            nat_addr: v.nat_addr,
            nat_port_be: v.nat_port_be,
            peer_port_be,
            state: if closing {
                FLOW_STATE_ESTABLISHED
            } else {
                v.state
            },
            flags: if closing { FLOW_F_FIN } else { 0 },
            _pad: [0; 2],
            svc_id: v.svc_id,
            backend_id: v.backend_id,
            ifindex: 0,
            _pad_a: [],
            created_ns: v.created_ns,
            last_seen_ns: v.last_seen_ns,
            peer_addr,
            adopted: 0,
            dispatch: 0,
            _reserved: [0; 2],
            _pad_b: [],
        }
    })?;
    migrate_flow_map::<FlowValueV2>(dir, map_names::FLOWS_V2, |k, v| FlowValue {
        nat_addr: v.nat_addr,
        nat_port_be: v.nat_port_be,
        peer_port_be: v.peer_port_be,
        state: v.state,
        flags: v.flags,
        _pad: [0; 2],
        svc_id: v.svc_id,
        backend_id: v.backend_id,
        ifindex: v.ifindex,
        _pad_a: [],
        created_ns: v.created_ns,
        last_seen_ns: v.last_seen_ns,
        peer_addr: peer(k).0,
        adopted: 0,
        dispatch: 0,
        _reserved: [0; 2],
        _pad_b: [],
    })
}

/// Copies every entry of the pinned flow map `old_name` (values `V`) into the current one
/// with `convert`, without overwriting, then unpins the old map. Nothing to do when it is
/// not pinned.
fn migrate_flow_map<V: aya::Pod>(
    dir: &Path,
    old_name: &'static str,
    convert: impl Fn(&lbproxy_common::FlowKey, &V) -> lbproxy_common::FlowValue,
) -> Result<(), BpfError> {
    use lbproxy_common::{FlowKey, FlowValue};
    /// The kernel's `BPF_NOEXIST` map-update flag: create only.
    const BPF_NOEXIST: u64 = 1;
    let old_path = dir.join(old_name);
    if !old_path.exists() {
        return Ok(());
    }
    let old: BpfHashMap<MapData, FlowKey, V> = open_pinned(dir, old_name, Map::LruHashMap)?;
    let mut new: BpfHashMap<MapData, FlowKey, FlowValue> =
        open_pinned(dir, map_names::FLOWS, Map::LruHashMap)?;
    let mut n = 0;
    for (k, v) in old.iter().flatten() {
        // BPF_NOEXIST: never overwrite what the new programs wrote meanwhile. A full table
        // refuses further entries; those flows are counted by the datapath when they return.
        if new.insert(k, convert(&k, &v), BPF_NOEXIST).is_ok() {
            n += 1;
        }
    }
    std::fs::remove_file(&old_path).map_err(|source| BpfError::Io {
        path: old_path.clone(),
        source,
    })?;
    tracing::info!(flows = n, "migrated {old_name} to {}", map_names::FLOWS);
    Ok(())
}

/// Writes the datapath settings (`LB_CONFIG_V1`). The programs read them on every packet, so
/// a change applies at once, also to programs a previous run left attached.
///
/// The flow-hash seed (`DatapathConfig::hash_seed`) already pinned there is kept, so that a
/// restart or an upgrade moves no flow: new flows get the backends they would have got
/// before it. A config without one (a fresh bpffs dir, after `lbproxy cleanup`, or written
/// by a version before seeds) gets a new seed from the kernel's randomness, never 0.
///
/// With `seed_file`'s seed (`--hash-seed-file`), that seed is written instead, whatever was
/// pinned: the cluster's nodes then share it. Returns the seed in effect.
pub fn write_config(
    dir: &Path,
    stack_bypass: bool,
    mode: crate::config::LoadBalancerMode,
    per_service_metrics: bool,
    seed_file: Option<u64>,
) -> Result<u64, BpfError> {
    let path = dir.join(map_names::CONFIG);
    let map_error = |source| BpfError::Map {
        name: map_names::CONFIG,
        path: path.clone(),
        source,
    };
    let mut map: Array<MapData, DatapathConfig> = open_pinned(dir, map_names::CONFIG, Map::Array)?;
    let pinned_config = map.get(&0, 0).map_err(map_error)?;
    let pinned = pinned_config.hash_seed();
    let seed = if let Some(seed) = seed_file {
        if pinned != 0 && pinned != seed {
            tracing::info!("flow hash seed taken from the seed file, replacing the pinned one");
        } else {
            tracing::info!("flow hash seed taken from the seed file");
        }
        seed
    } else if pinned != 0 {
        tracing::info!("flow hash seed kept from the pinned LB_CONFIG_V1");
        pinned
    } else {
        let seed = new_hash_seed().map_err(BpfError::Random)?;
        tracing::info!("flow hash seed created (none pinned yet)");
        seed
    };
    let config = DatapathConfig {
        // The ServiceCIDR flag is the programmer's: kept until its first sync rewrites it.
        // Untracking is kept too: an earlier takeover that died with flows handed over
        // leaves it on, and they need it until `takeover::prepare` finishes them.
        flags: (pinned_config.flags
            & (lbproxy_common::CONFIG_F_SERVICE_CIDRS | lbproxy_common::CONFIG_F_UNTRACK))
            | if stack_bypass {
                CONFIG_F_STACK_BYPASS
            } else {
                0
            }
            | mode.config_flags()
            | if per_service_metrics {
                0
            } else {
                lbproxy_common::CONFIG_F_NO_SERVICE_STATS
            },
        // The controller's id cursor is kept too (see `DatapathConfig::next_id`).
        ..pinned_config
    }
    .with_hash_seed(seed);
    map.set(0, config, 0).map_err(map_error)?;
    Ok(seed)
}

/// Writes the Maglev tables' size (`LB_MAGCFG_V1`): `m` under `--lb-algorithm maglev`, 0
/// under `jump`. Written before the first sync builds any table; the datapath falls back to
/// the jump hash over the slots wherever a table has no entry for it.
pub fn write_maglev_config(dir: &Path, m: u32) -> Result<(), BpfError> {
    let path = dir.join(map_names::MAGLEV_CONFIG);
    let mut map: Array<MapData, lbproxy_common::MaglevConfig> =
        open_pinned(dir, map_names::MAGLEV_CONFIG, Map::Array)?;
    map.set(0, lbproxy_common::MaglevConfig { m, _reserved: 0 }, 0)
        .map_err(|source| BpfError::Map {
            name: map_names::MAGLEV_CONFIG,
            path,
            source,
        })
}

/// A new flow-hash seed: 8 bytes from the kernel's randomness (`getrandom(2)`, which blocks
/// only until the pool is first initialized, early in boot), never 0 (0 means "no seed").
fn new_hash_seed() -> std::io::Result<u64> {
    loop {
        let mut buf = [0u8; 8];
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: the pointer and length describe the unfilled tail of `buf`.
            let n = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            got += n as usize;
        }
        let seed = u64::from_ne_bytes(buf);
        if seed != 0 {
            return Ok(seed);
        }
    }
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

/// The capacity of each pinned map, by name (for the capacity metric and the collector). A
/// ring buffer has no entries (its size is in bytes), so it is left out.
pub fn capacities(dir: &Path) -> Vec<(&'static str, i64)> {
    lbproxy_common::MAPS
        .iter()
        .filter(|spec| spec.kind != lbproxy_common::MapKind::RingBuf)
        .filter_map(|spec| {
            let info = MapData::from_pin(dir.join(spec.name))
                .and_then(|d| d.info())
                .ok()?;
            Some((spec.name, i64::from(info.max_entries())))
        })
        .collect()
}

/// Reads the datapath's drop, event, delivery, SNAT-tries and socket-level counters every
/// 2 s into their Prometheus counters, off the controller's loop.
pub fn spawn_counters(
    maps: PinnedMaps,
    metrics: std::sync::Arc<crate::telemetry::Metrics>,
    per_service: bool,
) {
    use crate::telemetry::{EventLabel, PathLabel, ReasonLabel};
    tokio::spawn(async move {
        // What each counter read last time, by label, one map per family.
        let mut seen: [HashMap<&'static str, u64>; 4] = Default::default();
        let mut services = ServiceCounters::default();
        let [drops, events, delivery, sock] = &mut seen;
        let reason = |l: &str| ReasonLabel { reason: l.into() };
        let event = |l: &str| EventLabel { event: l.into() };
        let path = |l: &str| PathLabel { path: l.into() };
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let d = &metrics.datapath;
            let drops_now = maps.drop_counts().into_iter();
            advance_family(
                &d.drops,
                drops,
                drops_now.map(|(r, n)| (r.label(), n)),
                reason,
            );
            // Absent only under maps an older lbproxy pinned; `run` has loaded its own.
            let events_now = maps.event_counts().into_iter().flatten();
            advance_family(
                &d.events,
                events,
                events_now.map(|(e, n)| (e.label(), n)),
                event,
            );
            let paths_now = maps.delivery_counts().into_iter();
            advance_family(
                &d.delivered,
                delivery,
                paths_now.map(|(p, n)| (p.label(), n)),
                path,
            );
            d.snat_port_tries.set(maps.snat_tries());
            let sock_now = maps.sock_counts().into_iter();
            advance_family(
                &d.sock_events,
                sock,
                sock_now.map(|(e, n)| (e.label(), n)),
                event,
            );
            if per_service {
                services.advance(&maps, d);
            }
        }
    });
}

/// The per-Service counters' state between reads of `LB_SVCSTATS_V1`.
#[derive(Default)]
struct ServiceCounters {
    /// What each counter entry summed to at the last read.
    seen: HashMap<lbproxy_common::SvcStatKey, u64>,
}

impl ServiceCounters {
    /// Moves the per-Service counters on by what each entry gained since the last read (an
    /// entry the LRU dropped and that came back counts from 0). The active-flow gauges come
    /// from the flow collector's walk (`telemetry::ActiveFlows`).
    fn advance(&mut self, maps: &PinnedMaps, d: &crate::telemetry::Datapath) {
        use crate::telemetry::{ServiceLabel, ServiceReasonLabel};
        let mut labels: HashMap<u32, Option<String>> = HashMap::new();
        let mut label = |id: u32| labels.entry(id).or_insert_with(|| maps.label(id)).clone();
        let mut seen = HashMap::new();
        for (key, now) in maps.service_stats() {
            let before = self.seen.get(&key).copied().unwrap_or(0);
            let gained = if now >= before { now - before } else { now };
            seen.insert(key, now);
            if gained == 0 {
                continue;
            }
            let Some(l) = label(key.svc_id) else {
                continue;
            };
            let svc = ServiceLabel::of(&l);
            let with_reason = || ServiceReasonLabel {
                namespace: svc.namespace.clone(),
                service: svc.service.clone(),
                reason: lbproxy_common::DropReason::ALL
                    .iter()
                    .find(|r| **r as u32 == u32::from(key.reason))
                    .map_or("unknown", |r| r.label())
                    .to_string(),
            };
            match key.kind {
                lbproxy_common::SVC_STAT_NEW_FLOW => {
                    d.service_new_flows.get_or_create(&svc).inc_by(gained);
                }
                lbproxy_common::SVC_STAT_REJECT => {
                    d.service_rejects
                        .get_or_create(&with_reason())
                        .inc_by(gained);
                }
                _ => {
                    d.service_drops.get_or_create(&with_reason()).inc_by(gained);
                }
            }
        }
        self.seen = seen;
    }
}

/// Moves each series of `family` (labelled by `label`) on by what its datapath counter
/// gained since `seen`, the counts of the last read by label.
fn advance_family<L: Clone + std::hash::Hash + Eq>(
    family: &Family<L, Counter>,
    seen: &mut HashMap<&'static str, u64>,
    counts: impl Iterator<Item = (&'static str, u64)>,
    label: fn(&'static str) -> L,
) {
    for (name, now) in counts {
        advance(
            &family.get_or_create(&label(name)),
            seen.entry(name).or_insert(0),
            now,
        );
    }
}

/// Moves a Prometheus counter on by what a datapath counter gained since it was last read.
fn advance(counter: &Counter, seen: &mut u64, now: u64) {
    if now > *seen {
        counter.inc_by(now - *seen);
    }
    *seen = now;
}

/// The first pinned map of this run that is no longer pinned under `dir`, if any, with the
/// look-up's error.
pub fn missing_pins(dir: &Path) -> Option<(PathBuf, std::io::Error)> {
    lbproxy_common::MAPS.iter().find_map(|spec| {
        let p = dir.join(spec.name);
        std::fs::symlink_metadata(&p).err().map(|e| (p, e))
    })
}

#[cfg(test)]
mod tests {
    /// Seeds come from the kernel, are never 0 and differ between calls (two equal 64-bit
    /// draws among 1000 would mean the randomness is not read).
    #[test]
    fn new_hash_seeds_are_random_and_never_zero() {
        let seeds: std::collections::BTreeSet<u64> = (0..1000)
            .map(|_| super::new_hash_seed().expect("getrandom"))
            .collect();
        assert_eq!(seeds.len(), 1000);
        assert!(!seeds.contains(&0));
    }
}
