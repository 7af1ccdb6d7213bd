//! The node maps, each a [`NodeMap`] over one [`Store`]: [`Pinned`] (the BPF maps pinned
//! under `--bpffs-dir`) or, in tests, [`mem::Mem`]. The programmer reads a map, and writes
//! and deletes entries, only through [`NodeMap`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapError};
use lbproxy_common::{NodeAddr, PodAddr, PodIf, SrcCheck, family::V4, family::V6, map_names};

use super::family::NodeFamily;
use crate::bpf::pinned::del_ok;
use crate::bpf::{BpfError, open_pinned};

/// A node map's key: an ifindex or an address.
pub trait Key: aya::Pod + Ord + std::fmt::Debug {}
impl<T: aya::Pod + Ord + std::fmt::Debug> Key for T {}

/// A node map's value.
pub trait Value: aya::Pod + PartialEq + std::fmt::Debug {}
impl<T: aya::Pod + PartialEq + std::fmt::Debug> Value for T {}

/// One hash map of the node state.
pub trait NodeMap<K, V> {
    /// The map's name (`LB_NODEIFS_V1`, ...), for errors.
    fn name(&self) -> &'static str;
    /// Every entry the map holds.
    fn entries(&self) -> BTreeMap<K, V>;
    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError>;
    /// Removes `key`; a key already absent is not an error.
    fn del(&mut self, key: &K) -> Result<(), MapError>;
}

/// Where the node maps are kept: says which [`NodeMap`] a map of each key and value is, and
/// opens it by name.
pub trait Store {
    type Map<K: Key, V: Value>: NodeMap<K, V>;
    fn open<K: Key, V: Value>(&self, name: &'static str) -> Result<Self::Map<K, V>, BpfError>;
}

/// The maps of one family (see [`NodeFamily`]).
pub struct FamilyMaps<S: Store, A: NodeFamily> {
    /// `LB_NODEIFS_V1` (`LB_NODEIFS6_V1`): each node interface's SNAT address and ports.
    pub ifs: S::Map<u32, A::If>,
    /// `LB_NODEADDRS_V1` (`LB_NODEADDR6_V1`): the node's addresses that serve NodePorts or
    /// are SNAT addresses.
    pub addrs: S::Map<A, NodeAddr>,
}

impl<S: Store, A: NodeFamily> FamilyMaps<S, A> {
    fn open(store: &S) -> Result<Self, BpfError> {
        Ok(Self {
            ifs: store.open(A::IFS_MAP)?,
            addrs: store.open(A::ADDRS_MAP)?,
        })
    }
}

/// Every map of the node state.
pub struct NodeMaps<S: Store> {
    pub v4: FamilyMaps<S, V4>,
    pub v6: FamilyMaps<S, V6>,
    /// `LB_PODIFS_V1`: the attached pod interfaces and the bridges of pod interfaces.
    pub pod_ifs: S::Map<u32, PodIf>,
    /// `LB_PODADDRS_V1`: the addresses routed to each routed pod interface.
    pub pod_addrs: S::Map<V4, PodAddr>,
    /// `LB_SRCCHECK_V1`: the interface the route to a pod's packet's source must use.
    pub src_checks: S::Map<u32, SrcCheck>,
}

impl<S: Store> NodeMaps<S> {
    pub fn open(store: &S) -> Result<Self, BpfError> {
        Ok(Self {
            v4: FamilyMaps::open(store)?,
            v6: FamilyMaps::open(store)?,
            pod_ifs: store.open(map_names::POD_IFS)?,
            pod_addrs: store.open(map_names::POD_ADDRS)?,
            src_checks: store.open(map_names::SRC_CHECK)?,
        })
    }
}

/// The maps pinned under a directory.
pub struct Pinned {
    pub dir: PathBuf,
}

impl Pinned {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }
}

/// A pinned BPF hash map.
pub struct PinnedMap<K, V> {
    name: &'static str,
    map: BpfHashMap<MapData, K, V>,
}

impl Store for Pinned {
    type Map<K: Key, V: Value> = PinnedMap<K, V>;
    fn open<K: Key, V: Value>(&self, name: &'static str) -> Result<PinnedMap<K, V>, BpfError> {
        Ok(PinnedMap {
            name,
            map: open_pinned(&self.dir, name, Map::HashMap)?,
        })
    }
}

impl<K: Key, V: Value> NodeMap<K, V> for PinnedMap<K, V> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn entries(&self) -> BTreeMap<K, V> {
        self.map.iter().flatten().collect()
    }
    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError> {
        self.map.insert(key, value, 0)
    }
    fn del(&mut self, key: &K) -> Result<(), MapError> {
        del_ok(self.map.remove(key))
    }
}

#[cfg(test)]
pub mod mem {
    use super::*;

    /// The maps in memory.
    pub struct Mem;

    /// A map in memory, counting its writes; `fail_next` makes the next write fail as a
    /// full map would.
    #[derive(Debug)]
    pub struct MemMap<K, V> {
        pub name: &'static str,
        pub entries: BTreeMap<K, V>,
        pub writes: usize,
        pub fail_next: bool,
    }

    impl<K, V> MemMap<K, V> {
        fn step(&mut self) -> Result<(), MapError> {
            if std::mem::take(&mut self.fail_next) {
                return Err(MapError::SyscallError(aya::sys::SyscallError {
                    call: "bpf_map_update_elem",
                    io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
                }));
            }
            self.writes += 1;
            Ok(())
        }
    }

    impl Store for Mem {
        type Map<K: Key, V: Value> = MemMap<K, V>;
        fn open<K: Key, V: Value>(&self, name: &'static str) -> Result<MemMap<K, V>, BpfError> {
            Ok(MemMap {
                name,
                entries: BTreeMap::new(),
                writes: 0,
                fail_next: false,
            })
        }
    }

    impl<K: Key, V: Value> NodeMap<K, V> for MemMap<K, V> {
        fn name(&self) -> &'static str {
            self.name
        }
        fn entries(&self) -> BTreeMap<K, V> {
            self.entries.clone()
        }
        fn put(&mut self, key: &K, value: &V) -> Result<(), MapError> {
            self.step()?;
            self.entries.insert(*key, *value);
            Ok(())
        }
        fn del(&mut self, key: &K) -> Result<(), MapError> {
            self.step()?;
            self.entries.remove(key);
            Ok(())
        }
    }

    impl NodeMaps<Mem> {
        pub fn mem() -> Self {
            Self::open(&Mem).expect("memory maps open")
        }
        /// Writes to every map so far.
        pub fn writes(&self) -> usize {
            self.v4.ifs.writes
                + self.v4.addrs.writes
                + self.v6.ifs.writes
                + self.v6.addrs.writes
                + self.pod_ifs.writes
                + self.pod_addrs.writes
                + self.src_checks.writes
        }
    }
}
