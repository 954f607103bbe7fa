//! userfaultfd: the kernel interface that lets ubc serve page faults on its mappings.
//!
//! Contract (see `map/mod.rs` for the scheme these calls implement):
//!
//! * One [`Uffd`] serves any number of registered ranges, from any number of threads: every
//!   call is one `ioctl` or `read` on the descriptor and takes `&self`; the kernel serializes
//!   what needs serializing (per mm, per page table), so this layer holds no lock.
//! * Fill calls ([`Uffd::copy`], [`Uffd::install`], [`Uffd::zeropage`], [`Uffd::poison`],
//!   [`Uffd::continue_`]) place pages atomically: a page appears in every mapping of the memfd
//!   whole or not at all. They never overwrite a page that exists; that is `EEXIST`, which
//!   [`Uffd::install`] turns into a count of pages found present.
//! * A faulting thread sleeps until something wakes its address: a fill without `dontwake`
//!   or [`Uffd::wake`]. A handler that finds nothing to do for a fault (the page is there
//!   already) must still wake it, or the thread sleeps forever.
//!
//! The constants are those of Linux 6.18 `include/uapi/linux/userfaultfd.h`; the build
//! machine's headers (Debian 12, Linux 6.1) lack the newer ones, so all are spelt out here.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

// ---------------------------------------------------------------------------------------------
// ioctl encoding (asm-generic/ioctl.h) and the userfaultfd ABI.

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, ty, nr, size)`.
pub(super) const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (ty << 8) | nr
}

const UFFDIO: u32 = 0xAA;
const UFFD_API: u64 = 0xAA;

/// `USERFAULTFD_IOC_NEW`: `_IO(0xAA, 0)` on `/dev/userfaultfd`; the argument is the flags.
pub(super) const USERFAULTFD_IOC_NEW: u32 = ioc(0, UFFDIO, 0x00, 0);
pub(super) const UFFDIO_REGISTER: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x00, size_of::<UffdioRegister>());
pub(super) const UFFDIO_UNREGISTER: u32 = ioc(IOC_READ, UFFDIO, 0x01, size_of::<UffdioRange>());
pub(super) const UFFDIO_WAKE: u32 = ioc(IOC_READ, UFFDIO, 0x02, size_of::<UffdioRange>());
pub(super) const UFFDIO_COPY: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x03, size_of::<UffdioCopy>());
pub(super) const UFFDIO_ZEROPAGE: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x04, size_of::<UffdioZeropage>());
pub(super) const UFFDIO_WRITEPROTECT: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x06, size_of::<UffdioWriteprotect>());
pub(super) const UFFDIO_CONTINUE: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x07, size_of::<UffdioContinue>());
pub(super) const UFFDIO_POISON: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x08, size_of::<UffdioPoison>());
pub(super) const UFFDIO_API: u32 = ioc(IOC_READ | IOC_WRITE, UFFDIO, 0x3F, size_of::<UffdioApi>());

/// Bits of `uffdio_register.ioctls`: which range ioctls the kernel allows on a range.
pub(crate) mod range_ioctl {
    pub(crate) const WAKE: u64 = 1 << 0x02;
    pub(crate) const COPY: u64 = 1 << 0x03;
    pub(crate) const ZEROPAGE: u64 = 1 << 0x04;
    pub(crate) const MOVE: u64 = 1 << 0x05;
    pub(crate) const WRITEPROTECT: u64 = 1 << 0x06;
    pub(crate) const CONTINUE: u64 = 1 << 0x07;
    pub(crate) const POISON: u64 = 1 << 0x08;
}

/// `UFFD_USER_MODE_ONLY`: the only way an unprivileged process may get a uffd when
/// `vm.unprivileged_userfaultfd` is 0; faults taken by the kernel (`copy_from_user`) then fail
/// with `EFAULT` instead of waiting for the handler.
const UFFD_USER_MODE_ONLY: libc::c_int = 1;

const REGISTER_MODE_MISSING: u64 = 1 << 0;
const REGISTER_MODE_WP: u64 = 1 << 1;
const REGISTER_MODE_MINOR: u64 = 1 << 2;

const COPY_MODE_DONTWAKE: u64 = 1 << 0;
const COPY_MODE_WP: u64 = 1 << 1;
const ZEROPAGE_MODE_DONTWAKE: u64 = 1 << 0;
const WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;
const CONTINUE_MODE_DONTWAKE: u64 = 1 << 0;
const CONTINUE_MODE_WP: u64 = 1 << 1;
const POISON_MODE_DONTWAKE: u64 = 1 << 0;

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

const PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
const PAGEFAULT_FLAG_WP: u64 = 1 << 1;
const PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct UffdioApi {
    pub(super) api: u64,
    pub(super) features: u64,
    pub(super) ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct UffdioRange {
    pub(super) start: u64,
    pub(super) len: u64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}

/// One `struct uffd_msg` as `read(2)` returns it (32 bytes; the C struct is `packed`, but
/// every field is naturally aligned, so `repr(C)` gives the same layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg: [u64; 3],
}

impl UffdMsg {
    /// An all-zero message, to initialize read buffers.
    pub(crate) const ZERO: UffdMsg = UffdMsg { event: 0, reserved1: 0, reserved2: 0, reserved3: 0, arg: [0; 3] };
}

// ---------------------------------------------------------------------------------------------
// Features.

/// `UFFD_FEATURE_*` bits of `uffdio_api.features`.
pub(crate) mod feature {
    pub(crate) const PAGEFAULT_FLAG_WP: u64 = 1 << 0;
    pub(crate) const EVENT_FORK: u64 = 1 << 1;
    pub(crate) const EVENT_REMAP: u64 = 1 << 2;
    pub(crate) const EVENT_REMOVE: u64 = 1 << 3;
    pub(crate) const MISSING_HUGETLBFS: u64 = 1 << 4;
    pub(crate) const MISSING_SHMEM: u64 = 1 << 5;
    pub(crate) const EVENT_UNMAP: u64 = 1 << 6;
    pub(crate) const SIGBUS: u64 = 1 << 7;
    pub(crate) const THREAD_ID: u64 = 1 << 8;
    pub(crate) const MINOR_HUGETLBFS: u64 = 1 << 9;
    pub(crate) const MINOR_SHMEM: u64 = 1 << 10;
    pub(crate) const EXACT_ADDRESS: u64 = 1 << 11;
    pub(crate) const WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
    pub(crate) const WP_UNPOPULATED: u64 = 1 << 13;
    pub(crate) const POISON: u64 = 1 << 14;
    pub(crate) const WP_ASYNC: u64 = 1 << 15;
    pub(crate) const MOVE: u64 = 1 << 16;

    /// Names, for reports ("userfaultfd lacks WP_ASYNC").
    pub(crate) const NAMES: [(u64, &str); 17] = [
        (PAGEFAULT_FLAG_WP, "PAGEFAULT_FLAG_WP"),
        (EVENT_FORK, "EVENT_FORK"),
        (EVENT_REMAP, "EVENT_REMAP"),
        (EVENT_REMOVE, "EVENT_REMOVE"),
        (MISSING_HUGETLBFS, "MISSING_HUGETLBFS"),
        (MISSING_SHMEM, "MISSING_SHMEM"),
        (EVENT_UNMAP, "EVENT_UNMAP"),
        (SIGBUS, "SIGBUS"),
        (THREAD_ID, "THREAD_ID"),
        (MINOR_HUGETLBFS, "MINOR_HUGETLBFS"),
        (MINOR_SHMEM, "MINOR_SHMEM"),
        (EXACT_ADDRESS, "EXACT_ADDRESS"),
        (WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
        (WP_UNPOPULATED, "WP_UNPOPULATED"),
        (POISON, "POISON"),
        (WP_ASYNC, "WP_ASYNC"),
        (MOVE, "MOVE"),
    ];

    /// What the mapping scheme cannot do without: MISSING faults and write protection on
    /// shmem, WP markers on unpopulated ptes, WP resolved by the kernel (dirty tracking
    /// without traps), and UFFDIO_POISON (SIGBUS for pager errors and past EOF).
    pub(crate) const SCHEME: u64 = MISSING_SHMEM | WP_HUGETLBFS_SHMEM | WP_UNPOPULATED | WP_ASYNC | POISON;

    /// Why each of [`SCHEME`] is needed, for the fallback message.
    pub(crate) fn why(bit: u64) -> &'static str {
        match bit {
            MISSING_SHMEM => "mappings of a memfd cannot be demand-paged",
            WP_HUGETLBFS_SHMEM => "stores through mappings of a memfd cannot be tracked",
            WP_UNPOPULATED => "pages faulted in later would not arrive write-protected",
            WP_ASYNC => "every first store to a clean page would trap to user space (~65 µs)",
            POISON => "a failed page-in or a touch past EOF cannot be made to raise SIGBUS",
            _ => "",
        }
    }

    /// "userfaultfd lacks NAME: why; userfaultfd lacks …" for each bit of `missing`.
    pub(crate) fn lacks(missing: u64) -> String {
        let mut why = Vec::new();
        for (bit, name) in NAMES {
            if missing & bit != 0 {
                why.push(match self::why(bit) {
                    "" => format!("userfaultfd lacks {name}"),
                    reason => format!("userfaultfd lacks {name}: {reason}"),
                });
            }
        }
        why.join("; ")
    }

    /// The names of the bits set in `bits`, space-separated.
    pub(crate) fn names(bits: u64) -> String {
        let mut s = String::new();
        for (bit, name) in NAMES {
            if bits & bit != 0 {
                if !s.is_empty() {
                    s.push(' ');
                }
                s.push_str(name);
            }
        }
        let unknown = bits & !NAMES.iter().fold(0, |a, (b, _)| a | b);
        if unknown != 0 {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(&format!("0x{unknown:x}"));
        }
        s
    }
}

/// How a uffd was obtained; only the first two let the kernel's own accesses wait for the
/// handler (`write(fd, mapping, n)`, `read` into a mapping, sending a mapping on a socket).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// `ioctl(USERFAULTFD_IOC_NEW)` on `/dev/userfaultfd` (access checked by file mode).
    Device,
    /// `userfaultfd(2)` (privileged, or `vm.unprivileged_userfaultfd = 1`).
    Syscall,
    /// `userfaultfd(UFFD_USER_MODE_ONLY)`: kernel accesses to unfilled pages get `EFAULT`.
    SyscallUserModeOnly,
}

/// What the kernel offers and what a uffd has enabled, from the `UFFDIO_API` handshake.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Features {
    /// Every feature the kernel reports (`uffdio_api.features` of a handshake asking none).
    pub(crate) offered: u64,
    /// The features enabled on this uffd (asked for and offered); `offered` for a probe.
    pub(crate) enabled: u64,
    /// How the uffd was opened.
    pub(crate) source: Source,
}

impl Features {
    /// Whether every bit of `bits` is enabled.
    pub(crate) fn has(&self, bits: u64) -> bool {
        self.enabled & bits == bits
    }

    /// The bits of `wanted` the kernel does not offer.
    pub(crate) fn missing(&self, wanted: u64) -> u64 {
        wanted & !self.offered
    }

    /// Whether a kernel access (`copy_from_user`) to an unfilled page waits for the handler.
    pub(crate) fn kernel_faults(&self) -> bool {
        self.source != Source::SyscallUserModeOnly
    }

    /// Why the scheme cannot run, or `None` when it can: one clause per missing feature.
    pub(crate) fn shortfall(&self) -> Option<String> {
        let mut why = Vec::new();
        let missing = self.missing(feature::SCHEME);
        if missing != 0 {
            why.push(feature::lacks(missing));
        }
        if !self.kernel_faults() {
            why.push(
                "userfaultfd is limited to user-mode faults (no access to /dev/userfaultfd and \
                 vm.unprivileged_userfaultfd = 0): kernel accesses to unfilled mapped pages would fail \
                 with EFAULT"
                    .to_string(),
            );
        }
        if why.is_empty() { None } else { Some(why.join("; ")) }
    }
}

impl std::fmt::Display for Features {
    /// "via /dev/userfaultfd; offered: …; enabled: …; scheme lacks: …".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match self.source {
            Source::Device => "/dev/userfaultfd",
            Source::Syscall => "userfaultfd(2)",
            Source::SyscallUserModeOnly => "userfaultfd(2, UFFD_USER_MODE_ONLY)",
        };
        write!(f, "via {source}; offered: {}", feature::names(self.offered))?;
        if self.enabled != self.offered {
            write!(f, "; enabled: {}", feature::names(self.enabled))?;
        }
        match self.missing(feature::SCHEME) {
            0 => write!(f, "; the scheme has all it needs"),
            m => write!(f, "; the scheme lacks: {}", feature::names(m)),
        }
    }
}

/// userfaultfd cannot serve ubc's mappings here; `reason` says why in words.
#[derive(Clone, Debug)]
pub(crate) struct Unavailable {
    pub(crate) reason: String,
    /// The handshake's report, when one got that far.
    pub(crate) features: Option<Features>,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

// ---------------------------------------------------------------------------------------------
// Events.

/// One message read from a uffd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A thread faulted at `addr` (page-aligned) and sleeps until the page is filled and
    /// woken. `wp`: a write to a write-protected page (never with `WP_ASYNC`); `minor`: the
    /// page is in the page cache but not mapped (MINOR mode); neither: a MISSING fault.
    /// `tid`: the faulting thread, when `THREAD_ID` is enabled (else 0).
    PageFault { addr: usize, write: bool, wp: bool, minor: bool, tid: u32 },
    /// `madvise(MADV_DONTNEED / MADV_REMOVE)` on a registered range (`EVENT_REMOVE`). The
    /// madvising thread waits until this message has been read.
    Remove { start: usize, end: usize },
    /// `munmap` of (part of) a registered range (`EVENT_UNMAP`). The unmapping thread waits
    /// until this message has been read.
    Unmap { start: usize, end: usize },
    /// `mremap` moved a registered range (`EVENT_REMAP`).
    Remap { from: usize, to: usize, len: usize },
    /// `fork` (`EVENT_FORK`): `uffd` is the child's new userfaultfd descriptor. The caller
    /// owns it (close it with `OwnedFd::from_raw_fd`).
    Fork { uffd: RawFd },
    /// An event this code does not know.
    Other { event: u8 },
}

impl Event {
    /// Decode one message.
    fn from_msg(m: &UffdMsg) -> Event {
        match m.event {
            EVENT_PAGEFAULT => {
                let flags = m.arg[0];
                Event::PageFault {
                    addr: m.arg[1] as usize,
                    write: flags & PAGEFAULT_FLAG_WRITE != 0,
                    wp: flags & PAGEFAULT_FLAG_WP != 0,
                    minor: flags & PAGEFAULT_FLAG_MINOR != 0,
                    tid: m.arg[2] as u32,
                }
            }
            EVENT_REMOVE => Event::Remove { start: m.arg[0] as usize, end: m.arg[1] as usize },
            EVENT_UNMAP => Event::Unmap { start: m.arg[0] as usize, end: m.arg[1] as usize },
            EVENT_REMAP => Event::Remap { from: m.arg[0] as usize, to: m.arg[1] as usize, len: m.arg[2] as usize },
            EVENT_FORK => Event::Fork { uffd: m.arg[0] as u32 as RawFd },
            e => Event::Other { event: e },
        }
    }
}

/// The events of one `read`, decoded as they are iterated.
pub(crate) struct Events<'a> {
    msgs: std::slice::Iter<'a, UffdMsg>,
}

impl Iterator for Events<'_> {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.msgs.next().map(Event::from_msg)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.msgs.size_hint()
    }
}

impl ExactSizeIterator for Events<'_> {}

/// What [`Uffd::wait`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ready {
    /// The uffd has messages to read.
    Events,
    /// The [`Waker`] is signalled (it stays so until [`Waker::drain`]); the uffd may have
    /// messages too.
    Woken,
    /// The timeout passed.
    Timeout,
}

/// An eventfd polled together with a uffd, so another thread can wake a handler blocked in
/// [`Uffd::wait`] (shutdown, or new work).
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    /// A new, unsignalled waker.
    pub(crate) fn new() -> io::Result<Waker> {
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        Ok(Waker { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wake the waiter (it stays woken until it drains).
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64. An error can only be EAGAIN (the counter is
        // at its maximum), which leaves the waker signalled: what we want.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reset the waker to unsignalled (a doorbell for new work drains; a shutdown signal is
    /// left set so every handler thread sees it). Returns whether it was signalled.
    pub(crate) fn drain(&self) -> bool {
        let mut n: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64; nonblocking.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) == 8 }
    }
}

// ---------------------------------------------------------------------------------------------
// Fill results.

/// Why a single `UFFDIO_COPY` stopped short of `len` bytes.
#[derive(Debug)]
pub(crate) struct CopyError {
    /// Bytes copied (and, without `dontwake`, woken) before the error, a multiple of the page size.
    pub(crate) done: usize,
    /// `EEXIST`: the page at `dst + done` exists already (in the memfd, or mapped at `dst`).
    /// `EAGAIN`: the address space is changing (a non-cooperative event is pending: read the
    /// events, then retry) — or a partial copy (`done > 0`).
    /// `ENOENT`: `dst` is not registered with this uffd (unmapped, or remapped). `ESRCH`: the
    /// process is exiting. `EFAULT`: `src` is unreadable. `ENOMEM`/`ENOSPC`: no memory.
    pub(crate) errno: i32,
}

impl CopyError {
    /// The errno as an `io::Error` (the progress is dropped).
    pub(crate) fn io_error(&self) -> io::Error {
        io::Error::from_raw_os_error(self.errno)
    }
}

impl From<CopyError> for io::Error {
    fn from(e: CopyError) -> io::Error {
        e.io_error()
    }
}

/// The outcome of [`Uffd::install`]: pages placed and pages found present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Installed {
    pub(crate) copied: usize,
    pub(crate) existing: usize,
}

/// Modes of a fill.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FillMode {
    /// Do not wake threads faulting in the range; wake them later with [`Uffd::wake`]
    /// (one wake for a whole cluster, after every page of it is in).
    pub(crate) dontwake: bool,
    /// Map the page write-protected at `dst` (only in a WP-registered range).
    pub(crate) wp: bool,
}

impl FillMode {
    pub(crate) const WAKE: FillMode = FillMode { dontwake: false, wp: false };
    pub(crate) const DONTWAKE: FillMode = FillMode { dontwake: true, wp: false };
}

/// Modes of a registration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Mode {
    /// Trap when the page is not in the memfd (MISSING).
    pub(crate) missing: bool,
    /// Write-protect tracking (WP); with `WP_ASYNC` the kernel resolves WP faults itself.
    pub(crate) wp: bool,
    /// Trap when the page is in the memfd but not mapped here (MINOR).
    pub(crate) minor: bool,
}

impl Mode {
    /// A user mapping: MISSING + WP.
    pub(crate) const USER: Mode = Mode { missing: true, wp: true, minor: false };
    /// The installer mapping: MISSING only (needed so `UFFDIO_COPY` may fill through it).
    pub(crate) const INSTALLER: Mode = Mode { missing: true, wp: false, minor: false };

    fn bits(self) -> u64 {
        (if self.missing { REGISTER_MODE_MISSING } else { 0 })
            | (if self.wp { REGISTER_MODE_WP } else { 0 })
            | (if self.minor { REGISTER_MODE_MINOR } else { 0 })
    }
}

// ---------------------------------------------------------------------------------------------
// The descriptor.

/// A userfaultfd with its features negotiated.
pub(crate) struct Uffd {
    fd: OwnedFd,
    features: Features,
}

/// `ioctl(fd, req, arg)` returning the errno on failure.
///
/// # Safety
/// `arg` must be what the kernel expects for `req` (a pointer to a live struct of the encoded
/// size, or an integer for `_IO` requests).
unsafe fn ioctl<T>(fd: BorrowedFd<'_>, req: u32, arg: *mut T) -> Result<libc::c_int, i32> {
    // SAFETY: per the function's precondition.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as libc::Ioctl, arg) };
    if r < 0 { Err(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)) } else { Ok(r) }
}

fn os(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

/// Open a fresh, unconfigured uffd (no handshake yet): `/dev/userfaultfd` first, then the
/// system call, then the system call limited to user-mode faults.
fn open_raw() -> Result<(OwnedFd, Source), String> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: a NUL-terminated path; open takes no other pointers.
    let dev = unsafe { libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    let dev_err = if dev >= 0 {
        // SAFETY: dev is a fresh descriptor nobody else owns.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        // SAFETY: USERFAULTFD_IOC_NEW takes the open flags as an integer argument.
        match unsafe { ioctl(dev.as_fd(), USERFAULTFD_IOC_NEW, flags as usize as *mut u8) } {
            // SAFETY: the ioctl returned a fresh descriptor nobody else owns.
            Ok(fd) => return Ok((unsafe { OwnedFd::from_raw_fd(fd) }, Source::Device)),
            Err(e) => os(e),
        }
    } else {
        io::Error::last_os_error()
    };
    let sys = |flags: libc::c_int| -> Result<OwnedFd, io::Error> {
        // SAFETY: userfaultfd takes only flags.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            // SAFETY: a fresh descriptor nobody else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
        }
    };
    let sys_err = match sys(flags) {
        Ok(fd) => return Ok((fd, Source::Syscall)),
        Err(e) => e,
    };
    match sys(flags | UFFD_USER_MODE_ONLY) {
        Ok(fd) => Ok((fd, Source::SyscallUserModeOnly)),
        Err(e) => Err(format!(
            "cannot open a userfaultfd: /dev/userfaultfd: {dev_err}; userfaultfd(2): {sys_err}; \
             userfaultfd(2, UFFD_USER_MODE_ONLY): {e}"
        )),
    }
}

/// `UFFDIO_API` on a fresh uffd asking for `features`; returns what the kernel reports.
fn handshake(fd: BorrowedFd<'_>, features: u64) -> Result<UffdioApi, i32> {
    let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
    // SAFETY: UFFDIO_API reads and writes a live uffdio_api.
    unsafe { ioctl(fd, UFFDIO_API, &mut api) }?;
    Ok(api)
}

/// The features the kernel offers, if a uffd can be opened at all.
pub(crate) fn offered_features() -> Option<u64> {
    offered().ok().map(|f| f.offered)
}

/// What the kernel offers (handshake on a throw-away uffd, asking nothing), cached: the
/// kernel does not change under a running process, and a handshake can be done only once
/// per uffd, so learning the offer costs a descriptor.
fn offered() -> Result<Features, Unavailable> {
    static OFFERED: std::sync::OnceLock<Result<Features, Unavailable>> = std::sync::OnceLock::new();
    OFFERED
        .get_or_init(|| {
            let (fd, source) = open_raw().map_err(|reason| Unavailable { reason, features: None })?;
            let api = handshake(fd.as_fd(), 0).map_err(|e| Unavailable {
                reason: format!("userfaultfd: UFFDIO_API handshake failed: {}", os(e)),
                features: None,
            })?;
            Ok(Features { offered: api.features, enabled: api.features, source })
        })
        .clone()
}

impl Uffd {
    /// Open a uffd with `required` features (fails naming the missing ones) and as many of
    /// `optional` as the kernel offers. => call from any thread; cheap after the first call.
    pub(crate) fn open(required: u64, optional: u64) -> Result<Uffd, Unavailable> {
        let offer = offered()?;
        let missing = offer.missing(required);
        if missing != 0 {
            return Err(Unavailable { reason: feature::lacks(missing), features: Some(offer) });
        }
        let (fd, source) = open_raw().map_err(|reason| Unavailable { reason, features: Some(offer) })?;
        let ask = required | (optional & offer.offered);
        handshake(fd.as_fd(), ask).map_err(|e| Unavailable {
            reason: format!("userfaultfd: UFFDIO_API asking for {} failed: {}", feature::names(ask), os(e)),
            features: Some(offer),
        })?;
        // The kernel turns WP_UNPOPULATED on with WP_ASYNC; say so.
        let enabled = ask | if ask & feature::WP_ASYNC != 0 { feature::WP_UNPOPULATED } else { 0 };
        Ok(Uffd { fd, features: Features { offered: offer.offered, enabled, source } })
    }

    /// The features this uffd negotiated.
    pub(crate) fn features(&self) -> Features {
        self.features
    }

    /// Register `start..start+len` (page-aligned, a whole VMA or part of one: the kernel
    /// splits it) for `mode`. Returns the `range_ioctl` bits the kernel allows there.
    /// => the range is mapped; a MAP_SHARED memfd range for WP / MINOR.
    pub(crate) fn register(&self, start: usize, len: usize, mode: Mode) -> io::Result<u64> {
        let mut r = UffdioRegister { range: range(start, len), mode: mode.bits(), ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes a live uffdio_register.
        unsafe { ioctl(self.fd.as_fd(), UFFDIO_REGISTER, &mut r) }.map_err(os)?;
        Ok(r.ioctls)
    }

    /// Unregister `start..start+len`: threads waiting there are woken (and refault as plain
    /// memory), write protection and WP markers are dropped. => no fault may be pending there
    /// that the cache still means to fill.
    pub(crate) fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut r = range(start, len);
        // SAFETY: UFFDIO_UNREGISTER reads a live uffdio_range.
        unsafe { ioctl(self.fd.as_fd(), UFFDIO_UNREGISTER, &mut r) }.map_err(os)?;
        Ok(())
    }

    /// One `UFFDIO_COPY`: copy `len` bytes from `src` into pages at `dst` that are not in the
    /// memfd, atomically per page. => `dst`, `src`, `len` page-aligned; `dst` registered
    /// MISSING with this uffd; `src` readable for `len` bytes (it may be any memory).
    pub(crate) fn copy(&self, dst: usize, src: *const u8, len: usize, mode: FillMode) -> Result<(), CopyError> {
        let mut c = UffdioCopy {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            mode: (if mode.dontwake { COPY_MODE_DONTWAKE } else { 0 }) | (if mode.wp { COPY_MODE_WP } else { 0 }),
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads a live uffdio_copy and writes its `copy`; the kernel
        // reads `src` with its own fault handling (EFAULT if unreadable).
        match unsafe { ioctl(self.fd.as_fd(), UFFDIO_COPY, &mut c) } {
            Ok(_) => Ok(()),
            Err(errno) => Err(CopyError { done: c.copy.max(0) as usize, errno }),
        }
    }

    /// Fill `len` bytes at `dst` from `src` with `UFFDIO_COPY`, skipping pages that exist
    /// already (`EEXIST`: left untouched, counted in `existing`) and resuming after partial
    /// copies. => as for [`Uffd::copy`]. Fails with `EAGAIN` (and what was done is lost to
    /// the count, not to the memfd) when the address space is changing: read the uffd's
    /// events, then call again — the pages already in will count as `existing`.
    pub(crate) fn install(&self, dst: usize, src: *const u8, len: usize, mode: FillMode) -> io::Result<Installed> {
        let page = super::page_size();
        let mut out = Installed::default();
        let mut off = 0;
        while off < len {
            // SAFETY of the pointer arithmetic: off < len, and src is readable for len bytes.
            match self.copy(dst + off, src.wrapping_add(off), len - off, mode) {
                Ok(()) => {
                    out.copied += (len - off) / page;
                    break;
                }
                Err(e) if e.done > 0 => {
                    // A partial copy: count it, then see why the next page stopped it.
                    out.copied += e.done / page;
                    off += e.done;
                }
                Err(e) if e.errno == libc::EEXIST => {
                    out.existing += 1;
                    off += page;
                }
                Err(e) => return Err(e.io_error()),
            }
        }
        Ok(out)
    }

    /// Fill pages at `start..start+len` that are not in the memfd with zeros (`UFFDIO_ZEROPAGE`;
    /// on shmem this allocates real zero pages). `EEXIST` and partial progress as for copy.
    /// => page-aligned, registered MISSING with this uffd.
    pub(crate) fn zeropage(&self, start: usize, len: usize, dontwake: bool) -> Result<(), CopyError> {
        let mut z = UffdioZeropage {
            range: range(start, len),
            mode: if dontwake { ZEROPAGE_MODE_DONTWAKE } else { 0 },
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE reads a live uffdio_zeropage and writes its last field.
        match unsafe { ioctl(self.fd.as_fd(), UFFDIO_ZEROPAGE, &mut z) } {
            Ok(_) => Ok(()),
            Err(errno) => Err(CopyError { done: z.zeropage.max(0) as usize, errno }),
        }
    }

    /// Wake threads faulting in `start..start+len` (they retry the access). => page-aligned;
    /// `len > 0` (a zero length would wake every waiter of the uffd).
    pub(crate) fn wake(&self, start: usize, len: usize) -> io::Result<()> {
        debug_assert!(len > 0);
        let mut r = range(start, len);
        // SAFETY: UFFDIO_WAKE reads a live uffdio_range.
        unsafe { ioctl(self.fd.as_fd(), UFFDIO_WAKE, &mut r) }.map_err(os)?;
        Ok(())
    }

    /// Write-protect (`on`) or unprotect `start..start+len`. Protecting leaves markers on
    /// empty ptes, so pages faulted in later arrive protected. Unprotecting wakes nobody:
    /// with `WP_ASYNC` nobody waits on WP, and a wake would rouse MISSING waiters in the
    /// range before their page is there (the kernel rejects DONTWAKE with WP set, so the two
    /// cases differ in mode). => page-aligned, registered WP with this uffd.
    pub(crate) fn writeprotect(&self, start: usize, len: usize, on: bool) -> io::Result<()> {
        let mut w = UffdioWriteprotect {
            range: range(start, len),
            mode: if on { WRITEPROTECT_MODE_WP } else { WRITEPROTECT_MODE_DONTWAKE },
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads a live uffdio_writeprotect.
        unsafe { ioctl(self.fd.as_fd(), UFFDIO_WRITEPROTECT, &mut w) }.map_err(os)?;
        Ok(())
    }

    /// Poison `start..start+len` in *this mapping only* (a pte marker, not a memfd page):
    /// a user access raises SIGBUS, a kernel access fails with EFAULT, faulting threads are
    /// woken (unless `dontwake`) and so take the SIGBUS. Survives punching the memfd; cleared
    /// by `madvise(MADV_DONTNEED)` on the range (see [`clear_poison`]).
    /// => page-aligned, registered MISSING with this uffd, no page mapped there (EEXIST).
    pub(crate) fn poison(&self, start: usize, len: usize, dontwake: bool) -> Result<(), CopyError> {
        let mut p = UffdioPoison {
            range: range(start, len),
            mode: if dontwake { POISON_MODE_DONTWAKE } else { 0 },
            updated: 0,
        };
        // SAFETY: UFFDIO_POISON reads a live uffdio_poison and writes its last field.
        match unsafe { ioctl(self.fd.as_fd(), UFFDIO_POISON, &mut p) } {
            Ok(_) => Ok(()),
            Err(errno) => Err(CopyError { done: p.updated.max(0) as usize, errno }),
        }
    }

    /// Map pages that are in the memfd but not mapped at `start..start+len` (`UFFDIO_CONTINUE`,
    /// the answer to a MINOR fault), optionally write-protected. => registered MINOR.
    pub(crate) fn continue_(&self, start: usize, len: usize, mode: FillMode) -> Result<(), CopyError> {
        let mut c = UffdioContinue {
            range: range(start, len),
            mode: (if mode.dontwake { CONTINUE_MODE_DONTWAKE } else { 0 })
                | (if mode.wp { CONTINUE_MODE_WP } else { 0 }),
            mapped: 0,
        };
        // SAFETY: UFFDIO_CONTINUE reads a live uffdio_continue and writes its last field.
        match unsafe { ioctl(self.fd.as_fd(), UFFDIO_CONTINUE, &mut c) } {
            Ok(_) => Ok(()),
            Err(errno) => Err(CopyError { done: c.mapped.max(0) as usize, errno }),
        }
    }

    /// Read the pending messages (up to `buf.len()`) without blocking; an empty iterator when
    /// there are none. Several threads may read one uffd: each message goes to one of them.
    pub(crate) fn read_events<'a>(&self, buf: &'a mut [UffdMsg]) -> io::Result<Events<'a>> {
        // SAFETY: reads at most size_of_val(buf) bytes into buf, plain-old-data.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), size_of_val(buf)) };
        let n = if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => 0,
                _ => return Err(e),
            }
        } else {
            n as usize / size_of::<UffdMsg>()
        };
        Ok(Events { msgs: buf[..n].iter() })
    }

    /// Block until the uffd has messages, `waker` is signalled, or `timeout` passes (`None`:
    /// forever). The waker is not drained. => any thread; usually the handler thread.
    pub(crate) fn wait(&self, waker: Option<&Waker>, timeout: Option<Duration>) -> io::Result<Ready> {
        let mut fds = [
            libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: waker.map_or(-1, |w| w.fd.as_raw_fd()), events: libc::POLLIN, revents: 0 },
        ];
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as libc::c_int);
        loop {
            // SAFETY: polls two live pollfd structs (a negative fd is ignored by poll).
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Ok(Ready::Timeout);
            }
            if fds[1].revents != 0 {
                return Ok(Ready::Woken);
            }
            if fds[0].revents & libc::POLLERR != 0 {
                // POLLERR: the uffd was not handshaken (cannot happen here) — report it.
                return Err(io::Error::other("userfaultfd: POLLERR"));
            }
            return Ok(Ready::Events);
        }
    }
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Remove poison markers (and any mapped pages) from `start..start+len` of a user mapping,
/// then write-protect it again so refilled pages arrive protected. => the range holds no
/// page written since the last dirty scan (the zap would drop its written state); the caller
/// is not the thread reading `uffd` if `EVENT_REMOVE` is enabled (the madvise waits for
/// that thread to read the Remove event).
pub(crate) fn clear_poison(uffd: &Uffd, start: usize, len: usize) -> io::Result<()> {
    // SAFETY: MADV_DONTNEED on a shared mapping only drops page-table entries; the memfd
    // keeps its pages, so no memory a Rust reference points to changes.
    if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) } != 0 {
        return Err(io::Error::last_os_error());
    }
    uffd.writeprotect(start, len, true)
}

fn range(start: usize, len: usize) -> UffdioRange {
    UffdioRange { start: start as u64, len: len as u64 }
}
