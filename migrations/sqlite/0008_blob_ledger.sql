-- The blob ledger (issue 14): one row per blob in the object store, how many rows
-- reference it and when a server last touched it. Garbage collection deletes a blob only
-- once nothing references it and nobody touched it for the grace period, holding the row
-- while it does, so several servers sharing one store cannot collect a blob another one
-- is writing or registering. Triggers keep `refs` exact for every insert and delete of a
-- referencing row (cascades included) and refuse a reference to a blob the ledger lacks.

CREATE TABLE blobs (
    digest     TEXT PRIMARY KEY,
    refs       INTEGER NOT NULL DEFAULT 0,
    touched_at INTEGER NOT NULL
);
CREATE INDEX blobs_unreferenced ON blobs (touched_at) WHERE refs <= 0;

INSERT INTO blobs (digest, refs, touched_at)
SELECT digest, COUNT(*), CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
FROM (
    SELECT digest FROM model_files
    UNION ALL SELECT digest FROM datasets
    UNION ALL SELECT digest FROM checkpoint_files
)
GROUP BY digest;

CREATE TRIGGER model_files_hold_blob AFTER INSERT ON model_files BEGIN
    SELECT RAISE(ABORT, 'blob_collected: the blob of this model file is not in the blob ledger')
    WHERE NOT EXISTS (SELECT 1 FROM blobs WHERE digest = NEW.digest);
    UPDATE blobs SET refs = refs + 1 WHERE digest = NEW.digest;
END;
CREATE TRIGGER model_files_release_blob AFTER DELETE ON model_files BEGIN
    UPDATE blobs SET refs = refs - 1, touched_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
    WHERE digest = OLD.digest;
END;

CREATE TRIGGER datasets_hold_blob AFTER INSERT ON datasets BEGIN
    SELECT RAISE(ABORT, 'blob_collected: the blob of this dataset is not in the blob ledger')
    WHERE NOT EXISTS (SELECT 1 FROM blobs WHERE digest = NEW.digest);
    UPDATE blobs SET refs = refs + 1 WHERE digest = NEW.digest;
END;
CREATE TRIGGER datasets_release_blob AFTER DELETE ON datasets BEGIN
    UPDATE blobs SET refs = refs - 1, touched_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
    WHERE digest = OLD.digest;
END;

CREATE TRIGGER checkpoint_files_hold_blob AFTER INSERT ON checkpoint_files BEGIN
    SELECT RAISE(ABORT, 'blob_collected: the blob of this checkpoint file is not in the blob ledger')
    WHERE NOT EXISTS (SELECT 1 FROM blobs WHERE digest = NEW.digest);
    UPDATE blobs SET refs = refs + 1 WHERE digest = NEW.digest;
END;
CREATE TRIGGER checkpoint_files_release_blob AFTER DELETE ON checkpoint_files BEGIN
    UPDATE blobs SET refs = refs - 1, touched_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
    WHERE digest = OLD.digest;
END;
