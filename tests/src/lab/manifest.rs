//! Rendering `v1` Service and `discovery.k8s.io/v1` EndpointSlice objects as YAML, the way
//! Kubernetes serializes them (`kubectl get -o yaml`: keys sorted, defaults filled in), and
//! writing manifest files atomically.
//!
//! ```no_run
//! use lbproxy_tests::lab::manifest::*;
//! let m = Manifest::new()
//!     .with(Service::cluster_ip("web", "198.19.0.10").port("http", 80, Protocol::Tcp, 8080))
//!     .with(
//!         EndpointSlice::new("web-abc", "web")
//!             .port("http", 8080, Protocol::Tcp)
//!             .endpoint(Endpoint::ready("198.18.0.3").pod("b1")),
//!     );
//! write_atomic("/tmp/x/cluster.yaml".as_ref(), &m.to_yaml(), None).unwrap();
//! ```

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A port protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl From<super::Proto> for Protocol {
    fn from(p: super::Proto) -> Self {
        match p {
            super::Proto::Tcp => Protocol::Tcp,
            super::Proto::Udp => Protocol::Udp,
        }
    }
}

/// A Service port's `targetPort`: a number or a container port name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

impl From<u16> for TargetPort {
    fn from(n: u16) -> Self {
        TargetPort::Number(n)
    }
}

impl From<&str> for TargetPort {
    fn from(s: &str) -> Self {
        TargetPort::Name(s.to_owned())
    }
}

/// One entry of `spec.ports`.
#[derive(Clone, Debug)]
pub struct ServicePort {
    /// `None` or empty: the name is omitted (allowed for single-port services).
    pub name: Option<String>,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: TargetPort,
}

/// A `v1` Service of type ClusterIP, single-stack: `ipFamilies` is `[IPv6]` when its
/// clusterIP is an IPv6 address, else `[IPv4]`.
#[derive(Clone, Debug)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    /// Kept as a string so tests can write invalid values.
    pub cluster_ip: String,
    pub ports: Vec<ServicePort>,
    /// Extra `metadata.labels`.
    pub labels: Vec<(String, String)>,
}

impl Service {
    /// A ClusterIP service `default/name` with `clusterIP`/`clusterIPs` = `ip`, no ports yet.
    pub fn cluster_ip(name: &str, ip: impl ToString) -> Service {
        Service {
            name: name.to_owned(),
            namespace: "default".to_owned(),
            cluster_ip: ip.to_string(),
            ports: Vec::new(),
            labels: Vec::new(),
        }
    }

    pub fn namespace(mut self, ns: &str) -> Service {
        self.namespace = ns.to_owned();
        self
    }

    /// Adds a port. `name` "" means unnamed.
    pub fn port(
        mut self,
        name: &str,
        port: u16,
        protocol: Protocol,
        target_port: impl Into<TargetPort>,
    ) -> Service {
        self.ports.push(ServicePort {
            name: (!name.is_empty()).then(|| name.to_owned()),
            port,
            protocol,
            target_port: target_port.into(),
        });
        self
    }

    pub fn label(mut self, k: &str, v: &str) -> Service {
        self.labels.push((k.to_owned(), v.to_owned()));
        self
    }

