//! `LB_PODIFS_V1`: host-side pod interfaces a packet may be redirected into the peer of, by
//! ifindex.

use crate::spec::{MapKind, MapSpec};

/// Host-side pod interfaces on one node that can take redirected packets.
pub const MAX_POD_IFS: u32 = 4_096;

/// `PodIf::kind`: the interface is a veth whose peer lives in another network namespace,
/// so `bpf_redirect_peer` can hand it a packet.
pub const POD_IF_VETH: u32 = 1;
/// The same for a netkit device.
pub const POD_IF_NETKIT: u32 = 2;
/// A bridge that pod interfaces are ports of (a `cni0`-like pod network): the route to a
/// pod on this node may lead to it, so north-south traffic treats it as a pod interface
/// (no SNAT). It is never a redirect target of the stack bypass.
pub const POD_IF_BRIDGE: u32 = 3;

/// Value of `LB_PODIFS_V1`, keyed by the host-side ifindex (`u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodIf {
    /// `POD_IF_*`.
    pub kind: u32,
}
const _: () = assert!(core::mem::size_of::<PodIf>() == 4);

pub const SPEC: MapSpec =
    MapSpec::of::<u32, PodIf>("LB_PODIFS_V1", "pod_ifs", MapKind::Hash, MAX_POD_IFS);
