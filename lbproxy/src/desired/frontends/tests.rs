//! Which frontends a service asks for, and with which endpoints and policy.

use super::*;

fn model_of(text: &str) -> Model {
    use crate::source::manifests;
    manifests::parse(std::path::Path::new("x.yaml"), text)
        .unwrap()
        .model
}

const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 198.19.0.10, ports: [{name: http, port: 80}]}\n";

fn slice_with(endpoints: &str) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-a, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: {endpoints}\n"
    )
}

fn addrs(v: &[BackendAddr]) -> Vec<String> {
    v.iter().map(|b| b.addr.to_string()).collect()
}

#[test]
fn terminating_serving_endpoints_are_the_fallback_when_none_is_ready() {
    let m = model_of(&format!(
        "{SVC}{}",
        slice_with(
            "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.3], conditions: {ready: false, serving: false, terminating: true}}, {addresses: [198.18.0.4], conditions: {ready: false, serving: true, terminating: false}}]"
        )
    ));
    let d = desired(&m, "n");
    let spec = d.values().next().unwrap();
    assert_eq!(addrs(&spec.backends), vec!["198.18.0.2"]);
    assert_eq!(addrs(&spec.draining), vec!["198.18.0.3", "198.18.0.4"]);
    // One ready endpoint: the terminating ones get no new connections.
    let m = model_of(&format!(
        "{SVC}{}",
        slice_with(
            "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.5]}]"
        )
    ));
    let d = desired(&m, "n");
    assert_eq!(
        addrs(&d.values().next().unwrap().backends),
        vec!["198.18.0.5"]
    );
}

#[test]
fn internal_traffic_policy_local_uses_this_nodes_endpoints_only() {
    let svc = SVC.replace(
        "clusterIP: 198.19.0.10,",
        "clusterIP: 198.19.0.10, internalTrafficPolicy: Local,",
    );
    let m = model_of(&format!(
        "{svc}{}",
        slice_with(
            "[{addresses: [198.18.0.2], nodeName: nodeA}, {addresses: [198.18.0.3], nodeName: b}]"
        )
    ));
    // This node's name is lowercased (as kube-proxy does); nodeName matches it whatever
    // its case.
    assert_eq!(
        addrs(&desired(&m, "nodea").values().next().unwrap().backends),
        vec!["198.18.0.2"]
    );
    assert!(
        desired(&m, "c")
            .values()
            .next()
            .unwrap()
            .backends
            .is_empty()
    );
}

#[test]
fn desired_serves_tcp_udp_sctp_in_each_family_from_its_own_slices() {
    use crate::source::manifests;
    let text = r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
  - {name: sig, port: 99, protocol: SCTP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}, {name: sig, port: 9999, protocol: SCTP}]
endpoints: [{addresses: [198.18.0.2]}]
";
    let model = manifests::parse(std::path::Path::new("x.yaml"), text)
        .unwrap()
        .model;
    let d = desired(&model, "node-a");
    let keys: Vec<String> = d.keys().map(ToString::to_string).collect();
    assert_eq!(
        keys,
        vec![
            "198.19.0.10:53/UDP",
            "198.19.0.10:80/TCP",
            "198.19.0.10:99/SCTP",
            "[fd00::10]:53/UDP",
            "[fd00::10]:80/TCP",
            "[fd00::10]:99/SCTP"
        ]
    );
    assert_eq!(d.values().next().unwrap().backends[0].port, 5353);
    assert_eq!(d.values().next().unwrap().label, "shop/web:dns");
    // SCTP is programmed like TCP and UDP: its targetPort from the slice's SCTP port.
    let sctp = d.values().nth(2).unwrap();
    assert_eq!(
        (sctp.label.as_str(), sctp.backends[0].port),
        ("shop/web:sig", 9999)
    );
    // The only slice is IPv4: the IPv6 frontends have no backend (and reject).
    for (fe, spec) in &d {
        let want = usize::from(fe.addr.is_ipv4());
        assert_eq!(spec.backends.len(), want, "{fe}");
    }
}

/// One line per unserved frontend: kind, family, address:port/proto, label, reason.
fn rows(f: &ServiceFrontends) -> Vec<String> {
    f.unserved
        .iter()
        .map(|u| {
            let at = match u.addr {
                Some(ip) => std::net::SocketAddr::new(ip, u.port).to_string(),
                None => format!("*:{}", u.port),
            };
            format!(
                "{} {} {at}/{} {}: {}",
                u.kind.display(),
                u.family.label(),
                u.proto.as_str(),
                u.label,
                u.reason
            )
        })
        .collect()
}

