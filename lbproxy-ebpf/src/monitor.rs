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
    EbpfContext as _,
    bindings::__sk_buff,
    cty::c_void,
    helpers::generated::{bpf_ktime_get_coarse_ns, bpf_skb_load_bytes},
    programs::TcContext,
};
use lbproxy_common::{
    DropReason, FAMILY_IPV4, FAMILY_IPV6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, MonitorEvent,
    MonitorRate,
};

use crate::{
    maps::{LB_EVENTS_V1, LB_MONCTL_V1, LB_MONRATE_V1},
    packet::{
        ETH_LEN, IP_DST_OFF, IP_PROTO_OFF, IP_SRC_OFF, IP6_DST_OFF, IP6_NEXT_OFF, IP6_SRC_OFF,
    },
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

// Not inlined, and written straight into the ring buffer's memory (headers loaded into it
// by the helper): the drop path adds a few bytes to the stack of the stages it ends, not
// the event's 64.
#[inline(never)]
fn send(ctx: &TcContext, what: u32, now: u64, suppressed: u32) {
    let Some(mut entry) = LB_EVENTS_V1.reserve(0) else {
        return;
    };
    let ev: *mut MonitorEvent = entry.as_mut_ptr();
    let skb = ctx.as_ptr();
    // SAFETY: `ev` is the reserved entry, `size_of::<MonitorEvent>()` bytes that only this
    // program writes until it submits them; the context pointer is the program's __sk_buff.
    unsafe {
        core::ptr::write_bytes(ev, 0, 1);
        let sk = skb as *const __sk_buff;
        (*ev).ts_ns = now;
        (*ev).reason = what & 0xffff;
        (*ev).hook = (what >> 16) as u8;
        (*ev).verdict = (what >> 24) as u8;
        (*ev).ifindex = (*sk).ifindex;
        (*ev).len = (*sk).len;
        (*ev).suppressed = suppressed;
        read_headers(skb, ev);
    }
    entry.submit(0);
}

/// Copies `len` bytes at `off` of the packet to `to`; false when the packet is shorter.
#[inline(always)]
unsafe fn load(skb: *mut c_void, off: usize, to: *mut u8, len: u32) -> bool {
    // SAFETY: the caller gives a context pointer and `len` writable bytes at `to`.
    unsafe { bpf_skb_load_bytes(skb, off as u32, to.cast(), len) == 0 }
}

/// The addresses, protocol and ports of the packet, as far as they can be read, into `ev`.
#[inline(always)]
unsafe fn read_headers(skb: *mut c_void, ev: *mut MonitorEvent) {
    let mut eth_proto = 0u16;
    // SAFETY: `ev` points at a whole MonitorEvent; every load is sized to its field.
    unsafe {
        if !load(skb, ETH_PROTO_OFF, (&raw mut eth_proto).cast(), 2) {
            return;
        }
        let l4_off = match u16::from_be(eth_proto) {
            ETH_P_IP => {
                let mut first = [0u8; 8];
                if !load(skb, ETH_LEN, first.as_mut_ptr(), 8)
                    || !load(skb, IP_PROTO_OFF, &raw mut (*ev).proto, 1)
                    || !load(skb, IP_SRC_OFF, (*ev).src_addr.as_mut_ptr(), 4)
                    || !load(skb, IP_DST_OFF, (*ev).dst_addr.as_mut_ptr(), 4)
                {
                    return;
                }
                (*ev).family = FAMILY_IPV4;
                // A fragment after the first carries no ports.
                if u16::from_be_bytes([first[6], first[7]]) & 0x1fff != 0 {
                    return;
                }
                ETH_LEN + usize::from(first[0] & 0x0f) * 4
            }
            ETH_P_IPV6 => {
                if !load(skb, IP6_NEXT_OFF, &raw mut (*ev).proto, 1)
                    || !load(skb, IP6_SRC_OFF, (*ev).src_addr.as_mut_ptr(), 16)
                    || !load(skb, IP6_DST_OFF, (*ev).dst_addr.as_mut_ptr(), 16)
                {
                    return;
                }
                (*ev).family = FAMILY_IPV6;
                // Ports only right after the fixed header; extension headers are not walked.
                ETH_LEN + IPV6_LEN
            }
            _ => return,
        };
        let proto = (*ev).proto;
        if (proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP)
            && load(skb, l4_off, (&raw mut (*ev).src_port_be).cast(), 2)
        {
            load(skb, l4_off + 2, (&raw mut (*ev).dst_port_be).cast(), 2);
        }
    }
}
