//! ServiceCIDRs from the Kubernetes API source (issue 28 §2): lbproxy lists and watches
//! `networking.k8s.io/v1` `servicecidrs` on a real list+watch API server, and an API server
//! without the resource (404, as before Kubernetes 1.33) leaves lbproxy serving with no
//! ServiceCIDR, one log line, and no crash loop. Both pod-network shapes.
//!
//! 1. [`service_cidrs_are_watched`]: a ServiceCIDR in the API server at start makes an
//!    undefined port of `web`'s ClusterIP refused at once and an unallocated address of the
//!    range dropped (counted); deleting it by a watch event stops both; creating it again
//!    brings them back.
//! 2. [`an_api_server_without_service_cidrs`]: `servicecidrs` answers 404: lbproxy becomes
//!    healthy and serves `web`, logs one line naming the resource, asks for it again at
//!    most once in 4 s, and an undefined port is not refused.

mod common;
mod kube_common;

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use kube_common::*;
use lbproxy_tests::lab::{Inspect as _, Pod, Proto, Shape, vip};
use serde_json::json;

both_shapes!(
    service_cidrs_are_watched,
    an_api_server_without_service_cidrs
);

const UNDEFINED_PORT: u16 = 81;
const REFUSED_WITHIN: Duration = Duration::from_millis(500);

fn service_cidr() -> serde_json::Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["198.19.0.0/16"]},
    })
}

/// A TCP connect and a connected UDP socket's datagram from `client` to `addr:port`: whether
/// each was refused within [`REFUSED_WITHIN`].
fn refused(client: &Pod, addr: IpAddr, port: u16) -> (bool, bool) {
    client.run(|| {
        let t = Instant::now();
        let tcp = TcpStream::connect_timeout(&SocketAddr::new(addr, port), REFUSED_WITHIN);
        let tcp = matches!(tcp, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
            && t.elapsed() < REFUSED_WITHIN;
        let t = Instant::now();
        let udp = (|| -> io::Result<()> {
            let u = UdpSocket::bind("0.0.0.0:0")?;
            u.connect((addr, port))?;
            u.set_read_timeout(Some(REFUSED_WITHIN))?;
            u.send(b"hello\n")?;
            u.recv(&mut [0u8; 64]).map(|_| ())
        })();
        let udp = matches!(udp, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
            && t.elapsed() < REFUSED_WITHIN;
        (tcp, udp)
    })
}

fn start(shape: Shape, hide: bool) -> Kube {
    let mut k = Kube::new(shape, &["client", "b1"]);
    let (web, webs) = web_json("web", WEB_VIP, ready_ips(&[k.ip("b1")]));
    k.api.apply_all([web, webs]);
    if hide {
        k.api.hide_resource("servicecidrs");
    } else {
        k.api.apply(service_cidr());
    }
    k.start_healthy();
    k.wait_fes("web", APPLY, &web_fes("web", WEB_VIP, &[k.ip("b1")]));
    k
}

fn web_serves(k: &Kube, ctx: &str) {
    let client = k.pod("client");
    for (proto, port) in [(Proto::Tcp, WEB_TCP), (Proto::Udp, WEB_UDP)] {
        let t = client.tally(proto, WEB_VIP, port, 3, T);
        assert!(
            t.all_ok() && t.count("b1") == 3,
            "{ctx}: web port {port}: {t}\n{}",
            k.diag()
        );
    }
}

fn service_cidrs_are_watched(shape: Shape) {
    let k = start(shape, false);
    let client = k.pod("client").clone();
    let unallocated: IpAddr = vip(99).into();
    let vip: IpAddr = WEB_VIP.into();
    assert_eq!(
        refused(&client, vip, UNDEFINED_PORT),
        (true, true),
        "[{shape}] listed ServiceCIDR: {vip}:{UNDEFINED_PORT} must be refused\n{}",
        k.diag()
    );
    let d0 = k.lab.drop_count("service_cidr_unallocated");
    assert_eq!(refused(&client, unallocated, WEB_TCP), (false, false));
    let d1 = k.lab.drop_count("service_cidr_unallocated");
    assert!(
        d1 >= d0 + 2,
        "[{shape}] {unallocated} not dropped: {d0} -> {d1}"
    );
    web_serves(&k, &format!("[{shape}] with the ServiceCIDR"));

    // Deleted by a watch event: neither refused nor dropped any more.
    assert!(k.api.delete("ServiceCIDR", "", "kubernetes"));
    let ctx = format!("[{shape}] ServiceCIDR deleted");
    lbproxy_tests::lab::wait_for(APPLY, Duration::from_millis(100), || {
        (refused(&client, vip, UNDEFINED_PORT) == (false, false)).then_some(())
    })
    .unwrap_or_else(|_| panic!("{ctx}: still refused\n{}", k.diag()));
    let d2 = k.lab.drop_count("service_cidr_unallocated");
    refused(&client, unallocated, WEB_TCP);
    assert_eq!(
        k.lab.drop_count("service_cidr_unallocated"),
        d2,
        "{ctx}: still dropped"
    );

    // Created again.
    k.api.apply(service_cidr());
    lbproxy_tests::lab::wait_for(APPLY, Duration::from_millis(100), || {
        (refused(&client, vip, UNDEFINED_PORT) == (true, true)).then_some(())
    })
    .unwrap_or_else(|_| {
        panic!(
            "[{shape}] ServiceCIDR created again: not refused\n{}",
            k.diag()
        )
    });
    web_serves(&k, &format!("[{shape}] after"));
}

fn an_api_server_without_service_cidrs(shape: Shape) {
    let mut k = start(shape, true);
    let ctx = format!("[{shape}] no servicecidrs resource");
    web_serves(&k, &ctx);
    let from = k.api.request_count();
    std::thread::sleep(Duration::from_secs(4));
    let asked = lists_since(&k.api.requests_since(from), "servicecidrs").len()
        + watches_since(&k.api.requests_since(from), "servicecidrs").len();
    assert!(
        asked <= 1,
        "{ctx}: asked for servicecidrs {asked} times in 4 s\n{}",
        k.diag()
    );
    assert!(k.lb().is_running(), "{ctx}: lbproxy exited\n{}", k.diag());
    let log = k.lb().stderr();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("servicecidrs")).collect();
    assert_eq!(
        lines.len(),
        1,
        "{ctx}: want one line about servicecidrs:\n{log}"
    );
    eprintln!("{ctx}: logged {}", lines[0]);
    assert!(
        lines[0].contains("404") && lines[0].contains("taken as none"),
        "{ctx}: the line must say why and what follows: {}",
        lines[0]
    );
    let client = k.pod("client").clone();
    assert_eq!(
        refused(&client, WEB_VIP.into(), UNDEFINED_PORT),
        (false, false),
        "{ctx}: an undefined port refused without any ServiceCIDR"
    );
}
