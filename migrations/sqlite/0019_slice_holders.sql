-- A rank pinned to a MIG slice is claimable only once no other rank holds the slice (a
-- grow or a start may take slices that ranks leaving in place still hold, issue 16); the
-- claim and the fleet's read look a slice's jobs up by it.
CREATE INDEX jobs_slice ON jobs (slice_uuid);