fn served(f: &ServiceFrontends) -> Vec<String> {
    f.served.iter().map(|(fe, _)| fe.to_string()).collect()
}

fn frontends_of(text: &str) -> ServiceFrontends {
    let m = model_of(text);
    let svc = m.services.values().next().unwrap();
    let f = frontends_for(&m, svc, "node-a");
    assert_eq!(f.served, desired_for(&m, svc, "node-a"));
    f
}

#[test]
fn cluster_ip_service_serves_tcp_udp_and_sctp() {
    let f = frontends_of(
        r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80}
  - {name: dns, port: 53, protocol: UDP}
  - {name: sig, port: 99, protocol: SCTP}
  externalIPs: [203.0.113.7]
  externalTrafficPolicy: Local
",
    );
    assert_eq!(
        served(&f),
        vec![
            "198.19.0.10:80/TCP",
            "[fd00::10]:80/TCP",
            "203.0.113.7:80/TCP",
            "198.19.0.10:53/UDP",
            "[fd00::10]:53/UDP",
            "203.0.113.7:53/UDP",
            "198.19.0.10:99/SCTP",
            "[fd00::10]:99/SCTP",
            "203.0.113.7:99/SCTP"
        ]
    );
    assert!(f.unserved.is_empty(), "{:?}", rows(&f));
}

