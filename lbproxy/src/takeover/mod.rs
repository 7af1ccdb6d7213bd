//! Taking a node over from kube-proxy without losing a connection (`lbproxy run --takeover`),
//! and leaving its rules alone without it.
//!
//! The order, and why no packet is ever left with neither path (docs/migration.md):
//! 1. [`prepare`], after the programs are attached and before the first sync (no frontend
//!    is served yet, so every packet still goes to kube-proxy's rules): kube-proxy's rules
//!    are found ([`kube_proxy::find`]; IPVS is refused), the datapath passes TCP segments
//!    other than SYN of no known flow to conntrack (`CONFIG_F_STRAYS_TO_CONNTRACK`), and
//!    every conntrack entry its rules destination-NATed is written into lbproxy's flow table
//!    as a flow that conntrack still translates ([`lbproxy_common::FlowAdopted::Conntrack`]):
//!    its client's packets pass untranslated. Once the first sync serves the frontends, new
//!    flows are lbproxy's and the adopted ones are still the kernel's: each packet has
//!    exactly one path.
//! 2. [`Takeover::complete`], after the first sync, while `/healthz` is held at 503: a second
//!    dump adopts the connections kube-proxy's rules opened since the first (their segments
//!    passed to conntrack meanwhile), and the strays flag goes off. Then the untrack rule is
//!    installed and the datapath marks for it every packet of its flows that it sends into
//!    the node's stack ([`untrack`], `CONFIG_F_UNTRACK`), and each flow lbproxy can carry on
//!    gets its service and backend ids and becomes
//!    [`lbproxy_common::FlowAdopted::Handover`]: lbproxy translates its client's packets,
//!    redirected past netfilter (into the backend's pod, or out of the node for a
//!    source-NATed flow) or marked into the stack; its conntrack entry sees none of them.
//! 3. kube-proxy's rules are removed. Only new connections used them, and those are
//!    lbproxy's since step 1; the adopted entries would keep translating without the rules.
//! 4. The handed-over flows' conntrack entries are deleted, then the flows become lbproxy's
//!    own, and the untrack rule goes. Each packet meanwhile is translated by lbproxy and
//!    never meets the entry, so the moment of the delete does not matter. Deleting before
//!    owning is what keeps the backend: an own flow's packets are tracked again, and its
//!    translated tuple would meet the entry's reply tuple in netfilter, which would then
//!    move the connection's source port.
//!
//! Without `--takeover`, step 1 and the second dump run: kube-proxy's flows stay the
//! kernel's until they end, and one warning says that kube-proxy's rules are present.

pub mod adopt;
pub mod hand_back;
pub mod kube_proxy;
pub mod untrack;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lbproxy_common::{
    Addr, CONFIG_F_STRAYS_TO_CONNTRACK, CONFIG_F_UNTRACK, FLOW_ADOPTED_CONNTRACK,
    FLOW_ADOPTED_HANDOVER, FLOW_ADOPTED_OWN, FLOW_DIR_FORWARD, FlowKeyOf, FlowValueOf,
    IPPROTO_SCTP, IPPROTO_TCP, NODE_ADDR_F_NODEPORT, NODE_ADDR_F_SNAT, NodeAddr, PodAddr,
    SCOPE_DEFAULT, SCOPE_INTERNAL, SVC_F_SPLIT_SCOPE, SVC_KIND_CLUSTER_IP, ServiceKeyOf,
    ServiceValue, map_names,
};

use self::adopt::{Adopted, Decision, Facts, FromIp, Left};
use crate::bpf::{PinnedMaps, flow_gc::Timeouts, open_pinned};
use crate::conntrack::{Conntrack, Family as CtFamily};
use crate::telemetry::{Metrics, TakeoverLabel, TakeoverLeftLabel};

/// What [`prepare`] found and wrote, for [`Takeover::complete`].
pub struct Takeover {
    /// `--takeover`: without it, [`Takeover::complete`] only catches up with the second dump.
    take: bool,
    kube_proxy: kube_proxy::KubeProxyState,
    flows: Dump,
    /// The flow table's timeouts (`--conntrack-*`), which adopted flows' idle clocks follow.
    timeouts: Timeouts,
    started: Instant,
}

