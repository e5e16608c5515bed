//! The control plane's state in SQLite (WAL, foreign keys on): executors, snapshot lineage,
//! where snapshots are held, and sandboxes. Everything survives a restart of the service.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::SqlitePool;

use crate::now_ms;

mod hot;
use hot::{Hot, Ran};

/// How many of the inline statements (see `hot`) found SQLite busy and ran on the pool.
pub fn inline_fallbacks() -> u64 {
    hot::fallbacks()
}

/// What every connection sets, the pool's and `hot`'s (WAL is the database file's own, set once
/// by the pool).
const CONNECTION_PRAGMAS: &[(&str, &str)] = &[
    ("synchronous", "NORMAL"),
    ("foreign_keys", "ON"),
    // Read pages through a mapping rather than a read(2) per page.
    ("mmap_size", "268435456"),
    // Checkpoints run in the background (`Checkpointer`), never inside a commit.
    ("wal_autocheckpoint", "0"),
    // A WAL that grew under a burst is cut back to this size once checkpointed.
    ("journal_size_limit", "67108864"),
];

// The statements `hot` runs too: one text for both paths.
// `live_sandboxes` is kept by triggers (migration 0010), so this read costs the same with ten
// live sandboxes or a hundred thousand.
const EXECUTOR_LOADS: &str = "SELECT e.*, e.live_sandboxes AS live, \
     EXISTS (SELECT 1 FROM snapshot_copies c WHERE c.tag = ?1 AND c.executor_id = e.id) AS holds, \
     (SELECT head_digest FROM snapshots WHERE tag = ?1) AS head_digest \
     FROM executors e ORDER BY e.id";
const INSERT_SANDBOX: &str = "INSERT INTO sandboxes (id, tag, executor_id, state, created_ms, \
     memory_limit_mib, cpu_millis, expires_ms) VALUES (?, ?, ?, 'starting', ?, ?, ?, ?)";
const SET_SANDBOX_READY: &str = "UPDATE sandboxes SET state = 'ready', ready_us = ? \
     WHERE id = ? AND state = 'starting' RETURNING *";
const END_SANDBOX: &str = "UPDATE sandboxes SET state = ?, error = ? WHERE id = ? \
     AND state IN ('starting', 'ready') RETURNING *";
/// [`END_SANDBOX`] for a kill its executor confirmed (it had the child and stopped it): that
/// also ends a sandbox a heartbeat marked lost meanwhile, since the executor still had it when
/// the kill came, so what the heartbeat missed was the kill itself.
const END_KILLED: &str = "UPDATE sandboxes SET state = 'killed', error = ? WHERE id = ? \
     AND state IN ('starting', 'ready', 'lost') RETURNING *";
/// Its conditions are the partial index's (migration 0010), so only live sandboxes are read.
const EXPIRED: &str =
    "SELECT s.*, e.addr FROM sandboxes s JOIN executors e ON e.id = s.executor_id \
     WHERE s.expires_ms IS NOT NULL AND s.expires_ms <= ? \
     AND s.state IN ('starting', 'ready') ORDER BY s.expires_ms LIMIT 256";
/// Ended sandboxes forgotten per transaction: about 1.3 ms of the write lock (5 µs each).
const FORGET_BATCH: u32 = 256;
/// The oldest ended sandboxes past the retention, by the index of ended times.
const FORGET_ENDED: &str = "DELETE FROM sandboxes WHERE rowid IN (SELECT rowid FROM sandboxes \
     WHERE ended_ms IS NOT NULL AND ended_ms < ? ORDER BY ended_ms LIMIT ?)";
const COUNT_LIVE: &str = "SELECT coalesce(sum(live_sandboxes), 0) FROM executors";
const SANDBOX_AT: &str =
    "SELECT s.*, e.addr FROM sandboxes s JOIN executors e ON e.id = s.executor_id WHERE s.id = ?";

/// The statement for [`Db::sandboxes_page`], with only the terms it needs, so SQLite can walk
/// an index in the listing's order (migration 0010) instead of reading and sorting every row,
/// ended history included. Parameters, in order: the tag if filtered, the page's last
/// (created_ms, id) if any, the limit.
fn sandboxes_page_sql(by_tag: bool, include_ended: bool, after: bool) -> &'static str {
    // Made once each: sqlx takes only static statement texts.
    static ALL: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        (0..8)
            .map(|i| page_sql(i & 1 != 0, i & 2 != 0, i & 4 != 0))
            .collect()
    });
    &ALL[usize::from(by_tag) | (usize::from(include_ended) << 1) | (usize::from(after) << 2)]
}

fn page_sql(by_tag: bool, include_ended: bool, after: bool) -> String {
    let mut terms = Vec::new();
    if !include_ended {
        // The very text of the partial index's condition, so the index is used.
        terms.push("state IN ('starting', 'ready')");
    }
    if by_tag {
        // Live ones are found among the live (`+` keeps SQLite off the tag's index, which
        // would walk the snapshot's whole history); any others by the tag's index.
        terms.push(if include_ended { "tag = ?" } else { "+tag = ?" });
    }
    if after {
        terms.push("(created_ms, id) > (?, ?)");
    }
    let filter = if terms.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", terms.join(" AND "))
    };
    format!("SELECT * FROM sandboxes{filter} ORDER BY created_ms, id LIMIT ?")
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("database: {0}")]
    Inline(#[from] rusqlite::Error),
    #[error("database migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("creating the database file: {0}")]
    Create(#[from] std::io::Error),
    #[error("snapshot {0} does not exist")]
    NoSnapshot(String),
    #[error("snapshot {0} already exists")]
    SnapshotExists(String),
    #[error("snapshot {tag} has {} descendant(s) ({}); delete them first or ask for cascade", .descendants.len(), .descendants.join(", "))]
    HasDescendants {
        tag: String,
        descendants: Vec<String>,
    },
    #[error("snapshot {0} is still being written: delete it once it is READY or FAILED")]
    StillWriting(String),
    #[error("snapshot {0} is no longer being written (it failed or was deleted meanwhile)")]
    NotWriting(String),
    #[error("executor {id} is registered with another credential ({by}): an executor id belongs to the token it first registered with")]
    ExecutorClaimed { id: String, by: String },
}

pub type Result<T, E = DbError> = std::result::Result<T, E>;

/// Lifecycle of a sandbox as the control plane records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxState {
    Starting,
    Ready,
    Failed,
    Killed,
    Lost,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Ready => "ready",
            SandboxState::Failed => "failed",
            SandboxState::Killed => "killed",
            SandboxState::Lost => "lost",
        }
    }

    /// Starting or ready: it occupies a slot on its executor.
    pub fn is_live(self) -> bool {
        matches!(self, SandboxState::Starting | SandboxState::Ready)
    }
}

impl FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "starting" => SandboxState::Starting,
            "ready" => SandboxState::Ready,
            "failed" => SandboxState::Failed,
            "killed" => SandboxState::Killed,
            "lost" => SandboxState::Lost,
            other => return Err(format!("unknown sandbox state {other:?}")),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct SnapshotRow {
    pub tag: String,
    pub parent_tag: Option<String>,
    pub image: String,
    pub vcpus: i64,
    pub mem_mib: i64,
    pub source_sandbox: Option<String>,
    pub created_ms: i64,
    #[sqlx(default)]
    pub head_digest: Option<String>,
    #[sqlx(default)]
    pub parent_digest: Option<String>,
    #[sqlx(default)]
    pub chain: Option<String>,
    #[sqlx(default)]
    pub memory_bytes: Option<i64>,
    #[sqlx(default)]
    pub stored_bytes: Option<i64>,
    #[sqlx(default)]
    pub compressed_bytes: Option<i64>,
    /// Executors holding it (comma-joined by the query, split here).
    #[sqlx(default)]
    pub executors: Option<String>,
    /// 'writing', 'ready' or 'failed' (read through [`SnapshotRow::status`]).
    #[sqlx(default)]
    pub state: String,
    #[sqlx(default)]
    pub error: Option<String>,
    #[sqlx(default)]
    pub writing_until_ms: Option<i64>,
    /// The executor it was (or is being) written on: where a failed one may have left files.
    #[sqlx(default)]
    pub writer: Option<String>,
}

