//! `LB_MAGLEV_V1` and `LB_MAGCFG_V1`: the Maglev lookup tables of the frontends marked
//! [`SvcFlags::MAGLEV`](crate::SvcFlags::MAGLEV) (`--lb-algorithm maglev`).
//!
//! A frontend's table has `m` entries ([`MaglevConfig::m`], one size for the node), each a
//! backend id, and is stored in chunks of [`MAGLEV_CHUNK`] entries keyed by the frontend's
//! `svc_id` and the chunk's number. A new flow's backend is entry `hash % m`: one lookup
//! in place of the jump hash over the slots. The controller builds the tables
//! (`lbproxy/src/program/maglev.rs`) from the frontend's serving backends' addresses and
//! ports and the cluster's seed, so every node with that seed has the same table.

use crate::spec::{MapKind, MapSpec};

/// Entries per chunk: a chunk is 16 KiB, so a table of the default size (16,381 entries)
/// is 4 chunks.
pub const MAGLEV_CHUNK: u32 = 4096;

/// Room in `LB_MAGLEV_V1`, in chunks: 65,536 tables of the default size. The map takes
/// memory only for the chunks it holds (`BPF_F_NO_PREALLOC`), plus its bucket array
/// (4 MiB).
pub const MAX_MAGLEV_CHUNKS: u32 = 1 << 18;

/// Key of `LB_MAGLEV_V1`: chunk `chunk` (entries `chunk * 4096 ..`) of frontend `svc_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub svc_id: u32,
    pub chunk: u32,
}
const _: () = assert!(core::mem::size_of::<MaglevKey>() == 8);

/// Value of `LB_MAGLEV_V1`: [`MAGLEV_CHUNK`] backend ids.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevChunk {
    pub backend_ids: [u32; MAGLEV_CHUNK as usize],
}
const _: () = assert!(core::mem::size_of::<MaglevChunk>() == 16 * 1024);

/// The single value of `LB_MAGCFG_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaglevConfig {
    /// The tables' size, a prime; 0 until the controller writes it (no table then).
    pub m: u32,
    pub _reserved: u32,
}
const _: () = assert!(core::mem::size_of::<MaglevConfig>() == 8);

/// Where the entry of `hash` is in a table of `m` entries (`m` > 0): its chunk and its
/// position in the chunk.
#[inline(always)]
pub fn position(hash: u64, m: u32) -> (u32, u32) {
    let i = (hash % u64::from(m)) as u32;
    (i / MAGLEV_CHUNK, i % MAGLEV_CHUNK)
}

pub const SPEC: MapSpec = MapSpec::of::<MaglevKey, MaglevChunk>(
    "LB_MAGLEV_V1",
    "maglev",
    MapKind::Hash,
    MAX_MAGLEV_CHUNKS,
)
.no_prealloc();

pub const CONFIG_SPEC: MapSpec =
    MapSpec::of::<u32, MaglevConfig>("LB_MAGCFG_V1", "maglev_config", MapKind::Array, 1);
