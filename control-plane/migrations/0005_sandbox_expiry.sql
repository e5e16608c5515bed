-- When a sandbox's timeout runs out (NULL: never). The control plane kills it then, across its
-- own restarts, and records why.
ALTER TABLE sandboxes ADD COLUMN expires_ms INTEGER;
CREATE INDEX sandboxes_by_expiry ON sandboxes(expires_ms) WHERE expires_ms IS NOT NULL;
