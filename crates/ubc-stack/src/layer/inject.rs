//! `inject`: error injection at any level of a stack, for tests of error paths.
//!
//! * [`Inject::over`] stacks a pass-through *general* layer on any layer: each file opened
//!   through it gets a pager over the lower layer's file (same bytes, identity translation)
//!   behind a [`ubc::pager::InjectingPager`], all driven by one [`Injector`] switchboard. Errors,
//!   torn transfers, slowness and hangs then happen *between* two layers of the stack — the
//!   layer above sees its lower file fail the way it would see a disk fail.
//! * [`Inject::dir`] is a `dir` bottom layer whose host-file pagers are wrapped the same way:
//!   the store itself fails.
//!
//! Not reachable from the spec language: it is for tests and for checking how a program
//! copes with failing storage (build the stack with [`crate::Stack::builder`]).

use super::{Below, Layer, Opened, dir::Dir};
use crate::coherence::Translate;
use crate::error::Result;
use std::io;
use std::ops::Range;
use std::sync::Arc;
use ubc::pager::{InjectingPager, Injector};
use ubc::{Fill, Identity, IoMode, Pager};

/// A fault-injecting layer (see the module docs).
pub struct Inject {
    kind: Kind,
    faults: Arc<Injector>,
}

enum Kind {
    Over(Arc<dyn Layer>),
    Dir(Dir),
}

impl Inject {
    /// A pass-through general layer over `lower` whose files fail as `faults` says.
    pub fn over(lower: Arc<dyn Layer>, faults: Arc<Injector>) -> Inject {
        Inject { kind: Kind::Over(lower), faults }
    }

    /// A `dir` bottom layer over host directory `root` whose stores fail as `faults` says.
    pub fn dir(root: impl Into<std::path::PathBuf>, faults: Arc<Injector>) -> Result<Inject> {
        Ok(Inject { kind: Kind::Dir(Dir::new(root)?), faults })
    }

    /// The layer whose namespace this one shows.
    fn names(&self) -> &dyn Layer {
        match &self.kind {
            Kind::Over(l) => &**l,
            Kind::Dir(d) => d,
        }
    }

    /// The switchboard.
    pub fn injector(&self) -> &Arc<Injector> {
        &self.faults
    }
}

impl Layer for Inject {
    fn spec(&self) -> String {
        match &self.kind {
            Kind::Over(_) => "fault".into(),
            Kind::Dir(d) => format!("fault-{}", d.spec()),
        }
    }
    fn lower(&self) -> Option<&Arc<dyn Layer>> {
        match &self.kind {
            Kind::Over(l) => Some(l),
            Kind::Dir(_) => None,
        }
    }
    fn is_general(&self) -> bool {
        matches!(self.kind, Kind::Over(_))
    }

    // Names are the wrapped layer's: a `Dir` answers them itself, `Over` forwards.
    fn getattr(&self, path: &str) -> Result<super::Attr> {
        self.names().getattr(path)
    }
    fn setattr(&self, path: &str, set: &super::SetAttr) -> Result<()> {
        self.names().setattr(path, set)
    }
    fn readdir(&self, path: &str) -> Result<Vec<super::DirEntry>> {
        self.names().readdir(path)
    }
    fn create(&self, path: &str, mode: u32) -> Result<()> {
        self.names().create(path, mode)
    }
    fn mkdir(&self, path: &str, mode: u32) -> Result<()> {
        self.names().mkdir(path, mode)
    }
    fn remove(&self, path: &str) -> Result<()> {
        self.names().remove(path)
    }
    fn rmdir(&self, path: &str) -> Result<()> {
        self.names().rmdir(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.names().rename(from, to)
    }

    fn open(&self, path: &str, access: ubc::Access, below: &dyn Below) -> Result<Opened> {
        match &self.kind {
            Kind::Over(_) => Ok(Opened::Wrap),
            Kind::Dir(d) => match d.open(path, access, below)? {
                Opened::Store(p) => Ok(Opened::Store(Arc::new(InjectingPager::with_injector(p, self.faults.clone())))),
                Opened::Shared { pager, remote } => Ok(Opened::Shared {
                    pager: Arc::new(InjectingPager::with_injector(pager, self.faults.clone())),
                    remote,
                }),
                other => Ok(other),
            },
        }
    }

    fn wrap(
        &self,
        _path: &str,
        lower: ubc::File,
        _writes: &Arc<crate::coherence::LowerWrites>,
    ) -> Result<(Arc<dyn Pager>, Arc<dyn Translate>)> {
        let p: Arc<dyn Pager> =
            Arc::new(InjectingPager::with_injector(Arc::new(LowerFile(lower)), self.faults.clone()));
        Ok((p, Arc::new(Identical)))
    }
}

/// The bytes are the lower file's, offset for offset.
struct Identical;

impl Translate for Identical {
    fn down(&self, upper: Range<u64>) -> Vec<Range<u64>> {
        vec![upper]
    }
    fn up(&self, lower: Range<u64>) -> Option<Range<u64>> {
        Some(lower)
    }
    fn reload(&self) -> io::Result<()> {
        Ok(())
    }
}

/// A pager over a lower layer's cached file.
struct LowerFile(ubc::File);

impl Pager for LowerFile {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let n = self.0.read_at(buf, offset)?;
        buf[n..].fill(0);
        Ok(Fill::Data)
    }
    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write_at(data, offset)?;
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.len()?)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        Ok(self.0.set_len(len)?)
    }
    fn sync(&self) -> io::Result<()> {
        Ok(self.0.sync()?)
    }
    fn sync_metadata(&self) -> io::Result<()> {
        Ok(self.0.sync_all()?)
    }
    fn write_through(&self) -> io::Result<()> {
        Ok(self.0.write_through()?)
    }
    fn fault_guard(&self, range: std::ops::Range<u64>, store: bool) -> io::Result<Option<ubc::FaultGuard>> {
        Ok(self.0.fault_guard(range, store)?)
    }
    fn identity(&self) -> Option<Identity> {
        self.0.identity().map(|id| Identity::Named { kind: "fault", name: format!("{id:?}") })
    }
    fn is_writable(&self) -> bool {
        self.0.is_writable()
    }
    fn describe(&self) -> String {
        format!("fault layer over {:?}", self.0)
    }
    fn io_mode(&self) -> IoMode {
        self.0.stats().io_mode
    }
    fn depth(&self) -> u32 {
        self.0.depth() + 1
    }
}
