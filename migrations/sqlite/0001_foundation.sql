-- Accounts, model registry, workers and the leased job queue.
-- Times are Unix epoch milliseconds; ids are UUID strings.

CREATE TABLE users (
    id            TEXT PRIMARY KEY,
    username      TEXT NOT NULL UNIQUE,
    password_hash TEXT NOT NULL,
    role          TEXT NOT NULL CHECK (role IN ('admin', 'user')),
    created_at    INTEGER NOT NULL
);

CREATE TABLE api_tokens (
    id           TEXT PRIMARY KEY,
    user_id      TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    prefix       TEXT NOT NULL,
    token_hash   TEXT NOT NULL UNIQUE,
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER
);

CREATE TABLE models (
    id           TEXT PRIMARY KEY,
    owner_id     TEXT NOT NULL REFERENCES users (id),
    name         TEXT NOT NULL,
    digest       TEXT NOT NULL,
    architecture TEXT NOT NULL,
    config       TEXT NOT NULL,
    size_bytes   INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    UNIQUE (owner_id, name)
);

CREATE TABLE model_files (
    model_id   TEXT NOT NULL REFERENCES models (id) ON DELETE CASCADE,
    path       TEXT NOT NULL,
    digest     TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    PRIMARY KEY (model_id, path)
);
CREATE INDEX model_files_digest ON model_files (digest);

CREATE TABLE workers (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    version       TEXT NOT NULL,
    inventory     TEXT NOT NULL,
    secret_hash   TEXT NOT NULL,
    registered_at INTEGER NOT NULL,
    last_seen_at  INTEGER NOT NULL
);

CREATE TABLE jobs (
    id               TEXT PRIMARY KEY,
    owner_id         TEXT NOT NULL REFERENCES users (id),
    name             TEXT NOT NULL,
    kind             TEXT NOT NULL,
    spec             TEXT NOT NULL,
    state            TEXT NOT NULL,
    message          TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    worker_id        TEXT REFERENCES workers (id),
    lease_expires_at INTEGER,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    started_at       INTEGER,
    finished_at      INTEGER
);
CREATE INDEX jobs_queue ON jobs (state, created_at);
CREATE INDEX jobs_owner ON jobs (owner_id, created_at);

CREATE TABLE job_logs (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq    INTEGER NOT NULL,
    at     INTEGER NOT NULL,
    line   TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);

CREATE TABLE job_metrics (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    name   TEXT NOT NULL,
    step   INTEGER NOT NULL,
    value  REAL NOT NULL,
    at     INTEGER NOT NULL
);
CREATE INDEX job_metrics_series ON job_metrics (job_id, name, step);
