-- The loaning round reads each rank count's newest steps of a gang, however old (issue 16):
-- a descending range of this index per count, so a long job's steps are never scanned. The
-- primary key (job_id, rank, step) orders by step only, across counts.
CREATE INDEX rank_steps_world ON rank_steps (job_id, rank, world, step);
