-- AutoLRS tags each training step (and the evaluation after it) `search` or `exploit`
-- (issue 13), so a speed-up can be read with or without the search's steps. The tag is
-- stored on each of the step's points; NULL for fixed schedules and older rows.

ALTER TABLE job_metrics ADD COLUMN phase TEXT;
