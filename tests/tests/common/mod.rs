//! Shared pieces of the lbproxy integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use lbproxy_tests::lab::inspect::rows::ServiceRow;

use lbproxy_tests::lab::{
    Backend, Endpoint, EndpointSlice, Family, Lab, Lbproxy, Manifest, Pod, Proto, Protocol,
    Service, Shape, run_in_ns, tcp_request_here, udp_request_here, vip,
};

/// Generates `mod $name { fn routed(); fn bridge(); }` tests calling `$name(Shape)`.
#[macro_export]
macro_rules! both_shapes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn routed() {
                super::$name(lbproxy_tests::lab::Shape::Routed)
            }
            #[test]
            fn bridge() {
                super::$name(lbproxy_tests::lab::Shape::Bridge)
            }
        }
    )*};
}

/// Generates `mod $name { fn routed_ipv4(); fn routed_ipv6(); fn bridge_ipv4(); fn
/// bridge_ipv6(); }` tests calling `$name(Shape, Family)`: [`both_shapes!`] times
/// `lbproxy_tests::both_families!`, for a behaviour the same in both shapes and families.
#[macro_export]
macro_rules! both_shapes_and_families {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use lbproxy_tests::lab::{Family, Shape};
            #[test]
            fn routed_ipv4() {
                super::$name(Shape::Routed, Family::V4)
            }
            #[test]
            fn routed_ipv6() {
                super::$name(Shape::Routed, Family::V6)
            }
            #[test]
            fn bridge_ipv4() {
                super::$name(Shape::Bridge, Family::V4)
            }
            #[test]
            fn bridge_ipv6() {
                super::$name(Shape::Bridge, Family::V6)
            }
        }
    )*};
}

/// Per-request timeout for ordinary requests.
pub const T: Duration = Duration::from_secs(1);
/// How long lbproxy may take to report healthy after start.
pub const HEALTHY_WITHIN: Duration = Duration::from_secs(15);
/// The contract: manifest changes are applied within 1 s. The assertions allow 250 ms on
/// top for the file write, the watcher's wake-up and the probe loop's own granularity.
pub const APPLY_WITHIN: Duration = Duration::from_millis(1250);
/// How long after SIGTERM lbproxy may take to exit.
pub const EXIT_WITHIN: Duration = Duration::from_secs(5);

/// The standard test service: `default/web` on [`WEB_VIP`], TCP 80 ("http") -> 8080 and
/// UDP 53 ("dns") -> 5353.
pub const WEB_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
pub const WEB_TCP: u16 = 80;
pub const WEB_UDP: u16 = 53;
pub const BACKEND_TCP: u16 = 8080;
pub const BACKEND_UDP: u16 = 5353;

/// Service `name` on `vip` with TCP `WEB_TCP`->8080 ("http") and UDP `WEB_UDP`->5353
/// ("dns"), plus one slice `<name>-1` holding `endpoints`: single-stack, of `vip`'s family
/// (the endpoints must be of the same).
pub fn web_objects(name: &str, vip: impl Into<IpAddr>, endpoints: Vec<Endpoint>) -> Manifest {
    let vip = vip.into();
    let mut slice = EndpointSlice::new(&format!("{name}-1"), name)
        .port("http", BACKEND_TCP, Protocol::Tcp)
        .port("dns", BACKEND_UDP, Protocol::Udp);
    slice.endpoints = endpoints;
    Manifest::new()
        .with(
            Service::cluster_ip(name, vip)
                .port("http", WEB_TCP, Protocol::Tcp, BACKEND_TCP)
                .port("dns", WEB_UDP, Protocol::Udp, BACKEND_UDP),
        )
        .with(slice)
}

/// Ready endpoints for `pods`, with targetRefs.
pub fn ready(pods: &[&Pod]) -> Vec<Endpoint> {
    ready_in(Family::V4, pods)
}

/// Ready endpoints for `pods`' addresses in `family`, with targetRefs.
pub fn ready_in(family: Family, pods: &[&Pod]) -> Vec<Endpoint> {
    pods.iter()
        .map(|p| Endpoint::ready(pod_addr(p, family)).pod(&p.name))
        .collect()
}

/// Merges manifests.
pub fn merge(ms: impl IntoIterator<Item = Manifest>) -> Manifest {
    let mut out = Manifest::new();
    for m in ms {
        out.objects.extend(m.objects);
    }
    out
}

