-- The credential an executor registered with: another credential may not take its id over.
-- '' (rows from before): claimed by whoever registers it next.
ALTER TABLE executors ADD COLUMN principal TEXT NOT NULL DEFAULT '';
