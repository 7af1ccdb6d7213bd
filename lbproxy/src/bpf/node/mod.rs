//! Node state is desired state too: what the node-interface, node-address, pod-interface,
//! pod-address and source-check maps hold follows from the interfaces the watcher
//! ([`super::attach::Attacher`]) lists, as the service maps follow from the model.
//!
//! - [`view::NodeView`]: the interfaces as listed, each with its [`view::Role`] (pod or node);
//! - [`desired::NodeState`]: what each node map should hold, worked out from a view
//!   (pure, so testable without network namespaces or root);
//! - [`maps::NodeMaps`]: the maps, over a [`maps::Store`] (the pinned BPF maps, or memory
//!   for tests), each one a [`maps::NodeMap`];
//! - [`programmer::NodeProgrammer`]: reads what the maps hold, writes only the differences,
//!   and logs what an operator needs (a new SNAT address, a new NodePort address, a new
//!   primary address) once.
//!
//! Each IP family has its own maps (`LB_NODEIFS_V1`/`LB_NODEIFS6_V1`, ...) but one code
//! path: [`family::NodeFamily`] says where a family's addresses and maps are.

pub mod desired;
pub mod family;
pub mod maps;
pub mod programmer;
pub mod view;

#[cfg(test)]
pub mod fixtures;
#[cfg(test)]
mod tests;

pub use desired::{NodeConfig, NodeState};
pub use maps::{NodeMaps, Pinned};
pub use programmer::NodeProgrammer;
pub use view::{NodeView, Role};
