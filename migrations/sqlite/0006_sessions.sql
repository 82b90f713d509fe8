-- Revocable sign-ins (issue 14). Every session JWT names a row here by its `sid` claim,
-- so logging out, changing a password or disabling a user ends sessions on the server,
-- not only in the browser. A disabled user keeps its rows but cannot sign in.

CREATE TABLE sessions (
    id         TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX sessions_user ON sessions (user_id);

ALTER TABLE users ADD COLUMN disabled_at INTEGER;
