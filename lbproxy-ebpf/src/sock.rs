//! Socket-level load balancing for the node's own processes (Cilium's `bpf_sock.c`): cgroup
//! programs that translate at the socket, so the packets of a translated socket are never
//! translated at all.
//!
//! - `connect4`: a TCP or UDP socket connecting to a frontend is connected to a backend
//!   instead; with no usable endpoint, `connect()` fails with ECONNREFUSED.
//! - `sendmsg4`: a datagram an unconnected UDP socket sends to a frontend goes to a backend.
//! - `recvmsg4`, `getpeername4`: a translated socket sees the frontend as its peer, never the
//!   backend (`LB_SOCKREV_V1`, written by the two above).
//!
//! The `*6` twins do the same for IPv6 sockets: an IPv6 frontend is translated alike, its
//! reverse entries in `LB_SOCKREV6_V1`; and a dual-stack socket talking IPv4 names an
//! IPv4-mapped address (`::ffff:a.b.c.d`), looked up as its IPv4 address and rewritten to
//! the backend's, mapped (Cilium's `sock6_xlate_v4_in_v6`). Without them, such a socket (a
//! Java client's, say) would bypass the socket programs and reach no backend.
//!
//! Only sockets of the node's network namespace are translated (`LB_SOCKCFG_V1`'s netns
//! cookie): pods keep the per-packet path and its flow lifecycle, unless `--socket-lb pods`
//! sets `SOCK_F_ALL_NETNS`.
//!
//! A backend is chosen by jump hashing a hash of the socket's cookie and the frontend, keyed
//! by the node's seed: one socket's datagrams to a frontend stay on one backend while it is
//! in the service's slots, and move by themselves when it leaves. Session affinity keys host
//! clients by 0.0.0.0: every process of the node is one client, as its packets all come
//! from the node's addresses under kube-proxy.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
};
use lbproxy_common::{
    BackendOf, IPPROTO_TCP, IPPROTO_UDP, SOCK_F_ALL_NETNS, SOCK_F_ENABLED, ServiceValue, SockEvent,
    SockRevKey, SockRevKey6, SockRevValue, SockRevValue6, select::flow_hash,
};

use crate::{
    family::Family,
    lb::{affinity, cidr, select, service},
    maps::{self, LB_SOCKCFG_V1, LB_SOCKCNT_V1, LB_SOCKREV_V1, LB_SOCKREV6_V1},
    reason,
    stage::Verdict,
    svc_stats,
};

/// Let the syscall go on (with the address as the program left it).
pub const ALLOW: i32 = 1;
/// Fail the syscall, with the error set by `bpf_set_retval`.
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EPERM: i32 = 1;

/// Counts one `event`.
#[inline(always)]
fn count(event: SockEvent) {
    if let Some(c) = LB_SOCKCNT_V1.get_ptr_mut(event as u32) {
        // Per-CPU slot: no other writer.
        unsafe { *c += 1 };
    }
}

/// Whether this socket is one to translate: the hooks are on and it is in the node's network
/// namespace (or `SOCK_F_ALL_NETNS`).
#[inline(always)]
fn in_scope(ctx: &SockAddrContext) -> Result<(), Scope> {
    let Some(cfg) = LB_SOCKCFG_V1.get(0) else {
        return Err(Scope::Off);
    };
    if cfg.flags & SOCK_F_ENABLED == 0 {
        return Err(Scope::Off);
    }
    if cfg.flags & SOCK_F_ALL_NETNS != 0 {
        return Ok(());
    }
    // SAFETY: a helper every cgroup sock_addr program may call, with its own context.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    if netns == cfg.netns_cookie {
        Ok(())
    } else {
        Err(Scope::OtherNetns)
    }
}

enum Scope {
    Off,
    OtherNetns,
}

/// The destination the syscall names: (address, port in network order, protocol), for TCP
/// and UDP only.
#[inline(always)]
fn destination(ctx: &SockAddrContext) -> Option<([u8; 4], u16, u8)> {
    let sa = ctx.sock_addr;
    // SAFETY: the kernel's bpf_sock_addr for this program; the verifier rewrites these
    // loads into reads of the socket and the syscall's address.
    let (proto, ip, port) = unsafe { ((*sa).protocol, (*sa).user_ip4, (*sa).user_port) };
    let proto = proto as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    // `user_port` holds the port in network order in its first two bytes.
    Some((ip.to_ne_bytes(), port as u16, proto))
}

