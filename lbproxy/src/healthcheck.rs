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
mod tests {
    use super::*;
    use crate::model::{Normalized, service_from_k8s, slice_from_k8s};
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn nn(namespace: &str, name: &str) -> NamespacedName {
        NamespacedName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn proxied<T>(n: Normalized<T>) -> T {
        match n {
            Normalized::Proxied(t) => t,
            Normalized::Skipped(why) => panic!("skipped: {why}"),
        }
    }

    fn add_service(m: &mut Model, name: &str, spec: &str) -> NamespacedName {
        let k8s = crate::yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: 198.19.0.1, ports: [{{name: http, port: 80}}], {spec}}}"
        ))
        .unwrap();
        let s = proxied(service_from_k8s(&k8s).unwrap());
        let id = s.id.clone();
        m.services.insert(id.clone(), s);
        id
    }

    fn add_slice(m: &mut Model, service: &str, name: &str, family: &str, rest: &str) {
        let k8s = crate::yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: {family}\n{rest}"
        ))
        .unwrap();
        m.upsert_slice(proxied(slice_from_k8s(&k8s).unwrap()));
    }

    #[test]
    fn local_endpoints_counts_distinct_ready_ips_on_this_node() {
        let mut m = Model::default();
        let web = add_service(
            &mut m,
            "web",
            "type: LoadBalancer, externalTrafficPolicy: Local",
        );
        add_slice(
            &mut m,
            "web",
            "web-a",
            "IPv4",
            "ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.0.0.1], nodeName: node-a}                        # ready absent: ready
- {addresses: [10.0.0.2], nodeName: node-a, conditions: {ready: true}}
- {addresses: [10.0.0.3], nodeName: node-a, conditions: {ready: false}}
- {addresses: [10.0.0.4], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}}
- {addresses: [10.0.0.5], nodeName: node-a, conditions: {ready: true, terminating: true}}
- {addresses: [10.0.0.6], nodeName: node-b}
- {addresses: [10.0.0.7]}                                           # no nodeName
",
        );
        // 10.0.0.1 again, behind another port and slice: counted once. 10.0.0.8 is new.
        add_slice(
            &mut m,
            "web",
            "web-b",
            "IPv4",
            "ports: [{name: https, port: 8443}]
endpoints: [{addresses: [10.0.0.1], nodeName: node-a}, {addresses: [10.0.0.8], nodeName: node-a}]",
        );
        // A slice without ports: kube-proxy has no entry for its endpoints.
        add_slice(
            &mut m,
            "web",
            "web-c",
            "IPv4",
            "endpoints: [{addresses: [10.0.0.9], nodeName: node-a}]",
        );
        // The dual-stack pods' IPv6 addresses count for IPv6 only.
        add_slice(
            &mut m,
            "web",
            "web-v6",
            "IPv6",
            "ports: [{name: http, port: 8080}]
endpoints: [{addresses: ['fd00::1'], nodeName: node-a}]",
        );
        assert_eq!(local_endpoints(&m, &web, "node-a", Family::V4), 3);
        assert_eq!(local_endpoints(&m, &web, "node-a", Family::V6), 1);
        assert_eq!(local_endpoints(&m, &web, "node-b", Family::V4), 1);
        assert_eq!(local_endpoints(&m, &web, "node-c", Family::V4), 0);
        assert_eq!(
            local_endpoints(&m, &nn("shop", "absent"), "node-a", Family::V4),
            0
        );
    }

    #[test]
    fn wanted_lists_load_balancers_with_local_policy_only() {
        let mut m = Model::default();
        add_service(
            &mut m,
            "lb-local",
            "type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 30001",
        );
        add_service(
            &mut m,
            "lb-cluster",
            "type: LoadBalancer, healthCheckNodePort: 30002",
        );
        add_service(
            &mut m,
            "np-local",
            "type: NodePort, externalTrafficPolicy: Local, healthCheckNodePort: 30003",
        );
        add_service(
            &mut m,
            "lb-no-port",
            "type: LoadBalancer, externalTrafficPolicy: Local",
        );
        add_slice(
            &mut m,
            "lb-local",
            "lb-local-a",
            "IPv4",
            "ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.0.0.1], nodeName: node-a}]",
        );
        assert_eq!(
            wanted(&m, "node-a"),
            vec![(
                30001,
                ServiceHealth {
                    service: nn("shop", "lb-local"),
                    local_endpoints: 1
                }
            )]
        );
        assert_eq!(wanted(&m, "node-b")[0].1.local_endpoints, 0);
    }

    #[test]
    fn body_is_kube_proxys_bytes() {
        let h = ServiceHealth {
            service: nn("shop", "web"),
            local_endpoints: 2,
        };
        assert_eq!(
            body(&h, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }

    // ---- real sockets on 127.0.0.1 ----

    const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    /// A port nothing listens on right now (the kernel's pick).
    fn free_port() -> u16 {
        std::net::TcpListener::bind((LO, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn health(name: &str, n: usize) -> ServiceHealth {
        ServiceHealth {
            service: nn("shop", name),
            local_endpoints: n,
        }
    }

    fn servers(addresses: Vec<IpAddr>) -> (HealthCheckServers, Arc<AtomicBool>) {
        let ok = Arc::new(AtomicBool::new(true));
        let flag = ok.clone();
        let hcs = HealthCheckServers::new(addresses, Arc::new(move || flag.load(Ordering::SeqCst)));
        (hcs, ok)
    }

    #[derive(Debug)]
    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
        fn json(&self) -> serde_json::Value {
            serde_json::from_str(&self.body).unwrap()
        }
    }

    /// One request on `conn`, answered with `Connection: close`.
    async fn request_on(mut conn: TcpStream, method: &str, path: &str) -> Reply {
        conn.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut raw))
            .await
            .expect("no answer within 5 s")
            .unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("no end of headers");
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap();
        Reply {
            status: status.parse().unwrap(),
            headers: lines
                .map(|l| {
                    let (n, v) = l.split_once(':').unwrap();
                    (n.trim().to_string(), v.trim().to_string())
                })
                .collect(),
            body: body.to_string(),
        }
    }

    async fn get(ip: IpAddr, port: u16, path: &str) -> Reply {
        request_on(TcpStream::connect((ip, port)).await.unwrap(), "GET", path).await
    }

    async fn refused(ip: IpAddr, port: u16) -> bool {
        matches!(
            TcpStream::connect((ip, port)).await,
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused
        )
    }

    fn expect_json(service: &str, n: usize, healthy: bool) -> serde_json::Value {
        serde_json::json!({
            "service": {"namespace": "shop", "name": service},
            "localEndpoints": n,
            "serviceProxyHealthy": healthy,
        })
    }

    #[tokio::test]
    async fn answers_any_path_and_method_with_kube_proxys_body_and_headers() {
        let (mut hcs, _) = servers(vec![LO]);
        let port = free_port();
        assert!(hcs.sync([(port, health("web", 2))]).is_empty());
        for (method, path) in [("GET", "/"), ("GET", "/healthz"), ("POST", "/any/path?x=1")] {
            let conn = TcpStream::connect((LO, port)).await.unwrap();
            let r = request_on(conn, method, path).await;
            assert_eq!(r.status, 200, "{method} {path}: {r:?}");
            assert_eq!(r.header("content-type"), Some("application/json"));
            assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
            assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("2"));
            assert_eq!(r.json(), expect_json("web", 2, true));
            assert_eq!(
                r.body,
                body(&health("web", 2), true),
                "kube-proxy's exact bytes"
            );
        }
    }

    #[tokio::test]
    async fn no_local_endpoint_or_unhealthy_proxy_is_503() {
        let (mut hcs, proxy_ok) = servers(vec![LO]);
        let (p0, p1) = (free_port(), free_port());
        assert!(
            hcs.sync([(p0, health("none", 0)), (p1, health("one", 1))])
                .is_empty()
        );
        let r = get(LO, p0, "/").await;
        assert_eq!((r.status, r.json()), (503, expect_json("none", 0, true)));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(get(LO, p1, "/").await.status, 200);

        proxy_ok.store(false, Ordering::SeqCst);
        let r = get(LO, p1, "/").await;
        assert_eq!((r.status, r.json()), (503, expect_json("one", 1, false)));
        proxy_ok.store(true, Ordering::SeqCst);
        assert_eq!(get(LO, p1, "/").await.status, 200);
    }

    #[tokio::test]
    async fn counts_change_live_without_restarting_the_server() {
        let (mut hcs, _) = servers(vec![LO]);
        let port = free_port();
        assert!(hcs.sync([(port, health("web", 1))]).is_empty());
        assert_eq!(get(LO, port, "/").await.json(), expect_json("web", 1, true));
        let slot = hcs.running[&port].listeners[0].slot.clone();
        // Connected (accepted by the running listener) before the change, asked after it.
        let early = TcpStream::connect((LO, port)).await.unwrap();

        assert!(hcs.sync([(port, health("web", 0))]).is_empty());
        let r = request_on(early, "GET", "/").await;
        assert_eq!((r.status, r.json()), (503, expect_json("web", 0, true)));
        assert!(
            Arc::ptr_eq(&slot, &hcs.running[&port].listeners[0].slot),
            "the same listener"
        );
        assert!(hcs.sync([(port, health("web", 3))]).is_empty());
        let r = get(LO, port, "/").await;
        assert_eq!((r.status, r.json()), (200, expect_json("web", 3, true)));
    }

    #[tokio::test]
    async fn a_port_no_longer_wanted_is_released_at_once() {
        let (mut hcs, _) = servers(vec![LO]);
        let port = free_port();
        assert!(hcs.sync([(port, health("web", 1))]).is_empty());
        assert_eq!(get(LO, port, "/").await.status, 200);

        assert!(hcs.sync(BTreeMap::new()).is_empty());
        assert!(hcs.ports().is_empty());
        // Released before `sync` returned: no yield to the runtime in between.
        let again = bind(SocketAddr::new(LO, port)).expect("the port is free again");
        drop(again);
        assert!(refused(LO, port).await);
        // And it serves again when wanted again.
        assert!(hcs.sync([(port, health("web", 1))]).is_empty());
        assert_eq!(get(LO, port, "/").await.status, 200);
        drop(hcs);
        assert!(refused(LO, port).await, "dropping the manager stops it");
    }

    #[tokio::test]
    async fn a_port_in_use_is_reported_and_retried_while_others_serve() {
        let (mut hcs, _) = servers(vec![LO]);
        let taken = std::net::TcpListener::bind((LO, 0)).unwrap();
        let busy = taken.local_addr().unwrap().port();
        let port = free_port();
        let want = BTreeMap::from([(busy, health("blocked", 1)), (port, health("web", 1))]);

        let failures = hcs.sync(want.clone());
        assert_eq!(failures.len(), 1, "{failures:?}");
        match &failures[0] {
            BindFailure::Io {
                service,
                port: p,
                addr,
                source,
            } => {
                assert_eq!(
                    (service, *p, *addr),
                    (&nn("shop", "blocked"), busy, SocketAddr::new(LO, busy))
                );
                assert_eq!(source.kind(), io::ErrorKind::AddrInUse);
            }
            other => panic!("{other:?}"),
        }
        assert!(
            failures[0].to_string().contains("shop/blocked")
                && failures[0].to_string().contains(&busy.to_string()),
            "{}",
            failures[0]
        );
        assert_eq!(hcs.ports(), vec![port]);
        assert_eq!(get(LO, port, "/").await.json(), expect_json("web", 1, true));

        // Still taken: reported again. Freed: the next sync binds it.
        assert_eq!(hcs.sync(want.clone()).len(), 1);
        drop(taken);
        assert!(hcs.sync(want).is_empty());
        assert_eq!(
            get(LO, busy, "/").await.json(),
            expect_json("blocked", 1, true)
        );
    }

    #[tokio::test]
    async fn the_first_service_by_name_gets_a_shared_port() {
        let (mut hcs, _) = servers(vec![LO]);
        let port = free_port();
        // Listed in the other order: the winner is by (namespace, name), not by position.
        let failures = hcs.sync(vec![(port, health("b", 2)), (port, health("a", 1))]);
        assert_eq!(failures.len(), 1, "{failures:?}");
        match &failures[0] {
            BindFailure::Conflict {
                service,
                port: p,
                winner,
            } => assert_eq!(
                (service, *p, winner),
                (&nn("shop", "b"), port, &nn("shop", "a"))
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(failures[0].service(), &nn("shop", "b"));
        assert_eq!(get(LO, port, "/").await.json(), expect_json("a", 1, true));
        // `a` leaves: `b` gets the port, on the same server.
        assert!(hcs.sync(vec![(port, health("b", 2))]).is_empty());
        assert_eq!(get(LO, port, "/").await.json(), expect_json("b", 2, true));
    }

    #[tokio::test]
    async fn changing_the_addresses_rebinds_every_server() {
        // Empty: 0.0.0.0, so reachable on 127.0.0.2 as well.
        let (mut hcs, _) = servers(Vec::new());
        let port = free_port();
        assert!(hcs.sync([(port, health("web", 1))]).is_empty());
        let lo2 = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        assert_eq!(get(lo2, port, "/").await.status, 200);

        // 0.0.0.0:port is closed before 127.0.0.1:port is bound, or the bind would fail.
        assert!(hcs.set_addresses(vec![LO]).is_empty());
        assert_eq!(get(LO, port, "/").await.json(), expect_json("web", 1, true));
        assert!(refused(lo2, port).await);

        assert!(hcs.set_addresses(vec![LO, lo2]).is_empty());
        assert_eq!(get(lo2, port, "/").await.status, 200);
        assert_eq!(get(LO, port, "/").await.status, 200);
    }
}