/// kube-proxy's flows in one dump of both families' conntrack tables.
#[derive(Default)]
struct Dump {
    v4: Vec<Adopted<[u8; 4]>>,
    v6: Vec<Adopted<[u8; 16]>>,
    left: BTreeMap<Left, u64>,
    /// kube-proxy's entries of closed TCP connections: deleted with the adopted ones.
    closed: Vec<(crate::conntrack::Tuple, u16)>,
}

impl Dump {
    /// Dumps conntrack and sorts its entries ([`adopt::flow_of`]).
    fn take(timeouts: &Timeouts) -> anyhow::Result<Dump> {
        let mut ct = Conntrack::open().context("opening ctnetlink")?;
        let local = local_addresses();
        let now = crate::bpf::flow_gc::monotonic_ns();
        let mut d = Dump::default();
        let entries = ct.dump(CtFamily::V4).context("dumping conntrack (IPv4)")?;
        d.collect(&entries, now, timeouts, &local);
        let entries = ct.dump(CtFamily::V6).context("dumping conntrack (IPv6)")?;
        d.collect(&entries, now, timeouts, &local);
        Ok(d)
    }

    fn collect(
        &mut self,
        entries: &[crate::conntrack::Entry],
        now: u64,
        timeouts: &Timeouts,
        local: &HashSet<IpAddr>,
    ) {
        for e in entries {
            let is_local = |ip: IpAddr| local.contains(&ip);
            if let Some(r) = adopt::flow_of::<[u8; 4]>(e, now, timeouts, is_local) {
                let r = r.map(|a| self.v4.push(a));
                self.sort(e, r);
            } else if let Some(r) = adopt::flow_of::<[u8; 16]>(e, now, timeouts, is_local) {
                let r = r.map(|a| self.v6.push(a));
                self.sort(e, r);
            }
        }
    }

    /// Counts an entry left to conntrack, or keeps a closed one's tuple.
    fn sort(&mut self, e: &crate::conntrack::Entry, r: Result<(), Left>) {
        match r {
            Ok(()) => {}
            Err(Left::Closed) => self.closed.push((e.orig, e.zone)),
            Err(l) => *self.left.entry(l).or_default() += 1,
        }
    }

    /// Writes every adopted flow, as conntrack's.
    fn write(&self, maps: &mut PinnedMaps) -> anyhow::Result<()> {
        write_all(&mut maps.flows, &self.v4).context("writing adopted flows (LB_FLOWS_V3)")?;
        write_all(&mut maps.flows6, &self.v6).context("writing adopted flows (LB_FLOWS6_V1)")
    }
}

type FlowMap<A> = BpfHashMap<MapData, FlowKeyOf<A>, FlowValueOf<A>>;

/// Step 1 (see the module doc). `take`: `--takeover`. Returns what [`Takeover::complete`]
/// finishes (with or without `take`), or `None` when kube-proxy's rules are not there.
pub fn prepare(
    bpffs_dir: &Path,
    take: bool,
    timeouts: &Timeouts,
) -> anyhow::Result<Option<Takeover>> {
    let started = Instant::now();
    finish_earlier(bpffs_dir)?;
    let state = kube_proxy::find().context("looking for kube-proxy's rules")?;
    if state.ipvs && take {
        anyhow::bail!(
            "--takeover: kube-proxy runs in IPVS mode here (link {}): lbproxy takes over only \
             from kube-proxy's iptables and nftables modes; switch kube-proxy to one of those, \
             or start lbproxy without --takeover (docs/migration.md)",
            kube_proxy::IPVS_LINK
        );
    }
    if state.is_empty() {
        if take {
            tracing::info!("takeover: {}; nothing to take over", state.summary());
        }
        return Ok(None);
    }
    if !take {
        tracing::warn!(
            "kube-proxy's rules are present ({}); lbproxy translates before them and leaves \
             them, and the flows they translated, to kube-proxy and conntrack; --takeover would \
             adopt those flows and remove the rules (docs/migration.md)",
            state.summary()
        );
    }
    let mut maps = PinnedMaps::open(bpffs_dir)?;
    // Until the second dump (`Takeover::catch_up`), a connection kube-proxy's rules open
    // after this one is known to conntrack alone: its packets pass to it.
    maps.set_config_flags(CONFIG_F_STRAYS_TO_CONNTRACK, true)
        .context("passing unknown connections to conntrack")?;
    let flows = Dump::take(timeouts)?;
    flows.write(&mut maps)?;
    tracing::info!(
        ipv4 = flows.v4.len(),
        ipv6 = flows.v6.len(),
        take,
        "kube-proxy's flows written as conntrack's, before any frontend is served"
    );
    let t = Takeover {
        take,
        kube_proxy: state,
        flows,
        timeouts: *timeouts,
        started,
    };
    Ok(Some(t))
}