    /// `IPv6` when the clusterIP is an IPv6 address, else `IPv4`.
    pub fn ip_family(&self) -> &'static str {
        ip_family(&self.cluster_ip)
    }

    pub fn to_yaml(&self) -> String {
        let mut y = String::new();
        y.push_str("apiVersion: v1\nkind: Service\nmetadata:\n");
        if !self.labels.is_empty() {
            y.push_str("  labels:\n");
            let mut labels = self.labels.clone();
            labels.sort();
            for (k, v) in &labels {
                let _ = writeln!(y, "    {}: {}", scalar(k), scalar(v));
            }
        }
        let _ = writeln!(y, "  name: {}", scalar(&self.name));
        let _ = writeln!(y, "  namespace: {}", scalar(&self.namespace));
        y.push_str("spec:\n");
        let _ = writeln!(y, "  clusterIP: {}", scalar(&self.cluster_ip));
        let _ = writeln!(y, "  clusterIPs:\n  - {}", scalar(&self.cluster_ip));
        let _ = writeln!(
            y,
            "  internalTrafficPolicy: Cluster\n  ipFamilies:\n  - {}",
            self.ip_family()
        );
        y.push_str("  ipFamilyPolicy: SingleStack\n");
        if !self.ports.is_empty() {
            y.push_str("  ports:\n");
            for p in &self.ports {
                let mut first = true;
                let mut item = |line: String| {
                    let _ = writeln!(y, "  {} {line}", if first { "-" } else { " " });
                    first = false;
                };
                if let Some(n) = &p.name {
                    item(format!("name: {}", scalar(n)));
                }
                item(format!("port: {}", p.port));
                item(format!("protocol: {}", p.protocol.as_str()));
                item(match &p.target_port {
                    TargetPort::Number(n) => format!("targetPort: {n}"),
                    TargetPort::Name(s) => format!("targetPort: {}", scalar(s)),
                });
            }
        }
        y.push_str("  sessionAffinity: None\n  type: ClusterIP\nstatus:\n  loadBalancer: {}\n");
        y
    }

    /// The same object as JSON, the way the API server returns it (for
    /// [`crate::apiserver::ApiServer::apply`]; the server fills in `resourceVersion`, `uid`, ...).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let mut metadata = json!({"name": self.name, "namespace": self.namespace});
        if !self.labels.is_empty() {
            let labels: serde_json::Map<String, serde_json::Value> = self
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            metadata["labels"] = serde_json::Value::Object(labels);
        }
        let ports: Vec<serde_json::Value> = self
            .ports
            .iter()
            .map(|p| {
                let mut o = json!({
                    "port": p.port,
                    "protocol": p.protocol.as_str(),
                    "targetPort": match &p.target_port {
                        TargetPort::Number(n) => json!(n),
                        TargetPort::Name(s) => json!(s),
                    },
                });
                if let Some(n) = &p.name {
                    o["name"] = json!(n);
                }
                o
            })
            .collect();
        let mut spec = json!({
            "clusterIP": self.cluster_ip,
            "clusterIPs": [self.cluster_ip],
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": [self.ip_family()],
            "ipFamilyPolicy": "SingleStack",
            "sessionAffinity": "None",
            "type": "ClusterIP",
        });
        if !ports.is_empty() {
            spec["ports"] = json!(ports);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": spec,
            "status": {"loadBalancer": {}},
        })
    }
}

/// `endpoints[].conditions`. `None` omits the key (Kubernetes: absent `ready` means ready).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Conditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

impl Conditions {
    /// ready, serving, not terminating.
    pub const READY: Conditions = Conditions {
        ready: Some(true),
        serving: Some(true),
        terminating: Some(false),
    };
    /// not ready, not serving, not terminating (e.g. failing its readiness probe).
    pub const NOT_READY: Conditions = Conditions {
        ready: Some(false),
        serving: Some(false),
        terminating: Some(false),
    };
    /// terminating but still serving.
    pub const TERMINATING_SERVING: Conditions = Conditions {
        ready: Some(false),
        serving: Some(true),
        terminating: Some(true),
    };
    /// All keys absent: `conditions: {}`.
    pub const ABSENT: Conditions = Conditions {
        ready: None,
        serving: None,
        terminating: None,
    };
}

/// `IPv6` when `addr` is an IPv6 address, else `IPv4` (also for an invalid one).
fn ip_family(addr: &str) -> &'static str {
    if addr.parse::<std::net::Ipv6Addr>().is_ok() {
        "IPv6"
    } else {
        "IPv4"
    }
}

/// One entry of an EndpointSlice's `endpoints`.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Kept as strings so tests can write invalid values.
    pub addresses: Vec<String>,
    pub conditions: Conditions,
    pub node_name: Option<String>,
    /// `targetRef` to a Pod of this name (same namespace as the slice), if set.
    pub pod: Option<String>,
    /// `hints.forZones` names (empty: none).
    pub for_zones: Vec<String>,
    /// `hints.forNodes` names (empty: none).
    pub for_nodes: Vec<String>,
}

impl Endpoint {
    pub fn new(addr: impl ToString, conditions: Conditions) -> Endpoint {
        Endpoint {
            addresses: vec![addr.to_string()],
            conditions,
            node_name: Some("lab-node".to_owned()),
            pod: None,
            for_zones: Vec::new(),
            for_nodes: Vec::new(),
        }
    }

    /// Ready, serving, not terminating.
    pub fn ready(addr: impl ToString) -> Endpoint {
        Endpoint::new(addr, Conditions::READY)
    }

    /// Not ready, not serving.
    pub fn not_ready(addr: impl ToString) -> Endpoint {
        Endpoint::new(addr, Conditions::NOT_READY)
    }

