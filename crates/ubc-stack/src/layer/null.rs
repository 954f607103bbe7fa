//! `null`: the null layer — every operation passes down. Its files are simply named: they
//! *are* the lower layer's files, sharing their cache object (one copy of each page), so
//! two null layers over one file cost nothing in coherence (the paper's Figure 11 measured
//! 23.9x for this case with per-layer caches).

use super::{Below, Layer, Opened};
use crate::error::Result;
use std::sync::Arc;

/// A pass-through layer.
pub struct Null {
    lower: Arc<dyn Layer>,
}

impl Null {
    pub fn new(lower: Arc<dyn Layer>) -> Null {
        Null { lower }
    }
}

impl Layer for Null {
    fn spec(&self) -> String {
        "null".into()
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        Some(&self.lower)
    }
    fn open(&self, _path: &str, _access: ubc::Access, _below: &dyn Below) -> Result<Opened> {
        Ok(Opened::Lower)
    }
}
