//! Writing messages: [`put`] and [`put_all`] in the caller's transaction,
//! and what makes a write refused rather than lost (an id another message
//! holds, a batch past what one statement carries).

use super::dialect::{self, Inserted, NewRow};
use super::{Message, MessageId, OutboxDatabase, OutboxError};
use crate::error::StoreError;

/// A transaction (or connection) messages can be written on: a
/// `&mut sqlx::Transaction` of PostgreSQL, MySQL or SQLite, or their bare
/// connections.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a transaction the outbox can write in",
    label = "pass the `&mut sqlx::Transaction<'_, DB>` from `pool.begin()`",
    note = "the outbox is on PostgreSQL, MySQL/MariaDB and SQLite (features `postgres`, `mysql`, `sqlite`)"
)]
pub trait OutboxTx: Send {
    /// The database.
    type Database: OutboxDatabase;

    /// The connection the insert runs on.
    fn outbox_connection(&mut self) -> &mut <Self::Database as sqlx::Database>::Connection;
}

impl<DB: OutboxDatabase> OutboxTx for sqlx::Transaction<'_, DB> {
    type Database = DB;

    fn outbox_connection(&mut self) -> &mut DB::Connection {
        self
    }
}

macro_rules! outbox_connection {
    ($feature:literal, $conn:ty, $db:ty) => {
        #[cfg(feature = $feature)]
        impl OutboxTx for $conn {
            type Database = $db;

            fn outbox_connection(&mut self) -> &mut $conn {
                self
            }
        }
    };
}
outbox_connection!("postgres", sqlx::PgConnection, sqlx::Postgres);
outbox_connection!("mysql", sqlx::MySqlConnection, sqlx::MySql);
outbox_connection!("sqlite", sqlx::SqliteConnection, sqlx::Sqlite);

/// Writes one message in the caller's transaction and returns its id.
///
/// Inside an idempotent call the id derives from the call's key, so a
/// retried call writes no second row; outside one, give it with
/// [`Message::id`] (see the [module documentation](super)).
///
/// ```no_run
/// # #[cfg(feature = "postgres")] mod doc {
/// use idem_runtime::idempotent;
/// use idem_runtime::outbox::{self, Message};
///
/// #[derive(serde::Serialize)]
/// struct OrderCreated { order_id: i64 }
/// # #[derive(Debug)]
/// # enum AppError {
/// #     Idem(idem_runtime::Error),
/// #     Db(sqlx::Error),
/// #     Codec(idem_runtime::CodecError),
/// #     Outbox(outbox::OutboxError),
/// # }
/// # impl From<idem_runtime::Error> for AppError { fn from(e: idem_runtime::Error) -> Self { AppError::Idem(e) } }
/// # impl From<sqlx::Error> for AppError { fn from(e: sqlx::Error) -> Self { AppError::Db(e) } }
/// # impl From<idem_runtime::CodecError> for AppError { fn from(e: idem_runtime::CodecError) -> Self { AppError::Codec(e) } }
/// # impl From<outbox::OutboxError> for AppError { fn from(e: outbox::OutboxError) -> Self { AppError::Outbox(e) } }
///
/// #[idempotent(scope = "orders.create", key = "id")]
/// async fn create_order(pool: &sqlx::PgPool, id: i64, sku: String) -> Result<(), AppError> {
///     let mut tx = pool.begin().await?;
///     sqlx::query("INSERT INTO orders (id, sku) VALUES ($1, $2)").bind(id).bind(&sku).execute(&mut *tx).await?;
///     outbox::put(&mut tx, Message::json("orders.created", &OrderCreated { order_id: id })?
///         .ordering_key(id.to_string())).await?;
///     tx.commit().await?;
///     Ok(())
/// }
/// # }
/// ```
pub async fn put<T: OutboxTx + ?Sized>(
    tx: &mut T,
    message: Message,
) -> Result<MessageId, OutboxError> {
    let mut ids = put_all(tx, [message]).await?;
    Ok(ids.remove(0))
}

