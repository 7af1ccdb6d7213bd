//! Stage 1: extract the service key from a packet and look the frontend up.

use lbproxy_common::{SCOPE_DEFAULT, ServiceKey, ServiceValue};

use crate::{maps::LB_SERVICES_V2, parse::Packet};

/// The frontend a packet is addressed to, if any. `None` means "not a service": the packet
/// is not ours and passes untouched.
///
/// The key's scope is `SCOPE_DEFAULT`, the entry every frontend has. A second lookup with
/// `SCOPE_INTERNAL` for in-cluster sources, when the entry has `SVC_F_SPLIT_SCOPE`, is
/// reserved: no entry sets that flag yet.
#[inline(always)]
pub fn lookup(pkt: &Packet) -> Option<ServiceValue> {
    let key = ServiceKey {
        addr: pkt.dst_addr,
        port_be: pkt.dst_port_be,
        proto: pkt.proto,
        scope: SCOPE_DEFAULT,
    };
    // SAFETY: the value is copied out at once; hash map values are not freed under RCU
    // while this program runs.
    unsafe { LB_SERVICES_V2.get(key) }.copied()
}
