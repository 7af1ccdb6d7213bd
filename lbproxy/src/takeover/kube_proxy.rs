//! kube-proxy's state on a node: finding it ([`find`]) and removing it ([`remove`]).
//!
//! `lbproxy run --takeover` calls [`find`] at start, and [`remove`] once lbproxy has programmed
//! every Service and adopted kube-proxy's conntrack flows; without `--takeover` lbproxy only
//! logs [`KubeProxyState::summary`] once as a warning. Both work in the network namespace of
//! the calling thread (the commands they run inherit it), so a test can call them from a
//! thread that has `setns(2)`ed into a lab's node namespace.
//!
//! # What is found
//!
//! * **iptables mode**, for IPv4 and IPv6 and for each backend that may hold the rules
//!   (iptables-legacy and iptables-nft: kube-proxy uses whichever its image's `iptables`
//!   wrapper picks, and a node may have leftovers in the other). The chains are those
//!   kube-proxy owns, as kubernetes `pkg/proxy/iptables/proxier.go` names them
//!   (`CleanupLeftovers`, `iptablesJumpChains`, the service chain prefixes of
//!   `isServiceChainName`):
//!   - nat: `KUBE-SERVICES`, `KUBE-NODEPORTS`, `KUBE-POSTROUTING`, `KUBE-MARK-MASQ`,
//!     `KUBE-PROXY-CANARY` and every `KUBE-SVC-*`, `KUBE-SVL-*`, `KUBE-SEP-*`, `KUBE-FW-*`,
//!     `KUBE-EXT-*` (and the older `KUBE-XLB-*`);
//!   - filter: `KUBE-SERVICES`, `KUBE-EXTERNAL-SERVICES`, `KUBE-FORWARD`, `KUBE-NODEPORTS`,
//!     `KUBE-PROXY-FIREWALL`, `KUBE-PROXY-CANARY`;
//!   - mangle: `KUBE-PROXY-CANARY`;
//!   - and the rules of the built-in chains (`PREROUTING`, `INPUT`, `FORWARD`, `OUTPUT`,
//!     `POSTROUTING`) that jump (`-j`/`-g`) to one of those chains.
//!
//!   kube-proxy's own `--cleanup` leaves `KUBE-MARK-MASQ` (kubelet created it too before
//!   1.28), `KUBE-PROXY-FIREWALL` and the canaries behind; they are kube-proxy's all the same
//!   (it writes them on every sync), so a takeover removes them as well.
//!
//!   Left alone, as kubelet's (`pkg/kubelet/kubelet_network_linux.go`): `KUBE-KUBELET-CANARY`
//!   (mangle, nat, filter), `KUBE-IPTABLES-HINT` (mangle) and `KUBE-FIREWALL` (filter, the
//!   "block incoming localnet connections" rule, jumped to from `INPUT` and `OUTPUT`).
//!   kube-proxy writes a copy of `KUBE-FIREWALL` when it allows NodePorts on localhost, but
//!   its `iptablesKubeletJumpChains` calls that chain kubelet's and `CleanupLeftovers` never
//!   deletes it; neither does this module. So are kubelet's pre-1.28 `KUBE-MARK-DROP` and
//!   every chain of any other component.
//!
//!   A kube-proxy chain that a chain of some other component still jumps to (say a CNI
//!   plugin's chain jumping to `KUBE-MARK-MASQ`) cannot be deleted without breaking that
//!   component; it is kept, and reported in [`IptablesTable::kept`] with the chain that
//!   refers to it (as is, transitively, whatever a kept chain jumps to).
//! * **nftables mode**: the tables `ip kube-proxy` and `ip6 kube-proxy` (`nft list tables`).
//! * **IPVS mode**: the dummy link `kube-ipvs0` holding the service addresses, looked up with
//!   `if_nametoindex(3)` (an ioctl on a socket of the calling thread's namespace; `/sys/class/
//!   net` would show the namespace sysfs was mounted in). [`KubeProxyState::ipvs`] says so;
//!   [`remove`] refuses such a node ([`KubeProxyError::Ipvs`]): its IPVS virtual servers and
//!   ipsets are not handled here.
//!
//! # What is removed
//!
//! [`remove`] removes exactly what [`find`] returned: per table, one `*-restore -w 5
//! --noflush` input that flushes kube-proxy's chains (`:CHAIN - [0:0]`), deletes the jump
//! rules from the built-in chains (`-D CHAIN <rule as iptables-save printed it>`) and deletes
//! the chains (`-X CHAIN`), so each table changes in one transaction; then `nft delete table
//! ip kube-proxy` (and `ip6`). Errors name the family, backend, table and chains, or the nft
//! table, with the command's stderr.
//!
//! kube-proxy must not run any more when [`remove`] is called: it would write its rules
//! again (removing its canary chains makes a running kube-proxy resync at once), and a
//! service chain it adds between [`find`] and [`remove`] that jumps to `KUBE-MARK-MASQ`
//! makes that table's transaction fail (nothing of that table changes then).
//!
//! # Binaries
//!
//! The lbproxy image must contain iptables (both `iptables-legacy-save`/`-restore` and
//! `iptables-nft-save`/`-restore`, and the `ip6tables-*` ones; a plain `iptables-save` is used,
//! with its backend read from `--version`, only when neither variant exists) and `nft`. A
//! missing binary is not an error: that backend is not looked at, and
//! [`KubeProxyState::looked_in`] lists what was.
//!
//! The parsers ([`parse_iptables_save`], [`parse_nft_tables`]) and the ownership rules
//! ([`IptablesTable::from_saved`], [`IptablesTable::restore_input`]) are pure and unit-tested
//! here (`cargo test -p lbproxy takeover`); the lab test `tests/tests/kube_proxy_rules.rs`
//! installs kube-proxy's layouts in a namespace and checks [`find`] and [`remove`] on them.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// kube-proxy's iptables canary chain (`ipt.Monitor` in mangle, nat and filter).
const CANARY: &str = "KUBE-PROXY-CANARY";
/// kube-proxy's fixed nat chains.
const NAT_CHAINS: [&str; 5] = [
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    CANARY,
];
/// kube-proxy's per-service nat chains, by prefix (`isServiceChainName`).
const NAT_SERVICE_PREFIXES: [&str; 6] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
];
/// kube-proxy's filter chains.
const FILTER_CHAINS: [&str; 6] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    CANARY,
];
/// The link kube-proxy's IPVS mode puts the service addresses on.
pub const IPVS_LINK: &str = "kube-ipvs0";
/// The nftables table of kube-proxy's nftables mode (families `ip` and `ip6`).
pub const NFT_TABLE: &str = "kube-proxy";

