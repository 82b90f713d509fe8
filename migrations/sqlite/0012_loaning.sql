-- Capacity loaning and elastic training (issue 16, Aryl). A loanable deployment lends the
-- slices its measured traffic leaves idle to training and takes them back when demand
-- returns; one server at a time runs the scheduling round (`scheduler_leases`).

ALTER TABLE deployments ADD COLUMN loanable INTEGER NOT NULL DEFAULT 0;
-- Fraction above the measured request rate that stays served (0.2 = 20%).
ALTER TABLE deployments ADD COLUMN reclaim_headroom REAL NOT NULL DEFAULT 0.2;
-- Rounds in a row the rate allowed a larger loan (the policy's hysteresis).
ALTER TABLE deployments ADD COLUMN loan_calm INTEGER NOT NULL DEFAULT 0;

-- 'serving' (the serving side's: a replica holds it or any replica may take it),
-- 'loaned' (lent by `lender_id` to training ranks), 'reclaiming' (on its way back: no
-- rank may take it, the ranks on it are being stopped).
ALTER TABLE slices ADD COLUMN loan_state TEXT NOT NULL DEFAULT 'serving';
ALTER TABLE slices ADD COLUMN lender_id TEXT;

-- Every loan-state change of a slice and every slice a training job took or left: the
-- dashboard's fleet timeline. `state` is 'serving', 'loaned', 'reclaiming' or 'training'
-- (a job's rank holds it), 'idle' (no rank any more).
CREATE TABLE loan_events (
    id            TEXT PRIMARY KEY,
    at            INTEGER NOT NULL,
    slice_uuid    TEXT NOT NULL,
    state         TEXT NOT NULL,
    deployment_id TEXT,
    job_id        TEXT,
    detail        TEXT NOT NULL
);
CREATE INDEX loan_events_at ON loan_events (at);
CREATE INDEX loan_events_slice ON loan_events (slice_uuid, at);

-- A reclaim decision: which job a deployment's returning demand hit, on which slice.
CREATE TABLE reclaim_events (
    id            TEXT PRIMARY KEY,
    at            INTEGER NOT NULL,
    deployment_id TEXT,
    deployment    TEXT NOT NULL,
    job_id        TEXT,
    job_name      TEXT NOT NULL,
    owner_id      TEXT,
    ranks         INTEGER NOT NULL,
    preempted     INTEGER NOT NULL,
    reason        TEXT NOT NULL
);
CREATE INDEX reclaim_events_at ON reclaim_events (at);

-- Each server's measured request rate per deployment (each counts only what reached it);
-- the round sums the fresh ones.
CREATE TABLE serving_rates (
    server_id     TEXT NOT NULL,
    deployment_id TEXT NOT NULL,
    rate          REAL NOT NULL,
    measured_at   INTEGER NOT NULL,
    PRIMARY KEY (server_id, deployment_id)
);

-- One row per scheduling round: the fleet's slices by loan state, for the capacity chart.
CREATE TABLE loan_rounds (
    at         INTEGER PRIMARY KEY,
    serving    INTEGER NOT NULL,
    loaned     INTEGER NOT NULL,
    reclaiming INTEGER NOT NULL,
    training   INTEGER NOT NULL,
    waiting    INTEGER NOT NULL
);

-- The round's view of each training job it schedules: ranks, bounds and predicted JCT.
CREATE TABLE training_plans (
    job_id         TEXT PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    position       INTEGER NOT NULL,
    ranks          INTEGER NOT NULL,
    min_ranks      INTEGER NOT NULL,
    max_ranks      INTEGER NOT NULL,
    preemptible    INTEGER NOT NULL,
    predicted_secs REAL,
    note           TEXT NOT NULL,
    updated_at     INTEGER NOT NULL
);

-- Who runs a periodic task that one server at a time may run, until when.
CREATE TABLE scheduler_leases (
    name       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    expires_at INTEGER NOT NULL
);
