//! Listed interfaces for tests, built as a listing would show them.

use crate::bpf::attach::Interface;
use crate::bpf::ifaces::{Link, LinkAddrs};

/// An interface `name` with ifindex `index`, nothing else yet.
pub fn link(index: u32, name: &str) -> LinkBuilder {
    LinkBuilder(Link {
        iface: Interface {
            index,
            name: name.into(),
        },
        peer_kind: None,
        master: None,
        is_bridge: false,
        is_loopback: false,
        v4: LinkAddrs::default(),
        routes_v4: Vec::new(),
        v6: LinkAddrs::default(),
    })
}

pub struct LinkBuilder(pub Link);

impl LinkBuilder {
    /// IPv4 addresses, primary first.
    pub fn v4(mut self, addrs: &[&str]) -> Self {
        self.0.v4.addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
        self
    }
    /// Global IPv6 addresses, in the kernel's order.
    pub fn v6(mut self, addrs: &[&str]) -> Self {
        self.0.v6.addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
        self
    }
    /// The IPv4 default route leaves by it, from `src`.
    pub fn primary_v4(mut self, src: &str) -> Self {
        self.0.v4.primary = Some(src.parse().unwrap());
        self
    }
    /// The IPv6 default route leaves by it, from `src`.
    pub fn primary_v6(mut self, src: &str) -> Self {
        self.0.v6.primary = Some(src.parse().unwrap());
        self
    }
    /// `/32` routes out of it.
    pub fn routes(mut self, addrs: &[&str]) -> Self {
        self.0.routes_v4 = addrs.iter().map(|a| a.parse().unwrap()).collect();
        self
    }
    /// Its peer is in another namespace (a pod's), as a veth's.
    pub fn veth(mut self) -> Self {
        self.0.peer_kind = Some(lbproxy_common::POD_IF_VETH);
        self
    }
    pub fn master(mut self, m: u32) -> Self {
        self.0.master = Some(m);
        self
    }
    pub fn bridge(mut self) -> Self {
        self.0.is_bridge = true;
        self
    }
    pub fn loopback(mut self) -> Self {
        self.0.is_loopback = true;
        self
    }
    pub fn done(self) -> Link {
        self.0
    }
}
