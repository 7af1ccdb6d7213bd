//! On the drop and reject paths: a [`MonitorEvent`] for `lbproxy monitor`, when one listens.
//!
//! Nothing is sent unless a monitor has moved `LB_MONCTL_V1`'s `until_ns` ahead of now, so
//! with nobody listening a drop costs one array lookup and a compare. While one listens,
//! each CPU sends at most `per_cpu_per_sec` events a second and counts the rest, which the
//! next event it sends reports as `suppressed`.
//!
//! The event is read from the packet as it is when the verdict is given: before a reject
//! rewrites it into its answer, and before (or, for a failed helper, during) translation.

use aya_ebpf::{
    EbpfContext as _, bindings::__sk_buff, helpers::generated::bpf_ktime_get_coarse_ns,
    programs::TcContext,
};
use lbproxy_common::{
    DropReason, FAMILY_IPV4, FAMILY_IPV6, IPPROTO_TCP, IPPROTO_UDP, MonitorEvent, MonitorRate,
};

use crate::{
    maps::{LB_EVENTS_V1, LB_MONCTL_V1, LB_MONRATE_V1},
    parse::ETH_LEN,
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_PROTO_OFF: usize = 12;
const IPV6_LEN: usize = 40;
const SECOND_NS: u64 = 1_000_000_000;

/// Sends an event for a packet dropped or answered (`verdict`) for `reason` at `hook`, if
/// a monitor listens and this CPU is under its cap.
#[inline(always)]
pub fn event(ctx: &TcContext, hook: u8, verdict: u8, reason: DropReason) {
    let Some(ctl) = LB_MONCTL_V1.get(0) else {
        return;
    };
    let until = ctl.until_ns;
    if until == 0 {
        return;
    }
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    if now >= until {
        return;
    }
    let Some(suppressed) = admit(now, ctl.per_cpu_per_sec) else {
        return;
    };
    // Packed into one argument: a BPF call takes at most five.
    let what = reason as u32 | u32::from(hook) << 16 | u32::from(verdict) << 24;
    send(ctx, what, now, suppressed);
}

/// Counts one event against this CPU's window: the events suppressed in the window before,
/// when this one may be sent; `None` when the window is full.
#[inline(always)]
fn admit(now: u64, cap: u32) -> Option<u32> {
    let rate: *mut MonitorRate = LB_MONRATE_V1.get_ptr_mut(0)?;
    // SAFETY: a per-CPU slot: no other writer while this program runs on this CPU.
    let r = unsafe { &mut *rate };
    if now.wrapping_sub(r.window_start_ns) >= SECOND_NS {
        let suppressed = r.suppressed;
        r.window_start_ns = now;
        r.sent = 1;
        r.suppressed = 0;
        return Some(suppressed);
    }
    if r.sent >= cap {
        r.suppressed = r.suppressed.saturating_add(1);
        return None;
    }
    r.sent += 1;
    Some(0)
}

// Not inlined: the event is built in its own frame, so the drop path does not add its 64
// bytes to the stack of the stages it ends.
#[inline(never)]
fn send(ctx: &TcContext, what: u32, now: u64, suppressed: u32) {
    let Some(mut entry) = LB_EVENTS_V1.reserve(0) else {
        return;
    };
    // SAFETY: the context pointer is the program's __sk_buff.
    let (ifindex, len) = unsafe {
        let skb = ctx.as_ptr() as *const __sk_buff;
        ((*skb).ifindex, (*skb).len)
    };
    let mut ev = MonitorEvent {
        ts_ns: now,
        reason: what & 0xffff,
        ifindex,
        src_addr: [0; 16],
        dst_addr: [0; 16],
        src_port_be: 0,
        dst_port_be: 0,
        proto: 0,
        hook: (what >> 16) as u8,
        verdict: (what >> 24) as u8,
        family: 0,
        len,
        suppressed,
    };
    read_headers(ctx, &mut ev);
    entry.write(ev);
    entry.submit(0);
}

/// The addresses, protocol and ports of the packet, as far as they can be read.
#[inline(always)]
fn read_headers(ctx: &TcContext, ev: &mut MonitorEvent) {
    let Ok(proto_be) = ctx.load::<u16>(ETH_PROTO_OFF) else {
        return;
    };
    let l4_off = match u16::from_be(proto_be) {
        ETH_P_IP => {
            let Ok(h) = ctx.load::<[u8; 20]>(ETH_LEN) else {
                return;
            };
            ev.family = FAMILY_IPV4;
            ev.proto = h[9];
            ev.src_addr[..4].copy_from_slice(&h[12..16]);
            ev.dst_addr[..4].copy_from_slice(&h[16..20]);
            // A fragment after the first carries no ports.
            if u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 {
                return;
            }
            ETH_LEN + usize::from(h[0] & 0x0f) * 4
        }
        ETH_P_IPV6 => {
            let Ok(h) = ctx.load::<[u8; IPV6_LEN]>(ETH_LEN) else {
                return;
            };
            ev.family = FAMILY_IPV6;
            ev.proto = h[6];
            ev.src_addr.copy_from_slice(&h[8..24]);
            ev.dst_addr.copy_from_slice(&h[24..40]);
            // Ports only right after the fixed header; extension headers are not walked.
            ETH_LEN + IPV6_LEN
        }
        _ => return,
    };
    if (ev.proto == IPPROTO_TCP || ev.proto == IPPROTO_UDP)
        && let Ok(ports) = ctx.load::<[u8; 4]>(l4_off)
    {
        ev.src_port_be = u16::from_ne_bytes([ports[0], ports[1]]);
        ev.dst_port_be = u16::from_ne_bytes([ports[2], ports[3]]);
    }
}