/// The third word of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), as it lies in memory.
const V4_MAPPED_PREFIX: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// [`destination`] for an IPv6 socket: an IPv4-mapped address (`::ffff:a.b.c.d`, a
/// dual-stack socket talking IPv4) gives its IPv4 address, served like an IPv4 socket's.
/// Any other IPv6 address is not translated at the socket (IPv6 frontends are served per
/// packet to pods only).
#[inline(always)]
fn destination6(ctx: &SockAddrContext) -> Option<([u8; 4], u16, u8)> {
    let sa = ctx.sock_addr;
    // SAFETY: as in `destination`; 4-byte loads of `user_ip6`.
    let (proto, w0, w1, w2, w3, port) = unsafe {
        (
            (*sa).protocol,
            (*sa).user_ip6[0],
            (*sa).user_ip6[1],
            (*sa).user_ip6[2],
            (*sa).user_ip6[3],
            (*sa).user_port,
        )
    };
    let proto = proto as u8;
    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        || w0 != 0
        || w1 != 0
        || w2 != V4_MAPPED_PREFIX
    {
        return None;
    }
    Some((w3.to_ne_bytes(), port as u16, proto))
}

/// The destination of an IPv6 socket's syscall when it is an IPv6 address proper (not
/// IPv4-mapped, which [`destination6`] reads): (address, port in network order, protocol),
/// for TCP and UDP only.
#[inline(always)]
fn destination6_native(ctx: &SockAddrContext) -> Option<([u8; 16], u16, u8)> {
    let sa = ctx.sock_addr;
    // SAFETY: as in `destination6`.
    let (proto, w, port) = unsafe {
        (
            (*sa).protocol,
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port,
        )
    };
    let proto = proto as u8;
    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        || (w[0] == 0 && w[1] == 0 && w[2] == V4_MAPPED_PREFIX)
    {
        return None;
    }
    let mut addr = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        addr[i * 4..i * 4 + 4].copy_from_slice(&w[i].to_ne_bytes());
        i += 1;
    }
    Some((addr, port as u16, proto))
}

/// Rewrites an IPv6 syscall's address (all of it: [`destination6_native`]'s kind).
#[inline(always)]
fn set_destination6_native(ctx: &SockAddrContext, addr: &[u8; 16], port_be: u16) {
    let sa = ctx.sock_addr;
    let w = |i: usize| u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]);
    // SAFETY: as in `set_destination`; 4-byte stores.
    unsafe {
        (*sa).user_ip6[0] = w(0);
        (*sa).user_ip6[1] = w(4);
        (*sa).user_ip6[2] = w(8);
        (*sa).user_ip6[3] = w(12);
        (*sa).user_port = u32::from(port_be);
    }
}

/// The syscall's address, as [`destination`] or [`destination6`] reads it.
#[inline(always)]
fn destination_of(ctx: &SockAddrContext, v6: bool) -> Option<([u8; 4], u16, u8)> {
    if v6 {
        destination6(ctx)
    } else {
        destination(ctx)
    }
}

/// Rewrites the syscall's address: the IPv4 address, or for an IPv6 socket the IPv4 part
/// of its IPv4-mapped address (the `::ffff:` prefix is already there).
#[inline(always)]
fn set_destination_of(ctx: &SockAddrContext, v6: bool, addr: [u8; 4], port_be: u16) {
    if !v6 {
        return set_destination(ctx, addr, port_be);
    }
    let sa = ctx.sock_addr;
    // SAFETY: as in `set_destination`.
    unsafe {
        (*sa).user_ip6[3] = u32::from_ne_bytes(addr);
        (*sa).user_port = u32::from(port_be);
    }
}

/// Rewrites the syscall's address.
#[inline(always)]
fn set_destination(ctx: &SockAddrContext, addr: [u8; 4], port_be: u16) {
    let sa = ctx.sock_addr;
    // SAFETY: as in `destination`; 4-byte stores, the only size the verifier takes here.
    unsafe {
        (*sa).user_ip4 = u32::from_ne_bytes(addr);
        (*sa).user_port = u32::from(port_be);
    }
}

/// Why a socket addressed to a frontend was not translated.
enum Refuse {
    /// No usable endpoint: the syscall fails with ECONNREFUSED.
    NoEndpoint,
    /// The maps were inconsistent: the socket goes on untranslated.
    Inconsistent,
}

