-- Data-parallel training (issue 12). A job with several ranks is a gang: the job row
-- users see (kind 'train_gang', never claimed itself) and one row per rank (kind
-- 'train_rank') that workers claim and lease like any job. `store::gangs` explains how
-- a gang is claimed all or none.

-- On a rank: its gang's job, its rank, what a worker must offer to claim it ('cpu',
-- 'cuda', 'slice:<profile>'), and the host:port it posted at the rendezvous.
ALTER TABLE jobs ADD COLUMN gang_id TEXT;
ALTER TABLE jobs ADD COLUMN gang_rank BIGINT;
ALTER TABLE jobs ADD COLUMN gang_placement TEXT;
ALTER TABLE jobs ADD COLUMN gang_address TEXT;
-- On a gang's job: when a gang whose first rank was claimed is released unless formed.
ALTER TABLE jobs ADD COLUMN gang_deadline BIGINT;
CREATE INDEX jobs_gang ON jobs (gang_id, gang_rank);

-- Each rank's timing of each step (the gang's job's id); a step reported again (a gang
-- resumed from a checkpoint) replaces it.
CREATE TABLE rank_steps (
    job_id       TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    rank         BIGINT NOT NULL,
    step         BIGINT NOT NULL,
    iter_ms      DOUBLE PRECISION NOT NULL,
    wait_ms      DOUBLE PRECISION NOT NULL,
    allreduce_ms DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, rank, step)
);
