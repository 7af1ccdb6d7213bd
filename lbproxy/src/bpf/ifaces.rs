//! Interfaces of this network namespace, from rtnetlink: a full listing (links, their IPv4
//! and global IPv6 addresses, the `/32` routes out of them, and the default routes), and a
//! stream of "something changed" events from the link, address and route multicast groups
//! of both families.

use futures::{StreamExt as _, TryStreamExt as _};
use lbproxy_common::{POD_IF_NETKIT, POD_IF_VETH};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo};
use rtnetlink::MulticastGroup;
use tokio::sync::mpsc;

use crate::bpf::attach::Interface;

/// An interface, whether the datapath may redirect packets into its peer, and the device it
/// is enslaved to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Link {
    pub iface: Interface,
    /// `POD_IF_VETH` or `POD_IF_NETKIT` when the interface is one end of a pair whose other
    /// end is in another network namespace (a pod's), which is what `bpf_redirect_peer`
    /// needs; `None` otherwise.
    pub peer_kind: Option<u32>,
    /// The ifindex of the device this interface is enslaved to (`IFLA_MASTER`): a bridge for
    /// a `cni0`-like pod network, `None` for a routed one.
    pub master: Option<u32>,
    /// Whether this interface is a Linux bridge.
    pub is_bridge: bool,
    /// Whether this is the loopback interface.
    pub is_loopback: bool,
    /// Its IPv4 addresses.
    pub v4: LinkAddrs<std::net::Ipv4Addr>,
    /// The addresses with a unicast `/32` route out of it in the main table (a routed pod
    /// network's pod addresses), sorted.
    pub routes_v4: Vec<std::net::Ipv4Addr>,
    /// Its IPv6 addresses of global scope (global and unique local; never link-local).
    pub v6: LinkAddrs<std::net::Ipv6Addr>,
}

/// An interface's addresses of one family.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LinkAddrs<A> {
    /// In the order the kernel lists them (primary first).
    pub addrs: Vec<A>,
    /// When the main table's default route of the family (the one of lowest metric) leaves
    /// by this interface: the node's primary address of the family, the route's preferred
    /// source if it has one, else this interface's first address of the family.
    /// `nodePortAddresses: primary` serves it.
    pub primary: Option<A>,
}

impl<A> Default for LinkAddrs<A> {
    fn default() -> Self {
        Self {
            addrs: Vec::new(),
            primary: None,
        }
    }
}

