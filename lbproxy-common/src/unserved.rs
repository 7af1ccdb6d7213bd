//! `LB_UNSERVED_V1`: the frontends the model asks for that the datapath does not serve yet
//! (a NodePort, an IPv6 cluster IP, an SCTP port, ...), for `lbproxy inspect services`. The
//! datapath never reads it; it declares it so the object carries it (and its BTF).

use crate::spec::{MapKind, MapSpec};

wire_enum! {
    /// `UnservedKey::family` and `MonitorEvent::family`: the IP version's number.
    pub enum IpFamily: u8 {
        V4 = 4,
        V6 = 6,
    }
}

pub const FAMILY_IPV4: u8 = IpFamily::V4 as u8;
pub const FAMILY_IPV6: u8 = IpFamily::V6 as u8;

/// Key of `LB_UNSERVED_V1`: one frontend of one service. `addr` is the IPv4 address in its
/// first 4 bytes, or the IPv6 address; all zeros for a NodePort (every node address).
/// `svc_hash` (FNV-1a of the label) tells apart two services asking for the same frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnservedKey {
    pub addr: [u8; 16],
    pub port_be: u16,
    pub proto: u8,
    /// A [`crate::SvcKind`].
    pub kind: u8,
    /// An [`IpFamily`].
    pub family: u8,
    pub _pad: [u8; 3],
    pub svc_hash: u64,
}
const _: () = assert!(core::mem::size_of::<UnservedKey>() == 32);

/// Value of `LB_UNSERVED_V1`: the service (`namespace/name:port-name`) and why its frontend
/// is not served, both NUL-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnservedValue {
    pub label: [u8; 128],
    pub reason: [u8; 64],
}
const _: () = assert!(core::mem::size_of::<UnservedValue>() == 192);

/// Room for 131,072 frontends, allocated as they are written (`BPF_F_NO_PREALLOC`): an empty
/// list costs only its hash buckets (2 MiB of locked memory), not 24 MiB of preallocated
/// entries. Past that, the list undercounts (logged), and nothing else is affected.
pub const SPEC: MapSpec = MapSpec::of::<UnservedKey, UnservedValue>(
    "LB_UNSERVED_V1",
    "unserved",
    MapKind::Hash,
    MAX_UNSERVED,
)
.no_prealloc();

pub const MAX_UNSERVED: u32 = 131_072;
