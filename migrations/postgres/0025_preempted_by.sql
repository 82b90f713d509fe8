-- The worker whose `preempted` report put a job (or a gang's rank) in that state, until the
-- job is claimed again. Preempting frees the lease (`worker_id` NULL, so the job is
-- claimable), which would leave the same report sent again, its answer lost, looking like
-- one from a worker that never held the job; this says it is the repeat of one accepted.
ALTER TABLE jobs ADD COLUMN preempted_by TEXT REFERENCES workers (id);
