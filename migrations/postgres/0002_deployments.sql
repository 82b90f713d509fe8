-- Serving: deployments, whose replicas are jobs of kind 'serve' in the leased queue.

CREATE TABLE deployments (
    id                 TEXT PRIMARY KEY,
    owner_id           TEXT NOT NULL REFERENCES users (id),
    name               TEXT NOT NULL UNIQUE,
    model_id           TEXT NOT NULL REFERENCES models (id),
    replicas           BIGINT NOT NULL,
    max_batch_tokens   BIGINT NOT NULL,
    max_batch_requests BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL
);

-- Where a running serve job's engine answers.
ALTER TABLE jobs ADD COLUMN endpoint TEXT;
ALTER TABLE jobs ADD COLUMN deployment_id TEXT REFERENCES deployments (id) ON DELETE CASCADE;
CREATE INDEX jobs_deployment ON jobs (deployment_id, state);

-- The token the gateway presents to a worker's engine endpoint.
ALTER TABLE workers ADD COLUMN engine_token TEXT NOT NULL DEFAULT '';
