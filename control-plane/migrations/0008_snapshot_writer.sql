-- The executor a snapshot was (or is being) written on. A snapshot that failed may have left
-- a copy there that no record matches; deleting the record, or creating the tag again,
-- removes it from this executor too.
ALTER TABLE snapshots ADD COLUMN writer TEXT;
UPDATE snapshots SET writer = (SELECT min(executor_id) FROM snapshot_copies c WHERE c.tag = snapshots.tag);
