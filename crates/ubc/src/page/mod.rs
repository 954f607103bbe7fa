//! Pages: the per-page state machine and the per-object page table.

pub(crate) mod state;
mod sync;
pub(crate) mod table;

/// Randomized-schedule tests of the state machine (`--features shuttle`).
#[cfg(all(test, feature = "shuttle"))]
mod schedules;
