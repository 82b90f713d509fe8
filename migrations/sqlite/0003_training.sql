-- Training: datasets, training-job metrics as one continuous series per job, AutoLRS
-- stage records, and checkpoints. Dataset and checkpoint files live in the same
-- content-addressed blob store as model files.

CREATE TABLE datasets (
    id         TEXT PRIMARY KEY,
    owner_id   TEXT NOT NULL REFERENCES users (id),
    name       TEXT NOT NULL,
    digest     TEXT NOT NULL,
    format     TEXT NOT NULL CHECK (format IN ('csv', 'jsonl')),
    columns    TEXT NOT NULL,
    num_rows   INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (owner_id, name)
);
CREATE INDEX datasets_digest ON datasets (digest);

-- The dataset a training job reads (no foreign key: finished jobs keep their history
-- when the dataset goes; a dataset in use by an unfinished job cannot be deleted).
ALTER TABLE jobs ADD COLUMN dataset_id TEXT;
-- The highest step a training job reported, for progress without scanning metrics.
ALTER TABLE jobs ADD COLUMN progress_step INTEGER;

-- 'step' rows are per training step, 'eval' rows per evaluation. A point reported
-- again (a job resumed from a checkpoint) replaces the earlier one.
ALTER TABLE job_metrics ADD COLUMN series TEXT NOT NULL DEFAULT 'step';
DELETE FROM job_metrics WHERE rowid NOT IN (SELECT MAX(rowid) FROM job_metrics GROUP BY job_id, name, step);
DROP INDEX job_metrics_series;
CREATE UNIQUE INDEX job_metrics_point ON job_metrics (job_id, series, name, step);

CREATE TABLE lr_stages (
    job_id     TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    stage      INTEGER NOT NULL,
    record     TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (job_id, stage)
);

CREATE TABLE checkpoints (
    job_id     TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step       INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (job_id, step)
);

CREATE TABLE checkpoint_files (
    job_id     TEXT NOT NULL,
    step       INTEGER NOT NULL,
    name       TEXT NOT NULL,
    digest     TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    PRIMARY KEY (job_id, step, name),
    FOREIGN KEY (job_id, step) REFERENCES checkpoints (job_id, step) ON DELETE CASCADE
);
CREATE INDEX checkpoint_files_digest ON checkpoint_files (digest);
