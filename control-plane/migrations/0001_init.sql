-- Executors, snapshot lineage, where each snapshot is held, and sandboxes.
CREATE TABLE executors (
    id                TEXT PRIMARY KEY,
    addr              TEXT NOT NULL,
    draining          INTEGER NOT NULL DEFAULT 0 CHECK (draining IN (0, 1)),
    max_sandboxes     INTEGER NOT NULL CHECK (max_sandboxes >= 0),
    running_sandboxes INTEGER NOT NULL CHECK (running_sandboxes >= 0),
    mem_total_mib     INTEGER NOT NULL,
    mem_available_mib INTEGER NOT NULL,
    registered_ms     INTEGER NOT NULL,
    last_heartbeat_ms INTEGER NOT NULL
);

CREATE TABLE snapshots (
    tag            TEXT PRIMARY KEY,
    -- RESTRICT: a parent cannot disappear under its children (cascade deletes children first).
    parent_tag     TEXT REFERENCES snapshots(tag) ON DELETE RESTRICT,
    image          TEXT NOT NULL,
    vcpus          INTEGER NOT NULL,
    mem_mib        INTEGER NOT NULL,
    source_sandbox TEXT,
    created_ms     INTEGER NOT NULL
);
CREATE INDEX snapshots_by_parent ON snapshots(parent_tag);

CREATE TABLE snapshot_copies (
    tag         TEXT NOT NULL REFERENCES snapshots(tag) ON DELETE CASCADE,
    executor_id TEXT NOT NULL REFERENCES executors(id) ON DELETE CASCADE,
    PRIMARY KEY (tag, executor_id)
);

CREATE TABLE sandboxes (
    id          TEXT PRIMARY KEY,
    -- No foreign key: a running child keeps its (mapped) memory after its snapshot is deleted.
    tag         TEXT NOT NULL,
    executor_id TEXT NOT NULL REFERENCES executors(id),
    state       TEXT NOT NULL CHECK (state IN ('starting', 'ready', 'failed', 'killed', 'lost')),
    created_ms  INTEGER NOT NULL,
    ready_us    INTEGER,
    error       TEXT
);
CREATE INDEX sandboxes_by_executor ON sandboxes(executor_id, state);
CREATE INDEX sandboxes_by_tag ON sandboxes(tag);