#[test]
fn node_port_service_asks_for_one_node_port_per_port_with_a_node_port() {
    let f = frontends_of(
        r"
apiVersion: v1
kind: Service
metadata: {name: np, namespace: shop}
spec:
  type: NodePort
  clusterIP: 198.19.0.11
  ports:
  - {name: http, port: 80, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
  - {name: metrics, port: 9100}
",
    );
    assert_eq!(
        served(&f),
        vec![
            "198.19.0.11:80/TCP",
            "0.0.0.0:30080/TCP",
            "198.19.0.11:53/UDP",
            "0.0.0.0:30053/UDP",
            "198.19.0.11:9100/TCP"
        ]
    );
    assert!(f.unserved.is_empty(), "{:?}", rows(&f));
}

const LB: &str = r"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: shop}
spec:
  type: LoadBalancer
  clusterIPs: [198.19.0.12, 'fd00::12']
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: PreferDualStack
  ports:
  - {name: http, port: 80, nodePort: 30080}
  - {name: sig, port: 99, protocol: SCTP, nodePort: 30099}
  externalIPs: [203.0.113.7, '2001:db8::7']
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
status:
  loadBalancer:
    ingress:
    - {ip: 192.0.2.1}
    - {ip: 192.0.2.3, ipMode: Proxy}
    - {hostname: lb.example}
    - {ip: '2001:db8::1', ipMode: VIP}
";

#[test]
fn dual_stack_load_balancer_asks_for_every_kind_in_both_families() {
    let f = frontends_of(LB);
    // 192.0.2.3 (ipMode Proxy) and the hostname-only ingress ask for nothing. Each
    // external frontend of this `Local` service has an entry for this node's pods.
    assert_eq!(
        served(&f),
        vec![
            "198.19.0.12:80/TCP",
            "[fd00::12]:80/TCP",
            "0.0.0.0:30080/TCP",
            "0.0.0.0:30080/TCP (pods)",
            "[::]:30080/TCP",
            "[::]:30080/TCP (pods)",
            "203.0.113.7:80/TCP",
            "203.0.113.7:80/TCP (pods)",
            "[2001:db8::7]:80/TCP",
            "[2001:db8::7]:80/TCP (pods)",
            "192.0.2.1:80/TCP",
            "192.0.2.1:80/TCP (pods)",
            "[2001:db8::1]:80/TCP",
            "[2001:db8::1]:80/TCP (pods)",
            "198.19.0.12:99/SCTP",
            "[fd00::12]:99/SCTP",
            "0.0.0.0:30099/SCTP",
            "0.0.0.0:30099/SCTP (pods)",
            "[::]:30099/SCTP",
            "[::]:30099/SCTP (pods)",
            "203.0.113.7:99/SCTP",
            "203.0.113.7:99/SCTP (pods)",
            "[2001:db8::7]:99/SCTP",
            "[2001:db8::7]:99/SCTP (pods)",
            "192.0.2.1:99/SCTP",
            "192.0.2.1:99/SCTP (pods)",
            "[2001:db8::1]:99/SCTP",
            "[2001:db8::1]:99/SCTP (pods)"
        ]
    );
    assert!(f.unserved.is_empty(), "{:?}", rows(&f));
}

#[test]
fn ip_mode_proxy_ingress_asks_for_nothing() {
    let f = frontends_of(
        "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIP: 198.19.0.12, ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.3, ipMode: Proxy}, {hostname: lb.example}]}}\n",
    );
    assert_eq!(served(&f), vec!["198.19.0.12:80/TCP", "0.0.0.0:30080/TCP"]);
    assert!(f.unserved.is_empty(), "{:?}", rows(&f));
}

#[test]
fn single_stack_service_asks_for_nothing_in_the_other_family() {
    // As kube-proxy: an IPv4-only service's IPv6 externalIPs and load-balancer IPs are
    // not programmed, and it has no IPv6 NodePort.
    let f = frontends_of(
        &LB.replace("[198.19.0.12, 'fd00::12']", "[198.19.0.12]")
            .replace("ipFamilies: [IPv4, IPv6]", "ipFamilies: [IPv4]"),
    );
    assert!(f.unserved.is_empty(), "{:#?}", rows(&f));
    let sctp: Vec<String> = served(&f)
        .into_iter()
        .filter(|s| s.contains("/SCTP"))
        .collect();
    assert_eq!(
        sctp,
        vec![
            "198.19.0.12:99/SCTP",
            "0.0.0.0:30099/SCTP",
            "0.0.0.0:30099/SCTP (pods)",
            "203.0.113.7:99/SCTP",
            "203.0.113.7:99/SCTP (pods)",
            "192.0.2.1:99/SCTP",
            "192.0.2.1:99/SCTP (pods)"
        ]
    );
}

#[test]
fn the_cluster_ip_ignores_every_other_kind_and_the_external_policy() {
    let slice = "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-a, namespace: shop, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{name: http, port: 8080}, {name: sig, port: 9999, protocol: SCTP}]\nendpoints: [{addresses: [198.18.0.2], nodeName: node-a}, {addresses: [198.18.0.3], nodeName: node-b}]\n";
    let plain = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {clusterIPs: [198.19.0.12, 'fd00::12'], ports: [{name: http, port: 80}, {name: sig, port: 99, protocol: SCTP}]}\n";
    let base = frontends_of(&format!("{plain}{slice}"));
    let full = frontends_of(&format!("{LB}{slice}"));
    assert_eq!(full.served[0], base.served[0]);
    // externalTrafficPolicy: Local narrows the external frontends to this node's, and
    // flags them split; their entries for this node's pods keep every endpoint (as
    // kube-proxy's short-circuit of pod traffic to the internal policy).
    // (The slice is IPv4: the IPv6 frontends have no endpoints.)
    for (fe, spec) in full.served[1..]
        .iter()
        .filter(|(fe, spec)| spec.kind != FrontendKind::ClusterIp && fe.addr.is_ipv4())
    {
        if fe.pods_only {
            assert_eq!(
                addrs(&spec.backends),
                vec!["198.18.0.2", "198.18.0.3"],
                "{fe}"
            );
            assert_eq!(u16::from(spec.policy.split_for_pods), 0, "{fe}");
        } else {
            assert_eq!(addrs(&spec.backends), vec!["198.18.0.2"], "{fe}");
            assert_ne!(u16::from(spec.policy.split_for_pods), 0, "{fe}");
        }
    }
    assert_eq!(
        full.served
            .iter()
            .filter(|(fe, _)| fe.pods_only && fe.addr.is_ipv4())
            .count(),
        // NodePort, externalIP and load-balancer IP, for TCP and SCTP.
        6
    );
    // externalTrafficPolicy: Local does not narrow the ClusterIP's backends.
    assert_eq!(
        addrs(&full.served[0].1.backends),
        vec!["198.18.0.2", "198.18.0.3"]
    );
    // internalTrafficPolicy: Local does.
    let local = frontends_of(&format!(
        "{}{slice}",
        LB.replace(
            "externalTrafficPolicy: Local",
            "internalTrafficPolicy: Local"
        )
    ));
    assert_eq!(addrs(&local.served[0].1.backends), vec!["198.18.0.2"]);
    // Both policies Local: pods and outside traffic get the same local endpoints, so
    // there is nothing to split.
    let both = frontends_of(&format!(
        "{}{slice}",
        LB.replace(
            "externalTrafficPolicy: Local",
            "externalTrafficPolicy: Local\n  internalTrafficPolicy: Local"
        )
    ));
    assert!(
        both.served
            .iter()
            .all(|(fe, s)| !fe.pods_only && u16::from(s.policy.split_for_pods) == 0),
        "{:?}",
        served(&both)
    );
}

/// Every kind in both families is served, whatever the protocol: SCTP too (docs/sctp.md).
#[test]
fn every_kind_and_family_is_servable() {
    let v4 = Some(IpAddr::from([198, 19, 0, 1]));
    let v6_addr: IpAddr = "fd00::1".parse().unwrap();
    let v6 = Some(v6_addr);
    use FrontendKind::*;
    let ok = |a: [u8; 4]| Ok(IpAddr::from(a));
    for (kind, family, addr, want) in [
        (NodePort, Family::V6, None, Ok(IpAddr::from([0u8; 16]))),
        (NodePort, Family::V4, None, ok([0, 0, 0, 0])),
        (ExternalIp, Family::V6, v6, Ok(v6_addr)),
        (LoadBalancerIp, Family::V6, v6, Ok(v6_addr)),
        (LoadBalancerIp, Family::V4, v4, ok([198, 19, 0, 1])),
        (ClusterIp, Family::V6, v6, Ok(v6_addr)),
        (ClusterIp, Family::V4, v4, ok([198, 19, 0, 1])),
    ] {
        assert_eq!(servable(kind, family, addr), want, "{kind:?} {family:?}");
    }
}

/// A dual-stack LoadBalancer: each family's LB IP is filtered by that family's ranges
/// only; a family with no range of its own admits no source of that family (the
/// Service asked for a filter); a `/0` of one family opens that family only.
#[test]
fn source_ranges_apply_per_family() {
    let lb = |ranges: &str| {
        frontends_of(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: shop}}\nspec: {{type: LoadBalancer, clusterIPs: [198.19.0.12, 'fd00:c613::12'], ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack, loadBalancerSourceRanges: {ranges}, ports: [{{port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 192.0.2.1}}, {{ip: '2001:db8::1'}}]}}}}\n"
        ))
    };
    let lb_ranges = |f: &ServiceFrontends| -> Vec<(String, u16, Vec<String>)> {
        f.served
            .iter()
            .filter(|(_, s)| s.kind == FrontendKind::LoadBalancerIp)
            .map(|(fe, s)| {
                (
                    fe.addr.to_string(),
                    u16::from(s.policy.source_ranges),
                    s.src_ranges.iter().map(ToString::to_string).collect(),
                )
            })
            .collect()
    };
    let f = lb("[203.0.113.0/24, '2001:db8:1::/48', '2001:db8:1::/48']");
    let flag = 1;
    assert_eq!(
        lb_ranges(&f),
        vec![
            ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
            ("2001:db8::1".into(), flag, vec!["2001:db8:1::/48".into()]),
        ]
    );
    assert!(f.unserved.is_empty(), "{:?}", f.unserved);
    assert_eq!(
        lb_ranges(&lb("[203.0.113.0/24]")),
        vec![
            ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
            ("2001:db8::1".into(), flag, vec![]),
        ],
        "IPv4 ranges only: the IPv6 LB IP admits no IPv6 source"
    );
    // A range holding one of the node's IPv6 addresses admits the IPv6 LB IP itself as
    // a source (and only that family's LB IP).
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIPs: [198.19.0.12, 'fd00:c613::12'], ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack, loadBalancerSourceRanges: [203.0.113.0/24, '2001:db8:1::/48'], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.1}, {ip: '2001:db8::1'}]}}\n";
    let mut m = model_of(text);
    assert_eq!(
        m.set_node_ips(vec!["2001:db8:1::5".parse().unwrap()]).len(),
        1
    );
    let svc = m.services.values().next().unwrap();
    assert_eq!(
        lb_ranges(&frontends_for(&m, svc, "node-a")),
        vec![
            ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
            (
                "2001:db8::1".into(),
                flag,
                vec!["2001:db8::1/128".into(), "2001:db8:1::/48".into()]
            ),
        ]
    );
    assert_eq!(
        lb_ranges(&lb("[203.0.113.0/24, '::/0']")),
        vec![
            ("192.0.2.1".into(), flag, vec!["203.0.113.0/24".into()]),
            ("2001:db8::1".into(), 0, vec![]),
        ],
        "::/0 opens IPv6 only"
    );
}

