//! The shape of every pinned map, in one table: [`MapSpec`].
//!
//! Each map's module holds its key and value types and one `SPEC`, whose sizes are computed
//! from those types, so the table cannot drift from the layouts. The datapath names and sizes
//! its map declarations from the specs; userspace can pin, check layouts and label metrics
//! from the same table ([`crate::MAPS`]).

/// The kernel map type of a [`MapSpec`]. Only the types lbproxy uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapKind {
    /// `BPF_MAP_TYPE_HASH`.
    Hash,
    /// `BPF_MAP_TYPE_LRU_HASH`.
    LruHash,
    /// `BPF_MAP_TYPE_ARRAY`.
    Array,
    /// `BPF_MAP_TYPE_PERCPU_ARRAY`.
    PerCpuArray,
    /// `BPF_MAP_TYPE_LPM_TRIE`.
    LpmTrie,
    /// `BPF_MAP_TYPE_RINGBUF`: no key or value size; `max_entries` is its size in bytes.
    RingBuf,
    /// `BPF_MAP_TYPE_LRU_PERCPU_HASH`.
    LruPerCpuHash,
}

impl MapKind {
    /// The same value as aya's map type.
    #[cfg(feature = "user")]
    pub const fn map_type(self) -> aya::maps::MapType {
        match self {
            MapKind::Hash => aya::maps::MapType::Hash,
            MapKind::LruHash => aya::maps::MapType::LruHash,
            MapKind::Array => aya::maps::MapType::Array,
            MapKind::PerCpuArray => aya::maps::MapType::PerCpuArray,
            MapKind::LpmTrie => aya::maps::MapType::LpmTrie,
            MapKind::RingBuf => aya::maps::MapType::RingBuf,
            MapKind::LruPerCpuHash => aya::maps::MapType::LruPerCpuHash,
        }
    }
}

/// One map's name and layout, as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MapSpec {
    /// The kernel map name, also the pin's file name under `--bpffs-dir`: versioned
    /// (`LB_SERVICES_V2`), at most 15 bytes (the kernel cuts longer names).
    pub name: &'static str,
    /// The unversioned name for metric labels and `lbproxy inspect` (`services`): stays the
    /// same across layout versions.
    pub label: &'static str,
    pub kind: MapKind,
    /// `size_of` the key type (4 for arrays, whose key is the `u32` index).
    pub key_size: u32,
    /// `size_of` the value type (per CPU, for per-CPU arrays).
    pub value_size: u32,
    /// The default capacity. The flow map's is overridden at load time (`--flow-map-size`).
    pub max_entries: u32,
    /// `map_flags` at creation: 0, or [`BPF_F_NO_PREALLOC`] for a hash map that should only
    /// take memory for the entries it holds.
    pub flags: u32,
}

/// The kernel's `BPF_F_NO_PREALLOC`.
pub const BPF_F_NO_PREALLOC: u32 = 1;

impl MapSpec {
    /// A spec whose key and value sizes are those of `K` and `V`.
    pub const fn of<K, V>(
        name: &'static str,
        label: &'static str,
        kind: MapKind,
        max_entries: u32,
    ) -> Self {
        Self {
            name,
            label,
            kind,
            key_size: size_u32::<K>(),
            value_size: size_u32::<V>(),
            max_entries,
            flags: 0,
        }
    }

    /// The same spec, created with `BPF_F_NO_PREALLOC` (hash maps, and LPM tries, which
    /// the kernel refuses without it): memory for the entries held, not for the capacity.
    pub const fn no_prealloc(mut self) -> Self {
        assert!(matches!(self.kind, MapKind::Hash | MapKind::LpmTrie));
        self.flags |= BPF_F_NO_PREALLOC;
        self
    }
}

/// `size_of::<T>()` as a `u32`; a map type too large for that fails to compile.
pub const fn size_u32<T>() -> u32 {
    let n = core::mem::size_of::<T>();
    assert!(n <= u32::MAX as usize);
    n as u32
}

/// Byte-wise string equality, usable in constants (the datapath asserts each map's
/// identifier equals its spec's name with it).
pub const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}
