-- Snapshots as layers in the cluster's store: what executors that lack a snapshot fetch, and
-- what it costs. NULL for snapshots made without a store.
ALTER TABLE snapshots ADD COLUMN head_digest TEXT;
ALTER TABLE snapshots ADD COLUMN parent_digest TEXT;
-- Head first, comma-joined digests.
ALTER TABLE snapshots ADD COLUMN chain TEXT;
ALTER TABLE snapshots ADD COLUMN memory_bytes INTEGER;
ALTER TABLE snapshots ADD COLUMN stored_bytes INTEGER;
ALTER TABLE snapshots ADD COLUMN compressed_bytes INTEGER;
