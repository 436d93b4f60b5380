//! What each SQL database supplies to the outbox: its statements. The relay's
//! algorithm (claim, publish, mark, back off, park) is written once in
//! `relay.rs`; a dialect only says how to claim a batch and how to mark it.

use std::future::Future;

use sqlx::{ColumnIndex, Decode, Row, Type};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
use sqlx::{Database, Encode, QueryBuilder};

/// Where a message stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageState {
    /// Waiting for a relay (or claimed by one that has not finished).
    Pending,
    /// Confirmed by the broker.
    Sent,
    /// Given up after `max_attempts`; `idem outbox retry ID` sends it again.
    Parked,
}

impl MessageState {
    pub(crate) fn code(self) -> i16 {
        match self {
            MessageState::Pending => 0,
            MessageState::Sent => 1,
            MessageState::Parked => 2,
        }
    }

    pub(crate) fn from_code(code: i64) -> MessageState {
        match code {
            0 => MessageState::Pending,
            1 => MessageState::Sent,
            _ => MessageState::Parked,
        }
    }
}

/// The unsent messages of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlog {
    /// The topic.
    pub topic: String,
    /// Messages waiting to be sent (claimed ones included).
    pub pending: u64,
    /// Messages parked for an operator.
    pub parked: u64,
    /// Messages sent and not purged yet (counted only when asked for).
    pub sent: u64,
    /// Milliseconds since the oldest pending message was written (0 when none).
    pub oldest_pending_ms: u64,
}

/// One message as `idem outbox list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedMessage {
    /// Its place in the table's order.
    pub seq: i64,
    /// The message id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// Where it stands.
    pub state: MessageState,
    /// Claims by relays so far.
    pub attempts: u32,
    /// When it was written (ms since the epoch, database clock).
    pub created_at: i64,
    /// The last failure's reason (or why it was parked).
    pub last_error: Option<String>,
    /// The body's size.
    pub payload_bytes: u64,
}

/// A row on its way into the table.
pub struct NewRow {
    pub id: String,
    pub topic: String,
    pub ordering_key: Option<String>,
    pub headers: Option<String>,
    pub payload: Vec<u8>,
    /// The id is the caller's ([`Message::id`](super::Message::id)), not
    /// derived from the message: another message may hold it.
    pub explicit: bool,
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// Every row.
    All,
    /// Some ids were held already, by the same message or another one
    /// (PostgreSQL and SQLite count the rows they inserted).
    SomeHeld,
    /// Nothing: a row's id is held by another message (MySQL compares the
    /// contents in the statement and fails it).
    Refused,
}

impl Inserted {
    /// From the rows an `ON CONFLICT DO NOTHING` insert of `rows` affected.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(super) fn counting(affected: u64, rows: &[NewRow]) -> Inserted {
        if affected < rows.len() as u64 {
            Inserted::SomeHeld
        } else {
            Inserted::All
        }
    }
}

/// The content of a stored row, to compare with a row whose id it holds.
pub struct StoredRow {
    /// The id it was asked for by.
    pub wanted: String,
    pub topic: String,
    pub ordering_key: Option<String>,
    pub headers: Option<String>,
    pub payload: Vec<u8>,
}

/// A message's parts, as a row holds them.
pub(super) type Parts<'a> = (&'a str, Option<&'a str>, Option<&'a str>, &'a [u8]);

impl NewRow {
    pub(super) fn parts(&self) -> Parts<'_> {
        (
            &self.topic,
            self.ordering_key.as_deref(),
            self.headers.as_deref(),
            &self.payload,
        )
    }
}

impl StoredRow {
    pub(super) fn parts(&self) -> Parts<'_> {
        (
            &self.topic,
            self.ordering_key.as_deref(),
            self.headers.as_deref(),
            &self.payload,
        )
    }
}

/// The first part in which two messages under one id differ; `None` when
/// they are one message.
pub(super) fn first_difference(a: Parts<'_>, b: Parts<'_>) -> Option<&'static str> {
    if a.0 != b.0 {
        Some("topic")
    } else if a.1 != b.1 {
        Some("ordering key")
    } else if a.2 != b.2 {
        Some("headers")
    } else if a.3 != b.3 {
        Some("payload")
    } else {
        None
    }
}

/// A stored row's content.
pub(super) fn stored(r: &impl Columns) -> Result<StoredRow, sqlx::Error> {
    Ok(StoredRow {
        wanted: r.text("wanted")?,
        topic: r.text("topic")?,
        ordering_key: r.maybe("ordering_key")?,
        headers: r.maybe("headers")?,
        payload: r.bytes("payload")?,
    })
}

