//! `LB_LABELS_V1`: service names by `svc_id`, for `lbproxy inspect`. The datapath never reads
//! it; it declares it so the object carries it (and its BTF).

use crate::services::MAX_SERVICES;
use crate::spec::{MapKind, MapSpec};

/// Value of `LB_LABELS_V1`, keyed by `svc_id`: `namespace/name:port-name`, NUL-padded.
/// Only userspace reads it; it lets `lbproxy inspect` name services without the controller.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLabel {
    pub name: [u8; 128],
}
const _: () = assert!(core::mem::size_of::<ServiceLabel>() == 128);

/// One label per `svc_id`.
pub const SPEC: MapSpec =
    MapSpec::of::<u32, ServiceLabel>("LB_LABELS_V1", "labels", MapKind::Hash, MAX_SERVICES);

/// `s` in a NUL-padded field of `N` bytes (`ServiceLabel::name`, the unserved list's
/// strings), cut on a char boundary so one NUL always fits.
pub fn nul_padded<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let mut end = s.len().min(N - 1);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out[..end].copy_from_slice(&s.as_bytes()[..end]);
    out
}