/// Lists every interface in this network namespace.
pub async fn list(handle: &rtnetlink::Handle) -> Result<Vec<Link>, rtnetlink::Error> {
    let mut out = Vec::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await? {
        let mut name = None;
        let mut kind = None;
        let mut peer_elsewhere = false;
        let mut master = None;
        let mut is_bridge = false;
        let is_loopback = msg
            .header
            .flags
            .contains(netlink_packet_route::link::LinkFlags::Loopback);
        for a in &msg.attributes {
            match a {
                LinkAttribute::IfName(n) => name = Some(n.clone()),
                LinkAttribute::LinkNetNsId(_) => peer_elsewhere = true,
                LinkAttribute::Controller(m) if *m != 0 => master = Some(*m),
                LinkAttribute::LinkInfo(infos) => {
                    kind = infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(InfoKind::Veth) => Some(POD_IF_VETH),
                        LinkInfo::Kind(InfoKind::Netkit) => Some(POD_IF_NETKIT),
                        _ => None,
                    });
                    is_bridge = infos
                        .iter()
                        .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Bridge)));
                }
                _ => {}
            }
        }
        if let Some(name) = name {
            out.push(Link {
                iface: Interface {
                    index: msg.header.index,
                    name,
                },
                peer_kind: kind.filter(|_| peer_elsewhere),
                master,
                is_bridge,
                is_loopback,
                v4: LinkAddrs::default(),
                routes_v4: Vec::new(),
                v6: LinkAddrs::default(),
            });
        }
    }
    let mut addrs = handle.address().get().execute();
    while let Some(msg) = addrs.try_next().await? {
        let index = msg.header.index;
        let global = msg.header.scope == netlink_packet_route::address::AddressScope::Universe;
        for a in &msg.attributes {
            use netlink_packet_route::address::AddressAttribute;
            let Some(l) = out.iter_mut().find(|l| l.iface.index == index) else {
                continue;
            };
            match a {
                AddressAttribute::Local(std::net::IpAddr::V4(ip)) if !l.v4.addrs.contains(ip) => {
                    l.v4.addrs.push(*ip);
                }
                // IPv6 addresses come as `Address` (there is no `Local` without a peer).
                AddressAttribute::Address(std::net::IpAddr::V6(ip))
                    if global && !ip.is_unicast_link_local() && !l.v6.addrs.contains(ip) =>
                {
                    l.v6.addrs.push(*ip);
                }
                _ => {}
            }
        }
    }
    let mut routes = handle
        .route()
        .get(rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new().build())
        .execute();
    let mut default: Option<DefaultRoute<std::net::Ipv4Addr>> = None;
    while let Some(msg) = routes.try_next().await? {
        if let Some((dst, oif)) = host_route(&msg)
            && let Some(l) = out.iter_mut().find(|l| l.iface.index == oif)
        {
            l.routes_v4.push(dst);
        }
        keep_best_default(&mut default, &msg);
    }
    set_primary(&mut out, default);
    let mut routes = handle
        .route()
        .get(rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new().build())
        .execute();
    let mut default6: Option<DefaultRoute<std::net::Ipv6Addr>> = None;
    while let Some(msg) = routes.try_next().await? {
        keep_best_default(&mut default6, &msg);
    }
    set_primary(&mut out, default6);
    for l in &mut out {
        l.routes_v4.sort();
        l.routes_v4.dedup();
    }
    out.sort();
    Ok(out)
}

/// A unicast IPv4 `/32` route of the main table with one output interface: (destination,
/// ifindex).
fn host_route(
    msg: &netlink_packet_route::route::RouteMessage,
) -> Option<(std::net::Ipv4Addr, u32)> {
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteType};
    let h = &msg.header;
    if h.destination_prefix_length != 32 || h.kind != RouteType::Unicast {
        return None;
    }
    let mut table = u32::from(h.table);
    let (mut dst, mut oif) = (None, None);
    for a in &msg.attributes {
        match a {
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => dst = Some(*ip),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Table(t) => table = *t,
            _ => {}
        }
    }
    (table == u32::from(RouteHeader::RT_TABLE_MAIN)).then_some(())?;
    Some((dst?, oif?))
}

/// An address family of the route listing: how a route's preferred source of the family
/// reads, and where a link keeps its addresses of the family.
trait RouteFamily: Copy {
    fn of(a: &netlink_packet_route::route::RouteAddress) -> Option<Self>;
    fn addrs_of(l: &mut Link) -> &mut LinkAddrs<Self>;
}

impl RouteFamily for std::net::Ipv4Addr {
    fn of(a: &netlink_packet_route::route::RouteAddress) -> Option<Self> {
        match a {
            netlink_packet_route::route::RouteAddress::Inet(ip) => Some(*ip),
            _ => None,
        }
    }
    fn addrs_of(l: &mut Link) -> &mut LinkAddrs<Self> {
        &mut l.v4
    }
}

impl RouteFamily for std::net::Ipv6Addr {
    fn of(a: &netlink_packet_route::route::RouteAddress) -> Option<Self> {
        match a {
            netlink_packet_route::route::RouteAddress::Inet6(ip) => Some(*ip),
            _ => None,
        }
    }
    fn addrs_of(l: &mut Link) -> &mut LinkAddrs<Self> {
        &mut l.v6
    }
}

/// (metric, ifindex, preferred source) of a default route.
type DefaultRoute<A> = (u32, u32, Option<A>);

