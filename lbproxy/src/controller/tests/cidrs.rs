//! ServiceCIDRs through the controller: a ServiceCIDR event alone is a change that syncs,
//! a Service's ClusterIP comes and goes with it, a re-list without the ServiceCIDR empties
//! the tables.

use super::*;

fn cidr(name: &str, cidrs: &[&str]) -> SourceEvent {
    let id = NamespacedName {
        namespace: String::new(),
        name: name.into(),
    };
    let cidr = (!cidrs.is_empty()).then(|| model::ServiceCidr {
        id: id.clone(),
        cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
    });
    SourceEvent::ServiceCidr { id, cidr }
}

fn table(ctl: &Controller<MemMaps>) -> Vec<String> {
    ctl.maps()
        .service_cidrs
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn service_cidrs_follow_their_objects_and_the_services() {
    let mut ctl = controller(MemMaps::default());
    drive(&mut ctl, two_services()).await;
    assert!(
        table(&ctl).is_empty(),
        "no ServiceCIDR, yet {:?}",
        table(&ctl)
    );

    drive(&mut ctl, vec![cidr("kubernetes", &["198.19.0.0/16"])]).await;
    assert!(!ctl.has_pending());
    assert_eq!(
        table(&ctl),
        ["198.19.0.0/16=1", "198.19.0.10/32=2", "198.19.0.11/32=2"]
    );

    drive(&mut ctl, vec![deleted("db")]).await;
    assert_eq!(table(&ctl), ["198.19.0.0/16=1", "198.19.0.10/32=2"]);

    // A re-list that no longer holds it: gone, and with it every entry.
    drive(
        &mut ctl,
        vec![
            SourceEvent::Listing(Kind::ServiceCidrs),
            SourceEvent::Listed(Kind::ServiceCidrs),
        ],
    )
    .await;
    assert!(table(&ctl).is_empty(), "{:?}", table(&ctl));
}
