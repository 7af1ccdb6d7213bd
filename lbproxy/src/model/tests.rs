//! Unit tests of the model: normalization of Services and EndpointSlices, as kube-proxy reads them.

use super::*;
use k8s_openapi::api::core::v1::Service as K8sService;
use k8s_openapi::api::discovery::v1::EndpointSlice as K8sEndpointSlice;

fn svc(yaml: &str) -> K8sService {
    crate::yaml::from_str(yaml).unwrap()
}
fn slice(yaml: &str) -> K8sEndpointSlice {
    crate::yaml::from_str(yaml).unwrap()
}

fn proxied<T: fmt::Debug>(n: Normalized<T>) -> T {
    match n {
        Normalized::Proxied(t) => t,
        Normalized::Skipped(why) => panic!("unexpectedly skipped: {why}"),
    }
}

const WEB: &str = r"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 198.19.0.10
  clusterIPs: [198.19.0.10, 'fd00::10']
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: web}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
";

#[test]
fn service_is_normalized_with_dual_stack_and_named_target_port() {
    let s = proxied(service_from_k8s(&svc(WEB)).unwrap());
    assert_eq!(s.id.to_string(), "shop/web");
    assert_eq!(
        s.cluster_ips,
        vec![
            "198.19.0.10".parse::<IpAddr>().unwrap(),
            "fd00::10".parse().unwrap()
        ]
    );
    assert_eq!(s.ports[0].target_port, TargetPort::Name("web".into()));
    assert_eq!(s.ports[1].target_port, TargetPort::Number(5353));
    assert_eq!(s.ports[1].protocol, Protocol::Udp);
}

#[test]
fn session_affinity_defaults_and_validation() {
    let base = "metadata: {name: a, namespace: n}\nspec: {clusterIP: 198.19.0.1";
    let s =
        proxied(service_from_k8s(&svc(&format!("{base}, sessionAffinity: ClientIP}}"))).unwrap());
    assert_eq!(s.affinity_timeout_s, 10_800);
    let s = proxied(
            service_from_k8s(&svc(&format!(
                "{base}, sessionAffinity: ClientIP, sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 60}}}}}}"
            )))
            .unwrap(),
        );
    assert_eq!(s.affinity_timeout_s, 60);
    let s = proxied(service_from_k8s(&svc(&format!("{base}}}"))).unwrap());
    assert_eq!(s.affinity_timeout_s, 0);
    let e = service_from_k8s(&svc(&format!(
            "{base}, sessionAffinity: ClientIP, sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 0}}}}}}"
        )))
        .unwrap_err();
    assert!(
        e.to_string().contains("timeoutSeconds 0 is out of range"),
        "{e}"
    );
}

#[test]
fn headless_externalname_and_other_proxy_are_skipped() {
    for y in [
        "metadata: {name: a}\nspec: {clusterIP: None}",
        "metadata: {name: a}\nspec: {type: ExternalName, externalName: x.example}",
        "metadata: {name: a, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 198.19.0.1}",
    ] {
        assert!(
            matches!(service_from_k8s(&svc(y)).unwrap(), Normalized::Skipped(_)),
            "{y}"
        );
    }
}

#[test]
fn bad_service_fields_name_the_object_and_field() {
    let e = service_from_k8s(&svc(
        "metadata: {name: a, namespace: n}\nspec: {clusterIP: 198.19.0.300}",
    ))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: spec.clusterIPs[0] \"198.19.0.300\" is not a valid IP address"
    );
    let e = service_from_k8s(&svc(
        "metadata: {name: a, namespace: n}\nspec: {clusterIP: 198.19.0.3, ports: [{port: 70000}]}",
    ))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "Service n/a: spec.ports[0].port 70000 is out of range 1-65535"
    );
    let e = service_from_k8s(&svc(
            "metadata: {name: a, namespace: n}\nspec: {clusterIP: 198.19.0.3, ports: [{port: 7, protocol: ICMP}]}",
        ))
        .unwrap_err();
    assert!(
        e.to_string().contains("spec.ports[0]: protocol \"ICMP\""),
        "{e}"
    );
}

fn slice_yaml(name: &str, port_name: &str, number: u16, eps: &str) -> String {
    format!(
        r"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: shop
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{{name: {port_name}, port: {number}, protocol: TCP}}]
endpoints: {eps}
"
    )
}