    /// Adds a `targetRef` to pod `name`.
    pub fn pod(mut self, name: &str) -> Endpoint {
        self.pod = Some(name.to_owned());
        self
    }

    /// Adds `hints: {forZones: [{name: Z}...], forNodes: [{name: N}...]}` (an empty list is
    /// left out).
    pub fn hints(mut self, zones: &[&str], nodes: &[&str]) -> Endpoint {
        self.for_zones = zones.iter().map(|z| z.to_string()).collect();
        self.for_nodes = nodes.iter().map(|n| n.to_string()).collect();
        self
    }

    /// Sets `nodeName` (default `lab-node`); `None` omits it.
    pub fn node(mut self, name: Option<&str>) -> Endpoint {
        self.node_name = name.map(str::to_owned);
        self
    }
}

/// One entry of an EndpointSlice's `ports`: named after the *Service port's* name, with the
/// resolved targetPort number.
#[derive(Clone, Debug)]
pub struct EndpointPort {
    /// `None`: unnamed. Kubernetes writes an unnamed port as `name: ""`.
    pub name: Option<String>,
    pub port: u16,
    pub protocol: Protocol,
}

/// A `discovery.k8s.io/v1` EndpointSlice: addressType IPv6 when its first endpoint's first
/// address is an IPv6 address, else IPv4.
#[derive(Clone, Debug)]
pub struct EndpointSlice {
    pub name: String,
    pub namespace: String,
    /// Value of the `kubernetes.io/service-name` label.
    pub service_name: String,
    pub endpoints: Vec<Endpoint>,
    pub ports: Vec<EndpointPort>,
}

impl EndpointSlice {
    /// Slice `default/name` for service `service`, no endpoints or ports yet.
    pub fn new(name: &str, service: &str) -> EndpointSlice {
        EndpointSlice {
            name: name.to_owned(),
            namespace: "default".to_owned(),
            service_name: service.to_owned(),
            endpoints: Vec::new(),
            ports: Vec::new(),
        }
    }

    pub fn namespace(mut self, ns: &str) -> EndpointSlice {
        self.namespace = ns.to_owned();
        self
    }

    /// Adds a port; `name` must equal the Service port's name ("" for an unnamed one).
    pub fn port(mut self, name: &str, port: u16, protocol: Protocol) -> EndpointSlice {
        self.ports.push(EndpointPort {
            name: Some(name.to_owned()),
            port,
            protocol,
        });
        self
    }

    pub fn endpoint(mut self, e: Endpoint) -> EndpointSlice {
        self.endpoints.push(e);
        self
    }

