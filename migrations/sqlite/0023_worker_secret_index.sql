-- Every agent request looks its worker up by the digest of its secret, and anyone may
-- send a bogus one: the lookup reads this index instead of scanning the table.
CREATE INDEX workers_secret ON workers (secret_hash);
