-- When a copy was last recorded (made here, or listed in its executor's report). A report
-- drops only copies recorded before it could have been taken: see db::COPY_GRACE_MS.
ALTER TABLE snapshot_copies ADD COLUMN recorded_ms INTEGER NOT NULL DEFAULT 0;