/// Failures of [`find`] and [`remove`].
#[derive(Debug, thiserror::Error)]
pub enum KubeProxyError {
    #[error("cannot run {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{command} printed something that is not iptables-save output: {reason}")]
    Parse { command: String, reason: String },
    #[error(
        "removing kube-proxy's rules from the {family} {backend} table {table} (chains {chains}; {jumps} jump rules) failed: {source}"
    )]
    Restore {
        family: IpFamily,
        backend: IptablesBackend,
        table: String,
        chains: String,
        jumps: usize,
        source: Box<KubeProxyError>,
    },
    #[error("deleting the nft table {family} {table} failed: {source}")]
    NftDelete {
        family: &'static str,
        table: String,
        source: Box<KubeProxyError>,
    },
    #[error(
        "kube-proxy runs in IPVS mode here (link {IPVS_LINK} exists): lbproxy cannot take over from it; switch kube-proxy to iptables or nftables mode first, or remove its IPVS state (kube-proxy --cleanup)"
    )]
    Ipvs,
}

/// An IP family of the iptables commands and of nftables tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The command prefix: `iptables` or `ip6tables`.
    pub fn iptables(self) -> &'static str {
        match self {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        }
    }

    /// The nftables family: `ip` or `ip6`.
    pub fn nft(self) -> &'static str {
        match self {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
    }
}

/// The kernel interface an iptables binary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IptablesBackend {
    /// `x_tables` (`iptables-legacy`).
    Legacy,
    /// nf_tables through the iptables compatibility layer (`iptables-nft`).
    Nft,
}

impl IptablesBackend {
    fn suffix(self) -> &'static str {
        match self {
            IptablesBackend::Legacy => "legacy",
            IptablesBackend::Nft => "nft",
        }
    }
}

impl fmt::Display for IptablesBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.suffix())
    }
}