/// A backend for `cookie`'s socket to the frontend `svc` at `(addr, port_be, proto)`.
#[inline(always)]
fn choose<A: Family>(
    svc: &ServiceValue,
    cookie: u64,
    addr: &A,
    port_be: u16,
    proto: u8,
) -> Result<(u32, BackendOf<A>), Refuse> {
    if svc.count == 0 {
        return Err(Refuse::NoEndpoint);
    }
    let seed = maps::config().hash_seed();
    let pick = || {
        // The cookie stands in for the client's address and port; an IPv6 frontend is
        // folded to 32 bits, as the packet path's hash does.
        let hash = flow_hash(
            seed,
            (cookie as u32).to_ne_bytes(),
            addr.fold().to_ne_bytes(),
            (cookie >> 32) as u16,
            port_be,
            proto,
        );
        select::select_by_hash(svc, hash).map_err(|_| Refuse::Inconsistent)
    };
    if svc.affinity_timeout_s == 0 {
        return pick();
    }
    // SAFETY: a helper with no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    affinity::select_for(svc, A::ZERO, now, pick)
}

/// The translation of a socket addressed to `(addr, port_be, proto)`: its cookie, the
/// frontend and the backend chosen; or the hook's return value when there is none (not a
/// frontend or not in scope: allowed untranslated; no usable endpoint: refused, counted as
/// `refused`).
#[inline(always)]
fn translation<A: Family>(
    ctx: &SockAddrContext,
    addr: &A,
    port_be: u16,
    proto: u8,
    refused: SockEvent,
) -> Result<(u64, ServiceValue, u32, BackendOf<A>), i32> {
    let Some(svc) = service::lookup_local(*addr, port_be, proto) else {
        return Err(no_frontend(ctx, addr, proto));
    };
    match in_scope(ctx) {
        Ok(()) => {}
        Err(Scope::Off) => return Err(ALLOW),
        Err(Scope::OtherNetns) => {
            count(SockEvent::OtherNetns);
            return Err(ALLOW);
        }
    }
    // SAFETY: a helper every cgroup sock_addr program may call, with its own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    match choose(&svc, cookie, addr, port_be, proto) {
        Ok((id, backend)) => Ok((cookie, svc, id, backend)),
        Err(Refuse::NoEndpoint) => {
            count(refused);
            // SAFETY: a helper of cgroup programs; the error is what the syscall returns.
            unsafe { bpf_set_retval(-ECONNREFUSED) };
            Err(DENY)
        }
        Err(Refuse::Inconsistent) => {
            count(SockEvent::Inconsistent);
            Err(ALLOW)
        }
    }
}

/// A socket in scope addressed to no frontend but inside a ServiceCIDR (`lb::cidr`): to an
/// allocated ClusterIP's undefined port, the syscall fails with ECONNREFUSED (what the RST
/// or ICMP port unreachable of the packet path gives a client); to an unallocated address,
/// with EPERM (what a netfilter drop in OUTPUT gives a local socket, as under kube-proxy).
/// Counted under the packet path's reasons. Anything else goes on untouched.
#[inline(always)]
fn no_frontend<A: Family>(ctx: &SockAddrContext, addr: &A, proto: u8) -> i32 {
    if !cidr::enabled() {
        return ALLOW;
    }
    let Some(v) = cidr::verdict(addr, proto) else {
        return ALLOW;
    };
    if in_scope(ctx).is_err() {
        return ALLOW;
    }
    let errno = match v {
        Verdict::Reject(_) => ECONNREFUSED,
        Verdict::Drop(_) => EPERM,
    };
    reason::count(v.reason());
    // SAFETY: a helper of cgroup programs; the error is what the syscall returns.
    unsafe { bpf_set_retval(-errno) };
    DENY
}

