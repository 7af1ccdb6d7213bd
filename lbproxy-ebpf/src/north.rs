//! North-south: traffic that arrives on one of the node's own interfaces (an uplink, listed
//! in `LB_NODEIFS_V1`) for a NodePort, an externalIP or a load-balancer IP.
//!
//! - A new flow's backend on this node (its route leads out of a pod interface) sees the
//!   client's own address: the packet is DNATed and goes up the stack to the pod, and the
//!   pod's reply is reverse-NATed by `lb_to_node` as it leaves the node.
//! - A backend on another node sees this node's address on the interface towards it (SNAT,
//!   [`source_for`]), so its replies come back here. Both directions are then redirected
//!   ([`redirect`]): the stack would drop a packet that arrives from outside with one of the
//!   node's own addresses as its source.
//!
//! Routes and neighbours are the node's own: the kernel's FIB picks the interface
//! (`bpf_fib_lookup`) and the kernel resolves the next hop's MAC (`bpf_redirect_neigh`).

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::generated::{bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use lbproxy_common::DropReason;

use crate::{
    deliver,
    family::Family,
    maps::LB_PODIFS_V1,
    packet::{IP_CSUM_OFF, Packet, ptr_at},
    stage::{NatTarget, Source},
};

const NO_ROUTE: DropReason = DropReason::NorthSouthNoRoute;

/// Whether a packet arriving from outside the node and addressed to `dst` may be the reply
/// of a source-NATed flow: `dst` is a SNAT address of this node (`NODE_ADDR_F_SNAT`). Every
/// other packet that is not for a frontend (the traffic of this node's pods, answered from
/// other nodes) passes without a flow lookup: the pod's own interface translates it.
#[inline(always)]
pub fn to_snat_address<A: Family>(dst: &A) -> bool {
    A::snat_addr(dst)
}

/// The next hop the FIB gives for `proto` from `src:sport` to `dst:dport`: the egress
/// interface and, when the neighbour is known, the MACs (destination then source) to write;
/// or `NorthSouthNoRoute`. A missing neighbour entry is not an error: `bpf_redirect_neigh`
/// resolves it.
#[inline(always)]
fn next_hop<A: Family>(
    ctx: &TcContext,
    proto: u8,
    src: &A,
    dst: &A,
    sport_be: u16,
    dport_be: u16,
) -> Result<(u32, Option<[u8; 12]>), DropReason> {
    let (rc, p, _) = deliver::fib(ctx, proto, src, dst, sport_be, dport_be);
    if rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS) {
        return Ok((p.ifindex, Some(deliver::macs(&p))));
    }
    if rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return Ok((p.ifindex, None));
    }
    Err(NO_ROUTE)
}

/// Whether a new flow from outside to the backend `addr:port_be` keeps the client's source
/// address (the backend's route leads out of a pod interface of this node) or is
/// source-NATed to the address of the node interface it leads out of, with that interface's
/// port range (which the hook turns into direct server return where that is on, `dsr`). A
/// route out of any other interface is `NorthSouthNoRoute`.
#[inline(always)]
pub fn source_for<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    addr: &A,
    port_be: u16,
) -> Result<Source<A>, DropReason> {
    let (out, _) = next_hop(
        ctx,
        pkt.proto,
        &pkt.src_addr,
        addr,
        pkt.src_port_be,
        port_be,
    )?;
    // SAFETY: a plain lookup, the value copied out at once.
    if unsafe { LB_PODIFS_V1.get(out) }.is_some() {
        return Ok(Source::CLIENT);
    }
    A::node_if_source(out).ok_or(NO_ROUTE)
}

/// Sends a packet already translated to `src -> to` out of the interface the FIB gives for
/// it, decrementing the TTL (hop limit) as the stack's hop would (the IPv4 header checksum
/// updated). With the neighbour known, the FIB's MACs are written and the packet is
/// redirected (one FIB lookup per packet, as Cilium's `fib_redirect`); otherwise the kernel
/// resolves the neighbour (`bpf_redirect_neigh`). Returns the TC action, or
/// `NorthSouthNoRoute` (also for a TTL that would reach 0).
#[inline(always)]
pub fn redirect<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    src: (&A, u16),
    to: (&A, u16),
) -> Result<i32, DropReason> {
    redirect_ip(ctx, pkt.proto, src, to)
}

/// [`redirect`] of a packet of protocol `proto` (ports 0 when it has none, as ICMP).
#[inline(always)]
pub fn redirect_ip<A: Family>(
    ctx: &TcContext,
    proto: u8,
    src: (&A, u16),
    to: (&A, u16),
) -> Result<i32, DropReason> {
    let (out, macs) = next_hop(ctx, proto, src.0, to.0, src.1, to.1)?;
    let ttl: *const [u8; 2] = ptr_at(ctx, A::TTL_OFF).ok_or(NO_ROUTE)?;
    // SAFETY: bounds-checked by ptr_at. IPv4: TTL and protocol form one 16-bit checksum
    // word; IPv6: the hop limit and the source address's first byte, stored back as read.
    let old = unsafe { *ttl };
    if old[0] <= 1 {
        return Err(NO_ROUTE);
    }
    let new = [old[0] - 1, old[1]];
    if A::AF == 2 {
        ctx.l3_csum_replace(
            IP_CSUM_OFF,
            u64::from(u16::from_ne_bytes(old)),
            u64::from(u16::from_ne_bytes(new)),
            2,
        )
        .map_err(|_| DropReason::NatFailed)?;
    }
    ctx.store(A::TTL_OFF, &new, 0)
        .map_err(|_| DropReason::NatFailed)?;
    if let Some(macs) = macs {
        ctx.store(0, &macs, 0).map_err(|_| DropReason::NatFailed)?;
        // SAFETY: a helper call with no pointer arguments.
        return Ok(unsafe { bpf_redirect(out, 0) } as i32);
    }
    // SAFETY: no parameters: the kernel looks the next hop up itself.
    Ok(unsafe { bpf_redirect_neigh(out, core::ptr::null_mut(), 0, 0) } as i32)
}

/// Where a forward packet of a flow translated to `to` is sent from and to.
#[inline(always)]
pub fn forward_ends<A: Family>(to: &NatTarget<A>) -> ((&A, u16), (&A, u16)) {
    ((&to.peer_addr, to.peer_port_be), (&to.addr, to.port_be))
}
