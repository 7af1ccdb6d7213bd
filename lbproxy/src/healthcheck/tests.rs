//! The health-check servers' tests: what each port answers, and how conflicts are settled.

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
        format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
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
