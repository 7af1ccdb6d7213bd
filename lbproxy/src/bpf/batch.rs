//! Whole hash maps read in a few system calls.
//!
//! aya's map iterator makes two system calls per entry (the next key, then its value). At
//! 10,000 Services and 100,000 endpoints, the controller's full reconcile reads some 330,000
//! entries back, and that way it held the controller for about a second every `syncPeriod`,
//! with no change synced meanwhile (`cargo xtask bench churn --sustained`).
//! `BPF_MAP_LOOKUP_BATCH` (Linux 5.6) copies thousands of entries per call. aya 0.14 does
//! not wrap it, so [`entries`] does, and falls back to aya's iterator where the kernel
//! refuses it.
//!
//! Only for plain hash maps: the batch of a per-CPU map carries one value per possible CPU,
//! and the other map types answer in their own ways.

use std::mem::{MaybeUninit, size_of};
use std::os::fd::{AsFd, AsRawFd};

use aya::Pod;
use aya::maps::{HashMap, IterableMap, MapData};

/// `enum bpf_cmd`'s `BPF_MAP_LOOKUP_BATCH` (include/uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Entries asked for per call. A hash map's batch ends at a bucket's end; a bucket holding
/// more than this is answered with `ENOSPC`, and the call is made again with room for more.
const CHUNK: usize = 4096;

/// The `batch` member of `union bpf_attr`. The kernel reads only as many bytes as it is
/// given, and takes the rest of the union as zero.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of a hash map: by `BPF_MAP_LOOKUP_BATCH`, or entry by entry when the kernel
/// refuses the batch (an entry that cannot be read is left out, as the iterator does).
pub fn entries<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Vec<(K, V)> {
    let fd = map.map().fd().as_fd().as_raw_fd();
    match lookup_batch(fd) {
        Ok(all) => all,
        Err(e) => {
            tracing::debug!(error = %e, "BPF_MAP_LOOKUP_BATCH refused; reading entry by entry");
            map.iter().flatten().collect()
        }
    }
}

/// Reads the whole map behind `fd` by `BPF_MAP_LOOKUP_BATCH`.
///
/// The kernel stores the entries of a hash map's buckets in order; the batch token it
/// writes to `out_batch` says where the next call goes on. A map written to meanwhile
/// reads as some state between the old and the new, as with the iterator.
fn lookup_batch<K: Pod, V: Pod>(fd: i32) -> std::io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    let mut chunk = CHUNK;
    // A hash map's token is a bucket number (u32); 8 bytes leave room for any map's.
    let mut token_in = 0u64;
    let mut token_out = 0u64;
    let mut first = true;
    let mut keys: Vec<MaybeUninit<K>> = Vec::new();
    let mut values: Vec<MaybeUninit<V>> = Vec::new();
    loop {
        keys.resize_with(chunk, MaybeUninit::uninit);
        values.resize_with(chunk, MaybeUninit::uninit);
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                std::ptr::from_ref(&token_in) as u64
            },
            out_batch: std::ptr::from_mut(&mut token_out) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: u32::try_from(chunk).unwrap_or(u32::MAX),
            map_fd: u32::try_from(fd)
                .map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: `attr` names buffers of `chunk` keys and values of the map's key and value
        // sizes (aya checked them against K and V when it opened the map), and two 8-byte
        // tokens; the kernel writes no further than that, and writes the count it filled
        // back into `attr`.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                std::ptr::from_mut(&mut attr),
                size_of::<BatchAttr>() as libc::c_uint,
            )
        };
        let err = (rc < 0).then(std::io::Error::last_os_error);
        let filled = (attr.count as usize).min(chunk);
        if let Some(e) = &err
            && e.raw_os_error() == Some(libc::ENOSPC)
            && filled == 0
            && chunk < (1 << 20)
        {
            chunk *= 2;
            continue;
        }
        if err
            .as_ref()
            .is_some_and(|e| e.raw_os_error() != Some(libc::ENOENT))
        {
            return Err(err.expect("checked above"));
        }
        for i in 0..filled {
            // SAFETY: the kernel filled the first `filled` keys and values.
            out.push(unsafe { (keys[i].assume_init(), values[i].assume_init()) });
        }
        if err.is_some() {
            // ENOENT: no bucket is left.
            return Ok(out);
        }
        token_in = token_out;
        first = false;
    }
}
