//! Packets kept out of conntrack while a takeover from kube-proxy or a hand-back to it runs
//! (`CONFIG_F_UNTRACK`): kube-proxy's NAT'd entries and lbproxy's translated tuples of the
//! same connections must never meet in netfilter (a translated client packet would make an
//! entry whose reply tuple is the NAT'd entry's, and netfilter would move its source port).
//! With the flag on, every packet of a handed-over flow (and with `CONFIG_F_UNTRACK_OWN`,
//! of lbproxy's own flows too) that goes into the node's stack gets `UNTRACK_MARK`, which
//! the controller's raw-table rule untracks: a client's packet it translated, and a
//! backend's answer that `lb_to_pod` or `lb_to_node` translate after the stack. Packets
//! redirected past the stack need no mark. With the flag off (always, outside those few
//! seconds), a packet costs one bit test of the config it already read.

use aya_ebpf::programs::TcContext;
use lbproxy_common::{
    CONFIG_F_UNTRACK, CONFIG_F_UNTRACK_OWN, DatapathConfig, FLOW_ADOPTED_HANDOVER,
    FLOW_ADOPTED_OWN, UNTRACK_MARK,
};

/// Whether the controller turned untracking on (`config` is this packet's `maps::config()`).
#[inline(always)]
pub fn enabled(config: &DatapathConfig) -> bool {
    config.flags & CONFIG_F_UNTRACK != 0
}

/// Whether a packet of a flow whose `FlowValue::adopted` is `adopted` is marked when it goes
/// into the stack.
#[inline(always)]
pub fn marks(config: &DatapathConfig, adopted: u8) -> bool {
    enabled(config)
        && (adopted == FLOW_ADOPTED_HANDOVER
            || (adopted == FLOW_ADOPTED_OWN && config.flags & CONFIG_F_UNTRACK_OWN != 0))
}

/// Whether the packet carries the mark: it went through the stack untracked, so conntrack
/// translated none of it, whoever translates its flow now.
#[inline(always)]
pub fn marked(ctx: &TcContext) -> bool {
    // SAFETY: the context's own skb; `mark` is readable from tc programs.
    unsafe { (*ctx.skb.skb).mark & UNTRACK_MARK != 0 }
}

/// Marks the packet for the untrack rule, keeping its other mark bits.
#[inline(always)]
pub fn mark(ctx: &TcContext) {
    // SAFETY: the context's own skb; `mark` is readable and writable from tc programs.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | UNTRACK_MARK);
}
