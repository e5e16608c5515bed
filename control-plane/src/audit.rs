//! Append-only audit trail: one JSON object per line for every call, accepted or rejected.
//! `reopen` (wired to SIGHUP) starts a new file after logrotate moved the old one away.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct AuditRecord<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    /// Token name, or null when authentication failed.
    pub principal: Option<&'a str>,
    pub rpc: &'a str,
    pub args: serde_json::Value,
    /// gRPC status code name ("OK", "UNAUTHENTICATED", ...).
    pub status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<&'a str>,
    pub latency_ms: f64,
    pub peer: Option<String>,
}

pub struct AuditLog {
    path: PathBuf,
    file: Mutex<File>,
}

fn open(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

impl AuditLog {
    pub fn open(path: &Path) -> std::io::Result<AuditLog> {
        Ok(AuditLog {
            path: path.to_path_buf(),
            file: Mutex::new(open(path)?),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one record as a single write, so concurrent records never interleave.
    pub fn record(&self, r: &AuditRecord<'_>) {
        let mut line = match serde_json::to_vec(r) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("audit record not serialisable: {e}");
                return;
            }
        };
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = f.write_all(&line) {
            tracing::error!(path = %self.path.display(), "audit write failed: {e}");
        }
    }

    /// Reopen the file by path (after rotation).
    pub fn reopen(&self) -> std::io::Result<()> {
        let new = open(&self.path)?;
        *self.file.lock().unwrap_or_else(|p| p.into_inner()) = new;
        Ok(())
    }
}

/// `time` as RFC 3339 UTC with milliseconds.
pub fn rfc3339(time: SystemTime) -> String {
    let d = time.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_651_200_123); // 2026-11-26
        assert_eq!(rfc3339(t), "2026-11-26T00:00:00.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn records_survive_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.log");
        let log = AuditLog::open(&p).unwrap();
        let rec = |rpc| AuditRecord {
            time: rfc3339(SystemTime::now()),
            principal: Some("ops"),
            rpc,
            args: serde_json::json!({"tag": "t"}),
            status: "OK",
            message: None,
            latency_ms: 1.5,
            peer: None,
        };
        log.record(&rec("A"));
        std::fs::rename(&p, dir.path().join("audit.log.1")).unwrap();
        log.record(&rec("B")); // still the rotated file until reopened
        log.reopen().unwrap();
        log.record(&rec("C"));
        let old = std::fs::read_to_string(dir.path().join("audit.log.1")).unwrap();
        let new = std::fs::read_to_string(&p).unwrap();
        assert_eq!(old.lines().count(), 2);
        let v: serde_json::Value = serde_json::from_str(new.trim()).unwrap();
        assert_eq!(v["rpc"], "C");
        assert_eq!(v["args"]["tag"], "t");
    }
}
