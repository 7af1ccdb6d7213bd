//! `lbproxy cleanup --hand-back`: gives a node back to kube-proxy without losing its live
//! connections (a rollback; docs/migration.md).
//!
//! kube-proxy's rules must be back first (its own start writes them): they make the
//! namespace track and NAT, so the entries written here take effect, and they serve every
//! connection made after lbproxy detaches. Then, with lbproxy's programs still attached:
//! 1. the datapath's stack bypass is turned on: a flow between two pods of this node is then
//!    translated and redirected past netfilter both ways, so netfilter stops making plain
//!    entries for it (a source-NATed flow from outside already goes past it both ways);
//! 2. flow by flow: the plain entries netfilter made for lbproxy's translated tuples are
//!    deleted (they hold the reply tuple the NAT'd entry needs: its creation would fail with
//!    EEXIST), the flow is written as a conntrack entry with its DNAT (and its SNAT), and
//!    the flow becomes conntrack's ([`lbproxy_common::FlowAdopted::Conntrack`]): its
//!    client's packets pass untranslated, to that entry;
//! 3. the caller detaches and unpins (`lbproxy cleanup`): every packet then meets netfilter,
//!    its entry or kube-proxy's rules.
//!
//! A flow whose packets go through the node's stack (to a backend on another node, or on a
//! bridged pod network) can have a packet translated by lbproxy between steps 2's delete and
//! create: netfilter then makes its plain entry again, and the create fails with EEXIST. It
//! is retried once after deleting again; a flow that still fails is counted and stays
//! lbproxy's until cleanup, after which its next packet meets kube-proxy's rules.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use lbproxy_common::{
    Addr, CONFIG_F_STACK_BYPASS, FLOW_ADOPTED_CONNTRACK, FLOW_DIR_FORWARD, FLOW_STATE_SYN_SENT,
    FlowKeyOf, FlowValueOf, IPPROTO_TCP,
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
    let mut config = maps.config.get(&0, 0).context("reading LB_CONFIG_V1")?;
    config.flags |= CONFIG_F_STACK_BYPASS;
    maps.config
        .set(0, config, 0)
        .context("turning the stack bypass on (LB_CONFIG_V1)")?;
    let mut ct = Conntrack::open().context("opening ctnetlink")?;
    let mut done = HandedBack::default();
    hand_back_family(&mut ct, &mut maps.flows, &mut done)?;
    hand_back_family(&mut ct, &mut maps.flows6, &mut done)?;
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
