//! Advice: how a program says it will use a file (`posix_fadvise`, TLPI 13.5) or a mapping
//! (`madvise`). What each value does is in `object/advice.rs` (files) and `map/service.rs`
//! (faults of a mapping).

/// What a program says of its use of a file or a range of it ([`crate::File::advise`]);
/// the values are `posix_fadvise`'s `POSIX_FADV_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Advice {
    /// No particular pattern: read-ahead detects sequential streams (the default).
    Normal = 0,
    /// Reads of this handle are random: no read-ahead.
    Random = 1,
    /// Reads of this handle are sequential: every miss reads ahead, up to twice the window.
    Sequential = 2,
    /// Fill this range soon (asynchronously, as read-ahead; at most half the budget).
    WillNeed = 3,
    /// This range is not needed soon: its dirty pages are written back (waited for) and its
    /// clean pages dropped, except those pinned or mapped.
    DontNeed = 4,
    /// The data read through this handle is used once: pages it fills are admitted as
    /// read-ahead's are, the first to go.
    NoReuse = 5,
}

impl Advice {
    /// From a `POSIX_FADV_*` value.
    pub fn from_posix(v: i32) -> Option<Advice> {
        use Advice::*;
        [Normal, Random, Sequential, WillNeed, DontNeed, NoReuse].into_iter().find(|a| *a as i32 == v)
    }

    /// A per-handle access pattern (as opposed to an action on a range).
    pub(crate) fn is_pattern(self) -> bool {
        matches!(self, Advice::Normal | Advice::Random | Advice::Sequential | Advice::NoReuse)
    }

    /// The pattern kept as a `u8` (on every read: a match, not a search).
    #[inline]
    pub(crate) fn from_u8(v: u8) -> Advice {
        match v {
            1 => Advice::Random,
            2 => Advice::Sequential,
            5 => Advice::NoReuse,
            _ => Advice::Normal,
        }
    }
}
