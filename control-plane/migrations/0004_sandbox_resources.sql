-- What each sandbox's spawn asked it to be held to (0: the executor's default / unlimited),
-- reported by GetSandbox beside what its cgroup counts.
ALTER TABLE sandboxes ADD COLUMN memory_limit_mib INTEGER NOT NULL DEFAULT 0
    CHECK (memory_limit_mib >= 0);
ALTER TABLE sandboxes ADD COLUMN cpu_millis INTEGER NOT NULL DEFAULT 0
    CHECK (cpu_millis >= 0);
