//! The outbox's statements on SQLite. One writer at a time: `seq` order is
//! commit order without any lock of ours, and a claim is one `UPDATE`.

use sqlx::{QueryBuilder, Sqlite, SqliteConnection, SqlitePool};

use super::dialect::{
    self, Backlog, Claimed, Dialect, Inserted, ListedMessage, MessageState, NewRow, StoredRow,
    Wakeup,
};

macro_rules! now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

impl Dialect for Sqlite {
    const BACKEND: &'static str = "sqlite";

    async fn insert<'a>(
        conn: &'a mut SqliteConnection,
        rows: &'a [NewRow],
    ) -> Result<Inserted, sqlx::Error> {
        let mut q = QueryBuilder::<Sqlite>::new(
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
        q.push(" ON CONFLICT (id) DO NOTHING");
        let affected = q.build().execute(conn).await?.rows_affected();
        Ok(Inserted::counting(affected, rows))
    }

    async fn stored<'a>(
        conn: &'a mut SqliteConnection,
        ids: &'a [&'a str],
    ) -> Result<Vec<StoredRow>, sqlx::Error> {
        let mut q = QueryBuilder::<Sqlite>::new("WITH v (wanted) AS (VALUES ");
        let mut list = q.separated(", ");
        for id in ids {
            list.push("(");
            list.push_bind_unseparated(*id);
            list.push_unseparated(")");
        }
        q.push(
            ")\nSELECT v.wanted, o.topic, o.ordering_key, o.headers, o.payload\n\
             FROM v JOIN idem_outbox o ON o.id = v.wanted",
        );
        let rows = q.build().fetch_all(conn).await?;
        rows.iter().map(dialect::stored).collect()
    }

    async fn claim<'a>(
        pool: &'a SqlitePool,
        token: &'a [u8],
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        // A plain read first: an idle relay polls often, and the UPDATE takes
        // the database's one write lock (waiting behind, and then blocking,
        // every writer) even when nothing is due.
        let due: Option<i64> = sqlx::query_scalar(concat!(
            "SELECT seq FROM idem_outbox WHERE state = 0 AND next_attempt_at <= ",
            now_ms!(),
            " LIMIT 1"
        ))
        .fetch_optional(pool)
        .await?;
        if due.is_none() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(concat!(
            "UPDATE idem_outbox SET attempts = attempts + 1, claim_token = ?1,\n",
            "  next_attempt_at = ",
            now_ms!(),
            " + ?2\n",
            "WHERE seq IN (SELECT o.seq FROM idem_outbox o\n",
            "  WHERE o.state = 0 AND o.next_attempt_at <= ",
            now_ms!(),
            "\n  AND (o.ordering_key IS NULL OR NOT EXISTS (\n",
            "    SELECT 1 FROM idem_outbox p\n",
            "    WHERE p.ordering_key = o.ordering_key AND p.state <> 1 AND p.seq < o.seq))\n",
            "  ORDER BY o.seq LIMIT ?3)\n",
            "RETURNING seq, id, topic, ordering_key, headers, payload, attempts"
        ))
        .bind(token)
        .bind(lease_ms)
        .bind(limit)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::claimed).collect()
    }

    async fn mark_sent<'a>(
        pool: &'a SqlitePool,
        token: &'a [u8],
        seqs: &'a [i64],
    ) -> Result<u64, sqlx::Error> {
        let mut q = dialect::mark_sent_query::<Sqlite>(now_ms!(), token, seqs);
        Ok(q.build().execute(pool).await?.rows_affected())
    }

    async fn mark_failed<'a>(
        pool: &'a SqlitePool,
        token: &'a [u8],
        seqs: &'a [i64],
        reason: &'a str,
        retry_in_ms: i64,
        park: bool,
    ) -> Result<u64, sqlx::Error> {
        let mut q =
            dialect::mark_failed_query::<Sqlite>(now_ms!(), token, seqs, reason, retry_in_ms, park);
        Ok(q.build().execute(pool).await?.rows_affected())
    }

    async fn backlog(pool: &SqlitePool, with_sent: bool) -> Result<Vec<Backlog>, sqlx::Error> {
        let rows = sqlx::query(concat!(
            "SELECT topic,\n",
            "  SUM(state = 0) AS pending, SUM(state = 2) AS parked, SUM(state = 1) AS sent,\n",
            "  COALESCE(",
            now_ms!(),
            " - MIN(CASE WHEN state = 0 THEN created_at END), 0) AS oldest\n",
            "FROM idem_outbox WHERE state <> 1 OR ?1 GROUP BY topic ORDER BY topic"
        ))
        .bind(with_sent)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::backlog).collect()
    }

    async fn list(
        pool: &SqlitePool,
        state: MessageState,
        limit: i64,
    ) -> Result<Vec<ListedMessage>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT seq, id, topic, ordering_key, state, attempts, created_at, last_error,\n\
               length(payload) AS size\n\
             FROM idem_outbox WHERE state = ?1 ORDER BY seq LIMIT ?2",
        )
        .bind(state.code())
        .bind(limit)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::listed).collect()
    }

    async fn retry<'a>(pool: &'a SqlitePool, id: &'a str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(concat!(
            "UPDATE idem_outbox SET state = 0, attempts = 0, claim_token = NULL, last_error = NULL,\n",
            "  next_attempt_at = ",
            now_ms!(),
            "\nWHERE id = ?1 AND state <> 1"
        ))
        .bind(id)
        .execute(pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge(pool: &SqlitePool, older_than_ms: i64, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(concat!(
            "DELETE FROM idem_outbox WHERE seq IN (\n",
            "  SELECT seq FROM idem_outbox WHERE state = 1 AND sent_at < ",
            now_ms!(),
            " - ?1\n",
            "  ORDER BY sent_at LIMIT ?2)"
        ))
        .bind(older_than_ms)
        .bind(limit)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn listen(_pool: &SqlitePool) -> Option<Box<dyn Wakeup>> {
        None
    }
}
