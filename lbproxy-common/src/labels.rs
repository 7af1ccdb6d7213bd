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
