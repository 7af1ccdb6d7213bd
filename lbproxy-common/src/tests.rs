//! The spec table against itself and against the types it describes.

use core::mem::size_of;
use std::collections::BTreeSet;

use super::*;

fn all_specs() -> impl Iterator<Item = &'static MapSpec> {
    MAPS.iter().chain(MIGRATED)
}

#[test]
fn names_are_unique_and_fit_the_kernel() {
    let mut seen = BTreeSet::new();
    for name in all_specs().map(|s| s.name).chain(RETIRED.iter().copied()) {
        assert!(seen.insert(name), "map name {name} appears twice");
        // BPF_OBJ_NAME_LEN is 16 with the NUL: longer names are cut.
        assert!(name.len() <= 15, "map name {name} is {} bytes", name.len());
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
            "map name {name} is not LB_UPPER_CASE"
        );
        assert!(
            name.starts_with("LB_"),
            "map name {name} lacks the LB_ prefix"
        );
    }
}

#[test]
fn labels_are_unique_and_unversioned() {
    let mut seen = BTreeSet::new();
    for s in MAPS {
        let l = s.label;
        assert!(seen.insert(l), "label {l} appears twice in MAPS");
        // A trailing 6 names the IPv6 twin of a map (`flows6`).
        let l4 = l.strip_suffix('6').unwrap_or(l);
        assert!(!l4.is_empty() && l4.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        assert!(!l.contains("_v"), "label {l} carries a version");
        assert!(!l.starts_with("lb_"), "label {l} carries the name prefix");
    }
    // A migrated layout keeps its successor's label.
    for old in MIGRATED {
        assert!(
            MAPS.iter().any(|s| s.label == old.label),
            "migrated {} has no successor labelled {}",
            old.name,
            old.label
        );
    }
}

fn sizes<K, V>() -> (u32, u32) {
    (size_of::<K>() as u32, size_of::<V>() as u32)
}

#[test]
fn spec_sizes_are_their_types() {
    let cases: [(MapSpec, (u32, u32)); 45] = [
        (services::SPEC, sizes::<ServiceKey, ServiceValue>()),
        (services::SPEC_V1, sizes::<ServiceKey, ServiceValueV1>()),
        (slots::SPEC, sizes::<SlotKey, u32>()),
        (backends::SPEC, sizes::<u32, Backend>()),
        (members::SPEC, sizes::<MemberKey, u32>()),
        (flows::SPEC, sizes::<FlowKey, FlowValue>()),
        (flows::SPEC_V1, sizes::<FlowKey, FlowValueV1>()),
        (flows::SPEC_V2, sizes::<FlowKey, FlowValueV2>()),
        (node_ifs::SPEC, sizes::<u32, NodeIf>()),
        (node_addrs::SPEC, sizes::<[u8; 4], NodeAddr>()),
        (src_ranges::SPEC, sizes::<SrcRangeKey, SrcRangeValue>()),
        (drops::SPEC, sizes::<u32, u64>()),
        (labels::SPEC, sizes::<u32, ServiceLabel>()),
        (affinity::SPEC, sizes::<AffinityKey, AffinityValue>()),
        (config::SPEC, sizes::<u32, DatapathConfig>()),
        (pod_ifs::SPEC, sizes::<u32, PodIf>()),
        (delivery::SPEC, sizes::<u32, u64>()),
        (unserved::SPEC, sizes::<UnservedKey, UnservedValue>()),
        (frags::SPEC, sizes::<FragKey, FragPorts>()),
        (src_check::SPEC, sizes::<u32, SrcCheck>()),
        (pod_addrs::SPEC, sizes::<[u8; 4], PodAddr>()),
        (snat_tries::SPEC, sizes::<u32, u64>()),
        (sock::CONFIG_SPEC, sizes::<u32, SockConfig>()),
        (sock::REV_SPEC, sizes::<SockRevKey, SockRevValue>()),
        (sock::COUNT_SPEC, sizes::<u32, u64>()),
        (monitor::CTL_SPEC, sizes::<u32, MonitorCtl>()),
        (monitor::RATE_SPEC, sizes::<u32, MonitorRate>()),
        (monitor::EVENTS_SPEC, (0, 0)),
        (services::SPEC6, sizes::<ServiceKey6, ServiceValue>()),
        (backends::SPEC6, sizes::<u32, Backend6>()),
        (flows::SPEC6, sizes::<FlowKey6, FlowValue6>()),
        (affinity::SPEC6, sizes::<AffinityKey6, AffinityValue>()),
        (flows::SCRATCH6_SPEC, sizes::<u32, FlowWork<family::V6>>()),
        (flows::SCRATCH_SPEC, sizes::<u32, FlowWork<family::V4>>()),
        (frags::SPEC6, sizes::<FragKey6, FragPorts>()),
        (node_ifs::SPEC6, sizes::<u32, NodeIf6>()),
        (node_addrs::SPEC6, sizes::<[u8; 16], NodeAddr>()),
        (sock::REV6_SPEC, sizes::<SockRevKey6, SockRevValue6>()),
        (src_ranges::SPEC6, sizes::<SrcRangeKey6, SrcRangeValue>()),
        (dp_events::SPEC, sizes::<u32, u64>()),
        (service_cidrs::SPEC, sizes::<CidrKey, CidrValue>()),
        (service_cidrs::SPEC6, sizes::<CidrKey6, CidrValue>()),
        (maglev::SPEC, sizes::<MaglevKey, MaglevChunk>()),
        (maglev::CONFIG_SPEC, sizes::<u32, MaglevConfig>()),
        (svc_stats::SPEC, sizes::<SvcStatKey, u64>()),
    ];
    for (spec, (k, v)) in cases {
        assert_eq!((spec.key_size, spec.value_size), (k, v), "{}", spec.name);
    }
    // Every spec in the table is one of the cases above.
    for s in all_specs() {
        assert!(
            cases.iter().any(|(c, _)| c == s),
            "{} has no size case",
            s.name
        );
    }
}

/// The layouts maps are pinned with. A change here breaks every pinned map of a running node:
/// it needs a new map version (and a migration or retirement), not an edit of this table.
#[test]
fn layouts_are_unchanged() {
    use MapKind::*;
    let expected: [(&str, &str, MapKind, u32, u32, u32); 42] = [
        ("LB_BACKENDS_V1", "backends", Hash, 4, 8, 262_144),
        ("LB_SLOTS_V1", "slots", Hash, 8, 4, 262_144),
        ("LB_SERVICES_V2", "services", Hash, 8, 16, 65_536),
        ("LB_FLOWS_V3", "flows", LruHash, 16, 48, 262_144),
        ("LB_DROPS_V2", "drops", PerCpuArray, 4, 8, 32),
        ("LB_LABELS_V1", "labels", Hash, 4, 128, 65_536),
        ("LB_AFFINITY_V1", "affinity", LruHash, 8, 16, 262_144),
        ("LB_MEMBERS_V1", "members", Hash, 8, 4, 262_144),
        ("LB_CONFIG_V1", "config", Array, 4, 16, 1),
        ("LB_PODIFS_V1", "pod_ifs", Hash, 4, 4, 4_096),
        ("LB_DELIVERY_V1", "delivery", PerCpuArray, 4, 8, 16),
        ("LB_UNSERVED_V1", "unserved", Hash, 32, 192, 131_072),
        ("LB_FRAGS_V1", "frags", LruHash, 12, 4, 8_192),
        ("LB_SRCCHECK_V1", "src_check", Hash, 4, 8, 4_096),
        ("LB_NODEIFS_V1", "node_ifs", Hash, 4, 12, 256),
        ("LB_NODEADDRS_V1", "node_addrs", Hash, 4, 4, 1_024),
        ("LB_SRCRANGES_V1", "src_ranges", LpmTrie, 12, 4, 65_536),
        ("LB_PODADDRS_V1", "pod_addrs", Hash, 4, 4, 16_384),
        ("LB_SNATTRIES_V1", "snat_tries", PerCpuArray, 4, 8, 18),
        ("LB_SOCKCFG_V1", "sock_config", Array, 4, 16, 1),
        ("LB_SOCKREV_V1", "sock_rev", LruHash, 16, 16, 262_144),
        ("LB_SOCKCNT_V1", "sock_events", PerCpuArray, 4, 8, 16),
        ("LB_MONCTL_V1", "monitor_ctl", Array, 4, 16, 1),
        ("LB_MONRATE_V1", "monitor_rate", PerCpuArray, 4, 16, 1),
        ("LB_EVENTS_V1", "events", RingBuf, 0, 0, 262_144),
        ("LB_SERVICES6_V1", "services6", Hash, 20, 16, 65_536),
        ("LB_BACKENDS6_V1", "backends6", Hash, 4, 20, 262_144),
        ("LB_FLOWS6_V1", "flows6", LruHash, 40, 80, 65_536),
        ("LB_AFFINITY6_V1", "affinity6", LruHash, 20, 16, 262_144),
        ("LB_SCRATCH6_V1", "scratch6", PerCpuArray, 4, 240, 1),
        ("LB_SCRATCH_V1", "scratch", PerCpuArray, 4, 112, 1),
        ("LB_FRAGS6_V1", "frags6", LruHash, 40, 4, 8_192),
        ("LB_NODEIFS6_V1", "node_ifs6", Hash, 4, 24, 256),
        ("LB_NODEADDR6_V1", "node_addrs6", Hash, 16, 4, 1_024),
        ("LB_SOCKREV6_V1", "sock_rev6", LruHash, 32, 28, 262_144),
        ("LB_SRCRANGE6_V1", "src_ranges6", LpmTrie, 24, 4, 65_536),
        ("LB_DPEVENTS_V1", "datapath_events", PerCpuArray, 4, 8, 16),
        ("LB_SVCCIDRS_V1", "service_cidrs", LpmTrie, 8, 4, 65_536),
        ("LB_SVCCIDR6_V1", "service_cidrs6", LpmTrie, 20, 4, 65_536),
        ("LB_MAGLEV_V1", "maglev", Hash, 8, 16_384, 262_144),
        ("LB_MAGCFG_V1", "maglev_config", Array, 4, 8, 1),
        ("LB_SVCSTATS_V1", "svc_stats", LruPerCpuHash, 8, 8, 65_536),
    ];
    let got: Vec<_> = MAPS
        .iter()
        .map(|s| {
            (
                s.name,
                s.label,
                s.kind,
                s.key_size,
                s.value_size,
                s.max_entries,
            )
        })
        .collect();
    assert_eq!(got, expected);
    let v1 = services::SPEC_V1;
    assert_eq!(
        (v1.name, v1.kind, v1.key_size, v1.value_size),
        ("LB_SERVICES_V1", Hash, 8, 8)
    );
    let v1 = flows::SPEC_V1;
    assert_eq!(
        (v1.name, v1.kind, v1.key_size, v1.value_size),
        ("LB_FLOWS_V1", LruHash, 16, 32)
    );
    let v2 = flows::SPEC_V2;
    assert_eq!(
        (v2.name, v2.kind, v2.key_size, v2.value_size),
        ("LB_FLOWS_V2", LruHash, 16, 40)
    );
}

#[test]
fn map_names_come_from_the_table() {
    assert_eq!(map_names::PINNED.len(), MAPS.len());
    for (name, spec) in map_names::PINNED.iter().zip(MAPS) {
        assert_eq!(*name, spec.name);
    }
    assert_eq!(map_names::RETIRED, ["LB_DROPS_V1"]);
    assert_eq!(map_names::SERVICES_V1, "LB_SERVICES_V1");
    assert_eq!(spec_by_name("LB_SERVICES_V1"), Some(&services::SPEC_V1));
    assert_eq!(spec_by_name("LB_FLOWS_V3"), Some(&flows::SPEC));
    assert_eq!(spec_by_name("LB_FLOWS_V2"), Some(&flows::SPEC_V2));
    assert_eq!(spec_by_name("LB_FLOWS_V1"), Some(&flows::SPEC_V1));
    assert_eq!(spec_by_name("LB_DROPS_V1"), None);
}

#[test]
fn counter_maps_have_room_for_every_value() {
    assert_eq!(drops::SPEC.max_entries, DropReason::SLOTS);
    assert_eq!(delivery::SPEC.max_entries, Delivery::SLOTS);
    assert_eq!(dp_events::SPEC.max_entries, DatapathEvent::SLOTS);
    assert_eq!(map_names::DP_EVENTS, "LB_DPEVENTS_V1");
}

/// The six reasons that were never drops map one to one onto the datapath events, under the
/// same label; every other reason is a drop. Their values in `LB_DROPS_V2` stay as they were
/// (the old series is kept for one release, and a value is never reused).
#[test]
fn deprecated_reasons_are_the_events() {
    let deprecated: Vec<(u32, DatapathEvent)> = DropReason::ALL
        .iter()
        .filter_map(|r| Some((*r as u32, r.event()?)))
        .collect();
    assert_eq!(
        deprecated,
        [
            (10, DatapathEvent::MidstreamWithoutFlow),
            (11, DatapathEvent::FlowHalfRecreated),
            (12, DatapathEvent::TupleClashPortRewritten),
            (14, DatapathEvent::StaleReplyRemoved),
            (15, DatapathEvent::FragmentWithoutFirst),
            (16, DatapathEvent::L4HeaderBadPassed),
        ]
    );
    for e in DatapathEvent::ALL {
        let from: Vec<DropReason> = DropReason::ALL
            .into_iter()
            .filter(|r| r.event() == Some(e))
            .collect();
        assert_eq!(from.len(), 1, "{e:?} is the event of {from:?}");
        assert_eq!(from[0].label(), e.label(), "{e:?} changed its label");
        assert!(!from[0].is_drop());
    }
    let drops = DropReason::ALL.iter().filter(|r| r.is_drop()).count();
    assert_eq!(drops + DatapathEvent::ALL.len(), DropReason::ALL.len());
    // The event indices are their own, from 0.
    let values: Vec<u32> = DatapathEvent::ALL.iter().map(|e| *e as u32).collect();
    assert_eq!(values, [0, 1, 2, 3, 4, 5]);
}

/// An entry written before scopes, kinds and flags were named (zeroed padding) means what it
/// meant then: the default scope, a ClusterIP, no flags.
#[test]
fn zero_is_todays_behaviour() {
    assert_eq!(SCOPE_DEFAULT, 0);
    assert_eq!(SVC_KIND_CLUSTER_IP, 0);
    let flags = [SVC_F_SPLIT_SCOPE, SVC_F_LOCAL_ONLY, SVC_F_SNAT];
    let mut all = 0u16;
    for f in flags {
        assert_eq!(f.count_ones(), 1, "flag {f:#x} is not one bit");
        assert_eq!(all & f, 0, "flag {f:#x} overlaps another");
        all |= f;
    }
    assert_ne!(SCOPE_INTERNAL, SCOPE_DEFAULT);
    // The new fields sit exactly where the padding was.
    assert_eq!(core::mem::offset_of!(ServiceKey, scope), 7);
    assert_eq!(core::mem::offset_of!(ServiceValue, flags), 12);
    assert_eq!(core::mem::offset_of!(ServiceValue, kind), 14);
    assert_eq!(core::mem::offset_of!(ServiceValue, _pad), 15);
}

/// Every map is preallocated, but the informational unserved list, whose memory follows
/// what it holds, and the LPM tries (source ranges, ServiceCIDRs: the kernel allows no other
/// kind of LPM trie).
#[test]
fn only_the_unserved_list_the_tries_and_maglev_are_not_preallocated() {
    for s in MAPS {
        let want = if s.name == unserved::SPEC.name
            || s.name == src_ranges::SPEC.name
            || s.name == src_ranges::SPEC6.name
            || s.name == service_cidrs::SPEC.name
            || s.name == service_cidrs::SPEC6.name
            || s.name == maglev::SPEC.name
        {
            spec::BPF_F_NO_PREALLOC
        } else {
            0
        };
        assert_eq!(s.flags, want, "{}", s.name);
    }
}

/// The hash seed and the id cursor sit in what was `_reserved` in `LB_CONFIG_V1`: the value
/// keeps its size and the flags their place, and a config written before them (zeros there)
/// reads as "no seed yet" (0, the unseeded hash) and "no cursor yet".
#[test]
fn hash_seed_takes_reserved_space() {
    assert_eq!(core::mem::offset_of!(DatapathConfig, flags), 0);
    assert_eq!(core::mem::offset_of!(DatapathConfig, hash_seed_lo), 4);
    assert_eq!(core::mem::offset_of!(DatapathConfig, hash_seed_hi), 8);
    assert_eq!(core::mem::offset_of!(DatapathConfig, next_id), 12);
    assert_eq!(DatapathConfig::default().hash_seed(), 0);
    for seed in [1, u64::MAX, 0x0123_4567_89ab_cdef, 1 << 32] {
        let c = DatapathConfig {
            flags: CONFIG_F_STACK_BYPASS,
            ..DatapathConfig::default()
        }
        .with_hash_seed(seed);
        assert_eq!(c.hash_seed(), seed);
        assert_eq!(c.flags, CONFIG_F_STACK_BYPASS);
        assert_eq!(
            (c.hash_seed_lo, c.hash_seed_hi),
            (seed as u32, (seed >> 32) as u32)
        );
    }
}

/// Every wire enum converts to its integer and back, and an unknown integer is refused
/// with its value.
#[test]
fn wire_enums_round_trip_and_refuse_unknown_values() {
    fn check<E, I>(all: &[E], unknown: I)
    where
        E: Copy + PartialEq + core::fmt::Debug + TryFrom<I, Error = I>,
        I: Copy + PartialEq + core::fmt::Debug + From<E>,
    {
        for v in all {
            assert_eq!(E::try_from(I::from(*v)), Ok(*v));
        }
        assert_eq!(E::try_from(unknown), Err(unknown));
    }
    check(SvcKind::ALL, 4u8);
    check(Scope::ALL, 2u8);
    check(FlowState::ALL, 4u8);
    check(FlowDir::ALL, 2u8);
    check(Hook::ALL, 4u8);
    check(Verdict::ALL, 2u8);
    check(IpFamily::ALL, 5u8);
    check(Membership::ALL, 0u32);
    // The aliases the datapath uses are the enums' values.
    assert_eq!(
        [
            SVC_KIND_CLUSTER_IP,
            SVC_KIND_NODE_PORT,
            SVC_KIND_EXTERNAL_IP,
            SVC_KIND_LOAD_BALANCER
        ],
        [0, 1, 2, 3]
    );
    assert_eq!((SCOPE_DEFAULT, SCOPE_INTERNAL), (0, 1));
    assert_eq!((FAMILY_IPV4, FAMILY_IPV6), (4, 6));
    assert_eq!((MEMBER_SERVING, MEMBER_DRAINING), (1, 2));
}

/// Flag sets keep unknown bits, and their bits are the values the maps always held.
#[test]
fn wire_flags_keep_their_bits() {
    let f = SvcFlags::LOCAL_ONLY | SvcFlags::SOURCE_RANGES;
    assert_eq!(f.bits(), 0b1010);
    assert!(f.contains(SvcFlags::LOCAL_ONLY) && !f.contains(SvcFlags::SNAT));
    assert_eq!(SvcFlags::from_bits_retain(0x8000).bits(), 0x8000);
    assert_eq!(
        [
            SVC_F_SPLIT_SCOPE,
            SVC_F_LOCAL_ONLY,
            SVC_F_SNAT,
            SVC_F_SOURCE_RANGES,
            SVC_F_TERMINATING_FALLBACK
        ],
        [1, 2, 4, 8, 16]
    );
    assert_eq!(
        (FLOW_F_FIN, FLOW_F_RST),
        (FlowFlags::FIN.bits(), FlowFlags::RST.bits())
    );
}
