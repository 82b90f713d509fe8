-- Jobs queued in one millisecond are claimed in the order they were queued: `created_at`
-- has millisecond resolution, and the random id broke its ties before. A sequence numbers
-- rows as they are inserted (existing rows in the order they are stored).
ALTER TABLE jobs ADD COLUMN queue_seq BIGSERIAL;
