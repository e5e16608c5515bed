-- When a sandbox ended, for history retention (ended ones are forgotten after it). Kept by a
-- trigger so every path that ends (or re-adopts) a sandbox sets it.
ALTER TABLE sandboxes ADD COLUMN ended_ms INTEGER;
UPDATE sandboxes SET ended_ms = created_ms WHERE state IN ('failed', 'killed', 'lost');
CREATE TRIGGER sandboxes_ended AFTER UPDATE OF state ON sandboxes
BEGIN
    UPDATE sandboxes SET ended_ms = CASE
        WHEN NEW.state IN ('starting', 'ready') THEN NULL
        ELSE coalesce(OLD.ended_ms, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
    END
    WHERE id = NEW.id;
END;
CREATE INDEX sandboxes_by_end ON sandboxes(ended_ms) WHERE ended_ms IS NOT NULL;
