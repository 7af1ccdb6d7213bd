//! Stage 1, on a miss: a packet (or a node process's socket) to no frontend, but to an
//! address of a ServiceCIDR (`LB_SVCCIDRS_V1`, `LB_SVCCIDR6_V1`), as kube-proxy's nftables
//! mode judges it:
//! - an allocated ClusterIP on a port or protocol no Service port defines is rejected at
//!   once (TCP RST, ICMP port unreachable): `cluster_ip_port_tcp_reset`,
//!   `cluster_ip_port_icmp_unreachable`;
//! - any other address inside a ServiceCIDR is dropped: `service_cidr_unallocated`.
//!
//! Only packets that missed the frontend lookup come here, so traffic to a frontend pays
//! nothing; with no ServiceCIDR the controller clears `CONFIG_F_SERVICE_CIDRS` and the
//! tries are not even looked up ([`enabled`]).

use lbproxy_common::CONFIG_F_SERVICE_CIDRS;
use lbproxy_common::select::{Refusal, cidr_refusal};

use crate::{family::Family, maps, stage::Verdict};

/// Whether the tries hold anything (`CONFIG_F_SERVICE_CIDRS`, kept by the controller): a
/// bit test, so that without a ServiceCIDR a packet to no frontend pays no trie lookup.
#[inline(always)]
pub fn enabled() -> bool {
    maps::config().flags & CONFIG_F_SERVICE_CIDRS != 0
}

/// What to do with TCP or UDP (`proto`) to `dst`, which is no frontend: `None` when `dst`
/// is in no ServiceCIDR (the packet is not ours).
#[inline(always)]
pub fn verdict<A: Family>(dst: &A, proto: u8) -> Option<Verdict> {
    // The mapping `lbproxy explain` shares (lbproxy_common::select::cidr_refusal).
    match cidr_refusal(A::service_cidr(dst), proto)? {
        Refusal::Reject(r) => Some(Verdict::Reject(r)),
        Refusal::Drop(r) => Some(Verdict::Drop(r)),
    }
}
