//! `LB_DELIVERY_V1`: per-CPU counters of how translated packets were delivered, indexed by
//! [`Delivery`].

use crate::spec::{MapKind, MapSpec};

counter_enum! {
    /// How a translated packet left the datapath: the index into `LB_DELIVERY_V1`. Redirects
    /// skip the node's stack; every other value names why a packet went through it instead.
    pub enum Delivery, slots 16 {
        /// A client's packet, translated, redirected into the backend's pod.
        RedirectToBackend = 0 => "redirect_to_backend",
        /// A backend's reply, translated, redirected into the client's pod.
        RedirectToClient = 1 => "redirect_to_client",
        /// The route's next hop is not a pod interface lbproxy manages (a bridge, another
        /// node, the node itself).
        StackNotPodInterface = 2 => "stack_not_pod_interface",
        /// The node has no neighbour entry for the destination yet; the stack resolves it.
        StackNoNeighbour = 3 => "stack_no_neighbour",
        /// The route lookup gave another answer (no route, forwarding disabled, MTU).
        StackNoRoute = 4 => "stack_no_route",
        /// The TTL would expire at this hop; the stack answers with ICMP.
        StackTtl = 5 => "stack_ttl",
        /// The destination pod is the sender itself (hairpin).
        StackHairpin = 6 => "stack_hairpin",
        /// A packet of a pod's flow to itself through a frontend (hairpin, either
        /// direction), translated and sent straight back into the pod.
        RedirectHairpin = 7 => "redirect_hairpin",
        /// North-south at XDP (`--xdp-acceleration`): a client's packet of an established
        /// flow to a backend on another node, translated (source-NATed) and sent back out
        /// of the interface it came in on (`XDP_TX`).
        XdpToBackend = 8 => "xdp_to_backend",
        /// North-south at XDP: a remote backend's reply of a source-NATed flow, translated
        /// back and sent out to the client (`XDP_TX`).
        XdpToClient = 9 => "xdp_to_client",
        /// North-south at XDP: a client's packet of an established flow to a backend on
        /// this node, translated and passed up the stack to its pod.
        XdpToLocalBackend = 10 => "xdp_to_local_backend",
        /// Direct server return, on the receiving node: a client's packet translated to a
        /// backend on another node, keeping the client's address, sent towards it.
        DsrToBackend = 11 => "dsr_to_backend",
        /// One of those that needed the frontend option (a SYN, a UDP datagram) but went
        /// without it: it would no longer fit the interface's MTU, or the IPv4 header had
        /// no room left for options.
        DsrNoRoomForOption = 12 => "dsr_no_room_for_option",
        /// Direct server return, on the backend's node: a flow another node dispatched here
        /// recorded (or refreshed) from the frontend option of its packet.
        DsrRecorded = 13 => "dsr_recorded",
        /// On the backend's node: a backend's reply of such a flow translated to come from
        /// the frontend, sent straight to the client.
        DsrReplyToClient = 14 => "dsr_reply_to_client",
    }
}

/// A per-CPU `u64` per [`Delivery`] slot.
pub const SPEC: MapSpec = MapSpec::of::<u32, u64>(
    "LB_DELIVERY_V1",
    "delivery",
    MapKind::PerCpuArray,
    Delivery::SLOTS,
);
