-- Fair use (issue 14). Each job counts its own log lines, so concurrent appends take
-- their sequence numbers from one row under its lock instead of racing on MAX(seq) + 1.
-- The queue orders claims by how many jobs each owner already runs, which this index
-- answers per owner.

ALTER TABLE jobs ADD COLUMN log_seq BIGINT NOT NULL DEFAULT 0;
UPDATE jobs SET log_seq = COALESCE((SELECT MAX(seq) FROM job_logs WHERE job_logs.job_id = jobs.id), 0);
CREATE INDEX jobs_owner_state ON jobs (owner_id, state);
