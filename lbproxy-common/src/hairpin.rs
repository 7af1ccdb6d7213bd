//! Hairpin: a pod that reaches itself through a frontend (its backend is its own address).
//!
//! Untranslated, such a packet would reach the pod from its own address: the pod's kernel
//! drops a packet from outside with a local source ("martian source"), and would answer it
//! over loopback anyway, never through the node. So the flow is source-NATed to
//! [`HAIRPIN_ADDR`], a link-local address no pod or node holds, as Cilium does with its
//! service loopback address: the pod sees `HAIRPIN_ADDR` as its client and answers it through
//! its default route, back to the node's side of its interface, where the reply is
//! translated back to come from the frontend. Both directions are sent straight back into
//! the pod from its own interface, so neither passes the node's routing or netfilter.
//!
//! The flow keeps the client's own port. Its reply half (`HAIRPIN_ADDR`, port -> backend)
//! need only be unique among the pod's own hairpin flows to one backend port: when another
//! one holds it (the pod used one source port towards two frontends of itself), the port is
//! moved as a clashing tuple's is (`select::clash_port`, 1024-65535).

/// The source address a pod sees on a flow it sent to itself through a frontend:
/// 169.254.42.1, link-local, never routed off the node (the address Cilium's kube-proxy
/// replacement uses for the same purpose, so rules written for one fit the other).
pub const HAIRPIN_ADDR: [u8; 4] = [169, 254, 42, 1];

/// The same for IPv6: `fd00:a9fe:2a01::1`, a unique local address (RFC 4193) with
/// 169.254.42.1 in its global ID, held by no pod or node and never routed off the node. Not
/// link-local: a pod answers a link-local source on its own link (after neighbour discovery
/// that nobody would answer), while a unique local address is answered through its default
/// route, to the node, where the reply is translated.
pub const HAIRPIN_ADDR6: [u8; 16] = [
    0xfd, 0x00, 0xa9, 0xfe, 0x2a, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
];