impl Takeover {
    /// Whether this is `--takeover` (else [`Takeover::complete`] only catches up).
    pub fn takes(&self) -> bool {
        self.take
    }

    /// Steps 2 to 4 (see the module doc), once the first sync is in the maps. Logs one
    /// line with what was adopted, left and removed, and counts it in `metrics`.
    pub fn complete(mut self, bpffs_dir: &Path, metrics: &Metrics) -> anyhow::Result<()> {
        let mut maps = PinnedMaps::open(bpffs_dir)?;
        let caught = self.catch_up(&mut maps);
        // Every connection kube-proxy's rules opened is now a flow (only new connections
        // used the rules, and those are lbproxy's since the first sync).
        maps.set_config_flags(CONFIG_F_STRAYS_TO_CONNTRACK, false)
            .context("balancing unknown connections again")?;
        if !self.take {
            return match caught {
                Ok(n) => {
                    tracing::info!(
                        "kube-proxy's flows opened since the first dump written as conntrack's: {n}"
                    );
                    Ok(())
                }
                Err(e) => {
                    // Only those connections' next packets are balanced anew; lbproxy serves.
                    tracing::warn!("catching up with kube-proxy's flows: {e:#}");
                    Ok(())
                }
            };
        }
        caught?;
        let rule = untrack::install()
            .map_err(|e| e.context("the takeover changed nothing of kube-proxy's"))?;
        maps.set_config_flags(CONFIG_F_UNTRACK, true)
            .context("turning untracking on")?;
        tracing::info!("takeover: untrack rule installed ({rule})");
        let members = member_index(&maps);
        let node4: BpfHashMap<MapData, [u8; 4], NodeAddr> =
            open_pinned(bpffs_dir, map_names::NODE_ADDRS, Map::HashMap)?;
        let node6: BpfHashMap<MapData, [u8; 16], NodeAddr> =
            open_pinned(bpffs_dir, map_names::NODE_ADDRS6, Map::HashMap)?;
        let pods4: BpfHashMap<MapData, [u8; 4], PodAddr> =
            open_pinned(bpffs_dir, map_names::POD_ADDRS, Map::HashMap)?;
        let is_pod4 = |a: &[u8; 4]| pods4.get(a, 0).is_ok();
        let v4 = Family {
            flows: &mut maps.flows,
            services: &maps.services,
            node_addrs: &node4,
            is_local_pod: &is_pod4,
            members: &members,
        }
        .hand_over(std::mem::take(&mut self.flows.v4), &mut self.flows.left)
        .context("handing IPv4 flows over")?;
        let v6 = Family {
            flows: &mut maps.flows6,
            services: &maps.services6,
            node_addrs: &node6,
            // No map of this node's IPv6 pod addresses: a masqueraded IPv6 flow to a local
            // pod is taken for one to another node (docs/migration.md).
            is_local_pod: &|_: &[u8; 16]| false,
            members: &members,
        }
        .hand_over(std::mem::take(&mut self.flows.v6), &mut self.flows.left)
        .context("handing IPv6 flows over")?;
        test_hold("after handing the flows over, before kube-proxy's rules and entries go");
        let removed =
            kube_proxy::remove(&self.kube_proxy).context("removing kube-proxy's rules")?;
        let mut ct = Conntrack::open().context("opening ctnetlink")?;
        let deleted4 = delete_entries(&mut ct, &v4)?;
        let deleted6 = delete_entries(&mut ct, &v6)?;
        let closed = ct
            .delete_many(&self.flows.closed)
            .context("deleting kube-proxy's entries of closed connections")?
            .into_iter()
            .filter(|d| *d)
            .count();
        test_hold("after deleting kube-proxy's entries, before owning the flows");
        own(&mut maps.flows, &v4)?;
        own(&mut maps.flows6, &v6)?;
        maps.set_config_flags(CONFIG_F_UNTRACK, false)
            .context("turning untracking off")?;
        if let Err(e) = untrack::remove() {
            // It untracks nothing from now on (no packet is marked): left, not fatal.
            tracing::warn!(
                "takeover: removing the untrack rule: {e:#}; `lbproxy cleanup` removes it"
            );
        }
        count(metrics, &v4, "ipv4");
        count(metrics, &v6, "ipv6");
        for (l, n) in &self.flows.left {
            metrics
                .takeover_left
                .get_or_create(&TakeoverLeftLabel { reason: l.reason() })
                .inc_by(*n);
        }
        let left: Vec<String> = self
            .flows
            .left
            .iter()
            .map(|(l, n)| format!("{} {n}", l.reason()))
            .collect();
        tracing::info!(
            "takeover: adopted {} flows (IPv4 {}, IPv6 {}), left {} to conntrack ({}), removed \
             {} iptables chains with {} rules and {} jumps in {} tables and {} nft tables, \
             deleted {} conntrack entries of those flows and {} of closed connections, in {} \
             ms",
            v4.len() + v6.len(),
            v4.len(),
            v6.len(),
            self.flows.left.values().sum::<u64>(),
            if left.is_empty() {
                "none".to_string()
            } else {
                left.join(", ")
            },
            removed.chains,
            removed.rules,
            removed.jump_rules,
            removed.tables,
            removed.nft_tables,
            deleted4 + deleted6,
            closed,
            self.started.elapsed().as_millis()
        );
        Ok(())
    }
}

