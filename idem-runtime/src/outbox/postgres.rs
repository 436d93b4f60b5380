//! The outbox's statements on PostgreSQL.

use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder};

use super::dialect::{
    self, Backlog, Claimed, Dialect, Inserted, ListedMessage, MessageState, NewRow, StoredRow,
    Wakeup,
};

// The server's wall clock in milliseconds (`clock_timestamp()`: `now()` is
// frozen at BEGIN and a long transaction would write stale times).
macro_rules! now_ms {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

/// The channel writers notify on (see `wake!`).
const CHANNEL: &str = "idem_outbox";

/// The advisory lock namespace of ordering keys (`hashtextextended`'s seed),
/// so they never meet the application's own advisory locks by accident.
const ORDERING_SEED: i64 = 0x6964_656d_6f62_786b; // "idemobxk"

// The clock of an insert (`w.now`), and its wake-up of relays waiting in
// LISTEN: while one waits (its row in `idem_outbox_sleepers` is unexpired),
// NOTIFY, which PostgreSQL delivers when the writer's transaction commits
// (once per transaction and payload; the payload is the schema, so relays of
// other schemas sleep on). Only while one waits: every committing transaction
// that sent a NOTIFY queues for one cluster-wide lock. This was a statement
// trigger, whose PL/pgSQL call cost a write more than the check itself
// (migration 5 drops it). `woke` is never read: the subquery's volatile
// output keeps PostgreSQL from dropping it, so the check runs once per
// statement, as an InitPlan. With ordering keys it runs before the keys'
// locks are granted (the trigger ran after): a relay that starts waiting
// while such a writer waits for an earlier writer of its key takes that
// message at its next poll, as it would from a writer still working after
// its insert.
macro_rules! wake {
    () => {
        concat!(
            "(SELECT ",
            now_ms!(),
            " AS now, (SELECT pg_notify('idem_outbox', current_schema()) FROM idem_outbox_sleepers\n",
            "  WHERE until > ",
            now_ms!(),
            " LIMIT 1) AS woke) AS w"
        )
    };
}

// "An earlier message of this key is not sent yet": a key's messages go out
// one at a time, in seq order (which is commit order, see `insert`).
macro_rules! first_of_key {
    () => {
        "(o.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM idem_outbox p
            WHERE p.ordering_key = o.ordering_key AND p.state <> 1 AND p.seq < o.seq))"
    };
}

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

    /// One statement, which also wakes waiting relays (`wake!`). Rows
    /// without an ordering key are a plain insert; the one-row form is a
    /// fixed text, so it stays one prepared statement on the connection
    /// (sqlx caches by text). A row with an ordering key first takes a
    /// transaction advisory lock on the key (in the `LATERAL` join, before
    /// the row's `seq` is drawn in the projection above it), so two
    /// transactions writing one key take their `seq`s in commit order: the
    /// second waits for the first to end. The rows are joined in key order,
    /// so two writers of the same keys lock them in the same order.
    async fn insert<'a>(
        conn: &'a mut PgConnection,
        rows: &'a [NewRow],
    ) -> Result<Inserted, sqlx::Error> {
        let keyed = rows.iter().any(|r| r.ordering_key.is_some());
        if let [row] = rows {
            if !keyed {
                let affected = sqlx::query(concat!(
                    "INSERT INTO idem_outbox (id, topic, headers, payload, created_at, next_attempt_at)\n",
                    "SELECT $1, $2, $3, $4, w.now, w.now FROM ",
                    wake!(),
                    "\nON CONFLICT (id) DO NOTHING"
                ))
                .bind(&row.id)
                .bind(&row.topic)
                .bind(&row.headers)
                .bind(&row.payload)
                .execute(conn)
                .await?
                .rows_affected();
                return Ok(Inserted::counting(affected, rows));
            }
        }
        let mut by_key: Vec<(usize, &NewRow)> = rows.iter().enumerate().collect();
        by_key.sort_by(|a, b| a.1.ordering_key.cmp(&b.1.ordering_key));
        let mut q = QueryBuilder::<Postgres>::new(concat!(
            "INSERT INTO idem_outbox (id, topic, ordering_key, headers, payload, created_at, next_attempt_at)\n",
            "SELECT v.id, v.topic, v.ordering_key, v.headers, v.payload, w.now, w.now\n",
            "FROM (VALUES "
        ));
        let mut values = q.separated(", ");
        for (position, row) in by_key {
            values.push("(");
            values.push_bind_unseparated(position as i32);
            values.push_unseparated("::int, ");
            values.push_bind_unseparated(&row.id);
            values.push_unseparated("::text, ");
            values.push_bind_unseparated(&row.topic);
            values.push_unseparated("::text, ");
            values.push_bind_unseparated(&row.ordering_key);
            values.push_unseparated("::text, ");
            values.push_bind_unseparated(&row.headers);
            values.push_unseparated("::text, ");
            values.push_bind_unseparated(&row.payload);
            values.push_unseparated("::bytea)");
        }
        q.push(") AS v (position, id, topic, ordering_key, headers, payload)\n");
        if keyed {
            q.push(
                "LEFT JOIN LATERAL (SELECT pg_advisory_xact_lock(hashtextextended(v.ordering_key, ",
            );
            q.push_bind(ORDERING_SEED);
            q.push(")) WHERE v.ordering_key IS NOT NULL) AS locked ON TRUE\n");
        }
        q.push(concat!(
            "CROSS JOIN ",
            wake!(),
            "\nORDER BY v.position\nON CONFLICT (id) DO NOTHING"
        ));
        let affected = q.build().execute(conn).await?.rows_affected();
        Ok(Inserted::counting(affected, rows))
    }

    async fn stored<'a>(
        conn: &'a mut PgConnection,
        ids: &'a [&'a str],
    ) -> Result<Vec<StoredRow>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT v.wanted, o.topic, o.ordering_key, o.headers, o.payload\n\
             FROM unnest($1::text[]) AS v (wanted) JOIN idem_outbox o ON o.id = v.wanted",
        )
        .bind(ids)
        .fetch_all(conn)
        .await?;
        rows.iter().map(dialect::stored).collect()
    }

    async fn claim<'a>(
        pool: &'a PgPool,
        token: &'a [u8],
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let rows = sqlx::query(concat!(
            "WITH clock AS (SELECT ",
            now_ms!(),
            " AS now),\n",
            "picked AS (SELECT o.seq FROM idem_outbox o, clock\n",
            "  WHERE o.state = 0 AND o.next_attempt_at <= clock.now AND ",
            first_of_key!(),
            "\n  ORDER BY o.seq LIMIT $1 FOR UPDATE OF o SKIP LOCKED)\n",
            "UPDATE idem_outbox u SET attempts = u.attempts + 1, claim_token = $2,\n",
            "  next_attempt_at = clock.now + $3\n",
            "FROM picked, clock WHERE u.seq = picked.seq\n",
            "RETURNING u.seq, u.id, u.topic, u.ordering_key, u.headers, u.payload, u.attempts::bigint AS attempts"
        ))
        .bind(limit)
        .bind(token)
        .bind(lease_ms)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::claimed).collect()
    }

    async fn mark_sent<'a>(
        pool: &'a PgPool,
        token: &'a [u8],
        seqs: &'a [i64],
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(concat!(
            "UPDATE idem_outbox SET state = 1, sent_at = ",
            now_ms!(),
            ", claim_token = NULL, last_error = NULL\n",
            "WHERE seq = ANY($1) AND claim_token = $2 AND state = 0"
        ))
        .bind(seqs)
        .bind(token)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn mark_failed<'a>(
        pool: &'a PgPool,
        token: &'a [u8],
        seqs: &'a [i64],
        reason: &'a str,
        retry_in_ms: i64,
        park: bool,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(concat!(
            "UPDATE idem_outbox SET state = CASE WHEN $4 THEN 2 ELSE 0 END, claim_token = NULL,\n",
            "  last_error = $3, next_attempt_at = ",
            now_ms!(),
            " + $5\n",
            "WHERE seq = ANY($1) AND claim_token = $2 AND state = 0"
        ))
        .bind(seqs)
        .bind(token)
        .bind(reason)
        .bind(park)
        .bind(retry_in_ms)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn backlog(pool: &PgPool, with_sent: bool) -> Result<Vec<Backlog>, sqlx::Error> {
        let rows = sqlx::query(concat!(
            "SELECT topic,\n",
            "  count(*) FILTER (WHERE state = 0) AS pending,\n",
            "  count(*) FILTER (WHERE state = 2) AS parked,\n",
            "  count(*) FILTER (WHERE state = 1) AS sent,\n",
            "  COALESCE(",
            now_ms!(),
            " - min(created_at) FILTER (WHERE state = 0), 0) AS oldest\n",
            "FROM idem_outbox WHERE state <> 1 OR $1 GROUP BY topic ORDER BY topic"
        ))
        .bind(with_sent)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::backlog).collect()
    }

    async fn list(
        pool: &PgPool,
        state: MessageState,
        limit: i64,
    ) -> Result<Vec<ListedMessage>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT seq, id, topic, ordering_key, state::bigint AS state, attempts::bigint AS attempts,\n\
               created_at, last_error,\n\
               octet_length(payload)::bigint AS size\n\
             FROM idem_outbox WHERE state = $1 ORDER BY seq LIMIT $2",
        )
        .bind(state.code())
        .bind(limit)
        .fetch_all(pool)
        .await?;
        rows.iter().map(dialect::listed).collect()
    }

    async fn retry<'a>(pool: &'a PgPool, id: &'a str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(concat!(
            "UPDATE idem_outbox SET state = 0, attempts = 0, claim_token = NULL, last_error = NULL,\n",
            "  next_attempt_at = ",
            now_ms!(),
            "\nWHERE id = $1 AND state <> 1"
        ))
        .bind(id)
        .execute(pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge(pool: &PgPool, older_than_ms: i64, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(concat!(
            "DELETE FROM idem_outbox WHERE seq IN (\n",
            "  SELECT seq FROM idem_outbox WHERE state = 1 AND sent_at < ",
            now_ms!(),
            " - $1\n",
            "  ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
        ))
        .bind(older_than_ms)
        .bind(limit)
        .execute(pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn listen(pool: &PgPool) -> Option<Box<dyn Wakeup>> {
        let mut listener = match PgListener::connect_with(pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "outbox relay: LISTEN unavailable, polling instead");
                return None;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "outbox relay: LISTEN failed, polling instead");
            return None;
        }
        let schema: String = match sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(pool)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "outbox relay: LISTEN unavailable, polling instead");
                return None;
            }
        };
        let mut me = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut me);
        Some(Box::new(Listening {
            listener,
            pool: pool.clone(),
            schema,
            me,
        }))
    }
}

