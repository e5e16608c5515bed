//! The statements every spawn, exec and kill makes, run inline on the calling thread through
//! connections of our own instead of a pooled sqlx connection.
//!
//! sqlx runs each statement on its connection's own thread: a hand-off there and back, and
//! another pair for the check before the pool hands a connection out. On this machine that
//! hop costs 80–100 µs per statement with nothing else running (an update itself takes about
//! 16 µs, a lookup by key 3.5 µs), and several times that when the cores are busy, since each
//! hop waits for a thread to be scheduled.
//!
//! A statement here never waits: the connections have no busy handler, so a write that finds
//! the write lock held (or anything else SQLite calls busy) comes back as [`Ran::Busy`] without
//! having changed anything, and the caller runs the pooled version, which waits its turn on
//! its own thread. So a tokio worker is held for the tens of microseconds a statement takes,
//! never for a lock wait. Other errors are returned as they are.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, Row};

use super::{ExecutorLoad, ExecutorRow, SandboxAt, SandboxRow};

/// Connections kept open between calls (at most one per thread running a statement at
/// once, so this covers large runtimes); more are opened when more calls run at once.
const KEEP: usize = 64;

/// Statements that found SQLite busy and went to the pool instead.
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// How many statements, in this process, found SQLite busy and ran on the pool instead.
pub fn fallbacks() -> u64 {
    FALLBACKS.load(Ordering::Relaxed)
}

/// What a statement here came to.
pub(super) enum Ran<T> {
    Done(T),
    /// SQLite was busy (a lock was held); nothing was changed. Run the pooled version.
    Busy,
}

pub(super) struct Hot {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Hot {
    /// For the database at `path`, whose schema is already up to date.
    pub(super) fn new(path: &Path) -> Hot {
        Hot {
            path: path.to_path_buf(),
            idle: Mutex::new(Vec::new()),
        }
    }

    fn open(&self) -> rusqlite::Result<Connection> {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        // The same settings as the pool's, but no busy handler: see above.
        conn.busy_timeout(std::time::Duration::ZERO)?;
        let pragmas: String = super::CONNECTION_PRAGMAS
            .iter()
            .map(|(key, value)| format!("PRAGMA {key} = {value};"))
            .collect();
        conn.execute_batch(&pragmas)?;
        Ok(conn)
    }

    /// Close the kept connections (the database is closing).
    pub(super) fn close(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn run<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<Ran<T>> {
        let kept = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let conn = match kept {
            Some(c) => c,
            None => match self.open() {
                Ok(c) => c,
                Err(e) if is_busy(&e) => {
                    FALLBACKS.fetch_add(1, Ordering::Relaxed);
                    return Ok(Ran::Busy);
                }
                Err(e) => return Err(e),
            },
        };
        let out = f(&conn);
        {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < KEEP {
                idle.push(conn);
            }
        }
        match out {
            Ok(v) => Ok(Ran::Done(v)),
            Err(e) if is_busy(&e) => {
                FALLBACKS.fetch_add(1, Ordering::Relaxed);
                Ok(Ran::Busy)
            }
            Err(e) => Err(e),
        }
    }

    pub(super) fn executor_loads(&self, tag: &str) -> rusqlite::Result<Ran<Vec<ExecutorLoad>>> {
        self.run(|c| {
            let mut st = c.prepare_cached(super::EXECUTOR_LOADS)?;
            let rows = st.query_map([tag], |r| {
                Ok(ExecutorLoad {
                    executor: executor_row(r)?,
                    live: r.get("live")?,
                    holds: r.get("holds")?,
                    head_digest: r.get("head_digest")?,
                })
            })?;
            rows.collect()
        })
    }

    pub(super) fn insert_sandbox(
        &self,
        (id, tag, executor): &(String, String, String),
        created_ms: i64,
        (mem, cpu): (i64, i64),
        expires_ms: Option<i64>,
    ) -> rusqlite::Result<Ran<()>> {
        self.run(|c| {
            c.prepare_cached(super::INSERT_SANDBOX)?
                .execute(rusqlite::params![
                    id, tag, executor, created_ms, mem, cpu, expires_ms
                ])?;
            Ok(())
        })
    }

    pub(super) fn set_sandbox_ready(
        &self,
        id: &str,
        ready_us: i64,
    ) -> rusqlite::Result<Ran<Option<SandboxRow>>> {
        self.run(|c| {
            let mut st = c.prepare_cached(super::SET_SANDBOX_READY)?;
            // Bound first: the rows borrow `st`, which must outlive them.
            let row = first_returned(st.query_map(rusqlite::params![ready_us, id], sandbox_row)?);
            row
        })
    }

    pub(super) fn end_sandbox(
        &self,
        id: &str,
        state: &str,
        error: Option<&str>,
    ) -> rusqlite::Result<Ran<Option<SandboxRow>>> {
        self.run(|c| {
            let mut st = c.prepare_cached(super::END_SANDBOX)?;
            let row =
                first_returned(st.query_map(rusqlite::params![state, error, id], sandbox_row)?);
            row
        })
    }

    pub(super) fn end_killed(
        &self,
        id: &str,
        reason: Option<&str>,
    ) -> rusqlite::Result<Ran<Option<SandboxRow>>> {
        self.run(|c| {
            let mut st = c.prepare_cached(super::END_KILLED)?;
            let row = first_returned(st.query_map(rusqlite::params![reason, id], sandbox_row)?);
            row
        })
    }

    pub(super) fn sandbox_at(&self, id: &str) -> rusqlite::Result<Ran<Option<SandboxAt>>> {
        self.run(|c| {
            c.prepare_cached(super::SANDBOX_AT)?
                .query_row([id], |r| {
                    Ok(SandboxAt {
                        sandbox: sandbox_row(r)?,
                        addr: r.get("addr")?,
                    })
                })
                .optional()
        })
    }
}

/// The row an `UPDATE ... RETURNING` on a key returned, if any. The statement is stepped to
/// its end: an autocommit write commits on that last step, so an error committing is returned
/// here rather than lost in the statement's reset.
fn first_returned<T>(
    rows: impl Iterator<Item = rusqlite::Result<T>>,
) -> rusqlite::Result<Option<T>> {
    let mut first = None;
    for row in rows {
        let row = row?;
        first.get_or_insert(row);
    }
    Ok(first)
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

fn executor_row(r: &Row<'_>) -> rusqlite::Result<ExecutorRow> {
    Ok(ExecutorRow {
        id: r.get("id")?,
        addr: r.get("addr")?,
        draining: r.get("draining")?,
        max_sandboxes: r.get("max_sandboxes")?,
        running_sandboxes: r.get("running_sandboxes")?,
        mem_total_mib: r.get("mem_total_mib")?,
        mem_available_mib: r.get("mem_available_mib")?,
        registered_ms: r.get("registered_ms")?,
        last_heartbeat_ms: r.get("last_heartbeat_ms")?,
    })
}

fn sandbox_row(r: &Row<'_>) -> rusqlite::Result<SandboxRow> {
    Ok(SandboxRow {
        id: r.get("id")?,
        tag: r.get("tag")?,
        executor_id: r.get("executor_id")?,
        state: r.get("state")?,
        created_ms: r.get("created_ms")?,
        ready_us: r.get("ready_us")?,
        error: r.get("error")?,
        memory_limit_mib: r.get("memory_limit_mib")?,
        cpu_millis: r.get("cpu_millis")?,
        expires_ms: r.get("expires_ms")?,
    })
}