/// `loadBalancerSourceRanges` restrict the load-balancer IPs only (as kube-proxy), and
/// `0.0.0.0/0` restricts nothing.
#[test]
fn source_ranges_restrict_load_balancer_ips_only() {
    let lb = |ranges: &str| {
        frontends_of(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: shop}}\nspec: {{type: LoadBalancer, clusterIP: 198.19.0.12, loadBalancerSourceRanges: {ranges}, ports: [{{port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: 192.0.2.1}}]}}}}\n"
        ))
    };
    let f = lb("[203.0.113.0/24, 198.51.100.7/32, 203.0.113.0/24]");
    assert_eq!(
        served(&f),
        vec![
            "198.19.0.12:80/TCP",
            "0.0.0.0:30080/TCP",
            "192.0.2.1:80/TCP"
        ]
    );
    let by_kind = |f: &ServiceFrontends, k: FrontendKind| {
        f.served
            .iter()
            .find(|(_, s)| s.kind == k)
            .map(|(_, s)| s.clone())
            .unwrap()
    };
    let lbip = by_kind(&f, FrontendKind::LoadBalancerIp);
    assert_eq!(
        lbip.src_ranges
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        vec!["198.51.100.7/32", "203.0.113.0/24"]
    );
    assert_ne!(u16::from(lbip.policy.source_ranges), 0);
    for k in [FrontendKind::ClusterIp, FrontendKind::NodePort] {
        let s = by_kind(&f, k);
        assert!(
            s.src_ranges.is_empty() && s.policy == Policy::default(),
            "{k:?}: {s:?}"
        );
    }
    let open = by_kind(
        &lb("[203.0.113.0/24, '0.0.0.0/0']"),
        FrontendKind::LoadBalancerIp,
    );
    assert!(
        open.src_ranges.is_empty() && open.policy == Policy::default(),
        "{open:?}"
    );
}