struct Listening {
    listener: PgListener,
    pool: PgPool,
    /// The schema of this relay's table: the payload its writers notify with.
    schema: String,
    /// This relay's row in `idem_outbox_sleepers`.
    me: [u8; 16],
}

#[async_trait::async_trait]
impl Wakeup for Listening {
    async fn arm(&mut self, max: std::time::Duration) {
        // Rows of relays that stopped waiting long ago go in the same
        // statement, so the table stays as small as the number of relays.
        let armed = sqlx::query(concat!(
            "WITH clock AS (SELECT ",
            now_ms!(),
            " AS now),\n",
            "gone AS (DELETE FROM idem_outbox_sleepers WHERE until < (SELECT now FROM clock) - 60000)\n",
            "INSERT INTO idem_outbox_sleepers (relay, until) SELECT $1, now + $2 FROM clock\n",
            "ON CONFLICT (relay) DO UPDATE SET until = EXCLUDED.until"
        ))
        .bind(self.me.as_slice())
        .bind(max.as_millis().min(i64::MAX as u128) as i64 + 1000)
        .execute(&self.pool)
        .await;
        if let Err(e) = armed {
            // Writers will not notify; the relay still polls.
            tracing::debug!(error = %e, "outbox relay: could not register as waiting");
        }
    }

    async fn wait(&mut self) {
        // An error (the connection dropped) is a reason to look now; PgListener
        // reconnects and re-listens on the next call.
        loop {
            match self.listener.recv().await {
                Ok(n) if n.payload() == self.schema => return,
                Ok(_) => {} // another schema's outbox
                Err(e) => {
                    tracing::debug!(error = %e, "outbox relay: LISTEN connection lost");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    return;
                }
            }
        }
    }
}
