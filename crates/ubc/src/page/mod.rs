//! Pages: the per-page state machine and the per-object page table.

pub(crate) mod state;
pub(crate) mod table;
