//! From the model to the desired state of the datapath: the frontends each service asks for
//! ([`frontends`]) and the endpoints each of them uses ([`endpoints`]).

pub mod endpoints;
mod frontends;

pub use frontends::{
    BackendAddr, BackendValue, Desired, Frontend, FrontendKey, FrontendKind, FrontendSpec,
    ServiceFrontends, Unserved, frontends_for,
};
