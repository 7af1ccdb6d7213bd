//! From the model to the desired state of the datapath: the frontends each service asks for
//! ([`frontends`]) and the endpoints each of them uses ([`endpoints`]).

mod endpoints;
mod frontends;

#[allow(
    unused_imports,
    reason = "the controller, its metrics and inspect are being wired to this; remove when they are"
)]
pub use endpoints::{Scope, local_only};
#[allow(
    unused_imports,
    reason = "the controller, its metrics and inspect are being wired to this; remove when they are"
)]
pub use frontends::{
    BackendAddr, Desired, Family, Frontend, FrontendKind, FrontendSpec, ServiceFrontends, Unserved,
    desired_for, frontends_for,
};