impl Takeover {
    /// The entries kube-proxy's rules made between [`prepare`]'s dump and the first sync
    /// (connections opened meanwhile), and those of connections closed since: written as
    /// conntrack's and added to what is handed over, or deleted with the others.
    fn catch_up(&mut self, maps: &mut PinnedMaps) -> anyhow::Result<usize> {
        let mut new = Dump::take(&self.timeouts)?;
        let f = &mut self.flows;
        let known4: HashSet<_> = f.v4.iter().map(|a| a.forward_key).collect();
        let known6: HashSet<_> = f.v6.iter().map(|a| a.forward_key).collect();
        new.v4.retain(|a| !known4.contains(&a.forward_key));
        new.v6.retain(|a| !known6.contains(&a.forward_key));
        new.write(maps)?;
        let added = new.v4.len() + new.v6.len();
        f.v4.extend(new.v4);
        f.v6.extend(new.v6);
        let known: HashSet<_> = f.closed.iter().copied().collect();
        f.closed
            .extend(new.closed.into_iter().filter(|c| !known.contains(c)));
        Ok(added)
    }
}

/// One family's maps, as [`Takeover::complete`] reads and writes them.
struct Family<'a, A: Addr> {
    flows: &'a mut FlowMap<A>,
    services: &'a BpfHashMap<MapData, ServiceKeyOf<A>, ServiceValue>,
    node_addrs: &'a BpfHashMap<MapData, A, NodeAddr>,
    is_local_pod: &'a dyn Fn(&A) -> bool,
    members: &'a HashMap<(u32, IpAddr, u16), u32>,
}

