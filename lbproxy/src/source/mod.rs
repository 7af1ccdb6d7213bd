//! Where the desired state comes from: the Kubernetes API ([`kube`]) or manifest files
//! ([`manifests`]). Both turn what they read into one stream of [`SourceEvent`]s, already
//! normalized into the model's types, so the controller has one code path for both.

pub mod kube;
pub mod kube_client;
pub mod manifests;

use crate::model::{self, NamespacedName};

/// The kinds of object a source lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Services,
    Slices,
    /// This node's own Node object (the kube source only).
    Node,
    /// `networking.k8s.io/v1` ServiceCIDRs (cluster-scoped). An API server without the
    /// resource lists none.
    ServiceCidrs,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Services, Kind::Slices, Kind::ServiceCidrs, Kind::Node];
}

/// What a source reports.
#[derive(Debug)]
pub enum SourceEvent {
    /// A full list of one kind starts. The objects of that kind that follow, up to its
    /// [`SourceEvent::Listed`], are the whole set: whatever was known and is not among them
    /// is gone (a watcher's re-list, after a `410 Gone` say).
    Listing(Kind),
    /// A service is now as given, or is no longer proxied (`None`: deleted, invalid, or
    /// not for this proxy).
    Service {
        id: NamespacedName,
        service: Option<model::Service>,
    },
    /// A slice is now as given, or gone (`None`). `trigger` is its
    /// `endpoints.kubernetes.io/last-change-trigger-time` in Unix seconds, for the network
    /// programming latency metric.
    Slice {
        id: NamespacedName,
        slice: Option<model::EndpointSlice>,
        trigger: Option<f64>,
    },
    /// A ServiceCIDR is now as given, or gone (`None`: deleted, or invalid).
    ServiceCidr {
        id: NamespacedName,
        cidr: Option<model::ServiceCidr>,
    },
    /// The list of a kind is complete.
    Listed(Kind),
    /// This node's object, for the Events the controller posts about it, and whether the
    /// node takes traffic (`not_eligible`: why not, as kube-proxy's `/healthz` decides:
    /// deleted, being deleted, or tainted `ToBeDeletedByClusterAutoscaler`).
    /// `zone` is its `topology.kubernetes.io/zone` label: `None` without it, or when the
    /// Node is gone (zone hints then stop applying, as in kube-proxy).
    Node {
        uid: Option<String>,
        not_eligible: Option<String>,
        zone: Option<String>,
    },
    /// Events that belong together (one manifest reload): all of them reach the model
    /// before the next sync.
    Batch(Vec<SourceEvent>),
    /// The source could not read what it watches (a broken watch); it retries by itself, and
    /// the last good state keeps serving.
    Failed { source: &'static str, error: String },
    /// The source read its input and refused it (an invalid manifest set), once per change
    /// of the input; the last good state keeps serving. Counted as a failed sync.
    Rejected { source: &'static str, error: String },
}
