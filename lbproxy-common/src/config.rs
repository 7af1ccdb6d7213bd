//! `LB_CONFIG_V1`: datapath settings the controller writes at start, one entry.

use crate::spec::{MapKind, MapSpec};

/// `DatapathConfig::flags`: redirect translated packets whose next hop is a local pod's
/// interface straight into that pod, skipping the node's routing and netfilter.
pub const CONFIG_F_STACK_BYPASS: u32 = 1;
/// `DatapathConfig::flags`: the ServiceCIDR tries (`LB_SVCCIDRS_V1`, `LB_SVCCIDR6_V1`) hold
/// entries. Without it a packet to no frontend skips their lookup: with no ServiceCIDR,
/// such a packet costs one bit test more than before, not a trie lookup.
pub const CONFIG_F_SERVICE_CIDRS: u32 = 2;
/// `DatapathConfig::flags`: while a takeover from kube-proxy or a hand-back to it runs, the
/// datapath sets [`UNTRACK_MARK`] on every packet of a handed-over flow
/// (`FlowAdopted::Handover`) that it sends into the node's stack: a client's packet it
/// translated, and a backend's answer it will translate after the stack. A raw-table rule
/// the controller installs for that time (`lbproxy/src/takeover/untrack.rs`) keeps such
/// packets out of conntrack, so that lbproxy's translated tuples never meet the NAT'd
/// entries of the same connections, which conntrack still holds (docs/migration.md).
/// lbproxy's own flows stay tracked (and so NATed by the node's other rules) unless
/// [`CONFIG_F_UNTRACK_OWN`] is on too.
pub const CONFIG_F_UNTRACK: u32 = 4;
/// `DatapathConfig::flags`, with [`CONFIG_F_UNTRACK`]: lbproxy's own flows' packets are
/// marked too. Set by a hand-back, which writes own flows into conntrack: netfilter must make
/// no plain entry for them meanwhile.
pub const CONFIG_F_UNTRACK_OWN: u32 = 32;

/// `DatapathConfig::flags`: a TCP packet other than a SYN that is of no flow lbproxy knows
/// passes untranslated, to conntrack. Set at start while kube-proxy's rules are found, from
/// the first dump of conntrack until the second, made after the first sync: a connection
/// kube-proxy's rules opened between the two is in neither the flow table nor the first
/// dump, and its next packet must not be balanced anew (docs/migration.md).
pub const CONFIG_F_STRAYS_TO_CONNTRACK: u32 = 8;
/// `DatapathConfig::flags`: every packet of no flow lbproxy knows passes untranslated, to
/// conntrack and kube-proxy's rules: set by `lbproxy cleanup --hand-back`, whose rules take
/// the new connections while lbproxy's own are written into conntrack.
pub const CONFIG_F_NEW_TO_CONNTRACK: u32 = 16;
/// `DatapathConfig::flags`: north-south TCP flows to a backend on another node are
/// dispatched with direct server return, not source-NATed (`--load-balancer-mode dsr` and
/// `hybrid`); and this node records the flows other nodes dispatch to its pods that way.
pub const CONFIG_F_DSR_TCP: u32 = 64;
/// The same for UDP (`--load-balancer-mode dsr`).
pub const CONFIG_F_DSR_UDP: u32 = 128;
/// Per-Service traffic counters are off (`--per-service-metrics=false`): new flows, rejects
/// and drops are not counted by service in `LB_SVCSTATS_V1`.
pub const CONFIG_F_NO_SERVICE_STATS: u32 = 256;

/// The skb mark bit of [`CONFIG_F_UNTRACK`]: `mark & UNTRACK_MARK == UNTRACK_MARK` is
/// untracked while the rule is installed. Outside kube-proxy's bits (0x4000 masquerade,
/// 0x8000 drop); the other bits of a packet's mark are kept.
pub const UNTRACK_MARK: u32 = 0x0020_0000;

/// The single value of `LB_CONFIG_V1` (key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// `CONFIG_F_*` bits.
    pub flags: u32,
    /// The node's secret seed of the flow hash that picks backends
    /// ([`crate::select::flow_hash`]), low and high halves: without it a client could choose
    /// its backend by choosing its source port. Created once per node, never 0, and kept
    /// across restarts so that a restart moves no flow; `lbproxy cleanup` removes it with the
    /// map. 0 (as written by versions before the seed) means "none yet".
    pub hash_seed_lo: u32,
    pub hash_seed_hi: u32,
    /// The controller's id cursor (read and written by the controller only): no service or
    /// backend id at or past it has been handed out since the ids last wrapped, so a restart
    /// goes on from here instead of reusing ids that flows may still hold. The controller
    /// moves it ahead before it writes a new id to a map. 0 (as written by versions before
    /// it) means "none yet".
    pub next_id: u32,
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 16);

impl DatapathConfig {
    /// The flow-hash seed (0 when none was written yet).
    #[inline(always)]
    pub const fn hash_seed(&self) -> u64 {
        (self.hash_seed_hi as u64) << 32 | self.hash_seed_lo as u64
    }

    /// This config with `seed` as the flow-hash seed.
    #[must_use]
    pub const fn with_hash_seed(self, seed: u64) -> DatapathConfig {
        DatapathConfig {
            hash_seed_lo: seed as u32,
            hash_seed_hi: (seed >> 32) as u32,
            ..self
        }
    }
}

/// An array of one entry, key 0.
pub const SPEC: MapSpec =
    MapSpec::of::<u32, DatapathConfig>("LB_CONFIG_V1", "config", MapKind::Array, 1);
