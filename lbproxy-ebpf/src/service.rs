//! Stage 1: extract the service key from a packet and look the frontend up.

use aya_ebpf::{btf_maps::HashMap, macros::btf_map};
use lbproxy_common::{MAX_SERVICES, SCOPE_DEFAULT, ServiceKey, ServiceLabel, ServiceValue};

use crate::packet::Packet;

#[btf_map(name = "LB_SERVICES_V2")]
static LB_SERVICES_V2: HashMap<ServiceKey, ServiceValue, { MAX_SERVICES as usize }> =
    HashMap::new();

/// Service names for `lbproxy inspect`. Declared here so the object carries it (and its BTF);
/// the datapath never reads it.
#[btf_map(name = "LB_LABELS_V1")]
static LB_LABELS_V1: HashMap<u32, ServiceLabel, { MAX_SERVICES as usize }> = HashMap::new();

/// The frontend a packet is addressed to, if any. `None` means "not a service": the packet
/// is not ours and passes untouched.
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
