//! Where the desired state comes from: the Kubernetes API ([`kube`]) or manifest files
//! ([`manifests`]). Both turn what they read into one stream of [`SourceEvent`]s.

pub mod kube;
pub mod manifests;