/// A lab with pods `client` and `backends` (each serving 8080 and 5353), the `web` service
/// over all backends written to the manifest, and lbproxy started and healthy.
pub struct Setup {
    pub lab: Lab,
    pub client: Pod,
    pub backends: Vec<Pod>,
    pub servers: Vec<Backend>,
    pub lb: Lbproxy,
}

impl Setup {
    pub fn new(shape: Shape, backends: &[&str]) -> Setup {
        Setup::with_members(shape, backends, backends)
    }

    /// Like [`Setup::new`], with extra `lbproxy run` arguments.
    pub fn with_args(shape: Shape, backends: &[&str], args: &[&str]) -> Setup {
        Setup::build(shape, backends, backends, args)
    }

    /// Like [`Setup::new`], but only `members` (a subset of `backends`) are in the service.
    pub fn with_members(shape: Shape, backends: &[&str], members: &[&str]) -> Setup {
        Setup::build(shape, backends, members, &[])
    }

    fn build(shape: Shape, backends: &[&str], members: &[&str], args: &[&str]) -> Setup {
        let lab = Lab::new(shape);
        let client = lab.add_pod("client");
        let (backends, servers) = serving_pods(&lab, backends);
        let m: Vec<&Pod> = backends
            .iter()
            .filter(|p| members.contains(&p.name.as_str()))
            .collect();
        lab.write_manifest(&web_objects("web", WEB_VIP, ready(&m)));
        let mut lb = lab.start_lbproxy_with(args);
        lb.expect_healthy(HEALTHY_WITHIN);
        Setup {
            lab,
            client,
            backends,
            servers,
            lb,
        }
    }

    pub fn backend(&self, name: &str) -> &Pod {
        self.backends.iter().find(|p| p.name == name).unwrap()
    }
}

/// Tallies `n` new TCP connections and `n` UDP requests (new source port each) from `client`
/// to the web service on `vip`; panics (with `ctx`) unless every request was answered from
/// the VIP:port. Returns (tcp, udp) counts per backend.
pub fn web_traffic_ok(
    ctx: &str,
    client: &Pod,
    vip: Ipv4Addr,
    n: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    web_traffic_ok_in(None, ctx, client, vip, n)
}

/// [`web_traffic_ok`] that adds `lab`'s diagnostics to the failure message.
pub fn web_traffic_ok_in(
    lab: Option<&Lab>,
    ctx: &str,
    client: &Pod,
    vip: Ipv4Addr,
    n: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let diag = || lab.map(Lab::diagnostics).unwrap_or_default();
    let t = client.tally(Proto::Tcp, vip, WEB_TCP, n, T);
    assert!(
        t.all_ok(),
        "{ctx}: TCP from {} ({}): {t}\n{}",
        client.name,
        client.ip,
        diag()
    );
    let u = client.tally(Proto::Udp, vip, WEB_UDP, n, T);
    assert!(
        u.all_ok(),
        "{ctx}: UDP from {} ({}): {u}\n{}",
        client.name,
        client.ip,
        diag()
    );
    (t.by_backend, u.by_backend)
}

/// One observed request in a probe loop.
#[derive(Clone, Debug)]
pub struct Obs {
    pub at: Duration,
    pub proto: Proto,
    pub result: Result<(String, SocketAddr), String>,
}