/// Writes several messages in the caller's transaction with one statement
/// (MySQL adds one for the messages' ordering keys, if they have any) and
/// returns their ids in order. A batch of more than 1 000 messages or 4 MiB
/// takes one statement per 1 000 messages or 4 MiB: no database's cap on a
/// statement's parameters or size (MySQL's `max_allowed_packet`) is met.
///
/// ```no_run
/// use idem_runtime::outbox::{self, Message};
/// # async fn go(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// let ids = outbox::put_all(&mut tx, [
///     Message::bytes("stock.reserved", b"{}".to_vec()).id("r-1"),
///     Message::bytes("orders.created", b"{}".to_vec()).id("o-1"),
/// ]).await?;
/// tx.commit().await?;
/// assert_eq!(ids.len(), 2);
/// # Ok(()) }
/// ```
pub async fn put_all<T, I>(tx: &mut T, messages: I) -> Result<Vec<MessageId>, OutboxError>
where
    T: OutboxTx + ?Sized,
    I: IntoIterator<Item = Message>,
{
    let rows = messages
        .into_iter()
        .map(Message::into_row)
        .collect::<Result<Vec<_>, _>>()?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    // Two messages of this batch under one id: the database would keep the
    // first and drop the second unseen.
    if rows.len() > 1 {
        let mut seen: std::collections::HashMap<&str, &NewRow> = Default::default();
        for row in &rows {
            if let Some(first) = seen.insert(&row.id, row) {
                if let Some(part) = dialect::first_difference(first.parts(), row.parts()) {
                    return Err(OutboxError::IdTaken {
                        id: row.id.clone(),
                        part,
                    });
                }
            }
        }
    }
    let db = |e| StoreError::new(<T::Database as dialect::Dialect>::BACKEND, "outbox", e);
    let conn = tx.outbox_connection();
    let (rows, ids) = in_statements(rows);
    for chunk in &rows {
        let inserted = <T::Database as dialect::Dialect>::insert(conn, chunk)
            .await
            .map_err(db)?;
        if inserted == Inserted::All {
            continue;
        }
        // A derived id hashes the whole message, so the row holding it is
        // this message. A caller's id may be held by another message, which
        // the broker and every consumer would take this one for. Checked
        // per statement, so the ids asked for stay under the same caps.
        let wanted: Vec<&str> = chunk
            .iter()
            .filter(|r| r.explicit)
            .map(|r| r.id.as_str())
            .collect();
        let stored = if wanted.is_empty() {
            Vec::new()
        } else {
            <T::Database as dialect::Dialect>::stored(conn, &wanted)
                .await
                .map_err(db)?
        };
        let taken = chunk.iter().filter(|r| r.explicit).find_map(|row| {
            stored
                .iter()
                .filter(|s| s.wanted == row.id)
                .find_map(|s| dialect::first_difference(s.parts(), row.parts()))
                .map(|part| (row.id.clone(), part))
        });
        match taken {
            Some((id, part)) => return Err(OutboxError::IdTaken { id, part }),
            // Only the database compared (MySQL's statement failed): it wrote
            // nothing of this statement, so this is no success either.
            None if inserted == Inserted::Refused => {
                let ids: Vec<&str> = chunk.iter().map(|r| r.id.as_str()).collect();
                return Err(OutboxError::IdTaken {
                    id: ids.join(", "),
                    part: "content (as the database compares ids)",
                });
            }
            None => {}
        }
    }
    Ok(ids)
}

/// The most rows one insert statement carries: five or six parameters a
/// row stays under every database's cap on a statement's parameters
/// (SQLite 32 766, PostgreSQL and MySQL 65 535).
const ROWS_PER_STATEMENT: usize = 1_000;

/// The most bytes of messages one insert statement carries: under MySQL's
/// smallest default `max_allowed_packet` (4 MiB on MySQL 5.7 and 8.0 before
/// 8.0.3; 16 MiB on MariaDB) with room for the statement's text, past which the server drops the connection
/// and with it the caller's transaction. A message larger than that goes
/// alone, and on MySQL must fit the server's `max_allowed_packet` itself.
const BYTES_PER_STATEMENT: usize = (4 << 20) - (64 << 10);

/// What a row costs a statement beyond its bytes: its parameters' types and
/// length prefixes (MySQL's execute packet), counted generously.
const OVERHEAD_PER_ROW: usize = 64;

/// The rows as the statements that write them, and their ids in the
/// caller's order. A batch within one statement's bounds is that one
/// statement, as it is. A larger one is cut, after a stable sort by
/// ordering key, so a transaction takes its keys' locks in one order across
/// statements as it does within one (two writers never wait on each other
/// crosswise); a key's messages keep their order.
fn in_statements(rows: Vec<NewRow>) -> (Vec<Vec<NewRow>>, Vec<MessageId>) {
    let size = |r: &NewRow| {
        OVERHEAD_PER_ROW
            + r.payload.len()
            + r.id.len()
            + r.topic.len()
            + r.ordering_key.as_ref().map_or(0, String::len)
            + r.headers.as_ref().map_or(0, String::len)
    };
    let total: usize = rows.iter().map(size).sum();
    if rows.len() <= ROWS_PER_STATEMENT && total <= BYTES_PER_STATEMENT {
        let ids = rows.iter().map(|r| MessageId::new(r.id.clone())).collect();
        return (vec![rows], ids);
    }
    let ids = rows.iter().map(|r| MessageId::new(r.id.clone())).collect();
    let mut rows = rows;
    rows.sort_by(|a, b| a.ordering_key.cmp(&b.ordering_key));
    let mut statements: Vec<Vec<NewRow>> = Vec::new();
    let mut bytes = 0;
    for row in rows {
        let n = size(&row);
        match statements.last_mut() {
            Some(last) if last.len() < ROWS_PER_STATEMENT && bytes + n <= BYTES_PER_STATEMENT => {
                bytes += n;
                last.push(row);
            }
            _ => {
                bytes = n;
                statements.push(vec![row]);
            }
        }
    }
    (statements, ids)
}