impl<A: FromIp> Family<'_, A>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
    ServiceKeyOf<A>: aya::Pod,
    A: aya::Pod,
{
    /// Step 2: each flow decided ([`adopt::decide`]); those lbproxy carries on are written
    /// handed over and returned; the others are counted in `left` (their halves stay
    /// conntrack's, or are removed when the entry's destination is no frontend).
    fn hand_over(
        &mut self,
        flows: Vec<Adopted<A>>,
        left: &mut BTreeMap<Left, u64>,
    ) -> anyhow::Result<Vec<Adopted<A>>> {
        let mut handed = Vec::with_capacity(flows.len());
        for mut a in flows {
            let from_pod = (self.is_local_pod)(&a.forward_key.src_addr);
            let frontend = self.frontend(&a.forward_key, from_pod);
            let backend = (a.reply_tuple.src, a.reply_tuple.src_port);
            let facts = Facts {
                frontend: frontend.map(|v| (v.svc_id, v.kind == SVC_KIND_CLUSTER_IP)),
                member: frontend
                    .and_then(|v| self.members.get(&(v.svc_id, backend.0, backend.1)).copied()),
                peer_is_snat_address: self
                    .node_addrs
                    .get(&a.forward.peer_addr, 0)
                    .is_ok_and(|n| n.flags & NODE_ADDR_F_SNAT != 0),
                backend_is_local_pod: (self.is_local_pod)(&a.forward.nat_addr),
            };
            match adopt::decide(a.masqueraded(), &facts) {
                Decision::Adopt { svc_id, backend_id } => {
                    a.with(FLOW_ADOPTED_HANDOVER, svc_id, backend_id);
                    write(self.flows, &a).with_context(|| format!("flow {}", a.orig))?;
                    handed.push(a);
                }
                Decision::Keep(l) => *left.entry(l).or_default() += 1,
                Decision::Forget(l) => {
                    *left.entry(l).or_default() += 1;
                    let _ = self.flows.remove(&a.forward_key);
                    let _ = self.flows.remove(&a.reply_key);
                }
            }
        }
        Ok(handed)
    }

    /// The frontend entry the datapath finds for a client packet of `k` (`from_pod`: sent
    /// by a pod of this node, which uses a split frontend's internal entry): exact, else a
    /// NodePort on one of the node's NodePort addresses.
    fn frontend(&self, k: &FlowKeyOf<A>, from_pod: bool) -> Option<ServiceValue> {
        let mut key = ServiceKeyOf {
            addr: k.dst_addr,
            port_be: k.dst_port_be,
            proto: k.proto,
            scope: SCOPE_DEFAULT,
        };
        let v = match self.services.get(&key, 0) {
            Ok(v) => v,
            Err(_) => {
                let nodeport = self
                    .node_addrs
                    .get(&k.dst_addr, 0)
                    .is_ok_and(|n| n.flags & NODE_ADDR_F_NODEPORT != 0);
                if !nodeport {
                    return None;
                }
                key.addr = A::ZERO;
                self.services.get(&key, 0).ok()?
            }
        };
        if from_pod && v.flags & SVC_F_SPLIT_SCOPE != 0 {
            key.scope = SCOPE_INTERNAL;
            return Some(self.services.get(&key, 0).unwrap_or(v));
        }
        Some(v)
    }
}