/// A unicast default route (`0.0.0.0/0`, `::/0`) of the main table with one output
/// interface, and its preferred source of family `A`.
fn default_route<A: RouteFamily>(
    msg: &netlink_packet_route::route::RouteMessage,
) -> Option<DefaultRoute<A>> {
    use netlink_packet_route::route::{RouteAttribute, RouteHeader, RouteType};
    let h = &msg.header;
    if h.destination_prefix_length != 0 || h.kind != RouteType::Unicast {
        return None;
    }
    let mut table = u32::from(h.table);
    let (mut oif, mut metric, mut src) = (None, 0, None);
    for a in &msg.attributes {
        match a {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Priority(p) => metric = *p,
            RouteAttribute::PrefSource(a) => {
                if let Some(ip) = A::of(a) {
                    src = Some(ip);
                }
            }
            RouteAttribute::Table(t) => table = *t,
            _ => {}
        }
    }
    (table == u32::from(RouteHeader::RT_TABLE_MAIN)).then_some(())?;
    Some((metric, oif?, src))
}

/// Keeps in `best` the default route of lowest metric of those seen, `msg` included (the
/// first of equal metrics).
fn keep_best_default<A: RouteFamily>(
    best: &mut Option<DefaultRoute<A>>,
    msg: &netlink_packet_route::route::RouteMessage,
) {
    if let Some(d) = default_route(msg)
        && best.is_none_or(|b| d.0 < b.0)
    {
        *best = Some(d);
    }
}

/// Makes the interface the `best` default route leaves by hold the node's primary address
/// of the family: the route's preferred source, else the interface's first address.
fn set_primary<A: RouteFamily>(links: &mut [Link], best: Option<DefaultRoute<A>>) {
    if let Some((_, oif, src)) = best
        && let Some(l) = links.iter_mut().find(|l| l.iface.index == oif)
    {
        let f = A::addrs_of(l);
        f.primary = src.or_else(|| f.addrs.first().copied());
    }
}

/// A handle for listing, and a receiver that gets `()` whenever a link is added, changed or
/// removed. The caller re-lists on each event (and on a timer, as a safety net).
pub fn watch() -> std::io::Result<(rtnetlink::Handle, mpsc::UnboundedReceiver<()>)> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    tokio::spawn(conn);
    let (mconn, _mhandle, mut messages) = rtnetlink::new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv4Route,
        MulticastGroup::Ipv6Ifaddr,
        MulticastGroup::Ipv6Route,
    ])?;
    tokio::spawn(mconn);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while messages.next().await.is_some() {
            if tx.send(()).is_err() {
                break;
            }
        }
    });
    Ok((handle, rx))
}

