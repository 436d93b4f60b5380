-- The outbox's names compared as bytes. Under the database's default
-- collation (utf8mb4_general_ci, and PAD SPACE in every utf8mb4 collation
-- MariaDB and MySQL 5.7 have) 'Order-1' = 'order-1', 'e' = 'é' and
-- 'a' = 'a ': two messages whose ids differ only so were one row, and the
-- second was never sent; two ordering keys that differ only so shared one
-- lock. VARBINARY compares bytes, as PostgreSQL and SQLite do. The widths
-- are the bytes the old columns could hold (255 characters of up to 4 bytes
-- for the ordering key; ids and topics are refused by `put` past 255 bytes).
ALTER TABLE idem_outbox
    MODIFY id           VARBINARY(255)  NOT NULL,
    MODIFY topic        VARBINARY(255)  NOT NULL,
    MODIFY ordering_key VARBINARY(1020) NULL;
ALTER TABLE idem_outbox_keys
    MODIFY ordering_key VARBINARY(1020) NOT NULL;
