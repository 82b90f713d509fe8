-- The blob ledger (issue 14): one row per blob in the object store, how many rows
-- reference it and when a server last touched it. Garbage collection deletes a blob only
-- once nothing references it and nobody touched it for the grace period, holding the row
-- (FOR UPDATE) while it does, so several servers sharing one store cannot collect a blob
-- another one is writing or registering. A trigger keeps `refs` exact for every insert
-- and delete of a referencing row (cascades included) and refuses a reference to a blob
-- the ledger lacks: its UPDATE waits for a collection holding the row, then finds none.

CREATE TABLE blobs (
    digest     TEXT PRIMARY KEY,
    refs       BIGINT NOT NULL DEFAULT 0,
    touched_at BIGINT NOT NULL
);
CREATE INDEX blobs_unreferenced ON blobs (touched_at) WHERE refs <= 0;

INSERT INTO blobs (digest, refs, touched_at)
SELECT digest, COUNT(*), FLOOR(EXTRACT(EPOCH FROM now()) * 1000)::BIGINT
FROM (
    SELECT digest FROM model_files
    UNION ALL SELECT digest FROM datasets
    UNION ALL SELECT digest FROM checkpoint_files
) referenced
GROUP BY digest;

CREATE FUNCTION blob_reference() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        UPDATE blobs SET refs = refs + 1 WHERE digest = NEW.digest;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'blob_collected: blob % of % is not in the blob ledger', NEW.digest, TG_TABLE_NAME;
        END IF;
        RETURN NEW;
    END IF;
    UPDATE blobs SET refs = refs - 1, touched_at = FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT
    WHERE digest = OLD.digest;
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER model_files_blob AFTER INSERT OR DELETE ON model_files
    FOR EACH ROW EXECUTE FUNCTION blob_reference();
CREATE TRIGGER datasets_blob AFTER INSERT OR DELETE ON datasets
    FOR EACH ROW EXECUTE FUNCTION blob_reference();
CREATE TRIGGER checkpoint_files_blob AFTER INSERT OR DELETE ON checkpoint_files
    FOR EACH ROW EXECUTE FUNCTION blob_reference();