/// Whether a snapshot can be spawned from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotStatus {
    Ready,
    /// Its layer is being written; finished or failed by `until_ms` at the latest.
    Writing {
        until_ms: i64,
    },
    Failed(String),
}

impl SnapshotRow {
    /// Its layer chain in the store, when it has one.
    pub fn layers(&self) -> Option<SnapshotLayers> {
        let head = self.head_digest.clone()?;
        Some(SnapshotLayers {
            head_digest: head,
            parent_digest: self.parent_digest.clone(),
            chain: self
                .chain
                .as_deref()
                .filter(|c| !c.is_empty())
                .map(|c| c.split(',').map(str::to_owned).collect())
                .unwrap_or_default(),
            memory_bytes: self.memory_bytes.unwrap_or(0) as u64,
            stored_bytes: self.stored_bytes.unwrap_or(0) as u64,
            compressed_bytes: self.compressed_bytes.unwrap_or(0) as u64,
        })
    }

    /// Its state at `now_ms`: a 'writing' row past its deadline has failed.
    pub fn status(&self, now_ms: i64) -> SnapshotStatus {
        match self.state.as_str() {
            "writing" => match self.writing_until_ms {
                Some(until_ms) if until_ms > now_ms => SnapshotStatus::Writing { until_ms },
                _ => SnapshotStatus::Failed(
                    "it was not reported complete in time (the control plane waiting for it may have restarted); delete it, or create it again".into(),
                ),
            },
            "failed" => SnapshotStatus::Failed(
                self.error
                    .clone()
                    .unwrap_or_else(|| "no reason recorded".into()),
            ),
            _ => SnapshotStatus::Ready,
        }
    }

    pub fn executor_list(&self) -> Vec<String> {
        self.executors
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| s.split(',').map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// Every executor that may have files of it: those holding it, and the one it was
    /// written on (a failed attempt's leftovers).
    pub fn holders(&self) -> Vec<String> {
        let mut all = self.executor_list();
        if let Some(w) = &self.writer {
            if !all.contains(w) {
                all.push(w.clone());
            }
        }
        all
    }
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ExecutorRow {
    pub id: String,
    pub addr: String,
    pub draining: bool,
    pub max_sandboxes: i64,
    pub running_sandboxes: i64,
    pub mem_total_mib: i64,
    pub mem_available_mib: i64,
    pub registered_ms: i64,
    pub last_heartbeat_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct SandboxRow {
    pub id: String,
    pub tag: String,
    pub executor_id: String,
    pub state: String,
    pub created_ms: i64,
    pub ready_us: Option<i64>,
    pub error: Option<String>,
    pub memory_limit_mib: i64,
    pub cpu_millis: i64,
    /// When its timeout runs out (None: never).
    pub expires_ms: Option<i64>,
}

/// A sandbox and the address of the executor running it (one query for relayed calls).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct SandboxAt {
    #[sqlx(flatten)]
    pub sandbox: SandboxRow,
    pub addr: String,
}

/// An executor with its live sandbox count as recorded here, and whether it holds a given
/// snapshot (for placement).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ExecutorLoad {
    #[sqlx(flatten)]
    pub executor: ExecutorRow,
    pub live: i64,
    pub holds: bool,
    /// The snapshot's head layer (the same on every row; None without layers or snapshot).
    pub head_digest: Option<String>,
}

impl SandboxRow {
    pub fn state(&self) -> SandboxState {
        // The CHECK constraint keeps the column to known values.
        self.state.parse().unwrap_or(SandboxState::Lost)
    }
}

/// What an executor reports about itself (registration and heartbeats).
#[derive(Clone, Debug, Default)]
pub struct ExecutorReport {
    pub max_sandboxes: u32,
    pub running_sandboxes: u32,
    pub mem_total_mib: u64,
    pub mem_available_mib: u64,
    pub cached_tags: Vec<String>,
    pub live_sandboxes: Vec<String>,
    /// Sandboxes that ended on their own: id, reason, killed at its memory limit.
    pub ended: Vec<(String, String, bool)>,
}

/// New snapshot as recorded after an executor made it.
#[derive(Clone, Debug)]
pub struct NewSnapshot {
    pub tag: String,
    pub parent_tag: Option<String>,
    pub image: String,
    pub vcpus: u32,
    pub mem_mib: u64,
    pub source_sandbox: Option<String>,
    pub executor_id: String,
    /// Its layers in the cluster's store, when the executor that made it has one.
    pub layers: Option<SnapshotLayers>,
    pub state: NewState,
}

/// How a new snapshot is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewState {
    /// Complete, held by its executor.
    Ready,
    /// Being written: [`Db::finish_snapshot`] or [`Db::fail_snapshot`] follows, by `until_ms`.
    Writing { until_ms: i64 },
}

/// A snapshot's layer chain in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotLayers {
    pub head_digest: String,
    pub parent_digest: Option<String>,
    /// Head first.
    pub chain: Vec<String>,
    pub memory_bytes: u64,
    pub stored_bytes: u64,
    pub compressed_bytes: u64,
}

/// Ready sandboxes an executor no longer reports are only declared lost after this long, so a
/// heartbeat composed just before a spawn finished cannot condemn the new child.
pub const LOST_GRACE_MS: i64 = 30_000;

const SNAPSHOT_COLUMNS: &str = "s.tag, s.parent_tag, s.image, s.vcpus, s.mem_mib, s.source_sandbox, s.created_ms, \
     s.head_digest, s.parent_digest, s.chain, s.memory_bytes, s.stored_bytes, s.compressed_bytes, \
     s.state, s.error, s.writing_until_ms, s.writer, \
     (SELECT group_concat(executor_id, ',') FROM snapshot_copies c WHERE c.tag = s.tag) AS executors";

/// How often the background checkpointer copies committed WAL frames into the database file.
/// Commits themselves never checkpoint (`wal_autocheckpoint=0`): SQLite would otherwise run the
/// checkpoint, with its two fsyncs, inside whichever request's commit crossed 1000 frames.
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct Db {
    pool: SqlitePool,
    /// The hot statements, inline (see `hot`); the pool is their fallback.
    hot: std::sync::Arc<Hot>,
    checkpointer: std::sync::Arc<Checkpointer>,
}

/// The task that checkpoints the WAL on its own connection, off the request path; it stops
/// when the last handle to the database goes.
struct Checkpointer(tokio::task::JoinHandle<()>);

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Checkpointer {
    async fn start(opts: &SqliteConnectOptions) -> Result<Checkpointer> {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect_with(opts).await?;
        Ok(Checkpointer(tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut lag = CheckpointLag::default();
            loop {
                tick.tick().await;
                // PASSIVE: copies what it can without waiting on readers or blocking writers;
                // frames a reader still needs are copied on a later tick.
                let r: Result<(i64, i64, i64), _> =
                    sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
                        .fetch_one(&mut conn)
                        .await;
                match r {
                    Ok((_, log, copied)) => {
                        if let Some(behind) = lag.saw(log, copied, std::time::Instant::now()) {
                            tracing::warn!(
                                frames_behind = log - copied,
                                "WAL checkpoints have not caught up for {behind:?}: a long-lived \
                                 reader keeps the WAL from being copied back, so it keeps growing"
                            );
                        }
                    }
                    Err(e) => tracing::warn!(
                        "WAL checkpoint failed (retried in {CHECKPOINT_EVERY:?}): {e}"
                    ),
                }
            }
        })))
    }
}

/// How long checkpoints may stay incomplete before it is worth a warning.
const LAG_WARN_AFTER: Duration = Duration::from_secs(60);

/// Tracks how long the WAL has had frames no checkpoint could copy.
#[derive(Default)]
struct CheckpointLag {
    behind_since: Option<std::time::Instant>,
    warned: bool,
}

