-- Preemption of training jobs (issue 16). A job the scheduler or an admin preempts keeps
-- its lease until the worker has checkpointed and reported `preempted`; it then waits in
-- the new state 'preempted' (claimable like 'queued') and resumes from that checkpoint.

-- Set while a preemption is asked for and not yet done (on a gang, its job's row): the
-- heartbeat answer carries it to the worker. Cleared when the job is preempted or
-- requeued any other way.
ALTER TABLE jobs ADD COLUMN preempt_reason TEXT;
-- Runs that ended preempted. They give their attempt back (`attempts` counts the others),
-- so a gang's rendezvous generation is attempts + preemptions, which only grows.
ALTER TABLE jobs ADD COLUMN preemptions BIGINT NOT NULL DEFAULT 0;
