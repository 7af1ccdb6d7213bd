//! `lbproxy cleanup --hand-back`: gives a node back to kube-proxy without losing its live
//! connections (a rollback; docs/migration.md).
//!
//! kube-proxy's rules must be back first (its own start writes them): they make the
//! namespace track and NAT, so the entries written here take effect, and they serve every
//! connection made after lbproxy detaches. Then, with lbproxy's programs still attached:
//! 1. the untrack rule is installed ([`super::untrack`]), and the datapath's stack bypass
//!    and untracking of its own flows are turned on: a flow between two pods of this node is
//!    translated and redirected past netfilter both ways, and every other packet of an
//!    lbproxy flow that goes through the node's stack is marked and skips conntrack (an
//!    answer marked on its way in whose flow becomes conntrack's as it crosses the stack is
//!    still translated on its way out: conntrack saw none of it). From then on netfilter
//!    makes no plain entry for lbproxy's translated tuples. And lbproxy makes no new flow
//!    (`CONFIG_F_NEW_TO_CONNTRACK`): a new connection passes untranslated, to kube-proxy's
//!    rules, so that none is left lbproxy's when it detaches;
//! 2. flow by flow: the plain entries netfilter made for those tuples before step 1 are
//!    deleted (they hold the reply tuple the NAT'd entry needs: its creation would fail with
//!    EEXIST), the flow is written as a conntrack entry with its DNAT (and its SNAT), and
//!    the flow becomes conntrack's ([`lbproxy_common::FlowAdopted::Conntrack`]): its
//!    client's packets, and its backend's answers, pass unmarked and untranslated, to that
//!    entry;
//! 3. the caller detaches and unpins (`lbproxy cleanup`), then removes the untrack rule:
//!    every packet then meets netfilter, its entry or kube-proxy's rules.
//!
//! A create that still fails with EEXIST (a plain entry made again between the delete and
//! the create, which step 1 rules out) is retried once after deleting again; a flow that
//! still fails is counted and stays lbproxy's until cleanup, after which its next packet
//! meets kube-proxy's rules.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use lbproxy_common::{
    Addr, CONFIG_F_NEW_TO_CONNTRACK, CONFIG_F_STACK_BYPASS, CONFIG_F_UNTRACK, CONFIG_F_UNTRACK_OWN,
    FLOW_ADOPTED_CONNTRACK, FLOW_DIR_FORWARD, FLOW_STATE_SYN_SENT, FlowKeyOf, FlowValueOf,
    IPPROTO_TCP,
};

use super::kube_proxy;
use crate::bpf::PinnedMaps;
use crate::conntrack::{
    Conntrack, Entry, IPS_ASSURED, IPS_CONFIRMED, IPS_DST_NAT, IPS_SEEN_REPLY, IPS_SRC_NAT,
    TCP_CONNTRACK_ESTABLISHED, TCP_CONNTRACK_SYN_SENT, Tuple,
};

/// What a hand-back did.
#[derive(Debug, Default)]
pub struct HandedBack {
    /// Flows written as conntrack entries.
    pub written: usize,
    /// Plain entries of netfilter's deleted to make room for them.
    pub plain_deleted: usize,
    /// Flows that could not be written (each one logged).
    pub failed: usize,
}

/// Steps 1 and 2 (see the module doc). The caller detaches and unpins after it.
pub fn hand_back(bpffs_dir: &Path) -> anyhow::Result<HandedBack> {
    let state = kube_proxy::find().context("looking for kube-proxy's rules")?;
    if state.iptables.is_empty() && state.nft.is_empty() {
        anyhow::bail!(
            "--hand-back: kube-proxy's rules are not in place ({}): start kube-proxy on this \
             node first, then hand back (docs/migration.md)",
            state.summary()
        );
    }
    let mut maps = PinnedMaps::open(bpffs_dir)?;
    let rule = super::untrack::install()?;
    tracing::info!("hand-back: untrack rule installed ({rule})");
    maps.set_config_flags(
        CONFIG_F_STACK_BYPASS | CONFIG_F_UNTRACK | CONFIG_F_UNTRACK_OWN | CONFIG_F_NEW_TO_CONNTRACK,
        true,
    )
    .context("turning the stack bypass, untracking and new flows to conntrack on")?;
    let mut ct = Conntrack::open().context("opening ctnetlink")?;
    let mut done = HandedBack::default();
    // A flow a packet made on another CPU as the flags changed is caught by the second
    // pass; a flow that failed is tried again, and counted as failed if the last pass
    // failed it.
    for pass in 0..3 {
        let before = done.written;
        done.failed = 0;
        hand_back_family(&mut ct, &mut maps.flows, &mut done)?;
        hand_back_family(&mut ct, &mut maps.flows6, &mut done)?;
        if pass > 0 && done.written == before {
            break;
        }
    }
    Ok(done)
}