/// The save and restore commands of one family and backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iptables {
    pub family: IpFamily,
    pub backend: IptablesBackend,
    pub save: PathBuf,
    pub restore: PathBuf,
}

/// A kube-proxy chain and how many rules it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub rules: usize,
}

/// A rule of a built-in chain that jumps to a kube-proxy chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JumpRule {
    /// The built-in chain (`PREROUTING`, ...).
    pub chain: String,
    /// The rule as iptables-save printed it after `-A CHAIN `.
    pub spec: String,
    /// The kube-proxy chain it jumps to.
    pub target: String,
}

/// A kube-proxy chain kept because a chain that is not kube-proxy's jumps to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptChain {
    pub name: String,
    pub referenced_by: String,
}

/// kube-proxy's part of one table of one family and backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesTable {
    pub tool: Iptables,
    /// `nat`, `filter` or `mangle`.
    pub table: String,
    /// The chains [`remove`] flushes and deletes.
    pub chains: Vec<Chain>,
    /// The rules of built-in chains [`remove`] deletes.
    pub jumps: Vec<JumpRule>,
    /// kube-proxy chains left in place (see the module docs).
    pub kept: Vec<KeptChain>,
}

/// An nftables table of kube-proxy's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftTable {
    pub family: IpFamily,
    pub name: String,
}

/// What [`find`] found. Tables with nothing of kube-proxy's are left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KubeProxyState {
    pub iptables: Vec<IptablesTable>,
    pub nft: Vec<NftTable>,
    /// The `kube-ipvs0` link exists: kube-proxy runs (or ran) in IPVS mode.
    pub ipvs: bool,
    /// The commands that were read (`iptables-nft-save`, ..., `nft list tables`): what was
    /// looked at, for the log.
    pub looked_in: Vec<String>,
}

/// What [`remove`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// iptables tables changed (one restore each).
    pub tables: usize,
    /// Chains flushed and deleted.
    pub chains: usize,
    /// Rules those chains held.
    pub rules: usize,
    /// Jump rules deleted from built-in chains.
    pub jump_rules: usize,
    /// nftables tables deleted.
    pub nft_tables: usize,
}

impl KubeProxyState {
    /// Nothing of kube-proxy's was found (not even a kept chain).
    pub fn is_empty(&self) -> bool {
        self.iptables.is_empty() && self.nft.is_empty() && !self.ipvs
    }

    /// One line for the log: per table the number of chains, rules and jump rules, the nft
    /// tables, kept chains and IPVS.
    pub fn summary(&self) -> String {
        if self.is_empty() {
            return format!(
                "no kube-proxy rules found (looked in: {})",
                self.looked_in.join(", ")
            );
        }
        let mut parts: Vec<String> = self
            .iptables
            .iter()
            .map(|t| {
                let rules: usize = t.chains.iter().map(|c| c.rules).sum();
                let mut s = format!(
                    "{} {} {}: {} chains, {} rules, {} jumps",
                    t.tool.family,
                    t.tool.backend,
                    t.table,
                    t.chains.len(),
                    rules,
                    t.jumps.len()
                );
                if !t.kept.is_empty() {
                    let kept: Vec<String> = t
                        .kept
                        .iter()
                        .map(|k| format!("{} (jumped to from {})", k.name, k.referenced_by))
                        .collect();
                    s.push_str(&format!(", kept {}", kept.join(" ")));
                }
                s
            })
            .collect();
        parts.extend(
            self.nft
                .iter()
                .map(|t| format!("nft table {} {}", t.family.nft(), t.name)),
        );
        if self.ipvs {
            parts.push(format!("IPVS mode ({IPVS_LINK} exists)"));
        }
        format!("kube-proxy rules found: {}", parts.join("; "))
    }
}

// ---- iptables-save parsing (pure) ----

/// One table of iptables-save output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub name: String,
    pub chains: Vec<SavedChain>,
    pub rules: Vec<SavedRule>,
}

/// A chain declaration (`:NAME POLICY [packets:bytes]`); built-in chains have a policy,
/// user chains `-`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedChain {
    pub name: String,
    pub builtin: bool,
}

/// A rule (`-A CHAIN SPEC`) and its jump or goto target, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    pub spec: String,
    pub target: Option<String>,
}

