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

wire_enum! {
    /// `MonitorEvent::hook`: where an event was seen, the program (and so the direction)
    /// that dropped the packet.
    pub enum Hook: u8 {
        FromPod = 0,
        ToPod = 1,
        FromNode = 2,
        ToNode = 3,
    }
}

impl Hook {
    /// Its name in `lbproxy monitor`'s output: the program's, without `lb_`.
    pub const fn label(self) -> &'static str {
        match self {
            Hook::FromPod => "from_pod",
            Hook::ToPod => "to_pod",
            Hook::FromNode => "from_node",
            Hook::ToNode => "to_node",
        }
    }
}

pub const HOOK_FROM_POD: u8 = Hook::FromPod as u8;
pub const HOOK_TO_POD: u8 = Hook::ToPod as u8;
pub const HOOK_FROM_NODE: u8 = Hook::FromNode as u8;
pub const HOOK_TO_NODE: u8 = Hook::ToNode as u8;

wire_enum! {
    /// `MonitorEvent::verdict`.
    pub enum Verdict: u8 {
        /// The packet was dropped.
        Drop = 0,
        /// The packet was answered (a TCP RST or an ICMP unreachable).
        Reject = 1,
    }
}

pub const VERDICT_DROP: u8 = Verdict::Drop as u8;
pub const VERDICT_REJECT: u8 = Verdict::Reject as u8;

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
    /// A [`Hook`].
    pub hook: u8,
    /// A [`Verdict`].
    pub verdict: u8,
    /// A [`crate::IpFamily`]; 0 when not IP.
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
