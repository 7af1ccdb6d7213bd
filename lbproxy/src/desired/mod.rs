//! From the model to the desired state of the datapath: the frontends each service asks for
//! ([`frontends`]) and the endpoints each of them uses ([`endpoints`]). Kubernetes semantics
//! only: how any of it is encoded in the maps is `program::encode`'s business.

pub mod endpoints;
mod frontends;
pub mod service_cidrs;
mod topology;

pub use frontends::{
    BackendAddr, Desired, Family, Frontend, FrontendKind, FrontendSpec, Policy, ServiceFrontends,
    Unserved, frontends_for,
};
pub use topology::{HintsIgnored, Topology};
