//! Map encoding: the desired state's types as the maps hold them, and back.
//!
//! `desired` speaks Kubernetes (frontends, kinds, traffic policies, backends); this module
//! alone knows how a frontend becomes a `ServiceKey` (address and port in network order, a
//! lookup [`Scope`]), a kind a [`SvcKind`] number, a policy [`SvcFlags`] bits, a backend a
//! `Backend` value and an unserved frontend an `LB_UNSERVED_V1` entry. Each has one
//! conversion each way, so adoption at start-up reads back exactly what was written.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lbproxy_common::{
    Backend, Backend6, IpFamily, Scope, ServiceKey, ServiceKey6, ServiceKeyOf, ServiceValue,
    SvcFlags, SvcKind, UnservedKey, UnservedValue, nul_padded,
};

use crate::desired::{BackendAddr, Family, Frontend, FrontendKind, FrontendSpec, Policy, Unserved};
use crate::desired::{HintsIgnored, Topology};
use crate::model::Protocol;

/// A frontend's key in its family's frontend map: `LB_SERVICES_V2` or `LB_SERVICES6_V1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

/// A backend's value in its family's backend map: `LB_BACKENDS_V1` or `LB_BACKENDS6_V1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackendValue {
    V4(Backend),
    V6(Backend6),
}

impl From<FrontendKind> for SvcKind {
    fn from(k: FrontendKind) -> SvcKind {
        match k {
            FrontendKind::ClusterIp => SvcKind::ClusterIp,
            FrontendKind::NodePort => SvcKind::NodePort,
            FrontendKind::ExternalIp => SvcKind::ExternalIp,
            FrontendKind::LoadBalancerIp => SvcKind::LoadBalancer,
        }
    }
}

impl From<SvcKind> for FrontendKind {
    fn from(k: SvcKind) -> FrontendKind {
        match k {
            SvcKind::ClusterIp => FrontendKind::ClusterIp,
            SvcKind::NodePort => FrontendKind::NodePort,
            SvcKind::ExternalIp => FrontendKind::ExternalIp,
            SvcKind::LoadBalancer => FrontendKind::LoadBalancerIp,
        }
    }
}

impl FrontendKind {
    /// Its number in the maps (`ServiceValue::kind`, `UnservedKey::kind`).
    pub fn number(self) -> u8 {
        SvcKind::from(self).into()
    }

    /// The kind a map's `kind` number stands for.
    pub fn from_number(n: u8) -> Option<Self> {
        SvcKind::try_from(n).ok().map(Self::from)
    }
}

/// A frontend's service entry: its id, how many slots serve new flows, and its spec's
/// affinity, kind and policy.
pub fn service_value(svc_id: u32, count: u32, spec: &FrontendSpec) -> ServiceValue {
    ServiceValue {
        svc_id,
        count,
        affinity_timeout_s: spec.affinity_timeout_s,
        flags: flags(&spec.policy).bits(),
        kind: spec.kind.number(),
        _pad: 0,
    }
}

/// The entry flags that carry a frontend's policy.
pub fn flags(p: &Policy) -> SvcFlags {
    let mut f = SvcFlags::EMPTY;
    for (on, bit) in [
        (p.split_for_pods, SvcFlags::SPLIT_SCOPE),
        (p.local_only_elsewhere, SvcFlags::LOCAL_ONLY),
        (p.source_ranges, SvcFlags::SOURCE_RANGES),
        (p.terminating_fallback, SvcFlags::TERMINATING_FALLBACK),
    ] {
        if on {
            f |= bit;
        }
    }
    f | topology_flags(p.topology)
}

/// The flag that records a frontend's [`Topology`] (none for no hints).
fn topology_flags(t: Topology) -> SvcFlags {
    match t {
        Topology::None => SvcFlags::EMPTY,
        Topology::SameNode => SvcFlags::TOPOLOGY_NODE,
        Topology::SameZone => SvcFlags::TOPOLOGY_ZONE,
        Topology::Ignored(why) => match why {
            HintsIgnored::Incomplete => SvcFlags::HINTS_INCOMPLETE,
            HintsIgnored::NotForNode => SvcFlags::HINTS_NOT_FOR_NODE,
            HintsIgnored::NotForZone => SvcFlags::HINTS_NOT_FOR_ZONE,
            HintsIgnored::NoZoneLabel => SvcFlags::HINTS_NO_ZONE_LABEL,
            HintsIgnored::LocalPolicy => SvcFlags::HINTS_LOCAL_POLICY,
        },
    }
}

/// The [`Topology`] an entry's flags record.
pub fn topology_of(flags: u16) -> Topology {
    let f = SvcFlags::from_bits_retain(flags);
    let ignored = [
        (SvcFlags::HINTS_INCOMPLETE, HintsIgnored::Incomplete),
        (SvcFlags::HINTS_NOT_FOR_NODE, HintsIgnored::NotForNode),
        (SvcFlags::HINTS_NOT_FOR_ZONE, HintsIgnored::NotForZone),
        (SvcFlags::HINTS_NO_ZONE_LABEL, HintsIgnored::NoZoneLabel),
        (SvcFlags::HINTS_LOCAL_POLICY, HintsIgnored::LocalPolicy),
    ];
    if f.contains(SvcFlags::TOPOLOGY_NODE) {
        Topology::SameNode
    } else if f.contains(SvcFlags::TOPOLOGY_ZONE) {
        Topology::SameZone
    } else if let Some((_, why)) = ignored.into_iter().find(|(bit, _)| f.contains(*bit)) {
        Topology::Ignored(why)
    } else {
        Topology::None
    }
}