/// Parses iptables-save output (any tables, `#` comments ignored). The error names the line.
pub fn parse_iptables_save(text: &str) -> Result<Vec<SavedTable>, String> {
    let mut tables = Vec::new();
    let mut current: Option<SavedTable> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            if let Some(t) = current.take() {
                return Err(format!(
                    "line {n}: table {name} starts before {} ends",
                    t.name
                ));
            }
            current = Some(SavedTable {
                name: name.to_owned(),
                ..SavedTable::default()
            });
            continue;
        }
        let Some(table) = current.as_mut() else {
            return Err(format!("line {n}: {line:?} outside a table"));
        };
        if line == "COMMIT" {
            tables.push(current.take().expect("current table"));
        } else if let Some(decl) = line.strip_prefix(':') {
            let mut words = decl.split_whitespace();
            let (Some(name), Some(policy)) = (words.next(), words.next()) else {
                return Err(format!(
                    "line {n}: chain declaration {line:?} lacks a policy"
                ));
            };
            table.chains.push(SavedChain {
                name: name.to_owned(),
                builtin: policy != "-",
            });
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
            table.rules.push(SavedRule {
                chain: chain.to_owned(),
                spec: spec.to_owned(),
                target: rule_target(spec),
            });
        } else {
            return Err(format!("line {n}: unexpected {line:?}"));
        }
    }
    match current {
        Some(t) => Err(format!("table {} has no COMMIT", t.name)),
        None => Ok(tables),
    }
}

/// The chain a rule spec jumps (`-j`/`--jump`) or goes (`-g`/`--goto`) to.
fn rule_target(spec: &str) -> Option<String> {
    let words = split_words(spec);
    words
        .windows(2)
        .rev()
        .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
        .map(|w| w[1].clone())
}

/// Splits a rule spec into words as iptables-restore does: blanks separate, double quotes
/// group (with `\"` inside them).
fn split_words(spec: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// Whether kube-proxy owns chain `chain` of table `table` (see the module docs).
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain) || NAT_SERVICE_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => chain == CANARY,
        _ => false,
    }
}

impl IptablesTable {
    /// kube-proxy's part of `saved` (read with `tool`), or `None` when it has nothing of
    /// kube-proxy's.
    pub fn from_saved(tool: &Iptables, saved: &SavedTable) -> Option<IptablesTable> {
        let builtin: BTreeSet<&str> = saved
            .chains
            .iter()
            .filter(|c| c.builtin)
            .map(|c| c.name.as_str())
            .collect();
        let owned: BTreeSet<&str> = saved
            .chains
            .iter()
            .filter(|c| !c.builtin && is_kube_proxy_chain(&saved.name, &c.name))
            .map(|c| c.name.as_str())
            .collect();
        let kept = kept_chains(saved, &builtin, &owned);
        let removable = |name: &str| owned.contains(name) && !kept.iter().any(|k| k.name == name);
        let chains: Vec<Chain> = saved
            .chains
            .iter()
            .filter(|c| removable(&c.name))
            .map(|c| Chain {
                name: c.name.clone(),
                rules: saved.rules.iter().filter(|r| r.chain == c.name).count(),
            })
            .collect();
        let jumps: Vec<JumpRule> = saved
            .rules
            .iter()
            .filter(|r| builtin.contains(r.chain.as_str()))
            .filter_map(|r| {
                let target = r.target.as_deref().filter(|t| removable(t))?;
                Some(JumpRule {
                    chain: r.chain.clone(),
                    spec: r.spec.clone(),
                    target: target.to_owned(),
                })
            })
            .collect();
        if chains.is_empty() && jumps.is_empty() && kept.is_empty() {
            return None;
        }
        Some(IptablesTable {
            tool: tool.clone(),
            table: saved.name.clone(),
            chains,
            jumps,
            kept,
        })
    }

    /// The `*-restore --noflush` input that removes this part in one transaction: flush the
    /// chains, delete the jump rules, delete the chains. Empty when there is nothing to
    /// remove (only kept chains).
    pub fn restore_input(&self) -> String {
        if self.chains.is_empty() && self.jumps.is_empty() {
            return String::new();
        }
        let mut out = format!("*{}\n", self.table);
        for c in &self.chains {
            out.push_str(&format!(":{} - [0:0]\n", c.name));
        }
        for j in &self.jumps {
            out.push_str(&format!("-D {} {}\n", j.chain, j.spec));
        }
        for c in &self.chains {
            out.push_str(&format!("-X {}\n", c.name));
        }
        out.push_str("COMMIT\n");
        out
    }

