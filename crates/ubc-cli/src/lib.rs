//! What the `ubc` command shares with the other programs of this package (the soak driver
//! `ubc-soak`) and with its tests.

pub mod mounts;