/// From `client`, alternates one TCP and one UDP request to the web service on `vip` for
/// `dur` (requests with a short timeout), recording what answered when.
pub fn probe_for(client: &Pod, vip: Ipv4Addr, dur: Duration, timeout: Duration) -> Vec<Obs> {
    let start = Instant::now();
    run_in_ns(&client.netns, || {
        let mut v = Vec::new();
        while start.elapsed() < dur {
            for proto in [Proto::Tcp, Proto::Udp] {
                let at = start.elapsed();
                let r = match proto {
                    Proto::Tcp => tcp_request_here(vip, WEB_TCP, timeout),
                    Proto::Udp => udp_request_here(vip, WEB_UDP, timeout, None),
                };
                v.push(Obs {
                    at,
                    proto,
                    result: r.map(|(r, s)| (r.backend, s)).map_err(|e| e.to_string()),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        v
    })
}

/// Summarizes observations: per proto, per backend, count and first/last time seen.
pub fn summarize(obs: &[Obs]) -> String {
    let mut m: BTreeMap<(Proto, String), (usize, Duration, Duration)> = BTreeMap::new();
    for o in obs {
        let key = match &o.result {
            Ok((b, src)) => (o.proto, format!("{b} via {src}")),
            Err(e) => (o.proto, format!("error {e}")),
        };
        let e = m.entry(key).or_insert((0, o.at, o.at));
        e.0 += 1;
        e.2 = o.at;
    }
    m.iter()
        .map(|((p, k), (n, first, last))| format!("{p} {k}: {n}x from {first:?} to {last:?}"))
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// The web VIP's frontends as `SocketAddr`s for source checks.
pub fn web_tcp_frontend(vip: Ipv4Addr) -> SocketAddr {
    SocketAddr::from((vip, WEB_TCP))
}

pub fn web_udp_frontend(vip: Ipv4Addr) -> SocketAddr {
    SocketAddr::from((vip, WEB_UDP))
}

pub fn default_vip() -> Ipv4Addr {
    vip(10)
}

/// Asserts no lbproxy program (`lb_from_pod`/`lb_to_pod`) is tcx-attached in `lab`'s node
/// namespace.
pub fn lb_attachments(lab: &Lab) -> Vec<lbproxy_tests::lab::bpf::TcxAttachment> {
    lab.tcx_attachments()
        .into_iter()
        .filter(|a| a.prog_name == "lb_from_pod" || a.prog_name == "lb_to_pod")
        .collect()
}

/// The backends of one `lbproxy inspect services --json` row as sorted `ip:port` strings
/// (`[ip]:port` for IPv6).
pub fn row_backends(row: &ServiceRow) -> Vec<String> {
    let mut b: Vec<String> = row
        .backends
        .iter()
        .map(|b| match b.addr.parse::<IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, b.port).to_string(),
            Err(_) => format!("{}:{}", b.addr, b.port),
        })
        .collect();
    b.sort();
    b
}

/// Adds the pods `names` to `lab`, each serving [`BACKEND_TCP`] and [`BACKEND_UDP`]; the
/// servers stop when the returned handles drop.
pub fn serving_pods(lab: &Lab, names: &[&str]) -> (Vec<Pod>, Vec<Backend>) {
    let pods: Vec<Pod> = names.iter().map(|n| lab.add_pod(n)).collect();
    let servers = pods
        .iter()
        .map(|p| p.serve(&[BACKEND_TCP, BACKEND_UDP]))
        .collect();
    (pods, servers)
}

/// A running `lbproxy monitor --json ARGS`: its stdout lines arrive on a channel.
pub struct Monitor {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Monitor {
    /// Starts it in the node namespace and waits until it says it listens.
    pub fn start(lab: &Lab, args: &[&str]) -> Monitor {
        use std::io::BufRead as _;
        let dir = lab.bpffs_dir().display().to_string();
        let bin = lbproxy_tests::lab::lbproxy_bin();
        let mut child = lab
            .node_command(bin.to_str().unwrap())
            .args(["monitor", "--json", "--bpffs-dir", &dir])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn lbproxy monitor");
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut banner = String::new();
        stderr.read_line(&mut banner).expect("monitor stderr");
        assert!(
            banner.contains("listening for drops and rejects"),
            "lbproxy monitor did not start listening: {banner:?} (exit {:?})",
            child.try_wait()
        );
        std::thread::spawn(move || {
            // Keep draining stderr so the monitor never blocks on it.
            for l in stderr.lines().map_while(Result::ok) {
                eprintln!("monitor: {l}");
            }
        });
        Monitor { child, lines }
    }

    /// The events printed until `n` arrived or `within` passed, parsed.
    pub fn events(&self, n: usize, within: Duration) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => out.push(
                    serde_json::from_str(&l)
                        .unwrap_or_else(|e| panic!("monitor line is not JSON ({e}): {l}")),
                ),
                Err(_) => break,
            }
        }
        out
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- IPv6: the `web` Service dual-stack ----

/// The Service's IPv6 clusterIP: outside the pods' `fd00:c612::/64`, routed nowhere.
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, 0x10);

/// The `web` Service with clusterIPs `WEB_VIP` and `VIP6`, its IPv4 slice holding the IPv4
/// addresses of `v4` and its IPv6 slice the IPv6 addresses of `v6`.
pub fn dual_stack_manifest(v4: &[&Pod], v6: &[&Pod]) -> String {
    dual_stack_manifest_with(v4, v6, "")
}

/// [`dual_stack_manifest`] with `spec` (YAML lines, indented two spaces) added to the
/// Service's spec.
pub fn dual_stack_manifest_with(v4: &[&Pod], v6: &[&Pod], spec: &str) -> String {
    let endpoints = |addrs: Vec<String>| -> String {
        if addrs.is_empty() {
            return "null".into();
        }
        let items: Vec<String> = addrs
            .iter()
            .map(|a| format!("{{addresses: [\"{a}\"], conditions: {{ready: true}}}}"))
            .collect();
        format!("[{}]", items.join(", "))
    };
    let slice = |name: &str, family: &str, addrs: Vec<String>| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels: {{kubernetes.io/service-name: web}}\naddressType: {family}\nports: [{{name: http, port: {BACKEND_TCP}, protocol: TCP}}, {{name: dns, port: {BACKEND_UDP}, protocol: UDP}}]\nendpoints: {}\n",
            endpoints(addrs)
        )
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\nspec:\n  clusterIP: {WEB_VIP}\n  clusterIPs: [\"{WEB_VIP}\", \"{VIP6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n{spec}  ports:\n  - {{name: http, port: {WEB_TCP}, protocol: TCP, targetPort: {BACKEND_TCP}}}\n  - {{name: dns, port: {WEB_UDP}, protocol: UDP, targetPort: {BACKEND_UDP}}}\n{}{}",
        slice(
            "web-v4",
            "IPv4",
            v4.iter().map(|p| p.ip.to_string()).collect()
        ),
        slice(
            "web-v6",
            "IPv6",
            v6.iter().map(|p| p.ip6.unwrap().to_string()).collect()
        ),
    )
}

/// Waits (at most [`APPLY_WITHIN`]) until a TCP request from `s`'s client to the IPv6
/// frontend `[VIP6]:WEB_TCP` is answered (the frontend is programmed).
pub fn wait_ipv6_served(s: &Setup) {
    let deadline = Instant::now() + APPLY_WITHIN;
    while s.client.tcp_request(VIP6, WEB_TCP, T).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One answered request: the backend that answered, the client address it saw, and the
/// address the answer came from.
#[derive(Debug)]
pub struct Answer {
    pub backend: String,
    pub client_seen: String,
    pub from: SocketAddr,
}

pub fn parse(line: &str, from: SocketAddr) -> Result<Answer, String> {
    let (backend, seen) = line
        .trim_end()
        .split_once(' ')
        .ok_or_else(|| format!("malformed reply {line:?}"))?;
    Ok(Answer {
        backend: backend.to_string(),
        client_seen: seen.to_string(),
        from,
    })
}

/// A new TCP connection to `[VIP6]:WEB_TCP` from the calling thread's namespace, one
/// request on it.
pub fn tcp6() -> Result<Answer, String> {
    let to = SocketAddr::from((VIP6, WEB_TCP));
    let mut c = TcpStream::connect_timeout(&to, T).map_err(|e| format!("connect {to}: {e}"))?;
    c.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
    c.write_all(b"hello\n").map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(&c)
        .read_line(&mut line)
        .map_err(|e| format!("read from {to}: {e}"))?;
    let peer = c.peer_addr().map_err(|e| e.to_string())?;
    parse(&line, peer)
}

/// One UDP request to `[VIP6]:WEB_UDP` from a new socket (a new source port, so a new flow).
pub fn udp6() -> Result<Answer, String> {
    let to = SocketAddr::from((VIP6, WEB_UDP));
    let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).map_err(|e| e.to_string())?;
    u.set_read_timeout(Some(T)).map_err(|e| e.to_string())?;
    u.send_to(b"hello\n", to)
        .map_err(|e| format!("send to {to}: {e}"))?;
    let mut buf = [0u8; 512];
    let (n, from) = u
        .recv_from(&mut buf)
        .map_err(|e| format!("no UDP answer from {to}: {e}"))?;
    parse(&String::from_utf8_lossy(&buf[..n]), from)
}

/// `n` TCP connections and `n` UDP requests over IPv6 from `client`: each must be answered
/// from the VIP:port it was sent to, by a backend that saw the client's own IPv6 address.
/// Returns the answers per backend, (TCP, UDP).
pub fn ipv6_traffic_ok(
    ctx: &str,
    s: &Setup,
    n: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let c6 = s.client.ip6.unwrap();
    let (tcp, udp) = s.client.run(|| {
        let tcp: Vec<_> = (0..n).map(|_| tcp6()).collect();
        let udp: Vec<_> = (0..n).map(|_| udp6()).collect();
        (tcp, udp)
    });
    let mut out = (BTreeMap::new(), BTreeMap::new());
    for (proto, answers, port, tally) in [
        ("TCP", tcp, WEB_TCP, &mut out.0),
        ("UDP", udp, WEB_UDP, &mut out.1),
    ] {
        for (i, a) in answers.into_iter().enumerate() {
            let a = a.unwrap_or_else(|e| {
                panic!(
                    "{ctx}: {proto} #{i} over IPv6: {e}\n{}",
                    s.lab.diagnostics()
                )
            });
            assert_eq!(
                a.from,
                SocketAddr::from((VIP6, port)),
                "{ctx}: {proto} #{i}: the answer must come from the IPv6 ClusterIP: {a:?}"
            );
            let seen: SocketAddr = a.client_seen.parse().unwrap();
            assert_eq!(
                seen.ip(),
                IpAddr::V6(c6),
                "{ctx}: {proto} #{i}: the backend must see the client's own address: {a:?}"
            );
            *tally.entry(a.backend).or_insert(0) += 1;
        }
    }
    out
}

// ---- Either family: a test written once for both ----

/// The `web` Service's clusterIP in `family`: [`WEB_VIP`] or [`VIP6`].
pub fn web_vip(family: Family) -> IpAddr {
    match family {
        Family::V4 => WEB_VIP.into(),
        Family::V6 => VIP6.into(),
    }
}

/// Service VIP number `n` in `family`: [`vip`]`(n)`, or `fd00:c612:ffff::` with `n`'s
/// decimal digits as its last group (`vip_in(Family::V6, 10)` is [`VIP6`]).
pub fn vip_in(family: Family, n: u8) -> IpAddr {
    match family {
        Family::V4 => vip(n).into(),
        Family::V6 => {
            let last = u16::from_str_radix(&n.to_string(), 16).unwrap();
            Ipv6Addr::new(0xfd00, 0xc612, 0xffff, 0, 0, 0, 0, last).into()
        }
    }
}

/// Waits until `t` (at once if it has passed).
pub fn sleep_until(t: std::time::Instant) {
    std::thread::sleep(t.saturating_duration_since(std::time::Instant::now()));
}

/// `pod`'s address in `family`.
pub fn pod_addr(pod: &Pod, family: Family) -> IpAddr {
    match family {
        Family::V4 => pod.ip.into(),
        Family::V6 => pod
            .ip6
            .unwrap_or_else(|| panic!("{} has no IPv6 address", pod.name))
            .into(),
    }
}

/// Makes `s`'s `web` Service serve `family` over `pods`: nothing to do for IPv4 ([`Setup`]
/// wrote the IPv4 Service); for IPv6, the Service turned dual-stack over `pods` in both
/// families, waited on until its IPv6 frontend answers.
pub fn serve_family(s: &Setup, family: Family, pods: &[&Pod]) {
    if family == Family::V6 {
        s.lab.write_manifest_text(&dual_stack_manifest(pods, pods));
        wait_ipv6_served(s);
    }
}

/// `n` TCP connections and `n` UDP requests from `s`'s client to `web` over `family`, with
/// each family's checks: [`web_traffic_ok_in`] for IPv4 (every request answered, from the
/// VIP:port), [`ipv6_traffic_ok`] for IPv6 (the same, and the backend saw the client's own
/// address). Returns the answers per backend, (TCP, UDP).
pub fn traffic_ok(
    s: &Setup,
    family: Family,
    ctx: &str,
    n: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    match family {
        Family::V4 => web_traffic_ok_in(Some(&s.lab), ctx, &s.client, WEB_VIP, n),
        Family::V6 => ipv6_traffic_ok(ctx, s, n),
    }
}

/// `iptables` for IPv4, `ip6tables` for IPv6.
pub fn iptables(family: Family) -> &'static str {
    match family {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    }
}
