-- The training queue's predicted JCT (issue 16): the round's forecast of when each job
-- starts and finishes (epoch ms; NULL start: it runs on; NULL finish: it never fits the
-- fleet) and what the figure rests on ('measured' or 'prior'). The JCT is the finish
-- less the job's submission (jobs.created_at).
ALTER TABLE training_plans ADD COLUMN predicted_start_at INTEGER;
ALTER TABLE training_plans ADD COLUMN predicted_finish_at INTEGER;
ALTER TABLE training_plans ADD COLUMN predicted_from TEXT;