impl CheckpointLag {
    /// Record one checkpoint's result (frames in the log, frames copied); returns how long it
    /// has been behind the first time that passes [`LAG_WARN_AFTER`] in one stretch.
    fn saw(&mut self, log: i64, copied: i64, now: std::time::Instant) -> Option<Duration> {
        if copied >= log {
            *self = CheckpointLag::default();
            return None;
        }
        let since = *self.behind_since.get_or_insert(now);
        let behind = now.duration_since(since);
        if behind >= LAG_WARN_AFTER && !self.warned {
            self.warned = true;
            return Some(behind);
        }
        None
    }
}

impl Db {
    /// Open (creating if needed) the database file and bring its schema up to date.
    pub async fn open(path: &Path) -> Result<Db> {
        // Created private (SQLite gives its -wal and -shm files the database's mode): it holds
        // who did what, and digests of every token's sandboxes.
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e.into()),
        }
        let opts = CONNECTION_PRAGMAS.iter().fold(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal),
            |opts, (key, value)| opts.pragma(*key, *value),
        );
        let opts = opts.busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .after_connect(|conn, _| Box::pin(crate::lock_wait::install(conn)))
            .connect_with(opts.clone())
            .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        let checkpointer = std::sync::Arc::new(Checkpointer::start(&opts).await?);
        let hot = std::sync::Arc::new(Hot::new(path));
        Ok(Db {
            pool,
            hot,
            checkpointer,
        })
    }

    /// A transaction that writes: it takes the write lock when it begins (BEGIN IMMEDIATE), so
    /// it waits its turn under the busy timeout instead of failing with "database is locked"
    /// when another writer commits between its reads and its first write.
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    pub async fn close(&self) {
        self.checkpointer.0.abort();
        self.hot.close();
        self.pool.close().await;
    }

    // ---- executors ----

    /// Insert or refresh an executor; a draining executor stays draining across re-registration.
    /// Register executor `id` at `addr` for `principal` (the credential's name), refused when
    /// another credential holds the id.
    pub async fn upsert_executor(
        &self,
        id: &str,
        addr: &str,
        r: &ExecutorReport,
        principal: &str,
    ) -> Result<()> {
        let now = now_ms();
        let mut tx = self.write_tx().await?;
        let held: Option<String> =
            sqlx::query_scalar("SELECT principal FROM executors WHERE id = ?")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(by) = held.filter(|p| !p.is_empty() && p != principal) {
            return Err(DbError::ExecutorClaimed { id: id.into(), by });
        }
        sqlx::query(
            "INSERT INTO executors (id, addr, max_sandboxes, running_sandboxes, mem_total_mib, \
             mem_available_mib, registered_ms, last_heartbeat_ms, principal) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT(id) DO UPDATE SET addr = excluded.addr, max_sandboxes = excluded.max_sandboxes, \
             running_sandboxes = excluded.running_sandboxes, mem_total_mib = excluded.mem_total_mib, \
             mem_available_mib = excluded.mem_available_mib, registered_ms = excluded.registered_ms, \
             last_heartbeat_ms = excluded.last_heartbeat_ms, principal = excluded.principal",
        )
        .bind(id)
        .bind(addr)
        .bind(r.max_sandboxes as i64)
        .bind(r.running_sandboxes as i64)
        .bind(r.mem_total_mib as i64)
        .bind(r.mem_available_mib as i64)
        .bind(now)
        .bind(now)
        .bind(principal)
        .execute(&mut *tx)
        .await?;
        set_copies(&mut tx, id, &r.cached_tags).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Record a heartbeat from `principal`; false when executor `id` is unknown or registered
    /// with another credential (it must register again, which says why).
    pub async fn heartbeat(&self, id: &str, r: &ExecutorReport, principal: &str) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        let done = sqlx::query(
            "UPDATE executors SET max_sandboxes = ?, running_sandboxes = ?, mem_total_mib = ?, \
             mem_available_mib = ?, last_heartbeat_ms = ? WHERE id = ? AND principal IN (?, '')",
        )
        .bind(r.max_sandboxes as i64)
        .bind(r.running_sandboxes as i64)
        .bind(r.mem_total_mib as i64)
        .bind(r.mem_available_mib as i64)
        .bind(now_ms())
        .bind(id)
        .bind(principal)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        set_copies(&mut tx, id, &r.cached_tags).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Mark the sandboxes an executor says ended on their own as failed, with why; returns
    /// the ones that were live until now (each is reported until it ages out on the executor).
    pub async fn end_reported(
        &self,
        executor: &str,
        ended: &[(String, String, bool)],
    ) -> Result<Vec<(String, String, bool)>> {
        let mut newly = Vec::new();
        let mut tx = self.write_tx().await?;
        for (id, reason, oom) in ended {
            // 'lost' too: a report can race the child's death (seen in neither list), and
            // the reason is worth more than "its executor no longer runs it".
            let r = sqlx::query(
                "UPDATE sandboxes SET state = 'failed', error = ? \
                 WHERE id = ? AND executor_id = ? AND state IN ('starting', 'ready', 'lost')",
            )
            .bind(reason)
            .bind(id)
            .bind(executor)
            .execute(&mut *tx)
            .await?;
            if r.rows_affected() == 1 {
                newly.push((id.clone(), reason.clone(), *oom));
            }
        }
        tx.commit().await?;
        Ok(newly)
    }

    /// Fail every snapshot still recorded as being written: at start, no call of this process
    /// waits for one, so none will be finished (a copy its executor completed anyway is removed
    /// when the tag is deleted or created again). How many.
    pub async fn fail_interrupted_snapshots(&self) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE snapshots SET state = 'failed', writing_until_ms = NULL, \
             error = 'its writing was cut short: the control plane stopped before it finished; delete it, or create it again' \
             WHERE state = 'writing'",
        )
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// At start: sandboxes still 'starting' belonged to spawns of a control plane that is gone
    /// (killed mid-spawn), whose callers never learned of them. They fail, so the executors
    /// running them are told at their next registration to kill them (see
    /// [`Db::reconcile_sandboxes`]) rather than leaving them starting forever. How many.
    pub async fn fail_interrupted_spawns(&self) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE sandboxes SET state = 'failed', \
             error = 'its spawn was cut short: the control plane stopped before it was ready' \
             WHERE state = 'starting'",
        )
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Reconcile the executor's live sandboxes with the records: ready sandboxes it no longer
    /// runs become lost; returns the ids it runs that the control plane has no live record of.
    pub async fn reconcile_sandboxes(
        &self,
        executor: &str,
        live: &[String],
        grace_ms: i64,
    ) -> Result<Vec<String>> {
        let mut tx = self.write_tx().await?;
        let known: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT id, state, created_ms FROM sandboxes WHERE executor_id = ? AND state IN ('starting', 'ready')",
        )
        .bind(executor)
        .fetch_all(&mut *tx)
        .await?;
        let cutoff = now_ms() - grace_ms;
        for (id, state, created) in &known {
            if state == "ready" && *created < cutoff && !live.contains(id) {
                sqlx::query("UPDATE sandboxes SET state = 'lost', error = 'its executor no longer runs it' WHERE id = ?")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        Ok(live
            .iter()
            .filter(|id| !known.iter().any(|(k, _, _)| k == *id))
            .cloned()
            .collect())
    }

    pub async fn set_draining(&self, id: &str) -> Result<bool> {
        let r = sqlx::query("UPDATE executors SET draining = 1 WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() == 1)
    }

    pub async fn executors(&self) -> Result<Vec<ExecutorRow>> {
        self.executors_page(None, u32::MAX).await
    }

    /// Up to `limit` executors by id, after `after`.
    pub async fn executors_page(
        &self,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<ExecutorRow>> {
        Ok(sqlx::query_as(
            "SELECT * FROM executors WHERE ?1 IS NULL OR id > ?1 ORDER BY id LIMIT ?2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    pub async fn executor(&self, id: &str) -> Result<Option<ExecutorRow>> {
        Ok(sqlx::query_as("SELECT * FROM executors WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Every executor with its live (starting or ready) sandbox count, whether it holds
    /// snapshot `tag`, and the snapshot's head layer, in one query (the spawn path's only
    /// read while executors are registered).
    pub async fn executor_loads(&self, tag: &str) -> Result<Vec<ExecutorLoad>> {
        if let Ran::Done(v) = self.hot.executor_loads(tag)? {
            return Ok(v);
        }
        Ok(sqlx::query_as(EXECUTOR_LOADS)
            .bind(tag)
            .fetch_all(&self.pool)
            .await?)
    }

    /// (executor, tag) for every held snapshot copy.
    pub async fn copies(&self) -> Result<Vec<(String, String)>> {
        Ok(
            sqlx::query_as(
                "SELECT executor_id, tag FROM snapshot_copies ORDER BY executor_id, tag",
            )
            .fetch_all(&self.pool)
            .await?,
        )
    }

    // ---- snapshots ----

    pub async fn insert_snapshot(&self, s: &NewSnapshot) -> Result<()> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query(
            "INSERT INTO snapshots (tag, parent_tag, image, vcpus, mem_mib, source_sandbox, created_ms, \
               head_digest, parent_digest, chain, memory_bytes, stored_bytes, compressed_bytes, \
               state, writing_until_ms, writer) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(tag) DO NOTHING",
        )
        .bind(&s.tag)
        .bind(&s.parent_tag)
        .bind(&s.image)
        .bind(s.vcpus as i64)
        .bind(s.mem_mib as i64)
        .bind(&s.source_sandbox)
        .bind(now_ms())
        .bind(s.layers.as_ref().map(|l| l.head_digest.clone()))
        .bind(s.layers.as_ref().and_then(|l| l.parent_digest.clone()))
        .bind(s.layers.as_ref().map(|l| l.chain.join(",")))
        .bind(s.layers.as_ref().map(|l| l.memory_bytes as i64))
        .bind(s.layers.as_ref().map(|l| l.stored_bytes as i64))
        .bind(s.layers.as_ref().map(|l| l.compressed_bytes as i64))
        .bind(match s.state {
            NewState::Ready => "ready",
            NewState::Writing { .. } => "writing",
        })
        .bind(match s.state {
            NewState::Ready => None,
            NewState::Writing { until_ms } => Some(until_ms),
        })
        .bind(&s.executor_id)
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() == 0 {
            return Err(DbError::SnapshotExists(s.tag.clone()));
        }
        if s.state == NewState::Ready {
            record_copy(&mut tx, &s.tag, &s.executor_id).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// A snapshot recorded as writing is complete on `executor_id` (and in the store, with
    /// `layers`; `shape` is its (vCPUs, MiB) when only the executor knew them). Fails with
    /// [`DbError::NotWriting`] if it is no longer writing.
    pub async fn finish_snapshot(
        &self,
        tag: &str,
        executor_id: &str,
        layers: Option<&SnapshotLayers>,
        shape: Option<(u32, u64)>,
    ) -> Result<()> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query(
            "UPDATE snapshots SET state = 'ready', writing_until_ms = NULL, \
               head_digest = ?, parent_digest = ?, chain = ?, memory_bytes = ?, stored_bytes = ?, \
               compressed_bytes = ?, vcpus = coalesce(?, vcpus), mem_mib = coalesce(?, mem_mib) \
             WHERE tag = ? AND state = 'writing' AND writing_until_ms > ?",
        )
        .bind(layers.map(|l| l.head_digest.clone()))
        .bind(layers.and_then(|l| l.parent_digest.clone()))
        .bind(layers.map(|l| l.chain.join(",")))
        .bind(layers.map(|l| l.memory_bytes as i64))
        .bind(layers.map(|l| l.stored_bytes as i64))
        .bind(layers.map(|l| l.compressed_bytes as i64))
        .bind(shape.map(|s| s.0 as i64))
        .bind(shape.map(|s| s.1 as i64))
        .bind(tag)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() == 0 {
            return Err(DbError::NotWriting(tag.to_string()));
        }
        record_copy(&mut tx, tag, executor_id).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Forget a snapshot recorded as writing whose making never started (its executor
    /// refused it): the tag is as free as before the call.
    pub async fn forget_writing(&self, tag: &str) -> Result<()> {
        sqlx::query("DELETE FROM snapshots WHERE tag = ? AND state = 'writing'")
            .bind(tag)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A snapshot recorded as writing failed: nothing can be spawned from it.
    pub async fn fail_snapshot(&self, tag: &str, error: &str) -> Result<()> {
        let r = sqlx::query(
            "UPDATE snapshots SET state = 'failed', error = ?, writing_until_ms = NULL \
             WHERE tag = ? AND state = 'writing'",
        )
        .bind(error)
        .bind(tag)
        .execute(&self.pool)
        .await?;
        if r.rows_affected() == 0 {
            return Err(DbError::NotWriting(tag.to_string()));
        }
        Ok(())
    }

    pub async fn snapshot(&self, tag: &str) -> Result<Option<SnapshotRow>> {
        let q = format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots s WHERE s.tag = ?");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(q))
            .bind(tag)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Up to `limit` snapshots, oldest first, after the one created at `after`.
    pub async fn snapshots_page(
        &self,
        after: Option<(i64, &str)>,
        limit: u32,
    ) -> Result<Vec<SnapshotRow>> {
        let q = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM snapshots s \
             WHERE ?1 IS NULL OR (s.created_ms, s.tag) > (?1, ?2) \
             ORDER BY s.created_ms, s.tag LIMIT ?3"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(q))
            .bind(after.map(|a| a.0))
            .bind(after.map(|a| a.1))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Parent, grandparent, ... of `tag` (nearest first).
    pub async fn ancestors(&self, tag: &str) -> Result<Vec<SnapshotRow>> {
        let q = format!(
            "WITH RECURSIVE up(tag, depth) AS ( \
               SELECT parent_tag, 1 FROM snapshots WHERE tag = ? AND parent_tag IS NOT NULL \
               UNION ALL \
               SELECT p.parent_tag, up.depth + 1 FROM snapshots p JOIN up ON p.tag = up.tag \
               WHERE p.parent_tag IS NOT NULL) \
             SELECT {SNAPSHOT_COLUMNS} FROM up JOIN snapshots s ON s.tag = up.tag ORDER BY up.depth"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(q))
            .bind(tag)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Every snapshot descending from `tag`, parents before their children.
    pub async fn descendants(&self, tag: &str) -> Result<Vec<SnapshotRow>> {
        let q = format!(
            "WITH RECURSIVE down(tag, depth) AS ( \
               SELECT tag, 1 FROM snapshots WHERE parent_tag = ? \
               UNION ALL \
               SELECT c.tag, down.depth + 1 FROM snapshots c JOIN down ON c.parent_tag = down.tag) \
             SELECT {SNAPSHOT_COLUMNS} FROM down JOIN snapshots s ON s.tag = down.tag ORDER BY down.depth, s.tag"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(q))
            .bind(tag)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Delete `tag` (and with `cascade` all its descendants, deepest first) in one
    /// transaction. Returns the deleted rows (with where they were held).
    pub async fn delete_snapshot(&self, tag: &str, cascade: bool) -> Result<Vec<SnapshotRow>> {
        let Some(me) = self.snapshot(tag).await? else {
            return Err(DbError::NoSnapshot(tag.to_string()));
        };
        if let SnapshotStatus::Writing { .. } = me.status(now_ms()) {
            return Err(DbError::StillWriting(tag.to_string()));
        }
        let descendants = self.descendants(tag).await?;
        if let Some(w) = descendants
            .iter()
            .find(|d| matches!(d.status(now_ms()), SnapshotStatus::Writing { .. }))
        {
            return Err(DbError::StillWriting(w.tag.clone()));
        }
        if !descendants.is_empty() && !cascade {
            return Err(DbError::HasDescendants {
                tag: tag.to_string(),
                descendants: descendants.into_iter().map(|d| d.tag).collect(),
            });
        }
        let mut doomed = descendants;
        doomed.reverse(); // children before parents (RESTRICT on parent_tag)
        doomed.push(me);
        let mut tx = self.write_tx().await?;
        for s in &doomed {
            sqlx::query("DELETE FROM snapshots WHERE tag = ?")
                .bind(&s.tag)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(doomed)
    }

    // ---- sandboxes ----

    /// Record new children as starting, all or none, with the (memory MiB, CPU millis) their
    /// spawn asked for and the seconds they live (None: until killed).
    pub async fn insert_sandboxes(
        &self,
        rows: &[(String, String, String)],
        resources: (u64, u32),
        timeout_s: Option<u32>,
    ) -> Result<()> {
        let now = now_ms();
        let (mem, cpu) = (resources.0 as i64, i64::from(resources.1));
        let expires = timeout_s.map(|s| now + i64::from(s) * 1000);
        if let [row @ (id, tag, executor)] = rows {
            // One row: a single autocommit statement (no BEGIN/COMMIT round trips), inline.
            if let Ran::Done(()) = self.hot.insert_sandbox(row, now, (mem, cpu), expires)? {
                return Ok(());
            }
            sqlx::query(INSERT_SANDBOX)
                .bind(id)
                .bind(tag)
                .bind(executor)
                .bind(now)
                .bind(mem)
                .bind(cpu)
                .bind(expires)
                .execute(&self.pool)
                .await?;
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for (id, tag, executor) in rows {
            sqlx::query(INSERT_SANDBOX)
                .bind(id)
                .bind(tag)
                .bind(executor)
                .bind(now)
                .bind(mem)
                .bind(cpu)
                .bind(expires)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Mark a starting sandbox ready; returns its row (None if it was not starting any more).
    pub async fn set_sandbox_ready(&self, id: &str, ready_us: u64) -> Result<Option<SandboxRow>> {
        if let Ran::Done(row) = self.hot.set_sandbox_ready(id, ready_us as i64)? {
            return Ok(row);
        }
        Ok(sqlx::query_as(SET_SANDBOX_READY)
            .bind(ready_us as i64)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        Ok(sqlx::query_as("SELECT * FROM sandboxes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Move a live sandbox's expiry; None if it is not live (or does not exist).
    pub async fn set_expiry(&self, id: &str, expires_ms: i64) -> Result<Option<SandboxRow>> {
        Ok(sqlx::query_as(
            "UPDATE sandboxes SET expires_ms = ? WHERE id = ? AND state IN ('starting', 'ready') \
             RETURNING *",
        )
        .bind(expires_ms)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Live sandboxes whose timeout ran out by `now_ms`, with their executors' addresses.
    pub async fn expired(&self, now_ms: i64) -> Result<Vec<SandboxAt>> {
        Ok(sqlx::query_as(EXPIRED)
            .bind(now_ms)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn sandbox_at(&self, id: &str) -> Result<Option<SandboxAt>> {
        if let Ran::Done(at) = self.hot.sandbox_at(id)? {
            return Ok(at);
        }
        Ok(sqlx::query_as(SANDBOX_AT)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// End a sandbox that is still live (starting or ready); returns its row if this call
    /// ended it. An ended one keeps how it ended: the first verdict (killed, expired, failed
    /// with its reason) is never overwritten by a later one.
    pub async fn end_sandbox(
        &self,
        id: &str,
        state: SandboxState,
        error: Option<&str>,
    ) -> Result<Option<SandboxRow>> {
        if let Ran::Done(row) = self.hot.end_sandbox(id, state.as_str(), error)? {
            return Ok(row);
        }
        Ok(sqlx::query_as(END_SANDBOX)
            .bind(state.as_str())
            .bind(error)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// End a sandbox as killed after a kill its executor answered: as [`Db::end_sandbox`];
    /// but when the executor had it (and so stopped it), a sandbox marked lost in the meantime
    /// ends too (see `END_KILLED`).
    pub async fn end_killed(
        &self,
        id: &str,
        reason: Option<&str>,
        executor_had_it: bool,
    ) -> Result<Option<SandboxRow>> {
        if !executor_had_it {
            return self.end_sandbox(id, SandboxState::Killed, reason).await;
        }
        if let Ran::Done(row) = self.hot.end_killed(id, reason)? {
            return Ok(row);
        }
        Ok(sqlx::query_as(END_KILLED)
            .bind(reason)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Sandboxes (of snapshot `tag`; with `include_ended`, also ended ones), oldest first.
    pub async fn sandboxes(
        &self,
        tag: Option<&str>,
        include_ended: bool,
    ) -> Result<Vec<SandboxRow>> {
        self.sandboxes_page(tag, include_ended, None, u32::MAX)
            .await
    }

    /// [`Db::sandboxes`], a page at a time: up to `limit` after the one created at `after`.
    pub async fn sandboxes_page(
        &self,
        tag: Option<&str>,
        include_ended: bool,
        after: Option<(i64, &str)>,
        limit: u32,
    ) -> Result<Vec<SandboxRow>> {
        let mut q = sqlx::query_as(sandboxes_page_sql(
            tag.is_some(),
            include_ended,
            after.is_some(),
        ));
        if let Some(tag) = tag {
            q = q.bind(tag);
        }
        if let Some((created, id)) = after {
            q = q.bind(created).bind(id);
        }
        Ok(q.bind(limit).fetch_all(&self.pool).await?)
    }

    /// Forget sandboxes that ended before `cutoff_ms` (history retention); how many. In
    /// batches of [`FORGET_BATCH`], each its own transaction, resting after each as long as it
    /// took: one statement over a backlog holds the write lock for as long as it runs (0.6 s
    /// for 120,000 sandboxes), and every spawn meanwhile waits; this way a spawn waits for one
    /// batch at most, and the lock is free at least half the time. `forgotten_batch` hears of
    /// each batch once it is committed, so a pass that fails part-way still counts what it did.
    pub async fn forget_ended_before(
        &self,
        cutoff_ms: i64,
        mut forgotten_batch: impl FnMut(u64),
    ) -> Result<u64> {
        let mut forgotten = 0;
        loop {
            let started = std::time::Instant::now();
            let n = sqlx::query(FORGET_ENDED)
                .bind(cutoff_ms)
                .bind(FORGET_BATCH)
                .execute(&self.pool)
                .await?
                .rows_affected();
            forgotten += n;
            if n > 0 {
                forgotten_batch(n);
            }
            if n < u64::from(FORGET_BATCH) {
                return Ok(forgotten);
            }
            tokio::time::sleep(started.elapsed()).await;
        }
    }

    /// Live (starting or ready) sandboxes on all executors, from the counts the triggers keep
    /// (not a scan of every sandbox row, history included).
    pub async fn count_live_sandboxes(&self) -> Result<i64> {
        let (n,): (i64,) = sqlx::query_as(COUNT_LIVE).fetch_one(&self.pool).await?;
        Ok(n)
    }
}

/// How long a copy recorded here stands without its executor's report listing it. A report
/// is taken on the executor before it is sent, so one taken just before a snapshot was
/// installed can arrive after the control plane recorded that copy; it must not drop it.
pub const COPY_GRACE_MS: i64 = 5_000;

/// Record that `executor` holds `tag`, as of now.
async fn record_copy(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    tag: &str,
    executor: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO snapshot_copies (tag, executor_id, recorded_ms) VALUES (?, ?, ?) \
         ON CONFLICT(tag, executor_id) DO UPDATE SET recorded_ms = excluded.recorded_ms",
    )
    .bind(tag)
    .bind(executor)
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Replace the executor's list of held snapshots with `tags` (unknown tags, and snapshots
/// not complete, are ignored), keeping copies recorded within [`COPY_GRACE_MS`].
async fn set_copies(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    executor: &str,
    tags: &[String],
) -> Result<()> {
    let now = now_ms();
    sqlx::query("DELETE FROM snapshot_copies WHERE executor_id = ? AND recorded_ms < ?")
        .bind(executor)
        .bind(now - COPY_GRACE_MS)
        .execute(&mut **tx)
        .await?;
    for tag in tags {
        sqlx::query(
            // Only complete snapshots: one still being written is the branch's to finish.
            "INSERT INTO snapshot_copies (tag, executor_id, recorded_ms) \
             SELECT tag, ?, ? FROM snapshots WHERE tag = ? AND state = 'ready' \
             ON CONFLICT(tag, executor_id) DO UPDATE SET recorded_ms = excluded.recorded_ms",
        )
        .bind(executor)
        .bind(now)
        .bind(tag)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writing(tag: &str, until_ms: i64) -> NewSnapshot {
        NewSnapshot {
            tag: tag.into(),
            parent_tag: None,
            image: "img".into(),
            vcpus: 1,
            mem_mib: 64,
            source_sandbox: None,
            executor_id: "ex".into(),
            layers: None,
            state: NewState::Writing { until_ms },
        }
    }

    /// Registers `executors` (each on its own address) and a ready snapshot "base" the first
    /// one holds.
    async fn executors_with_base(db: &Db, executors: &[&str], report: &ExecutorReport) {
        for (i, ex) in executors.iter().enumerate() {
            let addr = format!("http://127.0.0.1:{}", i + 1);
            db.upsert_executor(ex, &addr, report, "p").await.unwrap();
        }
        db.insert_snapshot(&NewSnapshot {
            state: NewState::Ready,
            executor_id: executors[0].into(),
            ..writing("base", 0)
        })
        .await
        .unwrap();
    }

    /// The database and the files SQLite keeps beside it are its owner's alone.
    #[tokio::test]
    async fn the_database_is_created_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cp.db");
        let db = Db::open(&path).await.unwrap();
        db.insert_snapshot(&writing("t", i64::MAX)).await.unwrap();
        for f in ["cp.db", "cp.db-wal", "cp.db-shm"] {
            let mode = std::fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "{f}: {:o}", mode & 0o777);
        }
    }

    /// A checkpointer that stays behind warns once per stretch, after a minute of it.
    #[test]
    fn checkpoint_lag_warns_once_per_stretch_behind() {
        let t0 = std::time::Instant::now();
        let mut lag = CheckpointLag::default();
        assert_eq!(lag.saw(10, 10, t0), None);
        assert_eq!(lag.saw(20, 5, t0), None);
        assert_eq!(lag.saw(30, 5, t0 + Duration::from_secs(59)), None);
        assert_eq!(lag.saw(40, 5, t0 + LAG_WARN_AFTER), Some(LAG_WARN_AFTER));
        assert_eq!(lag.saw(50, 5, t0 + Duration::from_secs(120)), None);
        // Caught up: a new stretch behind warns again after its own minute.
        assert_eq!(lag.saw(50, 50, t0 + Duration::from_secs(121)), None);
        let t1 = t0 + Duration::from_secs(122);
        assert_eq!(lag.saw(5, 1, t1), None);
        assert!(lag.saw(6, 1, t1 + LAG_WARN_AFTER).is_some());
    }

    /// Commits leave the WAL alone; the background checkpointer copies them into the database
    /// file on its own.
    #[tokio::test]
    async fn the_wal_is_checkpointed_in_the_background_not_by_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cp.db");
        let db = Db::open(&path).await.unwrap();
        let auto: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(auto, 0, "a commit could checkpoint on the request path");
        let tag = "checkpointed-by-the-background-task";
        db.insert_snapshot(&writing(tag, i64::MAX)).await.unwrap();
        let in_file = |f: &str| {
            let bytes = std::fs::read(dir.path().join(f)).unwrap();
            bytes.windows(tag.len()).any(|w| w == tag.as_bytes())
        };
        assert!(in_file("cp.db-wal"), "the commit went to the WAL");
        let deadline = std::time::Instant::now() + CHECKPOINT_EVERY * 10;
        while !in_file("cp.db") {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint within {:?}",
                CHECKPOINT_EVERY * 10
            );
            tokio::time::sleep(CHECKPOINT_EVERY / 4).await;
        }
        db.close().await;
    }

    /// A report taken before a snapshot was installed, arriving after the copy was recorded,
    /// keeps the copy; reports later than the grace drop a copy they do not list.
    #[tokio::test]
    async fn a_report_older_than_a_recorded_copy_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("copies.db")).await.unwrap();
        let old_report = ExecutorReport::default();
        db.upsert_executor("ex", "http://127.0.0.1:1", &old_report, "p")
            .await
            .unwrap();
        db.insert_snapshot(&writing("t", i64::MAX)).await.unwrap();
        db.finish_snapshot("t", "ex", None, None).await.unwrap();
        assert!(db.heartbeat("ex", &old_report, "p").await.unwrap());
        let held = vec![("ex".to_string(), "t".to_string())];
        assert_eq!(db.copies().await.unwrap(), held, "kept within the grace");

        // Recorded long ago: a report that does not list it drops it, one that does keeps it.
        let age = |db: &Db| {
            let pool = db.pool.clone();
            async move {
                sqlx::query("UPDATE snapshot_copies SET recorded_ms = ?")
                    .bind(now_ms() - COPY_GRACE_MS - 1)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        };
        age(&db).await;
        let listing = ExecutorReport {
            cached_tags: vec!["t".into()],
            ..Default::default()
        };
        assert!(db.heartbeat("ex", &listing, "p").await.unwrap());
        assert_eq!(db.copies().await.unwrap(), held, "listed: kept");
        age(&db).await;
        assert!(db.heartbeat("ex", &old_report, "p").await.unwrap());
        assert!(
            db.copies().await.unwrap().is_empty(),
            "gone from the report"
        );
        db.close().await;
    }

    /// The inline statements and the pooled ones read and write the same rows.
    #[tokio::test]
    async fn inline_statements_agree_with_the_pooled_ones() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("hot.db")).await.unwrap();
        let report = ExecutorReport {
            max_sandboxes: 7,
            cached_tags: vec!["base".into()],
            ..Default::default()
        };
        executors_with_base(&db, &["ex-a", "ex-b"], &report).await;
        let rows = [("sb-1".to_string(), "base".to_string(), "ex-a".to_string())];
        db.insert_sandboxes(&rows, (256, 500), Some(60))
            .await
            .unwrap();
        let pooled_loads: Vec<ExecutorLoad> = sqlx::query_as(EXECUTOR_LOADS)
            .bind("base")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        // Nothing holds a lock here, so these ran inline, not on the pool.
        assert!(matches!(db.hot.executor_loads("base"), Ok(Ran::Done(_))));
        assert!(matches!(db.hot.sandbox_at("sb-1"), Ok(Ran::Done(Some(_)))));
        let loads = db.executor_loads("base").await.unwrap();
        assert_eq!(loads, pooled_loads);
        assert_eq!(loads.len(), 2);
        assert_eq!((loads[0].live, loads[1].live), (1, 0));
        let pooled_at: Option<SandboxAt> = sqlx::query_as(SANDBOX_AT)
            .bind("sb-1")
            .fetch_optional(&db.pool)
            .await
            .unwrap();
        let at = db.sandbox_at("sb-1").await.unwrap();
        assert_eq!(at, pooled_at);
        let at = at.unwrap();
        assert_eq!(at.addr, "http://127.0.0.1:1");
        assert_eq!(
            (at.sandbox.memory_limit_mib, at.sandbox.cpu_millis),
            (256, 500)
        );
        assert!(at.sandbox.expires_ms.is_some());
        let ready = db.set_sandbox_ready("sb-1", 1234).await.unwrap().unwrap();
        assert_eq!(
            (ready.state(), ready.ready_us),
            (SandboxState::Ready, Some(1234))
        );
        assert_eq!(Some(&ready), db.sandbox("sb-1").await.unwrap().as_ref());
        // Only a starting sandbox becomes ready, only a live one ends, and only once.
        assert_eq!(db.set_sandbox_ready("sb-1", 1).await.unwrap(), None);
        let ended = db
            .end_sandbox("sb-1", SandboxState::Failed, Some("why"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ended.error.as_deref(), Some("why"));
        assert_eq!(
            db.end_sandbox("sb-1", SandboxState::Killed, None)
                .await
                .unwrap(),
            None
        );
        assert_eq!(db.sandbox_at("nope").await.unwrap(), None);
        // A constraint still fails the call: the same id twice.
        assert!(db.insert_sandboxes(&rows, (0, 0), None).await.is_err());
        db.close().await;
    }

    /// Each executor's live count as the triggers keep it, beside a count of its rows.
    async fn live_counts(db: &Db) -> Vec<(String, i64, i64)> {
        sqlx::query_as(
            "SELECT e.id, e.live_sandboxes, (SELECT count(*) FROM sandboxes s \
             WHERE s.executor_id = e.id AND s.state IN ('starting', 'ready')) \
             FROM executors e ORDER BY e.id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    }

    /// The kept counts equal the rows' after each step; returns them in executor order.
    async fn kept_counts(db: &Db, step: &str) -> Vec<i64> {
        let counts = live_counts(db).await;
        for (id, kept, counted) in &counts {
            assert_eq!(kept, counted, "{step}: executor {id}");
        }
        let loads = db.executor_loads("base").await.unwrap();
        let live: Vec<i64> = loads.iter().map(|l| l.live).collect();
        assert_eq!(
            live,
            counts.iter().map(|c| c.1).collect::<Vec<_>>(),
            "{step}"
        );
        assert_eq!(
            db.count_live_sandboxes().await.unwrap(),
            live.iter().sum::<i64>(),
            "{step}"
        );
        live
    }

    /// A spawn reads each executor's live count from its row, kept by triggers; every path
    /// that starts, readies, ends, loses, fails or forgets a sandbox keeps it equal to a count
    /// of the rows.
    #[tokio::test]
    async fn live_counts_follow_every_path_a_sandbox_takes() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("live.db")).await.unwrap();
        executors_with_base(&db, &["ex-a", "ex-b"], &ExecutorReport::default()).await;
        let row = |id: &str, ex: &str| (id.to_string(), "base".to_string(), ex.to_string());
        // One row inline, then several in one transaction.
        db.insert_sandboxes(&[row("a1", "ex-a")], (0, 0), None)
            .await
            .unwrap();
        let many: Vec<_> = ["a2", "a3", "a4", "a5"]
            .iter()
            .map(|id| row(id, "ex-a"))
            .chain([row("b1", "ex-b"), row("b2", "ex-b")])
            .collect();
        db.insert_sandboxes(&many, (0, 0), Some(60)).await.unwrap();
        assert_eq!(kept_counts(&db, "inserted").await, [5, 2]);
        for id in ["a1", "a2", "a3", "a4", "b1"] {
            db.set_sandbox_ready(id, 1).await.unwrap().unwrap();
        }
        assert_eq!(kept_counts(&db, "ready").await, [5, 2]);
        db.end_sandbox("a1", SandboxState::Failed, Some("gone"))
            .await
            .unwrap()
            .unwrap();
        db.end_killed("a2", None, true).await.unwrap().unwrap();
        assert_eq!(kept_counts(&db, "ended").await, [3, 2]);
        // Ending twice moves nothing.
        assert_eq!(db.end_killed("a2", None, true).await.unwrap(), None);
        assert_eq!(kept_counts(&db, "ended twice").await, [3, 2]);
        db.end_reported("ex-b", &[("b1".into(), "crashed".into(), false)])
            .await
            .unwrap();
        assert_eq!(kept_counts(&db, "reported").await, [3, 1]);
        // Ready ones become lost; then a confirmed kill ends a lost one (not live either way).
        db.reconcile_sandboxes("ex-a", &["a4".to_string()], -60_000)
            .await
            .unwrap();
        assert_eq!(kept_counts(&db, "lost").await, [2, 1]);
        db.end_killed("a3", None, true).await.unwrap().unwrap();
        assert_eq!(kept_counts(&db, "lost, then killed").await, [2, 1]);
        // A restart fails the spawns still starting (a5, b2).
        assert_eq!(db.fail_interrupted_spawns().await.unwrap(), 2);
        assert_eq!(kept_counts(&db, "interrupted").await, [1, 0]);
        // Forgetting ended history, and deleting a live row by hand, keep the counts too.
        db.forget_ended_before(i64::MAX, |_| {}).await.unwrap();
        assert_eq!(kept_counts(&db, "forgotten").await, [1, 0]);
        sqlx::query("DELETE FROM sandboxes WHERE id = 'a4'")
            .execute(&db.pool)
            .await
            .unwrap();
        assert_eq!(kept_counts(&db, "deleted").await, [0, 0]);
        db.close().await;
    }

    /// The statements that run per call or every second read an index made for them, never
    /// every sandbox (a week of history by default) and never sort them.
    #[tokio::test]
    async fn frequent_statements_read_their_own_index() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("plans.db")).await.unwrap();
        // Each statement, and the indexes it may read sandboxes through (none: it must not).
        let mut cases: Vec<(String, &[&str])> = vec![
            (EXECUTOR_LOADS.to_string(), &[]),
            (EXPIRED.to_string(), &["sandboxes_live_by_expiry"]),
            (COUNT_LIVE.to_string(), &[]),
            (SANDBOX_AT.to_string(), &["sqlite_autoindex_sandboxes_1"]),
            (
                FORGET_ENDED.to_string(),
                &["sandboxes_by_end", "INTEGER PRIMARY KEY (rowid=?)"],
            ),
        ];
        for by_tag in [false, true] {
            for after in [false, true] {
                cases.push((
                    sandboxes_page_sql(by_tag, false, after).to_string(),
                    &["sandboxes_live_by_created"],
                ));
                let all: &[&str] = if by_tag {
                    &["sandboxes_by_tag"]
                } else {
                    &["sandboxes_by_created"]
                };
                cases.push((sandboxes_page_sql(by_tag, true, after).to_string(), all));
            }
        }
        for (sql, indexes) in cases {
            let plan: Vec<(i64, i64, i64, String)> =
                sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                    .fetch_all(&db.pool)
                    .await
                    .unwrap();
            let lines: Vec<&str> = plan.iter().map(|p| p.3.as_str()).collect();
            for line in &lines {
                assert!(!line.contains("TEMP B-TREE"), "{sql}: sorts: {lines:?}");
                let reads_sandboxes = line.starts_with("SCAN s ")
                    || line.starts_with("SEARCH s ")
                    || line.contains(" sandboxes ")
                    || line.ends_with(" sandboxes");
                if reads_sandboxes {
                    assert!(
                        indexes.iter().any(|i| line.contains(i)),
                        "{sql}: not through {indexes:?}: {lines:?}"
                    );
                }
            }
            // Correlated subqueries on sandboxes show up as their own lines too.
            if indexes.is_empty() {
                assert!(
                    !lines.iter().any(|l| l.contains("sandboxes")),
                    "{sql}: {lines:?}"
                );
            }
        }
        db.close().await;
    }

    /// A backlog of several batches is forgotten whole, and only what ended before the cutoff.
    #[tokio::test]
    async fn a_backlog_past_the_retention_is_forgotten_in_batches() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("forget.db")).await.unwrap();
        executors_with_base(&db, &["ex-a"], &ExecutorReport::default()).await;
        let backlog = i64::from(FORGET_BATCH) * 2 + 17;
        // `backlog` ended long ago, 5 just after the cutoff.
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?1) \
             INSERT INTO sandboxes (id, tag, executor_id, state, created_ms, ended_ms) \
             SELECT 'old-' || i, 'base', 'ex-a', 'killed', i, i + 1 FROM n",
        )
        .bind(backlog)
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < 5) \
             INSERT INTO sandboxes (id, tag, executor_id, state, created_ms, ended_ms) \
             SELECT 'recent-' || i, 'base', 'ex-a', 'lost', 100000, 100000 + i FROM n",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let live = [("live".to_string(), "base".to_string(), "ex-a".to_string())];
        db.insert_sandboxes(&live, (0, 0), None).await.unwrap();

        let mut batches = Vec::new();
        assert_eq!(
            db.forget_ended_before(100_000, |n| batches.push(n))
                .await
                .unwrap(),
            backlog as u64
        );
        // Each committed batch is told as it goes (the metric counts what a failed pass did).
        assert_eq!(batches.iter().sum::<u64>(), backlog as u64);
        assert!(batches.len() > 1, "{batches:?}");
        assert!(batches.iter().all(|&n| n <= u64::from(FORGET_BATCH)));
        let left: Vec<(String,)> = sqlx::query_as("SELECT id FROM sandboxes ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        let left: Vec<&str> = left.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(
            left,
            ["live", "recent-0", "recent-1", "recent-2", "recent-3", "recent-4"]
        );
        assert_eq!(db.count_live_sandboxes().await.unwrap(), 1);
        assert_eq!(db.forget_ended_before(100_000, |_| {}).await.unwrap(), 0);
        db.close().await;
    }

    /// A database made before the counts existed gets them from its rows when it is opened.
    #[tokio::test]
    async fn an_older_database_gets_its_live_counts_from_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        {
            let pool = sqlx::SqlitePool::connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true),
            )
            .await
            .unwrap();
            // The migrations up to the one that adds the counts, read from a directory of
            // their own.
            let older = dir.path().join("migrations");
            std::fs::create_dir(&older).unwrap();
            let all = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
            for f in std::fs::read_dir(&all).unwrap() {
                let f = f.unwrap();
                let name = f.file_name().into_string().unwrap();
                if name.as_str() < "0010" {
                    std::fs::copy(f.path(), older.join(&name)).unwrap();
                }
            }
            let before = sqlx::migrate::Migrator::new(older.as_path()).await.unwrap();
            assert_eq!(before.iter().count(), 9);
            before.run(&pool).await.unwrap();
            sqlx::query(
                "INSERT INTO executors (id, addr, max_sandboxes, running_sandboxes, \
                 mem_total_mib, mem_available_mib, registered_ms, last_heartbeat_ms) \
                 VALUES ('ex-a', 'x', 9, 0, 0, 0, 0, 0), ('ex-b', 'x', 9, 0, 0, 0, 0, 0)",
            )
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query(
                "INSERT INTO sandboxes (id, tag, executor_id, state, created_ms) VALUES \
                 ('1', 't', 'ex-a', 'ready', 0), ('2', 't', 'ex-a', 'starting', 0), \
                 ('3', 't', 'ex-a', 'killed', 0), ('4', 't', 'ex-b', 'lost', 0)",
            )
            .execute(&pool)
            .await
            .unwrap();
            pool.close().await;
        }
        let db = Db::open(&path).await.unwrap();
        let counts = live_counts(&db).await;
        assert_eq!(
            counts,
            [("ex-a".to_string(), 2, 2), ("ex-b".to_string(), 0, 0)]
        );
        db.close().await;
    }

    /// A heartbeat composed just after a kill reaches the executor marks the child lost before
    /// the kill is recorded (seen in CI: `KILLED` read back as `LOST`). A kill the executor
    /// confirmed still ends it as killed; nothing else overrides a loss, and an ended child
    /// stays ended.
    #[tokio::test]
    async fn a_confirmed_kill_ends_a_child_a_heartbeat_marked_lost_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("kill.db")).await.unwrap();
        db.upsert_executor("ex", "http://127.0.0.1:1", &ExecutorReport::default(), "p")
            .await
            .unwrap();
        db.insert_snapshot(&NewSnapshot {
            state: NewState::Ready,
            executor_id: "ex".into(),
            ..writing("base", 0)
        })
        .await
        .unwrap();
        let rows = [
            ("sb-1".to_string(), "base".to_string(), "ex".to_string()),
            ("sb-2".to_string(), "base".to_string(), "ex".to_string()),
        ];
        db.insert_sandboxes(&rows, (256, 500), None).await.unwrap();
        for (id, _, _) in &rows {
            db.set_sandbox_ready(id, 1).await.unwrap().unwrap();
        }
        // A negative grace puts the cut-off in the future: both children count as old.
        db.reconcile_sandboxes("ex", &[], -60_000).await.unwrap();
        for (id, _, _) in &rows {
            assert_eq!(
                db.sandbox(id).await.unwrap().unwrap().state(),
                SandboxState::Lost
            );
        }
        assert_eq!(
            db.end_sandbox("sb-2", SandboxState::Failed, Some("late"))
                .await
                .unwrap(),
            None,
            "only a kill overrides a loss"
        );
        assert_eq!(
            db.end_killed("sb-2", None, false).await.unwrap(),
            None,
            "a kill the executor did not confirm leaves a loss as it is"
        );
        let killed = db.end_killed("sb-1", None, true).await.unwrap().unwrap();
        assert_eq!((killed.state(), killed.error), (SandboxState::Killed, None));
        assert_eq!(
            db.end_killed("sb-1", Some("again"), true).await.unwrap(),
            None,
            "ended once"
        );
        db.end_reported("ex", &[("sb-2".into(), "crashed".into(), false)])
            .await
            .unwrap();
        assert_eq!(
            db.end_killed("sb-2", None, true).await.unwrap(),
            None,
            "nor a failed one"
        );
        db.close().await;
    }

    /// A write that finds the lock held neither fails nor holds the (single) runtime thread:
    /// it waits on the pool's connection and lands once the lock is released.
    #[tokio::test]
    async fn an_inline_write_that_finds_the_lock_held_waits_on_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("busy.db")).await.unwrap();
        let report = ExecutorReport::default();
        db.upsert_executor("ex", "http://127.0.0.1:1", &report, "p")
            .await
            .unwrap();
        let mut holder = db.write_tx().await.unwrap();
        sqlx::query("UPDATE executors SET draining = 0")
            .execute(&mut *holder)
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let db = db.clone();
            async move {
                let rows = [("sb-w".to_string(), "t".to_string(), "ex".to_string())];
                db.insert_sandboxes(&rows, (0, 0), None).await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "the insert went past a held lock");
        assert_eq!(db.sandbox("sb-w").await.unwrap(), None);
        holder.commit().await.unwrap();
        waiting.await.unwrap().unwrap();
        assert!(db.sandbox("sb-w").await.unwrap().is_some());
        db.close().await;
    }

    #[tokio::test]
    async fn a_writing_snapshot_nobody_finishes_fails_at_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("cp.db")).await.unwrap();
        // The executor row a finished snapshot's copy refers to.
        db.upsert_executor(
            "ex",
            "http://127.0.0.1:1",
            &ExecutorReport::default(),
            "executors",
        )
        .await
        .unwrap();
        db.insert_snapshot(&writing("late", now_ms() - 1))
            .await
            .unwrap();
        db.insert_snapshot(&writing("live", now_ms() + 60_000))
            .await
            .unwrap();
        let late = db.snapshot("late").await.unwrap().unwrap();
        assert!(
            matches!(late.status(now_ms()), SnapshotStatus::Failed(why) if why.contains("restarted"))
        );
        // Too late to finish; deleting it is allowed.
        assert!(matches!(
            db.finish_snapshot("late", "ex", None, None).await,
            Err(DbError::NotWriting(_))
        ));
        db.delete_snapshot("late", false).await.unwrap();
        // One in time: not deletable while writing, and held by nobody until finished.
        assert!(matches!(
            db.delete_snapshot("live", false).await,
            Err(DbError::StillWriting(_))
        ));
        assert!(db
            .snapshot("live")
            .await
            .unwrap()
            .unwrap()
            .executor_list()
            .is_empty());
        db.finish_snapshot("live", "ex", None, None).await.unwrap();
        let live = db.snapshot("live").await.unwrap().unwrap();
        assert_eq!(live.status(now_ms()), SnapshotStatus::Ready);
        assert_eq!(live.executor_list(), vec!["ex"]);
        // Finished once: neither finished nor failed again.
        assert!(db.fail_snapshot("live", "late news").await.is_err());
        assert_eq!(
            db.snapshot("live").await.unwrap().unwrap().status(now_ms()),
            SnapshotStatus::Ready
        );
    }
}
