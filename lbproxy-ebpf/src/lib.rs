// Intentionally empty: the eBPF object is the `lbproxy` binary of this crate, built by
// lbproxy/build.rs for bpfel-unknown-none. The empty library lets the userspace crate depend
// on this one at build time so cargo rebuilds it when the datapath changes.
#![no_std]
