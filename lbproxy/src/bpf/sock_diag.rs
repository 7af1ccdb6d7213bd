//! The node's sockets (IPv4, and IPv6 with `dump6`) through netlink `sock_diag`: a dump of one protocol's sockets
//! with their cookies, and `SOCK_DESTROY` of one of them (what `ss -K` does; needs
//! `CONFIG_INET_DIAG_DESTROY` and CAP_NET_ADMIN). A destroyed TCP socket's owner sees
//! ECONNABORTED; a destroyed connected UDP socket fails its next send (EDESTADDRREQ) or
//! receive, and the application reconnects.
//!
//! Messages are netlink-packet-sock-diag's; `SOCK_DESTROY` is the same `inet_diag_req_v2`
//! as a dump request under another message type, which the crate does not name, so the
//! header's type is set after `finalize`.

use netlink_packet_core_sd::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, AF_INET6},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_SOCK_DIAG};

/// The kernel's `SOCK_DESTROY` message type (`linux/sock_diag.h`).
const SOCK_DESTROY: u16 = 21;

/// One socket of a dump.
#[derive(Clone, Debug)]
pub struct SockInfo {
    /// The socket's cookie, as `bpf_get_socket_cookie` returns it.
    pub cookie: u64,
    pub id: SocketId,
}

impl SockInfo {
    /// The remote address and port (`[u8; 4]`, host-order port), for IPv4 sockets and IPv6
    /// ones talking IPv4 (an IPv4-mapped peer).
    pub fn remote(&self) -> Option<([u8; 4], u16)> {
        match self.id.destination_address {
            std::net::IpAddr::V4(a) => Some((a.octets(), self.id.destination_port)),
            std::net::IpAddr::V6(a) => a
                .to_ipv4_mapped()
                .map(|v4| (v4.octets(), self.id.destination_port)),
        }
    }

    /// The remote IPv6 address and port of an IPv6 socket talking IPv6.
    pub fn remote6(&self) -> Option<([u8; 16], u16)> {
        match self.id.destination_address {
            std::net::IpAddr::V6(a) if a.to_ipv4_mapped().is_none() => {
                Some((a.octets(), self.id.destination_port))
            }
            _ => None,
        }
    }
}

/// The kernel's `idiag_cookie`: two host-order 32-bit words, the low one first.
fn cookie_of(id: &SocketId) -> u64 {
    let lo = u32::from_ne_bytes([id.cookie[0], id.cookie[1], id.cookie[2], id.cookie[3]]);
    let hi = u32::from_ne_bytes([id.cookie[4], id.cookie[5], id.cookie[6], id.cookie[7]]);
    u64::from(hi) << 32 | u64::from(lo)
}

/// A `NETLINK_SOCK_DIAG` socket: one per reap, for its dumps and destroys alike.
pub struct SockDiag(Socket);

impl SockDiag {
    pub fn open() -> std::io::Result<Self> {
        let mut s = Socket::new(NETLINK_SOCK_DIAG)?;
        s.bind_auto()?;
        s.connect(&SocketAddr::new(0, 0))?;
        Ok(Self(s))
    }

    /// Every IPv4 socket of protocol `proto` (TCP or UDP) in this network namespace.
    pub fn dump(&self, proto: u8) -> std::io::Result<Vec<SockInfo>> {
        self.dump_id(proto, SocketId::new_v4())
    }

    /// Every IPv6 socket of protocol `proto` in this network namespace (those talking IPv4
    /// through mapped addresses too).
    pub fn dump6(&self, proto: u8) -> std::io::Result<Vec<SockInfo>> {
        self.dump_id(proto, SocketId::new_v6())
    }

    fn dump_id(&self, proto: u8, id: SocketId) -> std::io::Result<Vec<SockInfo>> {
        self.send(NLM_F_REQUEST | NLM_F_DUMP, None, request(proto, id))?;
        let mut out = Vec::new();
        self.receive(|i| out.push(i))?;
        Ok(out)
    }

    /// Destroys the socket `info` names (its addresses, ports and cookie, as dumped).
    pub fn destroy(&self, proto: u8, info: &SockInfo) -> std::io::Result<()> {
        self.send(
            NLM_F_REQUEST | NLM_F_ACK,
            Some(SOCK_DESTROY),
            request(proto, info.id.clone()),
        )?;
        self.receive(|_| {})
    }

    fn send(&self, flags: u16, message_type: Option<u16>, req: InetRequest) -> std::io::Result<()> {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = flags;
        let mut msg = NetlinkMessage::new(hdr, SockDiagMessage::InetRequest(req).into());
        msg.finalize();
        if let Some(t) = message_type {
            msg.header.message_type = t;
        }
        let mut buf = vec![0; msg.buffer_len()];
        msg.serialize(&mut buf);
        self.0.send(&buf, 0)?;
        Ok(())
    }

    /// Reads messages until `Done` or an ack/error, handing each response to `each`.
    fn receive(&self, mut each: impl FnMut(SockInfo)) -> std::io::Result<()> {
        loop {
            let (buf, _) = self.0.recv_from_full()?;
            let mut off = 0;
            while off < buf.len() {
                let msg = <NetlinkMessage<SockDiagMessage>>::deserialize(&buf[off..])
                    .map_err(|e| std::io::Error::other(format!("sock_diag: {e}")))?;
                let len = msg.header.length as usize;
                match msg.payload {
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        let id = r.header.socket_id.clone();
                        each(SockInfo {
                            cookie: cookie_of(&id),
                            id,
                        });
                    }
                    NetlinkPayload::Done(_) => return Ok(()),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(()),
                            Some(code) => Err(std::io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    _ => {}
                }
                if len == 0 {
                    break;
                }
                off += (len + 3) & !3;
            }
        }
    }
}

/// An `inet_diag_req_v2` for sockets of `proto` in any state, naming `id` (of the family
/// its addresses are).
fn request(proto: u8, socket_id: SocketId) -> InetRequest {
    InetRequest {
        family: if socket_id.source_address.is_ipv4() {
            AF_INET
        } else {
            AF_INET6
        },
        protocol: proto,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id,
    }
}
