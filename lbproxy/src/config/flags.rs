//! `lbproxy run`'s flags, parsed by clap, and the settings they resolve to with the
//! `--config` file.

use std::path::PathBuf;

use anyhow::Context as _;

use super::{Settings, parse_file, resolve};

/// `lbproxy run`'s command line: the config file, what to do with the settings, and the
/// flags that override the file.
#[derive(clap::Args)]
pub struct RunArgs {
    /// A KubeProxyConfiguration-style YAML file (see README).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Validate the configuration and flags, print the result, and exit.
    #[arg(long)]
    pub validate_only: bool,
    /// Write the effective configuration (both documents, defaults filled in) to this file
    /// and exit, as kube-proxy's flag does.
    #[arg(long, value_name = "FILE")]
    pub write_config_to: Option<PathBuf>,
    #[command(flatten)]
    pub flags: Flags,
}

/// Values given on the command line, each `None` when not given. Flags override the
/// `--config` file; a flag not given takes the file's value, then the default shown.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct Flags {
    /// Log format: `text` or `json` (one JSON object per line) [default: text]
    #[arg(long, value_name = "FORMAT")]
    pub logging_format: Option<String>,
    /// Log verbosity, as kube-proxy's `-v`: 0-2 info, 3-4 lbproxy's debug lines, 5-6
    /// lbproxy's trace and its libraries' debug, 7 and up everything. RUST_LOG, when set,
    /// overrides it [default: 0]
    #[arg(short = 'v', long = "v", value_name = "N")]
    pub verbosity: Option<u32>,
    /// API client request rate, requests per second; negative: unlimited [default: 5]
    #[arg(long, allow_negative_numbers = true)]
    pub kube_api_qps: Option<f64>,
    /// API client burst above that rate [default: 10]
    #[arg(long)]
    pub kube_api_burst: Option<u32>,
    /// Standalone source: a file or directory of Service and EndpointSlice manifests (YAML or
    /// JSON), watched. Without it, lbproxy watches the Kubernetes API.
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// kubeconfig for the API server [default: $KUBECONFIG, else in-cluster]
    #[arg(long)]
    pub kubeconfig: Option<String>,
    /// This node's name, for node-local endpoints and Events [default: the hostname]
    #[arg(long)]
    pub hostname_override: Option<String>,
    /// Comma-separated globs of host-side pod interfaces [default: lxc*,veth*,cali*]
    #[arg(long)]
    pub pod_interfaces: Option<String>,
    /// Where maps and links are pinned; must be on a bpffs [default: /sys/fs/bpf/lbproxy]
    #[arg(long)]
    pub bpffs_dir: Option<PathBuf>,
    /// [default: 0.0.0.0:10256]
    #[arg(long)]
    pub healthz_bind_address: Option<String>,
    /// [default: 127.0.0.1:10249]
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// Full reconcile of the maps against the model [default: 30s]
    #[arg(long)]
    pub sync_period: Option<String>,
    /// Minimum time between two syncs [default: 0s]
    #[arg(long)]
    pub min_sync_period: Option<String>,
    /// Flow table capacity (LRU); each flow takes two entries [default: 262144]
    #[arg(long)]
    pub flow_map_size: Option<u64>,
    /// Redirect service traffic between pods on this node straight into the destination pod,
    /// skipping the node's routing and netfilter (iptables policy on the node then does not
    /// see it) [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub stack_bypass: Option<bool>,
    /// Take the node over from kube-proxy at start: adopt the flows its rules translated
    /// (conntrack), then remove its rules and those entries once every Service is served
    /// (docs/migration.md). Without it, kube-proxy's rules and flows are left alone
    /// [default: false]
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub takeover: Option<bool>,
    /// Idle timeout of an established TCP flow [default: 24h]
    #[arg(long)]
    pub conntrack_tcp_timeout_established: Option<String>,
    /// Idle timeout of a half-closed TCP flow (one FIN seen; the other side may still send)
    /// [default: 1h]. A flow closed both ways, or reset, goes after 10 s
    #[arg(long)]
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    /// Idle timeout of a UDP flow [default: 30s]
    #[arg(long)]
    pub conntrack_udp_timeout: Option<String>,
    /// Idle timeout of a TCP flow whose SYN was never answered [default: 30s]
    #[arg(long)]
    pub flow_tcp_timeout_syn_sent: Option<String>,
    /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the address
    /// the node's IPv4 default route prefers, followed as routes change) [default: every IPv4
    /// address of the node's non-pod interfaces except loopback]
    #[arg(long, value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<String>>,
    /// Source ports for north-south flows source-NATed to a backend on another node, MIN-MAX
    /// [default: 1024-29999, clear of the NodePort and the node's ephemeral ranges]
    #[arg(long)]
    pub snat_port_range: Option<String>,
    /// The cgroup v2 directory the socket-level programs attach to; they translate the
    /// sockets of every process in it and below [default: /sys/fs/cgroup when that is cgroup
    /// v2, else lbproxy's own cgroup2 mount at /run/lbproxy/cgroupv2]
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Socket-level load balancing: `host` (the node's own processes), `pods` (theirs and
    /// pods'), or `off` [default: host]
    #[arg(long)]
    pub socket_lb: Option<String>,
    /// How a new flow picks its backend: `jump` (jump consistent hash over the Service's
    /// backends, the node's own seed) or `maglev` (a Maglev table per frontend, the same on
    /// every node with the same --hash-seed-file) [default: jump]
    #[arg(long)]
    pub lb_algorithm: Option<String>,
    /// Entries of each frontend's Maglev table, a prime; more than 100 per backend keeps a
    /// backend change from moving more than 1% of other flows [default: 16381]
    #[arg(long)]
    pub maglev_table_size: Option<u32>,
    /// A file whose whole content (at least 8 bytes, e.g. a mounted Secret) gives the flow
    /// hash seed: every node with the same file picks the same backend for the same flow
    /// under `maglev` [default: a random seed per node, kept across restarts]
    #[arg(long)]
    pub hash_seed_file: Option<PathBuf>,
    /// North-south translation at XDP on the node's interfaces: `native` (every node
    /// interface must take XDP in driver mode, or lbproxy does not start), `best-effort`
    /// (TC alone where the driver refuses, said per interface) or `disabled` [default:
    /// disabled]
    #[arg(long)]
    pub xdp_acceleration: Option<String>,
    /// How north-south flows reach a backend on another node: `snat` (source-NATed to this
    /// node's address, replies back through it), `dsr` (direct server return: the backend
    /// sees the client's address and its node answers the client itself) or `hybrid` (DSR
    /// for TCP, SNAT for UDP). Every node must run the same mode [default: snat]
    #[arg(long)]
    pub load_balancer_mode: Option<String>,
    /// Count new flows, rejects and drops by Service in the datapath, and each Service's
    /// flows in the table, for the `lbproxy_service_*` metrics and `inspect services`
    /// [default: true]
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub per_service_metrics: Option<bool>,
}

impl RunArgs {
    /// The effective settings, and the warnings about what the config file held that lbproxy
    /// ignores.
    pub fn settings(&self) -> anyhow::Result<(Settings, Vec<String>)> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!("invalid configuration: {}: cannot read", path.display())
                })?;
                Some((path.as_path(), parse_file(path, &text)?))
            }
            None => None,
        };
        let warnings = file
            .as_ref()
            .map(|(_, f)| f.warnings.clone())
            .unwrap_or_default();
        Ok((resolve(file, self.flags.clone())?, warnings))
    }
}
