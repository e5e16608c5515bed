//! How a connection waits for SQLite's write lock.
//!
//! SQLite's own busy handler (what `busy_timeout` installs) sleeps 1, 2, 5, 10, 15 ... ms
//! between attempts. A write here holds the lock for tens to hundreds of microseconds, so one
//! collision between two writers cost the loser 1–3 ms: that was most of the spawn latency's
//! tail. This handler retries after 20 µs, doubling up to 500 µs, and gives up after about the
//! same 5 s as before.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use libsqlite3_sys::sqlite3_busy_handler;
use sqlx::SqliteConnection;

static WAITS: AtomicU64 = AtomicU64::new(0);

const FIRST_WAIT_US: u64 = 20;
const LONGEST_WAIT_US: u64 = 500;
/// Attempts until the waits add up to about 5 s.
const ATTEMPTS: c_int = 10_000;

/// The wait before attempt `n + 1` (n attempts have failed), or None to give up.
fn wait_after(n: c_int) -> Option<Duration> {
    if n >= ATTEMPTS {
        return None;
    }
    let us = FIRST_WAIT_US
        .checked_shl(n.min(16) as u32)
        .unwrap_or(LONGEST_WAIT_US)
        .min(LONGEST_WAIT_US);
    Some(Duration::from_micros(us))
}

/// Called by SQLite on the connection's own thread when the lock it needs is held; returning
/// non-zero means "try again".
extern "C" fn on_busy(_: *mut c_void, n: c_int) -> c_int {
    match wait_after(n) {
        Some(d) => {
            if n == 0 {
                WAITS.fetch_add(1, Ordering::Relaxed);
            }
            std::thread::sleep(d);
            1
        }
        None => 0,
    }
}

/// Install the handler on `conn` (replacing the `busy_timeout` one).
pub async fn install(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    // SAFETY: the handle is locked out of sqlx's worker thread for the call, and `on_busy`
    // neither uses its argument nor touches the connection.
    let rc = unsafe {
        sqlite3_busy_handler(
            handle.as_raw_handle().as_ptr(),
            Some(on_busy),
            std::ptr::null_mut(),
        )
    };
    if rc != 0 {
        return Err(sqlx::Error::Protocol(format!(
            "sqlite3_busy_handler failed with code {rc}"
        )));
    }
    Ok(())
}

/// Times any connection of this process found the write lock held (each wait counted once).
pub fn waits() -> u64 {
    WAITS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_start_short_double_and_give_up_after_about_five_seconds() {
        assert_eq!(wait_after(0), Some(Duration::from_micros(20)));
        assert_eq!(wait_after(1), Some(Duration::from_micros(40)));
        assert_eq!(wait_after(4), Some(Duration::from_micros(320)));
        assert_eq!(wait_after(5), Some(Duration::from_micros(500)));
        assert_eq!(wait_after(60), Some(Duration::from_micros(500)));
        let total: Duration = (0..ATTEMPTS).map(|n| wait_after(n).unwrap()).sum();
        assert!(
            (Duration::from_secs(4)..Duration::from_secs(6)).contains(&total),
            "{total:?}"
        );
        assert_eq!(wait_after(ATTEMPTS), None);
    }
}
