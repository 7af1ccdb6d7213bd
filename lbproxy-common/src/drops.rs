//! `LB_DROPS_V2`: per-CPU counters of why the datapath dropped (or answered) a packet,
//! indexed by [`DropReason`].

use crate::spec::{MapKind, MapSpec};

counter_enum! {
    /// Why the datapath dropped (or answered instead of forwarding) a packet. The values
    /// index `LB_DROPS_V2` and are the `reason` label of `lbproxy_datapath_drops_total`.
    /// They never collide with TC action codes because they only ever index the counter map.
    ///
    /// Deprecated: the six reasons that are not drops (10, 11, 12, 14, 15, 16) are
    /// [`crate::DatapathEvent`]s now, counted in `LB_DPEVENTS_V1` too
    /// ([`DropReason::event`]). They stay for one release, so
    /// `lbproxy_datapath_drops_total{reason}` keeps its series; their values are never reused.
    pub enum DropReason, slots 32 {
        /// The packet was too short for the headers its protocol fields promise.
        Malformed = 0 => "malformed",
        /// The service exists but has no usable endpoint.
        NoBackend = 1 => "no_backend",
        /// A slot pointed at a backend id that is not in `LB_BACKENDS_V1`.
        BackendMissing = 2 => "backend_missing",
        /// The flow table rejected a new entry.
        FlowInsertFailed = 3 => "flow_insert_failed",
        /// A checksum or store helper failed while translating.
        NatFailed = 4 => "nat_failed",
        /// A slot of a service with a non-zero count was missing.
        SlotMissing = 5 => "slot_missing",
        /// TCP to a service with no usable endpoint: answered with a RST.
        NoBackendTcpReset = 6 => "no_backend_tcp_reset",
        /// UDP to a service with no usable endpoint: answered with ICMP port unreachable.
        NoBackendUdpUnreachable = 7 => "no_backend_icmp_unreachable",
        /// A TCP segment of a flow whose backend left: answered with a RST, flow forgotten.
        BackendGoneReset = 8 => "backend_gone_tcp_reset",
        /// A reject could not be written (IP options, helper failure): dropped instead.
        RejectFailed = 9 => "reject_failed",
        /// Deprecated, not a drop: [`crate::DatapathEvent::MidstreamWithoutFlow`].
        MidstreamWithoutFlow = 10 => "tcp_midstream_without_flow",
        /// Deprecated, not a drop: [`crate::DatapathEvent::FlowHalfRecreated`].
        FlowHalfRecreated = 11 => "flow_half_recreated",
        /// Deprecated, not a drop: [`crate::DatapathEvent::TupleClashPortRewritten`].
        TupleClashPortRewritten = 12 => "tuple_clash_port_rewritten",
        /// A clashing tuple found no free source port in its attempts: dropped.
        TupleClashNoPort = 13 => "tuple_clash_no_port",
        /// Deprecated, not a drop: [`crate::DatapathEvent::StaleReplyRemoved`].
        StaleReplyRemoved = 14 => "stale_reply_removed",
        /// Deprecated, not a drop: [`crate::DatapathEvent::FragmentWithoutFirst`].
        FragmentWithoutFirst = 15 => "fragment_without_first",
        /// Deprecated, not a drop: [`crate::DatapathEvent::L4HeaderBadPassed`].
        L4HeaderBadPassed = 16 => "l4_header_bad_passed",
        /// A packet to a service with no usable endpoint (or of a flow whose backend left)
        /// that must not be answered: a TCP RST (RFC 793 never answers one) or a fragment
        /// after the first (it carries no header to answer). Dropped.
        RejectNotAnswered = 17 => "reject_not_answered",
        /// A packet from a pod interface to a frontend whose source address the node does
        /// not route back out of that interface (or its bridge): a spoofed source, dropped
        /// before it can take a flow entry.
        SpoofedSource = 18 => "spoofed_source",
        /// A flow from outside the node to a backend on another node found no free port in
        /// the SNAT range towards that backend (each port is unique per SNAT address,
        /// backend address and port, and protocol): dropped.
        SnatNoPort = 19 => "snat_no_port",
        /// A source-NATed packet (from outside to a remote backend, or a remote backend's
        /// reply) had no route, or no node interface to leave by: dropped.
        NorthSouthNoRoute = 20 => "north_south_no_route",
        /// Traffic from outside to a frontend with `externalTrafficPolicy: Local` whose
        /// endpoints are all on other nodes: dropped, as kube-proxy does (a load balancer's
        /// health check steers it elsewhere).
        NoLocalEndpoint = 21 => "no_local_endpoint",
        /// A packet to a load-balancer IP from a source outside its Service's
        /// `loadBalancerSourceRanges`: dropped, as kube-proxy's firewall chain does.
        SourceRangeDenied = 22 => "source_range_denied",
        /// TCP or UDP from a pod (or a connect() of the node's) to an address inside a
        /// ServiceCIDR that is not the ClusterIP of a proxied Service: dropped, as
        /// kube-proxy's nftables mode does ("Drop traffic to unallocated ClusterIPs").
        ServiceCidrUnallocated = 23 => "service_cidr_unallocated",
        /// TCP to an allocated ClusterIP on a port no Service port defines: answered with a
        /// RST (kube-proxy: "Reject traffic to invalid ports of ClusterIPs").
        ClusterIpPortTcpReset = 24 => "cluster_ip_port_tcp_reset",
        /// UDP to an allocated ClusterIP on a port no Service port defines: answered with
        /// ICMP port unreachable.
        ClusterIpPortUdpUnreachable = 25 => "cluster_ip_port_icmp_unreachable",
        /// A packet to a pod of this node carried the direct-server-return option (`dsr`)
        /// naming a frontend this node does not serve: passed, no flow recorded, so its
        /// replies leave untranslated.
        DsrUnknownFrontend = 26 => "dsr_unknown_frontend_passed",
    }
}

/// A per-CPU `u64` per [`DropReason`] slot. `LB_DROPS_V1` (room for 6 reasons) is retired:
/// the counters are statistics, so a controller removes it at start without migrating.
pub const SPEC: MapSpec = MapSpec::of::<u32, u64>(
    "LB_DROPS_V2",
    "drops",
    MapKind::PerCpuArray,
    DropReason::SLOTS,
);
