//! `lbproxy monitor`: the datapath's drops and rejects as a live stream of events.
//!
//! - `LB_MONCTL_V1` (one entry, [`MonitorCtl`]): written by a running `lbproxy monitor`, which
//!   keeps moving `until_ns` a few seconds ahead while it listens. The datapath sends events
//!   only before `until_ns`, so with nobody listening (or a monitor that was killed) a drop
//!   costs one array lookup and a compare, and nothing is written.
//! - `LB_MONRATE_V1` (per CPU, [`MonitorRate`]): each CPU's count of events sent in the
//!   current second, capped at `MonitorCtl::per_cpu_per_sec`, so a flood of drops cannot
//!   flood the ring buffer or the monitor.
//! - `LB_EVENTS_V1` (a ring buffer): one [`MonitorEvent`] per drop or reject sent.

use crate::spec::{MapKind, MapSpec};

/// The single value of `LB_MONCTL_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorCtl {
    /// Events are sent while `bpf_ktime_get_coarse_ns()` (CLOCK_MONOTONIC) is below this; 0:
    /// nobody listens.
    pub until_ns: u64,
    /// The most events each CPU sends per second; further drops are only counted.
    pub per_cpu_per_sec: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<MonitorCtl>() == 16);

/// The per-CPU value of `LB_MONRATE_V1` (key 0): this CPU's current one-second window.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorRate {
    pub window_start_ns: u64,
    /// Events sent in this window.
    pub sent: u32,
    /// Events not sent in this window because of the cap.
    pub suppressed: u32,
}
const _: () = assert!(core::mem::size_of::<MonitorRate>() == 16);

/// Where an event was seen: the program (and so the direction) that dropped the packet.
pub const HOOK_FROM_POD: u8 = 0;
pub const HOOK_TO_POD: u8 = 1;
pub const HOOK_FROM_NODE: u8 = 2;
pub const HOOK_TO_NODE: u8 = 3;

/// [`MonitorEvent::verdict`]: the packet was dropped.
pub const VERDICT_DROP: u8 = 0;
/// [`MonitorEvent::verdict`]: the packet was answered (a TCP RST or an ICMP unreachable).
pub const VERDICT_REJECT: u8 = 1;

/// One drop or reject, as the datapath saw the packet (before any translation of its own).
/// Addresses are 16 bytes for both families: an IPv4 address fills the first 4.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MonitorEvent {
    /// `bpf_ktime_get_coarse_ns` when it happened.
    pub ts_ns: u64,
    /// A [`crate::DropReason`] value.
    pub reason: u32,
    /// The interface the program runs on.
    pub ifindex: u32,
    pub src_addr: [u8; 16],
    pub dst_addr: [u8; 16],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// IP protocol (6 TCP, 17 UDP, ...); 0 when the packet is not IP.
    pub proto: u8,
    /// `HOOK_*`.
    pub hook: u8,
    /// `VERDICT_*`.
    pub verdict: u8,
    /// [`crate::FAMILY_IPV4`] or [`crate::FAMILY_IPV6`]; 0 when not IP.
    pub family: u8,
    /// The packet's length on the wire.
    pub len: u32,
    /// Events this CPU did not send, because of the rate cap, in the window before this one
    /// was sent.
    pub suppressed: u32,
}
const _: () = assert!(core::mem::size_of::<MonitorEvent>() == 64);

/// Events per CPU per second unless `lbproxy monitor --rate` says otherwise.
pub const DEFAULT_EVENTS_PER_CPU_PER_SEC: u32 = 1_000;

/// The ring buffer's size in bytes (a power of two, a multiple of the page size): room for
/// 4096 events between two reads.
pub const EVENTS_BYTES: u32 = 256 * 1024;

pub const CTL_SPEC: MapSpec =
    MapSpec::of::<u32, MonitorCtl>("LB_MONCTL_V1", "monitor_ctl", MapKind::Array, 1);
pub const RATE_SPEC: MapSpec =
    MapSpec::of::<u32, MonitorRate>("LB_MONRATE_V1", "monitor_rate", MapKind::PerCpuArray, 1);
/// A ring buffer has no key or value size; its capacity is in bytes.
pub const EVENTS_SPEC: MapSpec =
    MapSpec::of::<(), ()>("LB_EVENTS_V1", "events", MapKind::RingBuf, EVENTS_BYTES);
