-- Each executor's live (starting or ready) sandboxes, kept by triggers on every path that
-- adds, ends, re-adopts or forgets a sandbox. A spawn reads it to place children: counting
-- the rows instead cost a spawn time in proportion to the fleet's live sandboxes.
ALTER TABLE executors ADD COLUMN live_sandboxes INTEGER NOT NULL DEFAULT 0;
UPDATE executors SET live_sandboxes = (
    SELECT count(*) FROM sandboxes s
    WHERE s.executor_id = executors.id AND s.state IN ('starting', 'ready'));

CREATE TRIGGER sandboxes_live_added AFTER INSERT ON sandboxes
WHEN NEW.state IN ('starting', 'ready')
BEGIN
    UPDATE executors SET live_sandboxes = live_sandboxes + 1 WHERE id = NEW.executor_id;
END;

CREATE TRIGGER sandboxes_live_removed AFTER DELETE ON sandboxes
WHEN OLD.state IN ('starting', 'ready')
BEGIN
    UPDATE executors SET live_sandboxes = live_sandboxes - 1 WHERE id = OLD.executor_id;
END;

-- Only a change between live and not live, or of executor, moves a count: starting → ready
-- (every spawn) writes nothing more.
CREATE TRIGGER sandboxes_live_moved AFTER UPDATE OF state, executor_id ON sandboxes
WHEN (OLD.state IN ('starting', 'ready')) IS NOT (NEW.state IN ('starting', 'ready'))
    OR OLD.executor_id IS NOT NEW.executor_id
BEGIN
    UPDATE executors SET live_sandboxes = live_sandboxes - 1
    WHERE id = OLD.executor_id AND OLD.state IN ('starting', 'ready');
    UPDATE executors SET live_sandboxes = live_sandboxes + 1
    WHERE id = NEW.executor_id AND NEW.state IN ('starting', 'ready');
END;

-- The expiry pass (twice a second) looks only at live sandboxes: ended ones keep their
-- expiry for the history, and an index over all of them made each pass walk every ended
-- sandbox whose time had passed, a week of them by default.
DROP INDEX sandboxes_by_expiry;
CREATE INDEX sandboxes_live_by_expiry ON sandboxes(expires_ms)
WHERE expires_ms IS NOT NULL AND state IN ('starting', 'ready');

-- Listings walk these in their order (created, then id) rather than sorting every row: all
-- sandboxes, those of one snapshot, and the live ones (of any snapshot; a snapshot's live ones
-- are found among them).
CREATE INDEX sandboxes_by_created ON sandboxes(created_ms, id);
DROP INDEX sandboxes_by_tag;
CREATE INDEX sandboxes_by_tag ON sandboxes(tag, created_ms, id);
CREATE INDEX sandboxes_live_by_created ON sandboxes(created_ms, id)
WHERE state IN ('starting', 'ready');
