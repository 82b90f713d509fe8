-- Resizing running elastic training jobs (issue 16): the loaning round stops a running
-- gang at a checkpoint (a preemption) to restart it at another rank count. The count it
-- restarts at, until the round places it again; NULL otherwise.
ALTER TABLE jobs ADD COLUMN resize_ranks INTEGER;
