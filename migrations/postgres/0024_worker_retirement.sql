-- An admin removes a worker that is gone for good (`DELETE /api/v1/workers/{id}`): its
-- row stays for the history of the jobs it ran, marked retired and without a secret; the
-- same name registering again brings it back. `join_digest` is the digest of the worker
-- token it joined with: once the server's TESSERA_WORKER_TOKEN changes, workers admitted
-- with the old one are refused (NULL, for workers registered before this, is not checked).
ALTER TABLE workers ADD COLUMN retired_at BIGINT;
ALTER TABLE workers ADD COLUMN join_digest TEXT;
