-- The transactional outbox: messages written in the caller's transaction, sent
-- by a relay after it committed. Times are milliseconds since the Unix epoch
-- on the database server's clock.
CREATE TABLE IF NOT EXISTS idem_outbox (
    -- Insertion order; for one ordering key also commit order (writers of a key
    -- hold its row in idem_outbox_keys while they insert).
    seq             BIGINT       NOT NULL AUTO_INCREMENT,
    -- The stable message id the broker and the consumer deduplicate on.
    id              VARCHAR(255) NOT NULL,
    topic           VARCHAR(255) NOT NULL,
    ordering_key    VARCHAR(255) NULL,
    -- A JSON object of string headers, or NULL.
    headers         TEXT         NULL,
    payload         LONGBLOB     NOT NULL,
    created_at      BIGINT       NOT NULL,
    -- 0 pending, 1 sent, 2 parked
    state           TINYINT      NOT NULL DEFAULT 0,
    -- Claims by relays so far (a relay that died holding it counts too).
    attempts        INT          NOT NULL DEFAULT 0,
    -- When a relay may take it next: after a backoff, or after the lease of
    -- the relay that claimed it ran out.
    next_attempt_at BIGINT       NOT NULL,
    claim_token     BINARY(16)   NULL,
    sent_at         BIGINT       NULL,
    last_error      TEXT         NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY idem_outbox_id (id),
    INDEX idem_outbox_state (state, seq),
    INDEX idem_outbox_ordering (ordering_key, seq),
    INDEX idem_outbox_sent (state, sent_at)
) ENGINE = InnoDB;

-- One row per ordering key: a writer locks its key's row until commit, so the
-- messages of one key get their seq in commit order.
CREATE TABLE IF NOT EXISTS idem_outbox_keys (
    ordering_key VARCHAR(255) NOT NULL,
    PRIMARY KEY (ordering_key)
) ENGINE = InnoDB;