impl Frontend {
    /// Its entry's key, in its family's map.
    pub fn key(&self) -> FrontendKey {
        let scope = if self.pods_only {
            Scope::Internal
        } else {
            Scope::Default
        }
        .into();
        let (port_be, proto) = (self.port.to_be(), self.proto.number());
        match self.addr {
            IpAddr::V4(a) => FrontendKey::V4(ServiceKeyOf {
                addr: a.octets(),
                port_be,
                proto,
                scope,
            }),
            IpAddr::V6(a) => FrontendKey::V6(ServiceKeyOf {
                addr: a.octets(),
                port_be,
                proto,
                scope,
            }),
        }
    }

    pub fn from_key(k: &FrontendKey) -> Option<Self> {
        let (addr, port_be, proto, scope) = match k {
            FrontendKey::V4(k) => (
                IpAddr::from(Ipv4Addr::from(k.addr)),
                k.port_be,
                k.proto,
                k.scope,
            ),
            FrontendKey::V6(k) => (
                IpAddr::from(Ipv6Addr::from(k.addr)),
                k.port_be,
                k.proto,
                k.scope,
            ),
        };
        Some(Self {
            addr,
            port: u16::from_be(port_be),
            proto: Protocol::from_number(proto)?,
            pods_only: Scope::try_from(scope) == Ok(Scope::Internal),
        })
    }
}

impl BackendAddr {
    /// Its value, in its family's map.
    pub fn value(&self) -> BackendValue {
        let (port_be, proto) = (self.port.to_be(), self.proto.number());
        match self.addr {
            IpAddr::V4(a) => BackendValue::V4(Backend {
                addr: a.octets(),
                port_be,
                proto,
                _pad: 0,
            }),
            IpAddr::V6(a) => BackendValue::V6(Backend6 {
                addr: a.octets(),
                port_be,
                proto,
                _pad: 0,
            }),
        }
    }

    pub fn from_value(b: &BackendValue) -> Option<Self> {
        let (addr, port_be, proto) = match b {
            BackendValue::V4(b) => (IpAddr::from(Ipv4Addr::from(b.addr)), b.port_be, b.proto),
            BackendValue::V6(b) => (IpAddr::from(Ipv6Addr::from(b.addr)), b.port_be, b.proto),
        };
        Some(Self {
            addr,
            port: u16::from_be(port_be),
            proto: Protocol::from_number(proto)?,
        })
    }
}

impl Unserved {
    /// Its entry in `LB_UNSERVED_V1`, the list `lbproxy inspect` reads (as [`Frontend::key`]
    /// is a served frontend's entry in the services map).
    pub fn entry(&self) -> (UnservedKey, UnservedValue) {
        let mut addr = [0u8; 16];
        match self.addr {
            Some(IpAddr::V4(a)) => addr[..4].copy_from_slice(&a.octets()),
            Some(IpAddr::V6(a)) => addr = a.octets(),
            None => {}
        }
        let key = UnservedKey {
            addr,
            port_be: self.port.to_be(),
            proto: self.proto.number(),
            kind: self.kind.number(),
            family: match self.family {
                Family::V4 => IpFamily::V4,
                Family::V6 => IpFamily::V6,
            }
            .into(),
            _pad: [0; 3],
            svc_hash: fnv1a(self.label.as_bytes()),
        };
        let value = UnservedValue {
            label: nul_padded(&self.label),
            reason: nul_padded(self.reason),
        };
        (key, value)
    }
}

/// FNV-1a, 64 bits: tells apart two services asking for the same frontend.
fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, c| {
        (h ^ u64::from(*c)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_values_kinds_and_flags_round_trip() {
        for (addr, pods_only) in [
            (IpAddr::from([198, 19, 0, 10]), false),
            (IpAddr::from([198, 19, 0, 10]), true),
            ("fd00::10".parse().unwrap(), true),
        ] {
            let fe = Frontend {
                addr,
                port: 8080,
                proto: Protocol::Udp,
                pods_only,
            };
            assert_eq!(Frontend::from_key(&fe.key()), Some(fe));
            let be = BackendAddr {
                addr,
                port: 53,
                proto: Protocol::Tcp,
            };
            assert_eq!(BackendAddr::from_value(&be.value()), Some(be));
        }
        let FrontendKey::V4(k) = (Frontend {
            addr: IpAddr::from([198, 19, 0, 10]),
            port: 0x1234,
            proto: Protocol::Tcp,
            pods_only: true,
        })
        .key() else {
            panic!("an IPv4 frontend got an IPv6 key")
        };
        assert_eq!((k.port_be, k.scope), (0x1234u16.to_be(), 1));
        for k in FrontendKind::ALL {
            assert_eq!(FrontendKind::from_number(k.number()), Some(k));
        }
        assert_eq!(FrontendKind::from_number(9), None);
        let all = Policy {
            split_for_pods: true,
            local_only_elsewhere: true,
            source_ranges: true,
            terminating_fallback: true,
            topology: Topology::None,
        };
        assert_eq!(flags(&all).bits(), 0b1_1011, "SNAT is the datapath's own");
        assert_eq!(flags(&Policy::default()), SvcFlags::EMPTY);
        use HintsIgnored::*;
        for t in [
            Topology::None,
            Topology::SameNode,
            Topology::SameZone,
            Topology::Ignored(Incomplete),
            Topology::Ignored(NotForNode),
            Topology::Ignored(NotForZone),
            Topology::Ignored(NoZoneLabel),
            Topology::Ignored(LocalPolicy),
        ] {
            let f = flags(&Policy { topology: t, ..all });
            assert_eq!(f.bits() & 0b1_1111, 0b1_1011, "{t:?} keeps the other flags");
            assert_eq!(topology_of(f.bits()), t);
        }
    }
}