/// `connect4` and `sendmsg4` (and `connect6`, `sendmsg6` with `v6`): translates a socket
/// addressed to a frontend. `refused` and `translated` are the events to count.
#[inline(always)]
pub fn forward(ctx: &SockAddrContext, v6: bool, translated: SockEvent, refused: SockEvent) -> i32 {
    if v6 && let Some(dst) = destination6_native(ctx) {
        return forward6(ctx, dst, translated, refused);
    }
    let Some((addr, port_be, proto)) = destination_of(ctx, v6) else {
        return ALLOW;
    };
    let (cookie, svc, backend_id, backend) = match translation(ctx, &addr, port_be, proto, refused)
    {
        Ok(t) => t,
        Err(action) => return action,
    };
    let key = SockRevKey {
        cookie,
        backend_addr: backend.addr,
        backend_port_be: backend.port_be,
        proto,
        _pad: 0,
    };
    let value = SockRevValue {
        frontend_addr: addr,
        frontend_port_be: port_be,
        _pad: 0,
        svc_id: svc.svc_id,
        backend_id,
    };
    // An unconnected UDP socket's datagrams to one frontend keep their backend, so after its
    // first datagram the entry is already there: a lookup, not an LRU update, per datagram.
    // SAFETY: copied out at once.
    let known = unsafe { LB_SOCKREV_V1.get(key) }.copied();
    if known != Some(value) {
        // The socket's first translation to this frontend: a new flow of the service.
        svc_stats::new_flow(svc.svc_id);
        if LB_SOCKREV_V1.insert(key, value, 0).is_err() {
            count(SockEvent::RevWriteFailed);
        }
    }
    set_destination_of(ctx, v6, backend.addr, backend.port_be);
    count(translated);
    ALLOW
}

/// [`forward`] for an IPv6 socket addressed to an IPv6 frontend (`dst`).
#[inline(always)]
fn forward6(
    ctx: &SockAddrContext,
    (addr, port_be, proto): ([u8; 16], u16, u8),
    translated: SockEvent,
    refused: SockEvent,
) -> i32 {
    let (cookie, svc, backend_id, backend) = match translation(ctx, &addr, port_be, proto, refused)
    {
        Ok(t) => t,
        Err(action) => return action,
    };
    let key = SockRevKey6 {
        cookie,
        backend_addr: backend.addr,
        backend_port_be: backend.port_be,
        proto,
        _pad: 0,
        _pad2: 0,
    };
    let value = SockRevValue6 {
        frontend_addr: addr,
        frontend_port_be: port_be,
        _pad: 0,
        svc_id: svc.svc_id,
        backend_id,
    };
    // SAFETY: copied out at once.
    let known = unsafe { LB_SOCKREV6_V1.get(key) }.copied();
    if known != Some(value) {
        // The socket's first translation to this frontend: a new flow of the service.
        svc_stats::new_flow(svc.svc_id);
        if LB_SOCKREV6_V1.insert(key, value, 0).is_err() {
            count(SockEvent::RevWriteFailed);
        }
    }
    set_destination6_native(ctx, &backend.addr, backend.port_be);
    count(translated);
    ALLOW
}

/// `recvmsg4` and `getpeername4` (and `recvmsg6`, `getpeername6` with `v6`, for
/// IPv4-mapped peers): a translated socket's peer is shown as the frontend it asked for.
/// Always lets the syscall go on (these hooks cannot fail it).
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, v6: bool, proto: u8, restored: SockEvent) -> i32 {
    if in_scope(ctx).is_err() {
        return ALLOW;
    }
    if v6 && let Some((ip, port, _)) = destination6_native(ctx) {
        // SAFETY: as in `forward`.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        let key = SockRevKey6 {
            cookie,
            backend_addr: ip,
            backend_port_be: port,
            proto,
            _pad: 0,
            _pad2: 0,
        };
        // SAFETY: copied out at once.
        if let Some(v) = unsafe { LB_SOCKREV6_V1.get(key) }.copied() {
            set_destination6_native(ctx, &v.frontend_addr, v.frontend_port_be);
            count(restored);
        }
        return ALLOW;
    }
    let peer = if v6 {
        destination6(ctx).map(|(a, p, _)| (a, p))
    } else {
        let sa = ctx.sock_addr;
        // SAFETY: as in `destination`.
        let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port) };
        Some((ip.to_ne_bytes(), port as u16))
    };
    let Some((ip, port)) = peer else {
        return ALLOW;
    };
    // SAFETY: as in `forward`.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevKey {
        cookie,
        backend_addr: ip,
        backend_port_be: port,
        proto,
        _pad: 0,
    };
    // SAFETY: copied out at once.
    if let Some(v) = unsafe { LB_SOCKREV_V1.get(key) }.copied() {
        set_destination_of(ctx, v6, v.frontend_addr, v.frontend_port_be);
        count(restored);
    }
    ALLOW
}

/// The protocol of the socket (for `getpeername4`, which may run on TCP or UDP).
#[inline(always)]
pub fn protocol(ctx: &SockAddrContext) -> u8 {
    // SAFETY: as in `destination`.
    unsafe { (*ctx.sock_addr).protocol as u8 }
}
