//! lbproxy's datapath: TC programs on the host side of pod interfaces.
//!
//! - `lb_from_pod` (tcx ingress: packets leaving a pod) DNATs packets addressed to a service
//!   frontend to a backend, keeping every packet of a flow on one backend.
//! - `lb_to_pod` (tcx egress: packets entering a pod) reverse-NATs the backend's replies so
//!   the client sees the VIP:port it connected to.
//!
//! Translating the forward direction before the node's stack and the reply direction after
//! it means netfilter and conntrack on the node only ever see consistent pod-to-pod tuples,
//! so a `--ctstate INVALID -j DROP` rule never sees a half-translated flow.
//!
//! Each program is one pipeline in `hooks`, written once for both families and picked here
//! from the EtherType. Stages, one module each: `parse` -> `lb::service` (frontend lookup)
//! -> `source` (source check) -> `flow` (flow table, calling `lb::select` or `lb::affinity`
//! for new flows) -> `nat` (translate) -> `deliver` (to the stack, or with the stack bypass
//! straight into the destination pod), or `reject` (answer the client at once) when there is
//! no usable backend. A pod's flow to itself (`hairpin`) is source-NATed to a link-local
//! address and sent straight back into the pod, both ways. Drops and rejects are counted per
//! reason in `reason`. Every map is declared in `maps`, from `lbproxy_common`'s specs. What
//! differs between the families is in `headers` (offsets, checksums, parsing), `family`
//! (maps), `icmp::Errors` and `reject::Answer`; what the stages hand each other is in
//! `stage` and `packet`, which import none of them.
//!
//! With the stack bypass, `lb_from_pod` also handles the reply direction: a backend's reply
//! is reverse-NATed at its own interface and redirected into the client's pod, so neither
//! direction of a flow between two local pods passes the node's stack or `lb_to_pod`. When a
//! packet cannot be redirected (see `deliver`), both directions fall back to the split above.
//!
//! Socket level (`sock`): `lb_connect4`, `lb_sendmsg4`, `lb_recvmsg4` and
//! `lb_getpeername4` (cgroup programs on `--cgroup-root`) translate the node's own
//! processes' sockets, which no interface program sees before the stack routes them; their
//! `*6` twins do the same for dual-stack IPv6 sockets addressing IPv4 (mapped) frontends.
//!
//! North-south (`north`): `lb_from_node` (tcx ingress on the node's own interfaces) serves
//! NodePorts, externalIPs and load-balancer IPs to traffic from outside the node, and takes
//! back the replies of source-NATed flows; `lb_to_node` (tcx egress there) reverse-NATs the
//! replies of backends on this node to clients outside it. With `--xdp-acceleration`,
//! `lb_xdp` (XDP on the same interfaces, `xdp`) translates the packets of established
//! north-south flows before an skb exists, and passes everything else to `lb_from_node`.
#![no_std]
#![no_main]

mod csum;
mod deliver;
mod dsr;
mod family;
mod flow;
mod hairpin;
mod headers;
mod hooks;
mod icmp;
mod lb;
mod maps;
mod monitor;
mod nat;
mod north;
mod packet;
mod parse;
mod reason;
mod reject;
mod sctp;
mod sock;
mod source;
mod stage;
mod svc_stats;
mod untrack;
mod xdp;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use lbproxy_common::{IPPROTO_UDP, SockEvent};

/// IPv4 and IPv6 addresses: the type a hook's pipeline is compiled for.
type V4 = [u8; 4];
type V6 = [u8; 16];

// Each family's pipeline is its own BPF function (`run` is `#[inline(never)]`), so that
// the two do not add up in one stack frame: the verifier allows 512 bytes along a call chain.

#[classifier]
pub fn lb_from_pod(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        hooks::from_pod::run::<V6>(ctx)
    } else {
        hooks::from_pod::run::<V4>(ctx)
    }
}

#[classifier]
pub fn lb_to_pod(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        hooks::to_pod::run::<V6>(ctx)
    } else {
        hooks::to_pod::run::<V4>(ctx)
    }
}

#[classifier]
pub fn lb_from_node(ctx: TcContext) -> i32 {
    // The context crosses the call as its raw pointer (see `hooks::from_node::run`).
    let raw = aya_ebpf::EbpfContext::as_ptr(&ctx);
    if parse::is_ipv6(&ctx) {
        hooks::from_node::run::<V6>(raw)
    } else {
        hooks::from_node::run::<V4>(raw)
    }
}

#[classifier]
pub fn lb_to_node(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        hooks::to_node::run::<V6>(ctx)
    } else {
        hooks::to_node::run::<V4>(ctx)
    }
}

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    xdp::run(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        false,
        SockEvent::ConnectTranslated,
        SockEvent::ConnectRefused,
    )
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        false,
        SockEvent::SendmsgTranslated,
        SockEvent::SendmsgRefused,
    )
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, false, IPPROTO_UDP, SockEvent::RecvmsgRestored)
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    let proto = sock::protocol(&ctx);
    sock::reverse(&ctx, false, proto, SockEvent::GetpeernameRestored)
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        true,
        SockEvent::ConnectTranslated,
        SockEvent::ConnectRefused,
    )
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::forward(
        &ctx,
        true,
        SockEvent::SendmsgTranslated,
        SockEvent::SendmsgRefused,
    )
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, true, IPPROTO_UDP, SockEvent::RecvmsgRestored)
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    let proto = sock::protocol(&ctx);
    sock::reverse(&ctx, true, proto, SockEvent::GetpeernameRestored)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