#[test]
fn named_target_port_resolves_per_slice_and_merges_dedups() {
    let mut m = Model::default();
    let s = proxied(service_from_k8s(&svc(WEB)).unwrap());
    m.services.insert(s.id.clone(), s.clone());
    for (name, number, eps) in [
        (
            "web-a",
            8080,
            "[{addresses: [198.18.0.2]}, {addresses: [198.18.0.3], conditions: {ready: true}}]",
        ),
        ("web-b", 9090, "[{addresses: [198.18.0.4]}]"),
        // Same address and port as in web-a: de-duplicated.
        ("web-c", 8080, "[{addresses: [198.18.0.2]}]"),
    ] {
        let sl = proxied(slice_from_k8s(&slice(&slice_yaml(name, "http", number, eps))).unwrap());
        m.upsert_slice(sl);
    }
    let got = m.ready_endpoints(&s, &s.ports[0]);
    let want: Vec<EndpointAddr> = [
        ("198.18.0.2", 8080),
        ("198.18.0.3", 8080),
        ("198.18.0.4", 9090),
    ]
    .iter()
    .map(|(ip, port)| EndpointAddr {
        ip: ip.parse().unwrap(),
        port: *port,
    })
    .collect();
    assert_eq!(got, want);
    // The UDP port "dns" has no slice port of that name: no endpoints.
    assert!(m.ready_endpoints(&s, &s.ports[1]).is_empty());
}

#[test]
fn slice_port_named_after_target_port_is_a_fallback() {
    let mut m = Model::default();
    let s = proxied(service_from_k8s(&svc(WEB)).unwrap());
    m.services.insert(s.id.clone(), s.clone());
    let sl = proxied(
        slice_from_k8s(&slice(&slice_yaml(
            "web-a",
            "web",
            8081,
            "[{addresses: [198.18.0.2]}]",
        )))
        .unwrap(),
    );
    m.upsert_slice(sl);
    assert_eq!(m.ready_endpoints(&s, &s.ports[0])[0].port, 8081);
}

#[test]
fn not_ready_endpoints_get_no_new_connections() {
    let mut m = Model::default();
    let s = proxied(service_from_k8s(&svc(WEB)).unwrap());
    m.services.insert(s.id.clone(), s.clone());
    let sl = proxied(
            slice_from_k8s(&slice(&slice_yaml(
                "web-a",
                "http",
                8080,
                "[{addresses: [198.18.0.2], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [198.18.0.3]}]",
            )))
            .unwrap(),
        );
    assert!(!sl.endpoints[0].ready && sl.endpoints[0].serving && sl.endpoints[0].terminating);
    assert!(sl.endpoints[1].ready && sl.endpoints[1].serving && !sl.endpoints[1].terminating);
    m.upsert_slice(sl);
    let got = m.ready_endpoints(&s, &s.ports[0]);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].ip, "198.18.0.3".parse::<IpAddr>().unwrap());
    assert_eq!(m.present_endpoints(&s, &s.ports[0]).len(), 2);
}

#[test]
fn changed_services_are_those_whose_service_or_slices_differ() {
    let mut a = Model::default();
    let s = proxied(service_from_k8s(&svc(WEB)).unwrap());
    a.services.insert(s.id.clone(), s.clone());
    let sl = proxied(
        slice_from_k8s(&slice(&slice_yaml(
            "web-a",
            "http",
            8080,
            "[{addresses: [198.18.0.2]}]",
        )))
        .unwrap(),
    );
    a.upsert_slice(sl);
    let mut other = s.clone();
    other.id.name = "other".into();
    a.services.insert(other.id.clone(), other.clone());
    assert!(a.changed_services(&a.clone()).is_empty());

    let mut b = a.clone();
    let sl2 = proxied(
        slice_from_k8s(&slice(&slice_yaml(
            "web-a",
            "http",
            8080,
            "[{addresses: [198.18.0.3]}]",
        )))
        .unwrap(),
    );
    b.upsert_slice(sl2);
    assert_eq!(
        a.changed_services(&b).into_iter().collect::<Vec<_>>(),
        vec![s.id.clone()]
    );

    let mut c = a.clone();
    c.services.remove(&other.id);
    assert_eq!(
        c.changed_services(&a).into_iter().collect::<Vec<_>>(),
        vec![other.id]
    );
}

#[test]
fn slice_errors_name_the_field() {
    let e = slice_from_k8s(&slice(&slice_yaml(
        "web-a",
        "http",
        8080,
        "[{addresses: [not-an-ip]}]",
    )))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "EndpointSlice shop/web-a: endpoints[0].addresses[0] \"not-an-ip\" is not a valid IP address"
    );
    let e = slice_from_k8s(&slice(&slice_yaml(
        "web-a",
        "http",
        8080,
        "[{addresses: ['fd00::1']}]",
    )))
    .unwrap_err();
    assert!(
        e.to_string().contains("does not match addressType IPv4"),
        "{e}"
    );
}
