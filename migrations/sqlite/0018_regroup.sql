-- Resizing running elastic training jobs in place (issue 16): the ranks keep their
-- processes and re-form their ring at the new world, joining ranks load the checkpoint
-- the gang takes at the agreed step (`store::gangs`, regroup).
-- On a gang's job: the world an in-place resize forms, NULL when none is under way; and
-- how many formed, so a gang's rendezvous generation (attempts + preemptions + regroups)
-- grows with each.
ALTER TABLE jobs ADD COLUMN regroup_world INTEGER;
ALTER TABLE jobs ADD COLUMN regroups INTEGER NOT NULL DEFAULT 0;
-- On a rank: 1 while it joins a running gang (not yet in its ring), 1 when it leaves the
-- gang at the regroup under way.
ALTER TABLE jobs ADD COLUMN gang_joining INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN gang_leaving INTEGER NOT NULL DEFAULT 0;
