//! Service health checks: kube-proxy's `healthCheckNodePort` servers.
//!
//! A Service of type LoadBalancer with `externalTrafficPolicy: Local` gets a
//! `spec.healthCheckNodePort` from the API server. The cloud load balancer probes that port on
//! every node and only sends traffic to nodes that answer 200, because with `Local` a node
//! without an endpoint of its own has nowhere to send the traffic. As kube-proxy
//! (`pkg/proxy/healthcheck/service_health.go`), lbproxy runs one HTTP server per such port:
//!
//! - it answers any method on any path with kube-proxy's JSON body,
//!   `{"service":{"namespace":…,"name":…},"localEndpoints":N,"serviceProxyHealthy":…}`
//!   (written with kube-proxy's tab indentation, byte for byte), and the headers
//!   `Content-Type: application/json`, `X-Content-Type-Options: nosniff` and
//!   `X-Load-Balancing-Endpoint-Weight: N`;
//! - the status is 200 when N > 0 and the proxy itself is healthy (`/healthz`'s rule), 503
//!   otherwise;
//! - N is [`local_endpoints`]: the distinct ready, non-terminating endpoint IPs of the
//!   service on this node.
//!
//! [`HealthCheckServers`] owns the servers. The controller hands it, after each sync, every
//! port that is wanted ([`wanted`]) and it starts, stops (releasing the socket at once) and
//! updates servers to match; a port that cannot be bound is reported and retried on the
//! next call, and nothing else stops.
//!
//! To check it on a node: `curl -i http://<node-ip>:<healthCheckNodePort>/` (the port is
//! `kubectl get svc <name> -o jsonpath='{.spec.healthCheckNodePort}'`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::poll_fn;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::model::{Family, Model, NamespacedName, Service, ServiceType};

/// What one health-check port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceHealth {
    pub service: NamespacedName,
    /// Ready, non-terminating endpoint IPs on this node ([`local_endpoints`]).
    pub local_endpoints: usize,
}