    fn chain_names(&self) -> String {
        let names: Vec<&str> = self.chains.iter().map(|c| c.name.as_str()).collect();
        names.join(" ")
    }
}

/// kube-proxy chains that a non-kube-proxy user chain (or, transitively, a kept chain)
/// jumps to.
fn kept_chains(
    saved: &SavedTable,
    builtin: &BTreeSet<&str>,
    owned: &BTreeSet<&str>,
) -> Vec<KeptChain> {
    let mut kept: Vec<KeptChain> = Vec::new();
    loop {
        let is_kept = |name: &str| kept.iter().any(|k| k.name == name);
        let next = saved.rules.iter().find_map(|r| {
            let target = r.target.as_deref()?;
            let from_foreign = !builtin.contains(r.chain.as_str())
                && (!owned.contains(r.chain.as_str()) || is_kept(&r.chain));
            (owned.contains(target) && !is_kept(target) && from_foreign).then(|| KeptChain {
                name: target.to_owned(),
                referenced_by: r.chain.clone(),
            })
        });
        match next {
            Some(k) => kept.push(k),
            None => return kept,
        }
    }
}

// ---- nft (pure) ----

/// Parses `nft list tables` output into (family, name) pairs.
pub fn parse_nft_tables(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("table"), Some(family), Some(name)) => {
                    Some((family.to_owned(), name.to_owned()))
                }
                _ => None,
            }
        })
        .collect()
}

/// kube-proxy's tables among `nft list tables` output.
fn kube_proxy_nft_tables(text: &str) -> Vec<NftTable> {
    parse_nft_tables(text)
        .into_iter()
        .filter(|(_, name)| name == NFT_TABLE)
        .filter_map(|(family, name)| {
            let family = IpFamily::ALL.into_iter().find(|f| f.nft() == family)?;
            Some(NftTable { family, name })
        })
        .collect()
}

// ---- commands ----