/// Finishes a takeover that an earlier run of lbproxy left half done (it died between
/// handing flows over and owning them; untracking stays on meanwhile, kept across the
/// restart by `bpf::write_config`): as its step 4 would have, under the untrack rule, each
/// handed-over flow's conntrack entry is deleted and the flow made lbproxy's own. Nothing to
/// do, the usual case, costs one walk of the flow tables.
fn finish_earlier(bpffs_dir: &Path) -> anyhow::Result<()> {
    let mut maps = PinnedMaps::open(bpffs_dir)?;
    let v4 = left_handed_over(&maps.flows);
    let v6 = left_handed_over(&maps.flows6);
    if v4.is_empty() && v6.is_empty() {
        // Untracking kept from an earlier run (`bpf::write_config`) that needs it no more.
        return maps
            .set_config_flags(CONFIG_F_UNTRACK, false)
            .context("turning untracking off");
    }
    untrack::install().context("finishing an earlier takeover's handed-over flows")?;
    maps.set_config_flags(CONFIG_F_UNTRACK, true)
        .context("turning untracking on")?;
    let mut ct = Conntrack::open().context("opening ctnetlink")?;
    let mut deleted = 0;
    for orig in v4.iter().map(tuple_of).chain(v6.iter().map(tuple_of)) {
        if ct
            .delete(&orig, 0)
            .with_context(|| format!("deleting conntrack entry {orig}"))?
        {
            deleted += 1;
        }
    }
    own_keys(&mut maps.flows, &v4)?;
    own_keys(&mut maps.flows6, &v6)?;
    maps.set_config_flags(CONFIG_F_UNTRACK, false)
        .context("turning untracking off")?;
    if let Err(e) = untrack::remove() {
        tracing::warn!("takeover: removing the untrack rule: {e:#}; `lbproxy cleanup` removes it");
    }
    tracing::warn!(
        "takeover: an earlier takeover did not finish: its {} handed-over flows are lbproxy's \
         own now ({deleted} conntrack entries of theirs deleted)",
        v4.len() + v6.len()
    );
    Ok(())
}

/// The forward keys of the handed-over flows in `flows`.
fn left_handed_over<A: Addr>(flows: &FlowMap<A>) -> Vec<FlowKeyOf<A>>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    flows
        .iter()
        .flatten()
        .filter(|(k, v)| k.dir == FLOW_DIR_FORWARD && v.adopted == FLOW_ADOPTED_HANDOVER)
        .map(|(k, _)| k)
        .collect()
}

/// The conntrack tuple a flow's forward key was adopted from: client -> frontend.
fn tuple_of<A: Addr>(k: &FlowKeyOf<A>) -> crate::conntrack::Tuple {
    crate::conntrack::Tuple {
        src: k.src_addr.ip(),
        dst: k.dst_addr.ip(),
        src_port: u16::from_be(k.src_port_be),
        dst_port: u16::from_be(k.dst_port_be),
        proto: k.proto,
    }
}

/// Both halves of each handed-over flow with forward key in `keys` made lbproxy's own.
fn own_keys<A: Addr>(flows: &mut FlowMap<A>, keys: &[FlowKeyOf<A>]) -> anyhow::Result<()>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    for k in keys {
        let Ok(v) = flows.get(k, 0) else { continue };
        for key in [*k, k.partner(&v)] {
            if let Ok(mut half) = flows.get(&key, 0)
                && half.adopted == FLOW_ADOPTED_HANDOVER
            {
                half.adopted = FLOW_ADOPTED_OWN;
                flows
                    .insert(key, half, 0)
                    .context("flow of an earlier takeover")?;
            }
        }
    }
    Ok(())
}