/// Why a wanted port is not served. The port is tried again on the next
/// [`HealthCheckServers::sync`].
#[derive(Debug, thiserror::Error)]
pub enum BindFailure {
    /// The socket could not be bound or listened on (`EADDRINUSE`, `EACCES`, …). None of the
    /// port's addresses is served then, as kube-proxy.
    #[error("health check of service {service} on {addr}: {source}")]
    Io {
        service: NamespacedName,
        port: u16,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// Another service asks for the same port; the first by (namespace, name) has it.
    #[error("health check of service {service}: port {port} is already {winner}'s")]
    Conflict {
        service: NamespacedName,
        port: u16,
        winner: NamespacedName,
    },
}

impl BindFailure {
    pub fn service(&self) -> &NamespacedName {
        match self {
            BindFailure::Io { service, .. } | BindFailure::Conflict { service, .. } => service,
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            BindFailure::Io { port, .. } | BindFailure::Conflict { port, .. } => *port,
        }
    }
}

/// Whether the proxy itself is healthy (kube-proxy's `/healthz`), asked on every request.
pub type ProxyHealthy = Arc<dyn Fn() -> bool + Send + Sync>;

/// Whether a service gets a health-check server: as kube-proxy (`NeedsHealthCheck`), type
/// LoadBalancer with `externalTrafficPolicy: Local` (for a LoadBalancer, what
/// `desired::local_only` says of its external scope), and a `healthCheckNodePort`.
pub fn health_check_port(svc: &Service) -> Option<u16> {
    let wanted = svc.service_type == ServiceType::LoadBalancer && svc.external_local;
    svc.health_check_node_port.filter(|_| wanted)
}

/// The number a health check reports for `service` on `node`: the distinct endpoint IPs of
/// `family` over all the service's slices that are on `node` (`nodeName`), ready (an absent
/// `ready` counts as true) and not terminating.
///
/// As kube-proxy (`EndpointsMap.LocalReadyEndpoints`): an IP behind several ports or slices
/// counts once, and a slice without ports adds nothing (kube-proxy has no entry for it). One
/// family per count, as kube-proxy runs one set of servers per IP family: a dual-stack pod
/// counts once.
pub fn local_endpoints(
    model: &Model,
    service: &NamespacedName,
    node: &str,
    family: Family,
) -> usize {
    let mut ips: BTreeSet<&IpAddr> = BTreeSet::new();
    for slice in model.slices_of(service).filter(|s| !s.ports.is_empty()) {
        for ep in &slice.endpoints {
            if ep.ready && !ep.terminating && ep.on_node(node) {
                ips.extend(ep.addresses.iter().filter(|ip| Family::of(ip) == family));
            }
        }
    }
    ips.len()
}

/// Every health-check port the model asks for, with what it reports on `node`, in service
/// order (what [`HealthCheckServers::sync`] takes). IPv4 only, the family lbproxy serves.
pub fn wanted(model: &Model, node: &str) -> Vec<(u16, ServiceHealth)> {
    model
        .services
        .keys()
        .filter_map(|id| wanted_for(model, node, id))
        .collect()
}

/// The health-check port service `id` asks for, with what it reports on `node`; `None` when
/// it asks for none (or is gone). [`wanted`] for one service, so a sync of a few changed
/// services updates only theirs.
pub fn wanted_for(model: &Model, node: &str, id: &NamespacedName) -> Option<(u16, ServiceHealth)> {
    let svc = model.services.get(id)?;
    let port = health_check_port(svc)?;
    Some((
        port,
        ServiceHealth {
            service: svc.id.clone(),
            local_endpoints: local_endpoints(model, &svc.id, node, Family::V4),
        },
    ))
}

/// The health-check servers, one per port, each listening on every bind address.
///
/// Must be used from within a Tokio runtime: servers are spawned on it.
pub struct HealthCheckServers {
    addresses: Vec<IpAddr>,
    proxy_healthy: ProxyHealthy,
    running: BTreeMap<u16, PortServer>,
    /// The last `sync`'s input, for rebinding after an address change.
    last: Vec<(u16, ServiceHealth)>,
}

impl fmt::Debug for HealthCheckServers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthCheckServers")
            .field("addresses", &self.addresses)
            .field("ports", &self.running.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl HealthCheckServers {
    /// `addresses`: where every server listens (kube-proxy's node port addresses); empty
    /// means every address, `0.0.0.0` and `[::]`. `proxy_healthy` is asked on every request.
    pub fn new(addresses: Vec<IpAddr>, proxy_healthy: ProxyHealthy) -> Self {
        Self {
            addresses,
            proxy_healthy,
            running: BTreeMap::new(),
            last: Vec::new(),
        }
    }

    /// The ports served now.
    #[cfg(test)]
    pub fn ports(&self) -> Vec<u16> {
        self.running.keys().copied().collect()
    }

    /// Makes the servers match `wanted` (a `BTreeMap<u16, ServiceHealth>` will do, or a list
    /// with repeated ports):
    /// - a port no longer wanted stops, and its sockets are closed before this returns, so
    ///   the port can be bound again at once;
    /// - a port already served keeps its server (and its connections): only what it reports
    ///   changes;
    /// - a new port is bound on every address and served;
    /// - two services on one port: the first by (namespace, name) gets it.
    ///
    /// Returns what could not be served; those ports are tried again on the next call.
    pub fn sync(
        &mut self,
        wanted: impl IntoIterator<Item = (u16, ServiceHealth)>,
    ) -> Vec<BindFailure> {
        let mut wanted: Vec<(u16, ServiceHealth)> = wanted.into_iter().collect();
        wanted.sort_by(|(pa, a), (pb, b)| (pa, &a.service).cmp(&(pb, &b.service)));
        self.last.clone_from(&wanted);
        let mut failures = Vec::new();
        let mut winners: BTreeMap<u16, ServiceHealth> = BTreeMap::new();
        for (port, health) in wanted {
            match winners.get(&port) {
                Some(w) if w.service != health.service => failures.push(BindFailure::Conflict {
                    service: health.service,
                    port,
                    winner: w.service.clone(),
                }),
                // The same service listed twice: the first entry stands.
                Some(_) => {}
                None => {
                    winners.insert(port, health);
                }
            }
        }
        // Stop first, so a port that moves between addresses or services is free.
        self.running.retain(|port, server| {
            let keep = winners.contains_key(port);
            if !keep {
                tracing::info!(port, service = %server.service(), "health check server stopped");
            }
            keep
        });
        for (port, health) in winners {
            if let Some(server) = self.running.get(&port) {
                server.update(health);
                continue;
            }
            match PortServer::start(port, &self.addresses, health, &self.proxy_healthy) {
                Ok(server) => {
                    tracing::info!(port, service = %server.service(), addresses = ?self.addresses, "health check server started");
                    self.running.insert(port, server);
                }
                Err(e) => failures.push(e),
            }
        }
        failures
    }

    /// Listens on `addresses` instead (empty: `0.0.0.0` and `[::]`). Every server is stopped and
    /// started again on the new addresses with what the last [`sync`](Self::sync) asked
    /// for; returns what could not be bound. Nothing happens when the addresses are the
    /// same.
    pub fn set_addresses(&mut self, addresses: Vec<IpAddr>) -> Vec<BindFailure> {
        if addresses == self.addresses {
            return Vec::new();
        }
        self.addresses = addresses;
        self.running.clear();
        let last = std::mem::take(&mut self.last);
        self.sync(last)
    }
}

/// What a port's handlers read; shared by its listeners and updated in place.
struct Shared {
    health: Mutex<ServiceHealth>,
    proxy_healthy: ProxyHealthy,
}

/// One port's server: a listener per bind address.
struct PortServer {
    shared: Arc<Shared>,
    listeners: Vec<ListenerHandle>,
}

impl PortServer {
    fn start(
        port: u16,
        addresses: &[IpAddr],
        health: ServiceHealth,
        proxy_healthy: &ProxyHealthy,
    ) -> Result<Self, BindFailure> {
        let all = [
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        ];
        let ips = if addresses.is_empty() {
            &all[..]
        } else {
            addresses
        };
        let mut bound = Vec::with_capacity(ips.len());
        for ip in ips {
            let addr = SocketAddr::new(*ip, port);
            match bind(addr) {
                Ok(l) => bound.push((addr, l)),
                // A node without IPv6 (`ipv6.disable=1`) serves IPv4 only.
                Err(e) if addresses.is_empty() && ip.is_ipv6() && no_ipv6(&e) => {}
                // What was bound so far is dropped, so closed: all or nothing, as kube-proxy.
                Err(source) => {
                    return Err(BindFailure::Io {
                        service: health.service,
                        port,
                        addr,
                        source,
                    });
                }
            }
        }
        let shared = Arc::new(Shared {
            health: Mutex::new(health),
            proxy_healthy: proxy_healthy.clone(),
        });
        let listeners = bound
            .into_iter()
            .map(|(addr, l)| ListenerHandle::spawn(addr, l, shared.clone()))
            .collect();
        Ok(Self { shared, listeners })
    }

    fn service(&self) -> NamespacedName {
        lock(&self.shared.health).service.clone()
    }

    fn update(&self, health: ServiceHealth) {
        let mut h = lock(&self.shared.health);
        if *h != health {
            tracing::debug!(port = ?self.listeners.first().map(|l| l.addr.port()), service = %health.service, local_endpoints = health.local_endpoints, "health check updated");
            *h = health;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `SO_REUSEADDR`, as Go's listeners (kube-proxy's): a port whose server stopped can be
/// bound again while connections it accepted linger in TIME_WAIT. An IPv6 socket is IPv6
/// only (`IPV6_V6ONLY`), so that `[::]` and `0.0.0.0` are two listeners side by side,
/// whatever `net.ipv6.bindv6only` says.
fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    TcpListener::from_std(s.into())
}

/// Whether `e` says this node has no IPv6 at all.
fn no_ipv6(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL)
    )
}

/// The listening socket, shared between the server task (which accepts from it) and the
/// manager (which closes it by taking it out): closing does not wait for the task.
type Slot = Arc<Mutex<Option<TcpListener>>>;

/// A running listener. Dropping it closes the socket at once, then shuts the server down
/// gracefully (connections being answered finish).
struct ListenerHandle {
    addr: SocketAddr,
    slot: Slot,
    stop: Option<oneshot::Sender<()>>,
}

impl ListenerHandle {
    fn spawn(addr: SocketAddr, listener: TcpListener, shared: Arc<Shared>) -> Self {
        let slot: Slot = Arc::new(Mutex::new(Some(listener)));
        let (stop, stopped) = oneshot::channel::<()>();
        let app = Router::new().fallback(answer).with_state(shared);
        let accept = SlotListener(slot.clone());
        tokio::spawn(async move {
            let serve = axum::serve(accept, app).with_graceful_shutdown(async move {
                // A dropped sender stops the server as well.
                let _ = stopped.await;
            });
            if let Err(e) = serve.await {
                tracing::warn!(%addr, "health check server: {e}");
            }
        });
        Self {
            addr,
            slot,
            stop: Some(stop),
        }
    }
}

impl Drop for ListenerHandle {
    fn drop(&mut self) {
        drop(lock(&self.slot).take());
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// axum's view of a [`Slot`]: accepts while the socket is in it, waits forever once it is
/// taken (the graceful shutdown then ends the server).
struct SlotListener(Slot);

impl axum::serve::Listener for SlotListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            let r = poll_fn(|cx| match lock(&self.0).as_ref() {
                Some(l) => l.poll_accept(cx),
                None => Poll::Pending,
            })
            .await;
            match r {
                Ok(conn) => return conn,
                // The peer gave up before the accept: nothing wrong with the socket.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionRefused
                    ) => {}
                // Out of file descriptors, say: retry a little later rather than spin.
                Err(e) => {
                    tracing::warn!("health check server: accept: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        match lock(&self.0).as_ref() {
            Some(l) => l.local_addr(),
            None => Err(io::Error::from(io::ErrorKind::NotConnected)),
        }
    }
}

/// kube-proxy's body, byte for byte: tab-indented, no final newline.
fn body(health: &ServiceHealth, proxy_healthy: bool) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        q(&health.service.namespace),
        q(&health.service.name),
        health.local_endpoints,
        proxy_healthy,
    )
}

/// Any method, any path.
async fn answer(State(shared): State<Arc<Shared>>) -> Response {
    let health = lock(&shared.health).clone();
    let proxy_healthy = (shared.proxy_healthy)();
    let code = if health.local_endpoints > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let weight = HeaderValue::from(health.local_endpoints);
    (
        code,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                HeaderName::from_static("x-load-balancing-endpoint-weight"),
                weight,
            ),
        ],
        body(&health, proxy_healthy),
    )
        .into_response()
}

#[cfg(test)]
mod tests;
