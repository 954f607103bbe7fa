//! `ubc stat`: kind, size as this layer sees it, mode and modification time.

use crate::common::StackArgs;
use crate::error::{Ctx, Result};
use std::time::{SystemTime, UNIX_EPOCH};
use ubc_stack::Kind;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    stack: StackArgs,
    /// Path in the stack
    path: String,
}

pub fn run(a: Args) -> Result<()> {
    let (stack, layer) = a.stack.open()?;
    let at = layer.getattr(&a.path).input(&a.path)?;
    println!("  path: {}", a.path);
    println!(" layer: {} ({})", layer.index(), layer.spec());
    println!("  kind: {}", kind_name(at.kind));
    println!("  size: {}", at.size);
    println!("  mode: {:04o}", at.mode & 0o7777);
    println!(" mtime: {}", show_time(at.mtime));
    // The cache this command ran with: which memory its pages live in (huge pages or not).
    println!(" pages: {}", stack.cache().stats().page_memory);
    Ok(())
}

pub fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::File => "file",
        Kind::Dir => "directory",
        Kind::Symlink => "symlink",
        Kind::Fifo => "fifo",
        Kind::Socket => "socket",
        Kind::CharDevice => "character device",
        Kind::BlockDevice => "block device",
        _ => "unknown kind",
    }
}

/// `YYYY-MM-DD HH:MM:SS.nnnnnnnnn UTC`.
pub fn show_time(t: SystemTime) -> String {
    let (secs, nanos) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => (-(e.duration().as_secs() as i64) - 1, 1_000_000_000 - e.duration().subsec_nanos()),
    };
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{nanos:09} UTC", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates() {
        assert_eq!(show_time(UNIX_EPOCH), "1970-01-01 00:00:00.000000000 UTC");
        assert_eq!(show_time(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29 00:00:00.000000000 UTC");
        assert_eq!(show_time(UNIX_EPOCH + Duration::new(1_700_000_000, 5)), "2023-11-14 22:13:20.000000005 UTC");
    }
}
