//! This node's Node object as the proxy sees it: its zone, and whether it takes traffic.

use k8s_openapi::api::core::v1::Node as K8sNode;

use super::{InvalidObject, LABEL_TOPOLOGY_ZONE, NamespacedName, Normalized};

/// The cluster autoscaler's taint on a node it is about to delete (kube-proxy's
/// `ToBeDeletedTaint`).
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// What lbproxy keeps of a Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// The Node's name (a Node has no namespace: `namespace` is empty).
    pub id: NamespacedName,
    pub uid: Option<String>,
    /// Its `topology.kubernetes.io/zone` label, if set and not empty.
    pub zone: Option<String>,
    /// Why it takes no traffic, as [`not_eligible`]; `None`: it does.
    pub not_eligible: Option<String>,
}

/// A Node's zone: its `topology.kubernetes.io/zone` label, if set and not empty.
pub fn zone_of(node: &K8sNode) -> Option<String> {
    node.metadata
        .labels
        .as_ref()?
        .get(LABEL_TOPOLOGY_ZONE)
        .filter(|z| !z.is_empty())
        .cloned()
}

/// Why this node takes no traffic, as kube-proxy's `SyncNode` decides; `None`: it does.
pub fn not_eligible(node: &K8sNode) -> Option<String> {
    if node.metadata.deletion_timestamp.is_some() {
        return Some("the Node is being deleted".into());
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    tainted.then(|| format!("the Node has the {TO_BE_DELETED_TAINT} taint"))
}

/// Normalizes a v1 Node (from manifests; the kube source watches its own Node by name).
pub fn node_from_k8s(node: &K8sNode) -> Result<Normalized<NodeInfo>, InvalidObject> {
    let name = node.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err(InvalidObject {
            kind: "Node",
            object: "<no name>".into(),
            reason: "metadata.name is missing".into(),
        });
    }
    Ok(Normalized::Proxied(NodeInfo {
        id: NamespacedName {
            namespace: String::new(),
            name,
        },
        uid: node.metadata.uid.clone(),
        zone: zone_of(node),
        not_eligible: not_eligible(node),
    }))
}
