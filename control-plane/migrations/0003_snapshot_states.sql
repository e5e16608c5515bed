-- A branch taken with no_wait is recorded as soon as its sandbox resumes, while its layer is
-- still being written: 'writing' until the executor reports it complete ('ready') or the
-- branch fails ('failed', with the reason in error).
ALTER TABLE snapshots ADD COLUMN state TEXT NOT NULL DEFAULT 'ready'
    CHECK (state IN ('writing', 'ready', 'failed'));
ALTER TABLE snapshots ADD COLUMN error TEXT;
-- A 'writing' row not finished by then counts as failed: the control plane that was waiting
-- for the executor is gone (restarted), so nothing will finish it.
ALTER TABLE snapshots ADD COLUMN writing_until_ms INTEGER;