/// A claimed row.
pub struct Claimed {
    pub seq: i64,
    pub id: String,
    pub topic: String,
    pub ordering_key: Option<String>,
    pub headers: Option<String>,
    pub payload: Vec<u8>,
    pub attempts: i64,
}

/// Typed reads of a row, the same on every database: the dialects' SQL casts
/// what it stores narrower to BIGINT, so one reader serves all three.
pub trait Columns {
    fn int(&self, column: &str) -> Result<i64, sqlx::Error>;
    fn text(&self, column: &str) -> Result<String, sqlx::Error>;
    fn maybe(&self, column: &str) -> Result<Option<String>, sqlx::Error>;
    fn bytes(&self, column: &str) -> Result<Vec<u8>, sqlx::Error>;
}

impl<R> Columns for R
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<Vec<u8>>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn int(&self, column: &str) -> Result<i64, sqlx::Error> {
        self.try_get(column)
    }
    // MySQL keeps the outbox's names as VARBINARY (bytes compare as on the
    // other databases), which sqlx will not decode into a `String`: read
    // the bytes, then the UTF-8 `put` wrote.
    fn text(&self, column: &str) -> Result<String, sqlx::Error> {
        match self.try_get(column) {
            Err(sqlx::Error::ColumnDecode { .. }) => utf8(column, self.try_get(column)?),
            other => other,
        }
    }
    fn maybe(&self, column: &str) -> Result<Option<String>, sqlx::Error> {
        match self.try_get(column) {
            Err(sqlx::Error::ColumnDecode { .. }) => self
                .try_get::<Option<Vec<u8>>, _>(column)?
                .map(|b| utf8(column, b))
                .transpose(),
            other => other,
        }
    }
    fn bytes(&self, column: &str) -> Result<Vec<u8>, sqlx::Error> {
        self.try_get(column)
    }
}

fn utf8(column: &str, bytes: Vec<u8>) -> Result<String, sqlx::Error> {
    String::from_utf8(bytes).map_err(|e| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: Box::new(e),
    })
}

/// `(s1, s2, …)`, each a bound parameter: the `IN` list of the dialects
/// without arrays.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) fn push_seqs<'a, DB>(q: &mut QueryBuilder<'a, DB>, seqs: &[i64])
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
{
    q.push("(");
    let mut list = q.separated(", ");
    for s in seqs {
        list.push_bind(*s);
    }
    q.push(")");
}

/// The relay's two marks on the dialects without arrays (MySQL, SQLite),
/// built alike: only the clock expression (`now`) differs.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) fn mark_sent_query<'a, DB>(
    now: &str,
    token: &'a [u8],
    seqs: &[i64],
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    &'a [u8]: Encode<'a, DB> + Type<DB>,
{
    let mut q = QueryBuilder::new(format!(
        "UPDATE idem_outbox SET state = 1, sent_at = {now}, claim_token = NULL, last_error = NULL"
    ));
    push_still_claimed(&mut q, token, seqs);
    q
}

/// See [`mark_sent_query`].
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) fn mark_failed_query<'a, DB>(
    now: &str,
    token: &'a [u8],
    seqs: &[i64],
    reason: &'a str,
    retry_in_ms: i64,
    park: bool,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    bool: Encode<'a, DB> + Type<DB>,
    &'a str: Encode<'a, DB> + Type<DB>,
    &'a [u8]: Encode<'a, DB> + Type<DB>,
{
    let mut q = QueryBuilder::new("UPDATE idem_outbox SET state = CASE WHEN ");
    q.push_bind(park);
    q.push(" THEN 2 ELSE 0 END, claim_token = NULL, last_error = ");
    q.push_bind(reason);
    q.push(format!(", next_attempt_at = {now} + "));
    q.push_bind(retry_in_ms);
    push_still_claimed(&mut q, token, seqs);
    q
}

/// ` WHERE` the rows are still claimed under `token`.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
fn push_still_claimed<'a, DB>(q: &mut QueryBuilder<'a, DB>, token: &'a [u8], seqs: &[i64])
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    &'a [u8]: Encode<'a, DB> + Type<DB>,
{
    q.push(" WHERE seq IN ");
    push_seqs(q, seqs);
    q.push(" AND state = 0 AND claim_token = ");
    q.push_bind(token);
}

/// A claimed row (`RETURNING`, or MySQL's read after its update).
pub(super) fn claimed(r: &impl Columns) -> Result<Claimed, sqlx::Error> {
    Ok(Claimed {
        seq: r.int("seq")?,
        id: r.text("id")?,
        topic: r.text("topic")?,
        ordering_key: r.maybe("ordering_key")?,
        headers: r.maybe("headers")?,
        payload: r.bytes("payload")?,
        attempts: r.int("attempts")?,
    })
}