    /// `IPv6` when the first endpoint's first address is an IPv6 address, else `IPv4`.
    pub fn address_type(&self) -> &'static str {
        let first = self.endpoints.first().and_then(|e| e.addresses.first());
        first.map_or("IPv4", |a| ip_family(a))
    }

    pub fn to_yaml(&self) -> String {
        let mut y = String::new();
        let _ = writeln!(y, "addressType: {}", self.address_type());
        y.push_str("apiVersion: discovery.k8s.io/v1\n");
        if self.endpoints.is_empty() {
            y.push_str("endpoints: null\n");
        } else {
            y.push_str("endpoints:\n");
        }
        for e in &self.endpoints {
            y.push_str("- addresses:\n");
            for a in &e.addresses {
                let _ = writeln!(y, "  - {}", scalar(a));
            }
            let c = e.conditions;
            if c == Conditions::ABSENT {
                y.push_str("  conditions: {}\n");
            } else {
                y.push_str("  conditions:\n");
                for (k, v) in [
                    ("ready", c.ready),
                    ("serving", c.serving),
                    ("terminating", c.terminating),
                ] {
                    if let Some(v) = v {
                        let _ = writeln!(y, "    {k}: {v}");
                    }
                }
            }
            if let Some(n) = &e.node_name {
                let _ = writeln!(y, "  nodeName: {}", scalar(n));
            }
            if !e.for_zones.is_empty() || !e.for_nodes.is_empty() {
                y.push_str("  hints:\n");
                for (k, names) in [("forZones", &e.for_zones), ("forNodes", &e.for_nodes)] {
                    if !names.is_empty() {
                        let _ = writeln!(y, "    {k}:");
                        for n in names {
                            let _ = writeln!(y, "    - name: {}", scalar(n));
                        }
                    }
                }
            }
            if let Some(p) = &e.pod {
                let _ = writeln!(
                    y,
                    "  targetRef:\n    kind: Pod\n    name: {}\n    namespace: {}",
                    scalar(p),
                    scalar(&self.namespace)
                );
            }
        }
        y.push_str("kind: EndpointSlice\nmetadata:\n  labels:\n");
        y.push_str("    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n");
        let _ = writeln!(
            y,
            "    kubernetes.io/service-name: {}",
            scalar(&self.service_name)
        );
        let _ = writeln!(y, "  name: {}", scalar(&self.name));
        let _ = writeln!(y, "  namespace: {}", scalar(&self.namespace));
        if self.ports.is_empty() {
            y.push_str("ports: null\n");
        } else {
            y.push_str("ports:\n");
            for p in &self.ports {
                let _ = writeln!(y, "- name: {}", scalar(p.name.as_deref().unwrap_or("")));
                let _ = writeln!(y, "  port: {}", p.port);
                let _ = writeln!(y, "  protocol: {}", p.protocol.as_str());
            }
        }
        y
    }

    /// The same object as JSON, the way the API server returns it (`endpoints: null` and
    /// `ports: null` when empty, as Kubernetes serializes them).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let endpoints: Vec<serde_json::Value> = self
            .endpoints
            .iter()
            .map(|e| {
                let c = e.conditions;
                let mut cond = serde_json::Map::new();
                for (k, v) in [
                    ("ready", c.ready),
                    ("serving", c.serving),
                    ("terminating", c.terminating),
                ] {
                    if let Some(v) = v {
                        cond.insert(k.into(), json!(v));
                    }
                }
                let mut o = json!({"addresses": e.addresses, "conditions": cond});
                if let Some(n) = &e.node_name {
                    o["nodeName"] = json!(n);
                }
                let names = |v: &[String]| -> Vec<serde_json::Value> {
                    v.iter().map(|n| json!({"name": n})).collect()
                };
                let mut hints = serde_json::Map::new();
                if !e.for_zones.is_empty() {
                    hints.insert("forZones".into(), json!(names(&e.for_zones)));
                }
                if !e.for_nodes.is_empty() {
                    hints.insert("forNodes".into(), json!(names(&e.for_nodes)));
                }
                if !hints.is_empty() {
                    o["hints"] = serde_json::Value::Object(hints);
                }
                if let Some(p) = &e.pod {
                    o["targetRef"] = json!({"kind": "Pod", "name": p, "namespace": self.namespace});
                }
                o
            })
            .collect();
        let ports: Vec<serde_json::Value> = self
            .ports
            .iter()
            .map(|p| {
                json!({
                    "name": p.name.as_deref().unwrap_or(""),
                    "port": p.port,
                    "protocol": p.protocol.as_str(),
                })
            })
            .collect();
        json!({
            "addressType": self.address_type(),
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "labels": {
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    "kubernetes.io/service-name": self.service_name,
                },
                "name": self.name,
                "namespace": self.namespace,
            },
            "endpoints": if endpoints.is_empty() { serde_json::Value::Null } else { json!(endpoints) },
            "ports": if ports.is_empty() { serde_json::Value::Null } else { json!(ports) },
        })
    }
}

/// A v1 Node: its name and its `topology.kubernetes.io/zone` label.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub zone: Option<String>,
}

impl Node {
    pub fn new(name: &str, zone: Option<&str>) -> Node {
        Node {
            name: name.to_owned(),
            zone: zone.map(str::to_owned),
        }
    }

    pub fn to_yaml(&self) -> String {
        let mut y = format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n",
            scalar(&self.name)
        );
        if let Some(z) = &self.zone {
            let _ = writeln!(
                y,
                "  labels:\n    topology.kubernetes.io/zone: {}",
                scalar(z)
            );
        }
        y
    }

    pub fn to_json(&self) -> serde_json::Value {
        let mut o = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name},
        });
        if let Some(z) = &self.zone {
            o["metadata"]["labels"] = serde_json::json!({"topology.kubernetes.io/zone": z});
        }
        o
    }
}

/// Any object a manifest may hold.
#[derive(Clone, Debug)]
pub enum Object {
    Service(Service),
    EndpointSlice(EndpointSlice),
    Node(Node),
}

impl Object {
    pub fn to_yaml(&self) -> String {
        match self {
            Object::Service(s) => s.to_yaml(),
            Object::EndpointSlice(s) => s.to_yaml(),
            Object::Node(n) => n.to_yaml(),
        }
    }

