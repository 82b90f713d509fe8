-- QSync precision plans (issue 12). Rank 0 of a data-parallel job posts its plan report
-- (what each rank measured, the precision chosen per operator and rank, the allocator's
-- trace) after planning and again at the end; one row per job, under the job users see.
CREATE TABLE precision_plans (
    job_id     TEXT PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    report     TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);

-- The plan's prediction of each rank's step, beside what the rank measured.
ALTER TABLE rank_steps ADD COLUMN predicted_ms DOUBLE PRECISION;
