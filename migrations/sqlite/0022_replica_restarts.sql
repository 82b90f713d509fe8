-- A serving replica that failed is queued again in place by the server's repair tick
-- (`deployments::repair`), after a back-off that doubles with each restart in a row:
-- `restarts` counts them, reset once a run lasted ten minutes.
ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0;