/// Step 4, first half, for one family: each handed-over flow's conntrack entry deleted.
/// Returns the entries that were still there to delete. Its packets are untracked, or
/// redirected past netfilter, meanwhile: none needs the entry any more, and none meets it.
fn delete_entries<A: Addr>(ct: &mut Conntrack, handed: &[Adopted<A>]) -> anyhow::Result<usize> {
    let mut deleted = 0;
    for a in handed {
        if ct
            .delete(&a.orig, a.zone)
            .with_context(|| format!("deleting conntrack entry {}", a.orig))?
        {
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// Step 4, second half, for one family: each handed-over flow made lbproxy's own, once its
/// entry is gone (see the module doc).
fn own<A: Addr>(flows: &mut FlowMap<A>, handed: &[Adopted<A>]) -> anyhow::Result<()>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    for a in handed {
        // The datapath may have moved the flow on meanwhile (state, flags, times): keep
        // what it wrote, change only who translates.
        for k in [a.forward_key, a.reply_key] {
            if let Ok(mut v) = flows.get(&k, 0)
                && v.adopted == FLOW_ADOPTED_HANDOVER
            {
                v.adopted = FLOW_ADOPTED_OWN;
                flows
                    .insert(k, v, 0)
                    .with_context(|| format!("flow {}", a.orig))?;
            }
        }
    }
    Ok(())
}

/// `LBPROXY_TEST_TAKEOVER_HALF_HOLD_MS`, for tests only: how long the handover waits
/// between a flow's forward half and its reply half, so that a test's load surely crosses
/// a flow whose halves disagree (`takeover::a_flow_handed_over_half_by_half_loses_nothing`).
fn test_half_hold() {
    if let Some(ms) = std::env::var("LBPROXY_TEST_TAKEOVER_HALF_HOLD_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// `LBPROXY_TEST_TAKEOVER_HOLD_MS`, for tests only: how long the takeover waits at the two
/// moments a packet could fall between paths: once the flows are handed over (translated,
/// untracked) while their NAT'd entries still exist, and between deleting the entries and
/// owning the flows. The lab tests set it so that the load's packets surely meet both,
/// which must cost none of them (`tests/tests/takeover.rs`).
const TEST_HOLD_ENV: &str = "LBPROXY_TEST_TAKEOVER_HOLD_MS";

fn test_hold(at: &str) {
    if let Some(ms) = std::env::var(TEST_HOLD_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::info!("takeover: holding {ms} ms {at} ({TEST_HOLD_ENV})");
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

fn write<A: Addr>(flows: &mut FlowMap<A>, a: &Adopted<A>) -> Result<(), aya::maps::MapError>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    // Half by half, the forward half first: until the reply half of a handed-over flow
    // follows, the datapath takes the flow as handed over from its forward half
    // (`FlowKeyOf::pairs`).
    flows.insert(a.forward_key, a.forward, 0)?;
    if a.forward.adopted == FLOW_ADOPTED_HANDOVER {
        test_half_hold();
    }
    flows.insert(a.reply_key, a.reply, 0)
}

fn write_all<A: Addr>(flows: &mut FlowMap<A>, all: &[Adopted<A>]) -> anyhow::Result<()>
where
    FlowKeyOf<A>: aya::Pod,
    FlowValueOf<A>: aya::Pod,
{
    for a in all {
        debug_assert_eq!(a.forward.adopted, FLOW_ADOPTED_CONNTRACK);
        write(flows, a).with_context(|| format!("flow {}", a.orig))?;
    }
    Ok(())
}

/// (service id, backend address, port) -> backend id, for every member of every service.
fn member_index(maps: &PinnedMaps) -> HashMap<(u32, IpAddr, u16), u32> {
    let backends: HashMap<u32, (IpAddr, u16)> = maps
        .all_backends()
        .filter_map(|(id, _)| maps.backend(id).map(|b| (id, (b.addr, b.port))))
        .collect();
    maps.members
        .iter()
        .flatten()
        .filter_map(|(k, _)| {
            let (addr, port) = backends.get(&k.backend_id)?;
            Some(((k.svc_id, *addr, *port), k.backend_id))
        })
        .collect()
}

fn count<A: Addr>(metrics: &Metrics, flows: &[Adopted<A>], family: &'static str) {
    for a in flows {
        let protocol = match a.orig.proto {
            IPPROTO_TCP => "tcp",
            IPPROTO_SCTP => "sctp",
            _ => "udp",
        };
        metrics
            .takeover_adopted
            .get_or_create(&TakeoverLabel { family, protocol })
            .inc();
    }
}

/// The addresses of this network namespace's interfaces: a flow from one of them is a node
/// process's.
fn local_addresses() -> HashSet<IpAddr> {
    let mut out = HashSet::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&raw mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr of the family it names.
            match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
                libc::AF_INET => {
                    let sa = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                    out.insert(IpAddr::from(sa.sin_addr.s_addr.to_ne_bytes()));
                }
                libc::AF_INET6 => {
                    let sa = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                    out.insert(IpAddr::from(sa.sin6_addr.s6_addr));
                }
                _ => {}
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}
