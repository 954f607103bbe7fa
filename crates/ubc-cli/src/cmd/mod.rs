//! One module per command.

pub mod bench;
pub mod cat;
pub mod cp;
pub mod keygen;
pub mod ls;
pub mod mount;
pub mod stat;
pub mod tour;
