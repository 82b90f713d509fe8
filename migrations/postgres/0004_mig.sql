-- MIG-aware serving: the slices each worker offers, replicas bound to slices, throughput
-- SLO plans of deployments, and the profiler's throughput tables.

CREATE TABLE slices (
    uuid         TEXT PRIMARY KEY,
    worker_id    TEXT NOT NULL REFERENCES workers (id) ON DELETE CASCADE,
    gpu_uuid     TEXT NOT NULL,
    gpu_index    BIGINT NOT NULL,
    gpu_model    TEXT,
    profile      TEXT,
    start        BIGINT,
    memory_bytes BIGINT NOT NULL,
    simulated    BIGINT NOT NULL
);
CREATE INDEX slices_worker ON slices (worker_id);

ALTER TABLE workers ADD COLUMN allow_repartition BIGINT NOT NULL DEFAULT 0;

-- The slice a serve job runs on; pinned when the planner chose it (the job waits for that
-- slice), free to change at each claim otherwise.
ALTER TABLE jobs ADD COLUMN slice_uuid TEXT;
ALTER TABLE jobs ADD COLUMN slice_pinned BIGINT NOT NULL DEFAULT 0;

-- The SLO and its plan (JSON), for deployments given a throughput instead of replicas.
ALTER TABLE deployments ADD COLUMN slo TEXT;

CREATE TABLE model_profiles (
    model_id    TEXT NOT NULL REFERENCES models (id) ON DELETE CASCADE,
    gpu_model   TEXT NOT NULL,
    profile     TEXT NOT NULL,
    batch_size  BIGINT NOT NULL,
    throughput  DOUBLE PRECISION NOT NULL,
    p99_ms      DOUBLE PRECISION NOT NULL,
    simulated   BIGINT NOT NULL,
    measured_at BIGINT NOT NULL,
    PRIMARY KEY (model_id, gpu_model, profile, batch_size)
);
