-- The number of ranks that ran each step (issue 16): the loaning round reads a gang's step
-- time per rank count from its recent steps. Counting a step's rows gave the wrong count
-- while some ranks had not reported yet, and after a resize a re-run step kept the rows of
-- ranks the gang no longer has. Set from the gang's rank rows when the step is stored;
-- NULL on steps stored before this migration (the round skips them).
ALTER TABLE rank_steps ADD COLUMN world BIGINT;