/// `name` on `PATH` (plus the sbin directories, where iptables lives), if executable.
pub(super) fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs `program args`, feeding `input` on stdin; its stdout, or an error with its stderr.
pub(super) fn run(
    program: &Path,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, KubeProxyError> {
    let command = std::iter::once(program.display().to_string())
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_err = |source| KubeProxyError::Spawn {
        command: command.clone(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        return Err(KubeProxyError::Failed {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The iptables save/restore pairs present, per family: the `-legacy-` and `-nft-` variants,
/// or else the plain `iptables-save` with its backend from `--version`.
fn iptables_tools() -> Result<Vec<Iptables>, KubeProxyError> {
    let mut tools = Vec::new();
    for family in IpFamily::ALL {
        let p = family.iptables();
        let before = tools.len();
        for backend in [IptablesBackend::Legacy, IptablesBackend::Nft] {
            let b = backend.suffix();
            if let (Some(save), Some(restore)) = (
                which(&format!("{p}-{b}-save")),
                which(&format!("{p}-{b}-restore")),
            ) {
                tools.push(Iptables {
                    family,
                    backend,
                    save,
                    restore,
                });
            }
        }
        if tools.len() > before {
            continue;
        }
        if let (Some(save), Some(restore)) =
            (which(&format!("{p}-save")), which(&format!("{p}-restore")))
        {
            let version = run(&save, &["--version"], None)?;
            let backend = if version.contains("nf_tables") {
                IptablesBackend::Nft
            } else {
                IptablesBackend::Legacy
            };
            tools.push(Iptables {
                family,
                backend,
                save,
                restore,
            });
        }
    }
    Ok(tools)
}

/// Whether network interface `name` exists in the calling thread's network namespace.
fn link_exists(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: a valid NUL-terminated string; if_nametoindex only reads it.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// Finds kube-proxy's state in the calling thread's network namespace (see the module docs).
pub fn find() -> Result<KubeProxyState, KubeProxyError> {
    let mut state = KubeProxyState::default();
    for tool in iptables_tools()? {
        let text = run(&tool.save, &[], None)?;
        let tables = parse_iptables_save(&text).map_err(|reason| KubeProxyError::Parse {
            command: tool.save.display().to_string(),
            reason,
        })?;
        state.iptables.extend(
            tables
                .iter()
                .filter_map(|t| IptablesTable::from_saved(&tool, t)),
        );
        state.looked_in.push(tool.save.display().to_string());
    }
    if let Some(nft) = which("nft") {
        let text = run(&nft, &["list", "tables"], None)?;
        state.nft = kube_proxy_nft_tables(&text);
        state
            .looked_in
            .push(format!("{} list tables", nft.display()));
    }
    state.ipvs = link_exists(IPVS_LINK);
    Ok(state)
}

/// Removes what [`find`] found (see the module docs); refuses IPVS mode.
pub fn remove(state: &KubeProxyState) -> Result<Removed, KubeProxyError> {
    if state.ipvs {
        return Err(KubeProxyError::Ipvs);
    }
    let mut removed = Removed::default();
    for t in &state.iptables {
        let input = t.restore_input();
        if input.is_empty() {
            continue;
        }
        run(&t.tool.restore, &["-w", "5", "--noflush"], Some(&input)).map_err(|e| {
            KubeProxyError::Restore {
                family: t.tool.family,
                backend: t.tool.backend,
                table: t.table.clone(),
                chains: t.chain_names(),
                jumps: t.jumps.len(),
                source: Box::new(e),
            }
        })?;
        removed.tables += 1;
        removed.chains += t.chains.len();
        removed.rules += t.chains.iter().map(|c| c.rules).sum::<usize>();
        removed.jump_rules += t.jumps.len();
    }
    if !state.nft.is_empty() {
        let nft = which("nft").unwrap_or_else(|| PathBuf::from("nft"));
        for t in &state.nft {
            run(&nft, &["delete", "table", t.family.nft(), &t.name], None).map_err(|e| {
                KubeProxyError::NftDelete {
                    family: t.family.nft(),
                    table: t.name.clone(),
                    source: Box::new(e),
                }
            })?;
            removed.nft_tables += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// iptables-nft-save of an IPv4 node after kube-proxy 1.35's full sync: a ClusterIP
    /// service with two endpoints, a NodePort service with one, kubelet's chains, and a CNI
    /// chain that does not touch kube-proxy's (written by hand from proxier.go's rule shapes).
    const SAVE_V4: &str = r#"# Generated by iptables-nft-save v1.8.9 (nf_tables) on Sat Dec  5 18:00:00 2026
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
# Completed on Sat Dec  5 18:00:00 2026
# Generated by iptables-nft-save v1.8.9 (nf_tables) on Sat Dec  5 18:00:00 2026
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:CNI-FORWARD - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m comment --comment "CNI firewall plugin rules" -j CNI-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
# Completed on Sat Dec  5 18:00:00 2026
# Generated by iptables-nft-save v1.8.9 (nf_tables) on Sat Dec  5 18:00:00 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-EXT-7EJNTS7AENER2WLV - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-OYPFS5VJICHGATKP - [0:0]
:KUBE-SEP-UKSFD7AGPMPPLUHC - [0:0]
:KUBE-SEP-C6EBXVWJJZMIWKLZ - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SVC-7EJNTS7AENER2WLV - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -m comment --comment "flannel masq" -j MASQUERADE --random-fully
-A KUBE-EXT-7EJNTS7AENER2WLV -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-7EJNTS7AENER2WLV -j KUBE-SVC-7EJNTS7AENER2WLV
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -d 127.0.0.0/8 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -m nfacct --nfacct-name  localhost_nps_accepted_pkts -j KUBE-EXT-7EJNTS7AENER2WLV
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-EXT-7EJNTS7AENER2WLV
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-OYPFS5VJICHGATKP -s 10.244.1.5/32 -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-OYPFS5VJICHGATKP -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination 10.244.1.5:53
-A KUBE-SEP-UKSFD7AGPMPPLUHC -s 10.244.2.7/32 -m comment --comment "kube-system/kube-dns:dns" -j KUBE-MARK-MASQ
-A KUBE-SEP-UKSFD7AGPMPPLUHC -p udp -m comment --comment "kube-system/kube-dns:dns" -m udp -j DNAT --to-destination 10.244.2.7:53
-A KUBE-SEP-C6EBXVWJJZMIWKLZ -s 10.244.1.9/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-C6EBXVWJJZMIWKLZ -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.1.9:8080
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-NPX46M4PTMTKRN6Y
-A KUBE-SERVICES -d 10.96.0.80/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-7EJNTS7AENER2WLV
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-NPX46M4PTMTKRN6Y ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-MARK-MASQ
-A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment "kube-system/kube-dns:dns -> 10.244.1.5:53" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-OYPFS5VJICHGATKP
-A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment "kube-system/kube-dns:dns -> 10.244.2.7:53" -j KUBE-SEP-UKSFD7AGPMPPLUHC
-A KUBE-SVC-7EJNTS7AENER2WLV ! -s 10.244.0.0/16 -d 10.96.0.80/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-7EJNTS7AENER2WLV -m comment --comment "default/web:http -> 10.244.1.9:8080" -j KUBE-SEP-C6EBXVWJJZMIWKLZ
COMMIT
# Completed on Sat Dec  5 18:00:00 2026
"#;

    fn tool() -> Iptables {
        Iptables {
            family: IpFamily::V4,
            backend: IptablesBackend::Nft,
            save: "iptables-nft-save".into(),
            restore: "iptables-nft-restore".into(),
        }
    }

    fn found(text: &str) -> Vec<IptablesTable> {
        parse_iptables_save(text)
            .unwrap()
            .iter()
            .filter_map(|t| IptablesTable::from_saved(&tool(), t))
            .collect()
    }

    fn names(t: &IptablesTable) -> Vec<&str> {
        t.chains.iter().map(|c| c.name.as_str()).collect()
    }

    #[test]
    fn parses_tables_chains_rules_and_targets() {
        let tables = parse_iptables_save(SAVE_V4).unwrap();
        let names: Vec<&str> = tables.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["mangle", "filter", "nat"]);
        let nat = &tables[2];
        assert_eq!(nat.chains.iter().filter(|c| c.builtin).count(), 4);
        assert_eq!(nat.chains.len(), 16);
        assert_eq!(nat.rules.len(), 26);
        let masq = nat
            .rules
            .iter()
            .find(|r| r.spec.contains("flannel masq"))
            .unwrap();
        assert_eq!(masq.chain, "POSTROUTING");
        assert_eq!(masq.target.as_deref(), Some("MASQUERADE"));
        let dnat = nat
            .rules
            .iter()
            .find(|r| r.spec.contains("DNAT --to-destination 10.244.1.9:8080"))
            .unwrap();
        assert_eq!(dnat.target.as_deref(), Some("DNAT"));
    }

    #[test]
    fn finds_kube_proxy_chains_and_jumps_but_not_kubelets() {
        let t = found(SAVE_V4);
        let tables: Vec<&str> = t.iter().map(|t| t.table.as_str()).collect();
        assert_eq!(tables, ["mangle", "filter", "nat"]);
        assert_eq!(names(&t[0]), ["KUBE-PROXY-CANARY"]);
        assert!(t[0].jumps.is_empty());
        assert_eq!(
            names(&t[1]),
            [
                "KUBE-EXTERNAL-SERVICES",
                "KUBE-FORWARD",
                "KUBE-NODEPORTS",
                "KUBE-PROXY-CANARY",
                "KUBE-PROXY-FIREWALL",
                "KUBE-SERVICES"
            ]
        );
        // 9 jumps from INPUT/FORWARD/OUTPUT; kubelet's KUBE-FIREWALL jumps and the CNI jump stay.
        assert_eq!(t[1].jumps.len(), 9);
        assert!(t[1].jumps.iter().all(|j| j.target != "KUBE-FIREWALL"));
        assert_eq!(t[1].chains[1].rules, 3);
        let nat = &t[2];
        assert_eq!(nat.chains.len(), 11);
        assert!(!names(nat).contains(&"KUBE-KUBELET-CANARY"));
        assert_eq!(nat.jumps.len(), 3);
        assert_eq!(nat.chains.iter().map(|c| c.rules).sum::<usize>(), 22);
        assert!(nat.kept.is_empty());
    }

    #[test]
    fn restore_input_flushes_unlinks_and_deletes_in_one_transaction() {
        let t = found(SAVE_V4);
        let filter = t[1].restore_input();
        let lines: Vec<&str> = filter.lines().collect();
        assert_eq!(lines[0], "*filter");
        assert_eq!(lines[1], ":KUBE-EXTERNAL-SERVICES - [0:0]");
        assert!(lines.contains(
            &"-D INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS"
        ));
        assert_eq!(lines.iter().filter(|l| l.starts_with("-D ")).count(), 9);
        assert_eq!(lines.iter().filter(|l| l.starts_with("-X ")).count(), 6);
        assert_eq!(*lines.last().unwrap(), "COMMIT");
        // Deleting a chain comes after every flush and unlink.
        let first_x = lines.iter().position(|l| l.starts_with("-X ")).unwrap();
        assert!(lines[..first_x].iter().all(|l| !l.starts_with("-X ")));
        assert!(
            lines[first_x..]
                .iter()
                .all(|l| l.starts_with("-X ") || *l == "COMMIT")
        );
        assert!(!filter.contains("KUBE-FIREWALL ") && !filter.contains("KUBELET"));
    }

    #[test]
    fn chain_referenced_by_another_component_is_kept() {
        let text = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:CNI-HOSTPORT-SETMARK - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SERVICES - [0:0]\n\
            -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
            -A CNI-HOSTPORT-SETMARK -m comment --comment \"CNI portfwd masquerade mark\" -j KUBE-MARK-MASQ\n\
            -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\nCOMMIT\n";
        let t = found(text);
        assert_eq!(names(&t[0]), ["KUBE-SERVICES"]);
        assert_eq!(
            t[0].kept,
            [KeptChain {
                name: "KUBE-MARK-MASQ".into(),
                referenced_by: "CNI-HOSTPORT-SETMARK".into()
            }]
        );
        assert!(!t[0].restore_input().contains("KUBE-MARK-MASQ"));
    }

    #[test]
    fn nothing_of_kube_proxys_is_none() {
        let text = "*filter\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        assert!(found(text).is_empty());
        let state = KubeProxyState {
            looked_in: vec!["iptables-nft-save".into()],
            ..Default::default()
        };
        assert!(state.is_empty());
        assert!(state.summary().starts_with("no kube-proxy rules found"));
    }

    #[test]
    fn quoted_jump_in_a_comment_is_not_a_target() {
        let spec = r#"-m comment --comment "ns/svc:p -j KUBE-SVC-X \"q\"" -j KUBE-SEP-Y"#;
        assert_eq!(rule_target(spec).as_deref(), Some("KUBE-SEP-Y"));
        assert_eq!(rule_target("-g KUBE-SVC-Z").as_deref(), Some("KUBE-SVC-Z"));
        assert_eq!(rule_target("-p tcp --dport 80"), None);
    }

    #[test]
    fn bad_save_output_is_an_error_naming_the_line() {
        assert!(
            parse_iptables_save("*nat\n:FOO - [0:0]\n")
                .unwrap_err()
                .contains("no COMMIT")
        );
        assert!(
            parse_iptables_save("-A FOO -j ACCEPT\n")
                .unwrap_err()
                .contains("line 1")
        );
        assert!(
            parse_iptables_save("*nat\nbogus\nCOMMIT\n")
                .unwrap_err()
                .contains("line 2")
        );
    }

    #[test]
    fn nft_tables_of_kube_proxy() {
        let text = "table ip nat\ntable ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\ntable inet kube-proxy\ntable inet cilium\n";
        assert_eq!(parse_nft_tables(text).len(), 6);
        let t = kube_proxy_nft_tables(text);
        assert_eq!(
            t,
            [
                NftTable {
                    family: IpFamily::V4,
                    name: "kube-proxy".into()
                },
                NftTable {
                    family: IpFamily::V6,
                    name: "kube-proxy".into()
                }
            ]
        );
    }

    #[test]
    fn summary_names_tables_and_ipvs() {
        let state = KubeProxyState {
            iptables: found(SAVE_V4),
            nft: kube_proxy_nft_tables("table ip6 kube-proxy\n"),
            ipvs: true,
            looked_in: vec![],
        };
        let s = state.summary();
        assert!(!s.contains('\n'));
        assert!(
            s.contains("IPv4 nft nat: 11 chains, 22 rules, 3 jumps"),
            "{s}"
        );
        assert!(s.contains("nft table ip6 kube-proxy"), "{s}");
        assert!(s.contains("IPVS mode"), "{s}");
        assert!(matches!(remove(&state), Err(KubeProxyError::Ipvs)));
    }
}
