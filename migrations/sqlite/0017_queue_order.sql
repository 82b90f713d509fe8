-- Jobs queued in one millisecond are claimed in the order they were queued: `created_at`
-- has millisecond resolution, and the random id broke its ties before. SQLite numbers rows
-- as they are inserted (rowid); the trigger copies that number into `queue_seq`.
ALTER TABLE jobs ADD COLUMN queue_seq INTEGER;
UPDATE jobs SET queue_seq = rowid;
CREATE TRIGGER jobs_queue_seq AFTER INSERT ON jobs BEGIN
    UPDATE jobs SET queue_seq = NEW.rowid WHERE rowid = NEW.rowid;
END;