/// Keeps the programs attached to the pod interfaces: attaches once now (so they are in
/// place before the first sync), then again whenever a link changes, and every 2 s as a
/// safety net. The task owns the loaded datapath, which keeps the programs loaded.
pub async fn spawn_attach(
    mut dp: super::Datapath,
    mut attacher: super::Attacher,
    metrics: std::sync::Arc<crate::telemetry::Metrics>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let (handle, mut link_events) = watch().context("opening rtnetlink")?;
    // The first listing decides whether lbproxy starts: under `xdpAcceleration: native`, a
    // node interface that refuses XDP stops it, with the interface and the kernel's reason.
    if attacher.xdp_required() {
        let list = list(&handle).await.context("listing interfaces")?;
        let refused: Vec<String> = attacher
            .sync(&mut dp, &list)
            .iter()
            .inspect(|e| tracing::error!("attach failed (will retry): {}", super::error_chain(e)))
            .filter(|e| matches!(e, super::BpfError::XdpRefused { .. }))
            .map(|e| super::error_chain(e))
            .collect();
        if !refused.is_empty() {
            anyhow::bail!(
                "xdpAcceleration native: {} (use best-effort to keep TC alone on such interfaces)",
                refused.join("; ")
            );
        }
    }
    let sync =
        async move |dp: &mut super::Datapath, attacher: &mut super::Attacher| match list(&handle)
            .await
        {
            Ok(list) => {
                for e in attacher.sync(dp, &list) {
                    tracing::error!("attach failed (will retry): {}", super::error_chain(&e));
                }
                metrics
                    .attached_interfaces
                    .set(i64::try_from(attacher.attached().len()).unwrap_or(i64::MAX));
            }
            Err(e) => tracing::error!("listing interfaces: {e}"),
        };
    sync(&mut dp, &mut attacher).await;
    tokio::spawn(async move {
        let mut missing_before = false;
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ev = link_events.recv() => {
                    if ev.is_none() {
                        return;
                    }
                    // A burst of link messages is one change.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    while link_events.try_recv().is_ok() {}
                }
                _ = tick.tick() => {}
            }
            match super::missing_pins(&dp.dir) {
                // `lbproxy cleanup` (or a hand) removed what this run pinned: the programs
                // it would go on writing to are no longer what the node's interfaces use.
                // Exit so that the DaemonSet restarts lbproxy, which pins and attaches anew.
                // Two checks in a row (at least 2 s apart) must agree, so one failed look-up
                // never restarts a working proxy.
                Some((missing, why)) if missing_before => {
                    tracing::error!(
                        missing = %missing.display(),
                        %why,
                        "pinned maps are gone (lbproxy cleanup while running?); exiting so that a restart pins and attaches again"
                    );
                    std::process::exit(3);
                }
                Some((missing, why)) => {
                    tracing::warn!(missing = %missing.display(), %why, "a pinned map is missing; exiting if it still is at the next check");
                    missing_before = true;
                }
                None => missing_before = false,
            }
            sync(&mut dp, &mut attacher).await;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType,
    };

    use super::*;

    fn route(prefix: u8, table: u8, attrs: Vec<RouteAttribute>) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.destination_prefix_length = prefix;
        m.header.kind = RouteType::Unicast;
        m.header.table = table;
        m.attributes = attrs;
        m
    }

    const MAIN: u8 = RouteHeader::RT_TABLE_MAIN;

    /// Of the main table's default routes, the one of lowest metric wins, with its
    /// preferred source of the family listed; other tables and other prefixes do not count.
    #[test]
    fn the_default_route_of_lowest_metric_per_family() {
        let v4: std::net::Ipv4Addr = "10.0.0.5".parse().unwrap();
        let v6: std::net::Ipv6Addr = "2001:db8::5".parse().unwrap();
        let msgs = [
            route(
                0,
                MAIN,
                vec![RouteAttribute::Oif(2), RouteAttribute::Priority(200)],
            ),
            route(
                0,
                MAIN,
                vec![
                    RouteAttribute::Oif(3),
                    RouteAttribute::Priority(100),
                    RouteAttribute::PrefSource(RouteAddress::Inet(v4)),
                    RouteAttribute::PrefSource(RouteAddress::Inet6(v6)),
                ],
            ),
            route(
                0,
                100,
                vec![RouteAttribute::Oif(4), RouteAttribute::Priority(1)],
            ),
            route(
                8,
                MAIN,
                vec![RouteAttribute::Oif(5), RouteAttribute::Priority(0)],
            ),
            route(
                0,
                MAIN,
                vec![RouteAttribute::Oif(6), RouteAttribute::Priority(100)],
            ),
        ];
        let mut best4: Option<DefaultRoute<std::net::Ipv4Addr>> = None;
        let mut best6: Option<DefaultRoute<std::net::Ipv6Addr>> = None;
        for m in &msgs {
            keep_best_default(&mut best4, m);
            keep_best_default(&mut best6, m);
        }
        assert_eq!(best4, Some((100, 3, Some(v4))));
        assert_eq!(best6, Some((100, 3, Some(v6))));
        // A table given as an attribute counts over the header's.
        let mut m = route(
            0,
            MAIN,
            vec![RouteAttribute::Oif(7), RouteAttribute::Table(100)],
        );
        assert_eq!(default_route::<std::net::Ipv4Addr>(&m), None);
        m.attributes = vec![RouteAttribute::Table(u32::from(MAIN))];
        assert_eq!(
            default_route::<std::net::Ipv4Addr>(&m),
            None,
            "no output interface"
        );
    }
}
