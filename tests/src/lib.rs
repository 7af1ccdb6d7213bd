//! Test support for lbproxy.
//!
//! [`lab`] builds throw-away network-namespace "nodes" with pods on them, runs backend servers
//! and clients inside those namespaces, writes Kubernetes manifests and drives a real
//! `lbproxy run` process. It is used by this crate's integration tests (`tests/tests/*.rs`)
//! and by `cargo xtask demo`.
//!
//! [`frames`] builds the Ethernet frames of the packet tests (`tests/tests/packet/`), every
//! checksum computed in full, and decodes frames for their failure messages.
//!
//! [`apiserver`] is a small, real Kubernetes API server (list + watch over HTTP/1.1) that
//! lbproxy's Kubernetes source can be pointed at from inside a lab's node namespace.
//!
//! Everything here needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_BPF): creating a namespace
//! without it panics with a message saying so.

pub mod apiserver;
pub mod frames;
pub mod lab;

/// Generates `mod $name { fn ipv4(); fn ipv6(); }` tests calling `$name(Family)`, for a
/// test whose behaviour is the same over both IP families: the families' cases fold into
/// one body, as `both_shapes!` (`tests/tests/common`) does for the lab's pod-network
/// shapes, and as aya's integration tests do with rstest cases.
#[macro_export]
macro_rules! both_families {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn ipv4() {
                super::$name($crate::lab::Family::V4)
            }
            #[test]
            fn ipv6() {
                super::$name($crate::lab::Family::V6)
            }
        }
    )*};
}