/// A row of the backlog's `GROUP BY topic`.
pub(super) fn backlog(r: &impl Columns) -> Result<Backlog, sqlx::Error> {
    Ok(Backlog {
        topic: r.text("topic")?,
        pending: r.int("pending")?.max(0) as u64,
        parked: r.int("parked")?.max(0) as u64,
        sent: r.int("sent")?.max(0) as u64,
        oldest_pending_ms: r.int("oldest")?.max(0) as u64,
    })
}

/// A row of `list`.
pub(super) fn listed(r: &impl Columns) -> Result<ListedMessage, sqlx::Error> {
    Ok(ListedMessage {
        seq: r.int("seq")?,
        id: r.text("id")?,
        topic: r.text("topic")?,
        ordering_key: r.maybe("ordering_key")?,
        state: MessageState::from_code(r.int("state")?),
        attempts: r.int("attempts")?.clamp(0, i64::from(u32::MAX)) as u32,
        created_at: r.int("created_at")?,
        last_error: r.maybe("last_error")?,
        payload_bytes: r.int("size")?.max(0) as u64,
    })
}

/// A database the outbox runs on: PostgreSQL, MySQL/MariaDB and SQLite.
/// Sealed: its methods are the outbox's own.
pub trait OutboxDatabase: Dialect {}

impl<T: Dialect> OutboxDatabase for T {}

/// The statements of one database. Every time is the database server's clock
/// in milliseconds, read in the statement.
pub trait Dialect: sqlx::Database {
    const BACKEND: &'static str;

    /// Inserts the rows (conflict on `id` writes nothing), ordering keys
    /// locked until the transaction ends so a key's rows take `seq` in commit
    /// order.
    fn insert<'a>(
        conn: &'a mut Self::Connection,
        rows: &'a [NewRow],
    ) -> impl Future<Output = Result<Inserted, sqlx::Error>> + Send + 'a;

    /// The stored content of the rows holding these ids, each with the id
    /// asked for (`wanted`: the database's own equality pairs them, which on
    /// MySQL ignores case and trailing spaces).
    fn stored<'a>(
        conn: &'a mut Self::Connection,
        ids: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<StoredRow>, sqlx::Error>> + Send + 'a;

    /// Claims up to `limit` due messages for `lease_ms` under `token`, one per
    /// ordering key and only a key's oldest unsent one, raising `attempts`.
    fn claim<'a>(
        pool: &'a sqlx::Pool<Self>,
        token: &'a [u8],
        limit: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<Vec<Claimed>, sqlx::Error>> + Send + 'a;

    /// Marks the rows still claimed under `token` sent.
    fn mark_sent<'a>(
        pool: &'a sqlx::Pool<Self>,
        token: &'a [u8],
        seqs: &'a [i64],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Gives the rows still claimed under `token` back, due after
    /// `retry_in_ms`, with the reason; parked instead when `park`. One
    /// statement for all of them: during an outage a whole batch fails alike.
    fn mark_failed<'a>(
        pool: &'a sqlx::Pool<Self>,
        token: &'a [u8],
        seqs: &'a [i64],
        reason: &'a str,
        retry_in_ms: i64,
        park: bool,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Counts by topic; sent messages only when `with_sent` (a scan of them).
    fn backlog(
        pool: &sqlx::Pool<Self>,
        with_sent: bool,
    ) -> impl Future<Output = Result<Vec<Backlog>, sqlx::Error>> + Send + '_;

    /// Messages in `state`, oldest first.
    fn list(
        pool: &sqlx::Pool<Self>,
        state: MessageState,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ListedMessage>, sqlx::Error>> + Send + '_;

    /// Makes a pending or parked message due now with its attempts reset.
    fn retry<'a>(
        pool: &'a sqlx::Pool<Self>,
        id: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Deletes up to `limit` messages sent more than `older_than_ms` ago.
    fn purge(
        pool: &sqlx::Pool<Self>,
        older_than_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + '_;

    /// A way to wait for the next commit that wrote messages, if the database
    /// has one (PostgreSQL's LISTEN); `None` makes the relay poll.
    fn listen(pool: &sqlx::Pool<Self>)
    -> impl Future<Output = Option<Box<dyn Wakeup>>> + Send + '_;
}

/// Waits for a commit that wrote messages.
#[async_trait::async_trait]
pub trait Wakeup: Send {
    /// Tells writers a relay is about to wait (for at most `max`), so their
    /// commits wake it. The relay looks for work once more after this and
    /// before [`Wakeup::wait`], so a commit between its last look and this is
    /// not missed.
    async fn arm(&mut self, max: std::time::Duration);

    /// Returns after a notification (or an error, which the relay treats as
    /// "look now").
    async fn wait(&mut self);
}
