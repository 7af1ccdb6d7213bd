//! lbproxy: an eBPF service load balancer for Kubernetes, replacing kube-proxy.
//!
//! The binary (`main.rs`) only parses the command line and hands it to [`cli::main`]:
//! - `lbproxy run` ([`run`]): load the datapath, attach it to pod interfaces, and keep the
//!   BPF maps equal to the desired state read from a source.
//! - `lbproxy inspect services|backends|flows|drops|events|delivery|snat|sockets|affinity|status`:
//!   read the pinned maps (and, for `status`, the controller's /healthz).
//! - `lbproxy flows flush`: remove flows from the flow table.
//! - `lbproxy monitor`: stream drops and rejects live.
//! - `lbproxy cleanup`: detach and unpin everything.

pub mod bpf;
pub mod cli;
pub mod config;
pub mod config_watch;
pub mod conntrack;
pub mod controller;
pub mod desired;
pub mod healthcheck;
pub mod model;
pub mod program;
pub mod run;
pub mod server;
pub mod source;
pub mod takeover;
pub mod telemetry;
pub mod yaml;