fn hand_back_family<A: Addr>(
    ct: &mut Conntrack,
    flows: &mut aya::maps::HashMap<aya::maps::MapData, FlowKeyOf<A>, FlowValueOf<A>>,
    done: &mut HandedBack,
) -> anyhow::Result<()>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    let forward: Vec<(FlowKeyOf<A>, FlowValueOf<A>)> = flows
        .iter()
        .flatten()
        .filter(|(k, v)| k.dir == FLOW_DIR_FORWARD && v.adopted != FLOW_ADOPTED_CONNTRACK)
        .collect();
    for (k, v) in forward {
        let e = entry_of(&k, &v);
        let plain = [
            Tuple {
                dst: e.reply.src,
                dst_port: e.reply.src_port,
                ..e.orig
            },
            e.reply,
        ];
        let mut written = false;
        for _try in 0..2 {
            for p in &plain {
                if ct.delete(p, 0).with_context(|| format!("deleting {p}"))? {
                    done.plain_deleted += 1;
                }
            }
            match ct.create(&e) {
                Ok(()) => {
                    written = true;
                    break;
                }
                Err(err) if err.errno() == Some(libc::EEXIST) => continue,
                Err(err) => {
                    tracing::warn!("hand-back: flow {}: {err}", e.orig);
                    break;
                }
            }
        }
        if !written {
            done.failed += 1;
            continue;
        }
        done.written += 1;
        for key in [k, k.partner(&v)] {
            if let Ok(mut half) = flows.get(&key, 0) {
                half.adopted = FLOW_ADOPTED_CONNTRACK;
                flows
                    .insert(key, half, 0)
                    .with_context(|| format!("flow {}", e.orig))?;
            }
        }
    }
    Ok(())
}

/// The conntrack entry a forward half stands for: client -> frontend, translated to the
/// backend, and from the node's address and port when source-NATed. Timeouts as kube-proxy
/// sets the kernel's (established TCP 24 h) and the kernel's defaults (120 s).
fn entry_of<A: Addr>(k: &FlowKeyOf<A>, v: &FlowValueOf<A>) -> Entry {
    let at = |a: A, port_be: u16| SocketAddr::new(a.ip(), u16::from_be(port_be));
    let (client, frontend) = (at(k.src_addr, k.src_port_be), at(k.dst_addr, k.dst_port_be));
    let (backend, peer) = (
        at(v.nat_addr, v.nat_port_be),
        at(v.peer_addr, v.peer_port_be),
    );
    let tuple = |s: SocketAddr, d: SocketAddr| Tuple {
        src: s.ip(),
        dst: d.ip(),
        src_port: s.port(),
        dst_port: d.port(),
        proto: k.proto,
    };
    let tcp = k.proto == IPPROTO_TCP;
    let syn_sent = tcp && v.state == FLOW_STATE_SYN_SENT;
    let mut status = IPS_CONFIRMED | IPS_DST_NAT;
    if peer != client {
        status |= IPS_SRC_NAT;
    }
    if !syn_sent {
        status |= IPS_SEEN_REPLY | IPS_ASSURED;
    }
    Entry {
        orig: tuple(client, frontend),
        reply: tuple(backend, peer),
        status,
        timeout_s: if tcp && !syn_sent { 86_400 } else { 120 },
        tcp_state: tcp.then_some(if syn_sent {
            TCP_CONNTRACK_SYN_SENT
        } else {
            TCP_CONNTRACK_ESTABLISHED
        }),
        mark: 0,
        zone: 0,
    }
}
