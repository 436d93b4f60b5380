-- The outbox's writers look for waiting relays in their insert statement
-- itself (`outbox/postgres.rs`), so the statement trigger that did it goes:
-- a PL/pgSQL call on every insert statement cost a write about a third of
-- its time (pg_stat_statements: 38 µs against 26 µs without it). The check
-- and the NOTIFY are the trigger's, in the writer's statement, delivered at
-- its commit. Writers of an earlier version of idem do not notify once this
-- is applied: their messages are sent at the relays' next poll (1 s).
--
-- DROP TRIGGER takes an ACCESS EXCLUSIVE lock on idem_outbox: it waits for
-- every open transaction that wrote to the outbox, and every put and relay
-- queues behind it. Bounded here, so a long transaction fails the migration
-- (and the store's start, with PostgreSQL's lock_timeout error: start again
-- at a quieter moment) instead of stalling every writer behind it.
SET LOCAL lock_timeout = '5s';
DROP TRIGGER IF EXISTS idem_outbox_notify ON idem_outbox;
DROP FUNCTION IF EXISTS idem_outbox_notify();