/// As kube-proxy: ranges that hold one of this node's addresses admit the service's
/// load-balancer IPs as sources too; ranges that hold none do not. A change of the
/// node's addresses names the services it concerns.
#[test]
fn source_ranges_holding_a_node_ip_admit_the_lb_ips() {
    let text = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: shop}\nspec: {type: LoadBalancer, clusterIP: 198.19.0.12, loadBalancerSourceRanges: [10.0.0.0/24], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 192.0.2.1}, {ip: 192.0.2.2}, {ip: 192.0.2.3, ipMode: Proxy}]}}\n";
    let mut m = model_of(text);
    let ranges = |m: &Model| -> Vec<Vec<String>> {
        let svc = m.services.values().next().unwrap();
        frontends_for(m, svc, "node-a")
            .served
            .iter()
            .filter(|(_, s)| s.kind == FrontendKind::LoadBalancerIp)
            .map(|(_, s)| s.src_ranges.iter().map(ToString::to_string).collect())
            .collect()
    };
    assert_eq!(ranges(&m), vec![vec!["10.0.0.0/24"]; 2]);
    let touched = m.set_node_ips(vec!["10.0.1.5".parse().unwrap()]);
    assert_eq!(touched.len(), 1, "the service with ranges is named");
    assert_eq!(
        ranges(&m),
        vec![vec!["10.0.0.0/24"]; 2],
        "no node IP in range"
    );
    m.set_node_ips(vec![
        "10.0.0.5".parse().unwrap(),
        "10.0.1.5".parse().unwrap(),
    ]);
    assert_eq!(
        ranges(&m),
        vec![vec!["10.0.0.0/24", "192.0.2.1/32", "192.0.2.2/32"]; 2],
        "both VIP-mode LB IPs admitted on both LB frontends"
    );
    assert!(
        m.set_node_ips(vec![
            "10.0.1.5".parse().unwrap(),
            "10.0.0.5".parse().unwrap()
        ])
        .is_empty(),
        "the same addresses in another order change nothing"
    );
}

#[test]
fn kinds_and_families_have_stable_labels() {
    let got: Vec<_> = FrontendKind::ALL
        .iter()
        .map(|k| (k.label(), k.display(), k.scope()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("cluster_ip", "ClusterIP", Scope::Internal),
            ("node_port", "NodePort", Scope::External),
            ("external_ip", "ExternalIP", Scope::External),
            ("load_balancer_ip", "LoadBalancerIP", Scope::External),
        ]
    );
    assert_eq!((Family::V4.label(), Family::V6.label()), ("ipv4", "ipv6"));
}
