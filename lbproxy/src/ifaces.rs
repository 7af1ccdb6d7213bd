//! Interfaces of this network namespace, from rtnetlink: a full listing, and a stream of
//! "something changed" events from the link multicast group.

use futures::{StreamExt as _, TryStreamExt as _};
use netlink_packet_route::link::LinkAttribute;
use rtnetlink::MulticastGroup;
use tokio::sync::mpsc;

use crate::bpf::Interface;

/// Lists every interface in this network namespace.
pub async fn list(handle: &rtnetlink::Handle) -> Result<Vec<Interface>, rtnetlink::Error> {
    let mut out = Vec::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await? {
        let name = msg.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        if let Some(name) = name {
            out.push(Interface {
                index: msg.header.index,
                name,
            });
        }
    }
    out.sort();
    Ok(out)
}

/// A handle for listing, and a receiver that gets `()` whenever a link is added, changed or
/// removed. The caller re-lists on each event (and on a timer, as a safety net).
pub fn watch() -> std::io::Result<(rtnetlink::Handle, mpsc::UnboundedReceiver<()>)> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    tokio::spawn(conn);
    let (mconn, _mhandle, mut messages) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Link])?;
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
