//! Desired state into the maps: a [`Programmer`] diffs what is programmed against what is
//! desired and writes the difference through the [`Maps`] trait; [`encode`] is how the
//! desired state's types look in the maps.

pub mod cidrs;
pub mod encode;
pub mod maglev;
mod maps;
mod programmer;

#[cfg(test)]
pub use maps::mem;
pub use maps::{MapWriteError, Maps, ReadBack, WriteCause, assemble};
pub use programmer::{ApplyStats, Programmed, ProgrammedFrontend, Programmer};
