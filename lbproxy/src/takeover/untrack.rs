//! The untrack rule: while a takeover from kube-proxy or a hand-back to it runs, packets the
//! datapath marks with [`UNTRACK_MARK`] (`CONFIG_F_UNTRACK`, see `lbproxy-ebpf/src/untrack.rs`)
//! skip conntrack. Then lbproxy can translate a connection whose NAT'd conntrack entry still
//! exists, into the node's stack, and the entry can be deleted (takeover) or written
//! (hand-back) at any moment: neither ever meets lbproxy's translated tuple, and no packet
//! waits between the two (docs/migration.md).
//!
//! The rule sits in the raw priority of `prerouting` (before conntrack), for both families:
//! with `nft`, the table `inet lbproxy_untrack`; without it, one rule in iptables' and
//! ip6tables' `raw PREROUTING`, with the comment [`COMMENT`]. [`install`] replaces any rule
//! left by an earlier run; [`remove`] removes it and is a no-op when there is none, so
//! `lbproxy cleanup` calls it too.

use std::path::PathBuf;

use anyhow::Context as _;
use lbproxy_common::UNTRACK_MARK;

use super::kube_proxy::{run, which};

/// The nft table (family `inet`).
pub const NFT_TABLE: &str = "lbproxy_untrack";
/// The iptables rule's comment.
pub const COMMENT: &str = "lbproxy: untracked during a takeover or hand-back";

/// How the rule is written on this node.
#[derive(Debug)]
pub enum Untrack {
    Nft(PathBuf),
    Iptables(Vec<PathBuf>),
}

impl Untrack {
    /// `nft` when it is there, else `iptables` and `ip6tables`.
    fn tool() -> anyhow::Result<Untrack> {
        if let Some(nft) = which("nft") {
            return Ok(Untrack::Nft(nft));
        }
        match (which("iptables"), which("ip6tables")) {
            (Some(v4), Some(v6)) => Ok(Untrack::Iptables(vec![v4, v6])),
            (v4, _) => anyhow::bail!(
                "the untrack rule needs nft, or both iptables and ip6tables (one family \
                 without it would stay tracked): nft is not on PATH or in /usr/sbin, /sbin, \
                 and {} is not either",
                if v4.is_none() {
                    "iptables"
                } else {
                    "ip6tables"
                }
            ),
        }
    }

    fn mark() -> String {
        format!("{UNTRACK_MARK:#x}/{UNTRACK_MARK:#x}")
    }
}

/// Installs the rule (replacing one left behind). Returns how it was written, for the log.
pub fn install() -> anyhow::Result<String> {
    match Untrack::tool()? {
        Untrack::Nft(nft) => {
            // One transaction: an old table, if any, goes, and the new one comes.
            let script = format!(
                "table inet {NFT_TABLE} {{}}\ndelete table inet {NFT_TABLE}\n\
                 table inet {NFT_TABLE} {{\n  chain prerouting {{\n    type filter hook \
                 prerouting priority raw; policy accept;\n    meta mark & {UNTRACK_MARK:#x} == \
                 {UNTRACK_MARK:#x} notrack\n  }}\n}}\n"
            );
            run(&nft, &["-f", "-"], Some(&script)).with_context(|| {
                format!("installing the untrack rule (nft table inet {NFT_TABLE})")
            })?;
            Ok(format!("nft table inet {NFT_TABLE}"))
        }
        Untrack::Iptables(tools) => {
            remove_iptables(&tools);
            for t in &tools {
                let mut args = vec!["-w", "5", "-t", "raw", "-I", "PREROUTING"];
                let mark = Untrack::mark();
                args.extend(rule_spec(&mark));
                run(t, &args, None).with_context(|| {
                    format!(
                        "installing the untrack rule ({} -t raw PREROUTING)",
                        t.display()
                    )
                })?;
            }
            Ok("iptables and ip6tables raw PREROUTING".to_string())
        }
    }
}

/// Removes the rule; nothing to remove is no error. Returns whether one was there.
pub fn remove() -> anyhow::Result<bool> {
    match Untrack::tool()? {
        Untrack::Nft(nft) => {
            let tables = run(&nft, &["list", "tables", "inet"], None)
                .context("listing nft tables (the untrack rule)")?;
            let present = tables
                .lines()
                .any(|l| l.split_whitespace().eq(["table", "inet", NFT_TABLE]));
            if present {
                run(&nft, &["delete", "table", "inet", NFT_TABLE], None).with_context(|| {
                    format!("removing the untrack rule (nft table inet {NFT_TABLE})")
                })?;
            }
            Ok(present)
        }
        Untrack::Iptables(tools) => Ok(remove_iptables(&tools)),
    }
}

/// Deletes every copy of the iptables rule; whether there was one.
fn remove_iptables(tools: &[PathBuf]) -> bool {
    let mark = Untrack::mark();
    let mut any = false;
    for t in tools {
        let mut args = vec!["-w", "5", "-t", "raw", "-D", "PREROUTING"];
        args.extend(rule_spec(&mark));
        while run(t, &args, None).is_ok() {
            any = true;
        }
    }
    any
}

fn rule_spec(mark: &str) -> [&str; 11] {
    [
        "-m",
        "mark",
        "--mark",
        mark,
        "-m",
        "comment",
        "--comment",
        COMMENT,
        "-j",
        "CT",
        "--notrack",
    ]
}
