-- A running elastic gang that a reclaim moves between pools shrinks in place now and grows
-- into the other pool later (issue 16). 1 on its job from that split until its next
-- regroup or stop: the loaning round may grow it back as soon as the shrink formed, not
-- after the cooldown that follows a formation, since the round chose that size already.
ALTER TABLE jobs ADD COLUMN regrow BIGINT NOT NULL DEFAULT 0;
