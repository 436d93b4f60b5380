//! The outbox's statements on MySQL and MariaDB (InnoDB).
//!
//! The claim never takes a range lock: candidates come from a plain
//! (non-locking) read, and only their primary-key rows are then locked with
//! `FOR UPDATE SKIP LOCKED`. A locking range scan would hold next-key locks
//! on the table's indexes, and writers inserting into those gaps would queue
//! behind the relay (and the relay behind their uncommitted rows).

use sqlx::{Acquire, MySql, MySqlConnection, MySqlPool, QueryBuilder};

use super::dialect::{
    self, Backlog, Claimed, Dialect, Inserted, ListedMessage, MessageState, NewRow, StoredRow,
    Wakeup,
};

/// Milliseconds since the epoch on the server's clock, free of the session's
/// time zone (see the store's `now_ms`).
macro_rules! now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// ER_SUBQUERY_NO_1_ROW's SQLSTATE ("Subquery returns more than 1 row"):
/// the insert's way to refuse an id held by another message.
const SUBQUERY_ROWS: &str = "21000";

impl Dialect for MySql {
    const BACKEND: &'static str = "mysql";

    /// One statement, plus one before it when the rows have ordering keys: an
    /// upsert of each key's row in `idem_outbox_keys`, which holds it locked
    /// until the transaction ends, so a key's messages take their `seq` in
    /// commit order (the keys in sorted order, so two writers of the same keys
    /// lock them in the same order).
    async fn insert<'a>(
        conn: &'a mut MySqlConnection,
        rows: &'a [NewRow],
    ) -> Result<Inserted, sqlx::Error> {
        let mut keys: Vec<&str> = rows
            .iter()
            .filter_map(|r| r.ordering_key.as_deref())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if !keys.is_empty() {
            let mut q = QueryBuilder::<MySql>::new("INSERT INTO idem_outbox_keys (ordering_key) ");
            q.push_values(&keys, |mut b, k| {
                b.push_bind(*k);
            });
            q.push(" ON DUPLICATE KEY UPDATE ordering_key = ordering_key");
            q.build().execute(&mut *conn).await?;
        }
        let mut q = QueryBuilder::<MySql>::new(
            "INSERT INTO idem_outbox (id, topic, ordering_key, headers, payload, created_at, next_attempt_at) ",
        );
        q.push_values(rows, |mut b, r| {
            b.push_bind(&r.id)
                .push_bind(&r.topic)
                .push_bind(&r.ordering_key)
                .push_bind(&r.headers)
                .push_bind(&r.payload)
                .push(now_ms!())
                .push(now_ms!());
        });
        // An id held by the same message changes nothing; held by another,
        // the statement fails (and, as any failed statement in InnoDB,
        // writes none of its rows): the affected-rows count cannot tell the
        // two apart, as sqlx connects with CLIENT_FOUND_ROWS. A scalar
        // subquery of two rows is the one error an expression can raise in
        // every SQL mode; nothing else in this statement can raise it.
        q.push(concat!(
            " ON DUPLICATE KEY UPDATE id = IF(",
            "CAST(topic AS BINARY) = CAST(VALUES(topic) AS BINARY)",
            " AND CAST(ordering_key AS BINARY) <=> CAST(VALUES(ordering_key) AS BINARY)",
            " AND CAST(headers AS BINARY) <=> CAST(VALUES(headers) AS BINARY)",
            " AND payload = VALUES(payload), id, (SELECT 1 UNION ALL SELECT 2))"
        ));
        match q.build().execute(&mut *conn).await {
            Ok(_) => Ok(Inserted::All),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(SUBQUERY_ROWS) => {
                Ok(Inserted::Refused)
            }
            Err(e) => Err(e),
        }
    }

    async fn stored<'a>(
        conn: &'a mut MySqlConnection,
        ids: &'a [&'a str],
    ) -> Result<Vec<StoredRow>, sqlx::Error> {
        let mut q = QueryBuilder::<MySql>::new(
            "SELECT v.wanted, o.topic, o.ordering_key, o.headers, o.payload\nFROM (",
        );
        let mut list = q.separated(" UNION ALL ");
        for id in ids {
            list.push("SELECT ");
            list.push_bind_unseparated(*id);
            list.push_unseparated(" AS wanted");
        }
        q.push(") AS v JOIN idem_outbox o ON o.id = v.wanted");
        let rows = q.build().fetch_all(conn).await?;
        rows.iter().map(dialect::stored).collect()
    }

    async fn claim<'a>(
        pool: &'a MySqlPool,
        token: &'a [u8],
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let candidates: Vec<i64> = sqlx::query_scalar(concat!(
            "SELECT o.seq FROM idem_outbox o\n",
            "WHERE o.state = 0 AND o.next_attempt_at <= ",
            now_ms!(),
            " AND (o.ordering_key IS NULL OR NOT EXISTS (\n",
            "  SELECT 1 FROM idem_outbox p\n",
            "  WHERE p.ordering_key = o.ordering_key AND p.state <> 1 AND p.seq < o.seq))\n",
            "ORDER BY o.seq LIMIT ?"
        ))
        // More than a batch: the first rows are often another relay's batch
        // being claimed right now (still due in this read), which the
        // locking read below skips.
        .bind(limit.saturating_mul(4))
        .fetch_all(&mut *tx)
        .await?;
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        // Rechecked on the rows' latest versions: another relay may have
        // claimed some since the plain read.
        let mut q = QueryBuilder::<MySql>::new("SELECT seq FROM idem_outbox WHERE seq IN ");
        dialect::push_seqs(&mut q, &candidates);
        q.push(concat!(
            " AND state = 0 AND next_attempt_at <= ",
            now_ms!(),
            " ORDER BY seq LIMIT "
        ));
        q.push_bind(limit);
        q.push(" FOR UPDATE SKIP LOCKED");
        let locked: Vec<i64> = q.build_query_scalar().fetch_all(&mut *tx).await?;
        if locked.is_empty() {
            return Ok(Vec::new());
        }
        let mut q = QueryBuilder::<MySql>::new(
            "UPDATE idem_outbox SET attempts = attempts + 1, claim_token = ",
        );
        q.push_bind(token);
        q.push(concat!(", next_attempt_at = ", now_ms!(), " + "));
        q.push_bind(lease_ms);
        q.push(" WHERE seq IN ");
        dialect::push_seqs(&mut q, &locked);
        q.build().execute(&mut *tx).await?;
        let mut q = QueryBuilder::<MySql>::new(
            "SELECT seq, id, topic, ordering_key, headers, payload, CAST(attempts AS SIGNED) AS attempts FROM idem_outbox WHERE seq IN ",
        );
        dialect::push_seqs(&mut q, &locked);
        let rows = q.build().fetch_all(&mut *tx).await?;
        tx.commit().await?;
        rows.iter().map(dialect::claimed).collect()
    }

    async fn mark_sent<'a>(
        pool: &'a MySqlPool,
        token: &'a [u8],
        seqs: &'a [i64],
    ) -> Result<u64, sqlx::Error> {
        let mut q = dialect::mark_sent_query::<MySql>(now_ms!(), token, seqs);
        Ok(q.build().execute(pool).await?.rows_affected())
    }

    async fn mark_failed<'a>(
        pool: &'a MySqlPool,
        token: &'a [u8],
        seqs: &'a [i64],
        reason: &'a str,
        retry_in_ms: i64,
        park: bool,
    ) -> Result<u64, sqlx::Error> {
        let mut q =
            dialect::mark_failed_query::<MySql>(now_ms!(), token, seqs, reason, retry_in_ms, park);
        Ok(q.build().execute(pool).await?.rows_affected())
    }

    async fn backlog(pool: &MySqlPool, with_sent: bool) -> Result<Vec<Backlog>, sqlx::Error> {
        let rows = sqlx::query(concat!(
            "SELECT topic,\n",
            "  CAST(SUM(state = 0) AS SIGNED) AS pending,\n",
            "  CAST(SUM(state = 2) AS SIGNED) AS parked,\n",
            "  CAST(SUM(state = 1) AS SIGNED) AS sent,\n",
            "  CAST(COALESCE(",
            now_ms!(),
            " - MIN(IF(state = 0, created_at, NULL)), 0) AS SIGNED) AS oldest\n",
            "FROM idem_outbox WHERE state <> 1 OR ? GROUP BY topic ORDER BY topic"
        ))
        .bind(with_sent)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::backlog).collect()
    }

    async fn list(
        pool: &MySqlPool,
        state: MessageState,
        limit: i64,
    ) -> Result<Vec<ListedMessage>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT seq, id, topic, ordering_key, CAST(state AS SIGNED) AS state,\n\
               CAST(attempts AS SIGNED) AS attempts, created_at,\n\
               last_error, CAST(LENGTH(payload) AS SIGNED) AS size\n\
             FROM idem_outbox WHERE state = ? ORDER BY seq LIMIT ?",
        )
        .bind(state.code())
        .bind(limit)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::listed).collect()
    }

    async fn retry<'a>(pool: &'a MySqlPool, id: &'a str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(concat!(
            "UPDATE idem_outbox SET state = 0, attempts = 0, claim_token = NULL, last_error = NULL,\n",
            "  next_attempt_at = ",
            now_ms!(),
            "\nWHERE id = ? AND state <> 1"
        ))
        .bind(id)
        .execute(pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge(pool: &MySqlPool, older_than_ms: i64, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(concat!(
            "DELETE FROM idem_outbox WHERE state = 1 AND sent_at < ",
            now_ms!(),
            " - ? ORDER BY sent_at LIMIT ?"
        ))
        .bind(older_than_ms)
        .bind(limit)
        .execute(pool)
        .await?;
        // Ordering keys with no message left: a writer that needs one again
        // recreates it (and a writer holding one makes this wait, not fail).
        sqlx::query(
            "DELETE FROM idem_outbox_keys WHERE NOT EXISTS (\n\
               SELECT 1 FROM idem_outbox o WHERE o.ordering_key = idem_outbox_keys.ordering_key)\n\
             LIMIT ?",
        )
        .bind(limit)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn listen(_pool: &MySqlPool) -> Option<Box<dyn Wakeup>> {
        None
    }
}
