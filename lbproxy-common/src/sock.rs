//! Socket-level load balancing for the node's own processes: the cgroup `connect4`,
//! `sendmsg4`, `recvmsg4` and `getpeername4` programs (Cilium's `bpf_sock.c`).
//!
//! - `LB_SOCKCFG_V1` ([`SockConfig`], one entry): which network namespace's sockets are
//!   translated (its cookie), written by the controller at start.
//! - `LB_SOCKREV_V1` ([`SockRevKey`] to [`SockRevValue`]): for each socket translated, the
//!   backend it was sent to and the frontend it asked for, so `recvmsg` and `getpeername`
//!   show the frontend, and the controller can find the sockets of a backend that left.
//! - `LB_SOCKREV6_V1` ([`SockRevKey6`] to [`SockRevValue6`]): the same for IPv6 sockets
//!   talking IPv6 (the `*6` programs; an IPv4-mapped peer uses `LB_SOCKREV_V1`).
//! - `LB_SOCKCNT_V1`: per-CPU counters by [`SockEvent`].

use crate::spec::{MapKind, MapSpec};

/// [`SockConfig::flags`]: the hooks are attached and should translate. Without it (a map
/// written by nothing yet) every socket passes untouched.
pub const SOCK_F_ENABLED: u32 = 1;
/// [`SockConfig::flags`]: translate sockets of every network namespace under the cgroup,
/// pods' too (`--socket-lb pods`), not only the node's own.
pub const SOCK_F_ALL_NETNS: u32 = 2;

/// The single value of `LB_SOCKCFG_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockConfig {
    /// The node's network namespace cookie (`SO_NETNS_COOKIE` of a socket of the
    /// controller's namespace): only sockets of this namespace are translated.
    pub netns_cookie: u64,
    /// `SOCK_F_*`.
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<SockConfig>() == 16);

pub const CONFIG_SPEC: MapSpec =
    MapSpec::of::<u32, SockConfig>("LB_SOCKCFG_V1", "sock_config", MapKind::Array, 1);

/// Room in `LB_SOCKREV_V1` (an LRU: a socket long gone is forgotten first).
pub const MAX_SOCK_REV: u32 = 262_144;

/// Key of `LB_SOCKREV_V1`: a socket (its cookie) and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockRevKey {
    pub cookie: u64,
    pub backend_addr: [u8; 4],
    pub backend_port_be: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<SockRevKey>() == 16);

/// Value of `LB_SOCKREV_V1`: the frontend the socket asked for, and the service and backend
/// it was given.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SockRevValue {
    pub frontend_addr: [u8; 4],
    pub frontend_port_be: u16,
    pub _pad: u16,
    pub svc_id: u32,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevValue>() == 16);

pub const REV_SPEC: MapSpec = MapSpec::of::<SockRevKey, SockRevValue>(
    "LB_SOCKREV_V1",
    "sock_rev",
    MapKind::LruHash,
    MAX_SOCK_REV,
);

/// Key of `LB_SOCKREV6_V1`: [`SockRevKey`] with an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SockRevKey6 {
    pub cookie: u64,
    pub backend_addr: [u8; 16],
    pub backend_port_be: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    pub _pad: u8,
    pub _pad2: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevKey6>() == 32);

/// Value of `LB_SOCKREV6_V1`: [`SockRevValue`] with an IPv6 frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevValue6 {
    pub frontend_addr: [u8; 16],
    pub frontend_port_be: u16,
    pub _pad: u16,
    pub svc_id: u32,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevValue6>() == 28);

pub const REV6_SPEC: MapSpec = MapSpec::of::<SockRevKey6, SockRevValue6>(
    "LB_SOCKREV6_V1",
    "sock_rev6",
    MapKind::LruHash,
    MAX_SOCK_REV,
);

counter_enum! {
    /// What a socket hook did: the index into `LB_SOCKCNT_V1`.
    pub enum SockEvent, slots 16 {
        /// `connect()` to a frontend, connected to a backend instead.
        ConnectTranslated = 0 => "connect_translated",
        /// `connect()` to a frontend without a usable endpoint: refused (ECONNREFUSED).
        ConnectRefused = 1 => "connect_refused",
        /// A datagram sent to a frontend by `sendmsg()`, sent to a backend instead.
        SendmsgTranslated = 2 => "sendmsg_translated",
        /// `sendmsg()` to a frontend without a usable endpoint: refused (ECONNREFUSED).
        SendmsgRefused = 3 => "sendmsg_refused",
        /// `recvmsg()` of a datagram from a backend, shown as from the frontend.
        RecvmsgRestored = 4 => "recvmsg_restored",
        /// `getpeername()` of a translated socket, shown as the frontend.
        GetpeernameRestored = 5 => "getpeername_restored",
        /// A translated socket whose reverse entry could not be written: `recvmsg` and
        /// `getpeername` will show the backend.
        RevWriteFailed = 6 => "rev_write_failed",
        /// A socket of another network namespace (a pod's) addressed to a frontend, left to
        /// the per-packet path.
        OtherNetns = 7 => "other_netns",
        /// The maps were inconsistent (a slot or backend missing): left untranslated.
        Inconsistent = 8 => "inconsistent",
    }
}

/// A per-CPU `u64` per [`SockEvent`] slot.
pub const COUNT_SPEC: MapSpec = MapSpec::of::<u32, u64>(
    "LB_SOCKCNT_V1",
    "sock_events",
    MapKind::PerCpuArray,
    SockEvent::SLOTS,
);