    /// See [`Service::to_json`] and [`EndpointSlice::to_json`].
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Object::Service(s) => s.to_json(),
            Object::EndpointSlice(s) => s.to_json(),
            Object::Node(n) => n.to_json(),
        }
    }
}

impl From<Node> for Object {
    fn from(n: Node) -> Self {
        Object::Node(n)
    }
}

impl From<Service> for Object {
    fn from(s: Service) -> Self {
        Object::Service(s)
    }
}

impl From<EndpointSlice> for Object {
    fn from(s: EndpointSlice) -> Self {
        Object::EndpointSlice(s)
    }
}

/// A multi-document YAML manifest.
#[derive(Clone, Debug, Default)]
pub struct Manifest {
    pub objects: Vec<Object>,
}

impl Manifest {
    pub fn new() -> Manifest {
        Manifest::default()
    }

    pub fn with(mut self, o: impl Into<Object>) -> Manifest {
        self.objects.push(o.into());
        self
    }

    pub fn push(&mut self, o: impl Into<Object>) {
        self.objects.push(o.into());
    }

    /// The documents joined with `---` lines (empty string for no objects).
    pub fn to_yaml(&self) -> String {
        self.objects
            .iter()
            .map(Object::to_yaml)
            .collect::<Vec<_>>()
            .join("---\n")
    }
}

/// Renders a YAML scalar, quoting it when a plain scalar would be read as something other
/// than that string.
fn scalar(s: &str) -> String {
    let plain_ok = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-./_".contains(c))
        && !s.starts_with(['-', '.'])
        && s.parse::<f64>().is_err()
        && !matches!(
            s.to_ascii_lowercase().as_str(),
            "true" | "false" | "yes" | "no" | "on" | "off" | "null" | "y" | "n" | "~"
        );
    if plain_ok {
        s.to_owned()
    } else {
        format!("{s:?}")
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `contents` to `path` atomically: writes a temporary file, fsyncs it and renames it
/// over `path`, so a watcher never sees a half-written file. The temporary file is created
/// in `tmp_dir` (must be on the same filesystem) or, if `None`, next to `path` as a hidden
/// `.NAME.tmp-…` file.
pub fn write_atomic(path: &Path, contents: &str, tmp_dir: Option<&Path>) -> io::Result<()> {
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
        .to_string_lossy()
        .into_owned();
    let dir = tmp_dir
        .map(Path::to_path_buf)
        .or_else(|| path.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| ".".into());
    let tmp = dir.join(format!(
        ".{file_name}.tmp-{}-{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_yaml() {
        let s = Service::cluster_ip("web", "198.19.0.10")
            .port("http", 80, Protocol::Tcp, 8080)
            .port("dns", 53, Protocol::Udp, "dns-port");
        let y = s.to_yaml();
        assert!(y.contains("  clusterIPs:\n  - 198.19.0.10\n"), "{y}");
        assert!(
            y.contains("  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n"),
            "{y}"
        );
        assert!(y.contains("    targetPort: dns-port\n"), "{y}");
    }

    #[test]
    fn slice_yaml() {
        let s = EndpointSlice::new("web-1", "web")
            .port("http", 8080, Protocol::Tcp)
            .port("", 53, Protocol::Udp)
            .endpoint(Endpoint::ready("198.18.0.3").pod("b1"))
            .endpoint(Endpoint::new("198.18.0.4", Conditions::ABSENT));
        let y = s.to_yaml();
        assert!(y.contains("    kubernetes.io/service-name: web\n"), "{y}");
        assert!(
            y.contains("- addresses:\n  - 198.18.0.3\n  conditions:\n    ready: true\n    serving: true\n    terminating: false\n"),
            "{y}"
        );
        assert!(y.contains("  conditions: {}\n"), "{y}");
        assert!(
            y.contains("- name: \"\"\n  port: 53\n  protocol: UDP\n"),
            "{y}"
        );
    }

    #[test]
    fn scalars() {
        assert_eq!(scalar("web"), "web");
        assert_eq!(scalar("198.19.0.10"), "198.19.0.10");
        assert_eq!(scalar("80"), "\"80\"");
        assert_eq!(scalar("true"), "\"true\"");
        assert_eq!(scalar(""), "\"\"");
        assert_eq!(scalar("a: b"), "\"a: b\"");
    }
}
