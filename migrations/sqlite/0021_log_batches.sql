-- A worker names each batch of log lines it sends, with the same id on every retry: the
-- id is stored on the batch's first line, so a batch sent again after its answer was lost
-- (the server stored it, the reply never came) is not appended twice.
ALTER TABLE job_logs ADD COLUMN batch TEXT;
CREATE UNIQUE INDEX job_logs_batch ON job_logs (job_id, batch) WHERE batch IS NOT NULL;
