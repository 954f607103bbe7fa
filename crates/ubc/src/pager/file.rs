//! The local-file pager: positional I/O on a host file (the vnode pager of a local file
//! system).

use super::{Fill, Identity, IoMode, Pager};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Pages of a host file, read and written with `pread`/`pwrite`.
#[derive(Debug)]
pub struct FilePager {
    file: File,
    path: PathBuf,
    writable: bool,
    identity: Identity,
}

impl FilePager {
    /// Open an existing host file, read-only or read-write.
    pub fn open(path: impl AsRef<Path>, writable: bool) -> io::Result<FilePager> {
        let path = path.as_ref();
        let file = OpenOptions::new().read(true).write(writable).open(path)?;
        FilePager::from_file(file, path, writable)
    }

    /// Open a host file read-write, creating it if it does not exist.
    pub fn create(path: impl AsRef<Path>) -> io::Result<FilePager> {
        let path = path.as_ref();
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        FilePager::from_file(file, path, true)
    }

    /// Wrap an already open host file. `path` is only used in messages.
    pub fn from_file(file: File, path: impl AsRef<Path>, writable: bool) -> io::Result<FilePager> {
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        Ok(FilePager {
            identity: Identity::HostFile { dev: meta.dev(), ino: meta.ino() },
            file,
            path: path.as_ref().to_path_buf(),
            writable,
        })
    }

    /// The host path this pager was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Pager for FilePager {
    fn get_pages(&self, offset: u64, buf: &mut [u8]) -> io::Result<Fill> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break, // end of file: the rest reads as zeros
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if done == 0 {
            // Entirely past the end: nothing to copy, the cache zero-fills.
            return Ok(Fill::Hole);
        }
        buf[done..].fill(0);
        Ok(Fill::Data)
    }

    fn put_pages(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn identity(&self) -> Option<Identity> {
        Some(self.identity.clone())
    }

    fn is_writable(&self) -> bool {
        self.writable
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn io_mode(&self) -> IoMode {
        IoMode::Buffered
    }
}
