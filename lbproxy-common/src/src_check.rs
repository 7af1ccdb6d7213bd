//! `LB_SRCCHECK_V1`: the source check of each pod interface, by the host-side ifindex.
//!
//! A packet that leaves a pod for a service frontend is only translated if the node's route
//! back to its source address leads out of the interface it came in on (a strict
//! reverse-path check, as Calico's BPF dataplane does for workload interfaces). The entry
//! says which interface that route must use: the pod interface itself on a routed pod
//! network (a `/32` route per pod), or its bridge when the interface is a bridge port. An
//! interface without an entry is not checked.

use crate::spec::{MapKind, MapSpec};

/// Pod interfaces on one node that can be checked (as many as `LB_PODIFS_V1` holds).
pub const MAX_SRC_CHECKS: u32 = 4_096;

/// Value of `LB_SRCCHECK_V1`, keyed by the host-side ifindex (`u32`) of a pod interface.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SrcCheck {
    /// The interface the node's route to a packet's source address must lead out of: the
    /// pod interface itself, or the bridge it is a port of.
    pub expected_ifindex: u32,
    /// Zero; room for a check mode without a new layout.
    pub _reserved: u32,
}
const _: () = assert!(core::mem::size_of::<SrcCheck>() == 8);

pub const SPEC: MapSpec =
    MapSpec::of::<u32, SrcCheck>("LB_SRCCHECK_V1", "src_check", MapKind::Hash, MAX_SRC_CHECKS);
