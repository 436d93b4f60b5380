//! The transactional outbox: a message leaves if and only if the transaction
//! that wrote it commits, and a consumer keyed on its id applies it once.
//!
//! 1. **Writing.** [`put`] / [`put_all`] insert messages into `idem_outbox`
//!    inside the caller's sqlx transaction (PostgreSQL, MySQL/MariaDB, SQLite),
//!    in one statement (one per 1 000 messages or 4 MiB). A rolled-back
//!    transaction leaves nothing to send.
//! 2. **Relaying.** A [`Relay`] claims committed messages in batches
//!    (`FOR UPDATE SKIP LOCKED` where the database has it, so relays share
//!    the work), publishes them through a [`Sink`](sink::Sink), and marks them
//!    sent only after the broker confirmed. Failures back off and, after
//!    `max_attempts`, park with their reason. Messages sharing an ordering key
//!    are published in commit order, one at a time.
//! 3. **Receiving.** Every message carries its id (a Redis Streams field,
//!    `Nats-Msg-Id` on JetStream, AMQP `message-id`), and a consumer handler
//!    that takes an [`Envelope`](crate::consumer::Envelope) is keyed on it.
//!
//! The guarantee: **at least once from the relay** (a relay that dies after
//! the broker took a message and before it marked the message sent publishes
//! it again), **once in effect** at a consumer keyed on the message id. JetStream
//! also drops a re-publish inside its duplicate window (`Nats-Msg-Id`).
//!
//! ## Message ids
//! Inside an idempotent call (or step), a message's id derives from the
//! call's (or step's) key and the whole message: topic, ordering key, headers
//! and payload. A retried call that writes the same message again meets its
//! row and writes no second one (conflict is success), whether the retry is
//! the call's or a transaction the call itself tried again. A retry that
//! writes a different message (its first run's message is already committed,
//! its later effects changed what it sends) gets a different id and is sent
//! too: no message takes an id another one holds. So two messages that are
//! the same in every part, written by one call, are one message: make them
//! differ (a line number in the payload) or give each an id. Outside an
//! idempotent call, give the id with [`Message::id`]. A caller's id already
//! held by another message (other topic, ordering key, headers or payload) is
//! refused with [`OutboxError::IdTaken`] rather than taken as the same
//! message: the broker and its consumers would drop the second one unseen.
//!
//! ```no_run
//! use idem_runtime::outbox::{self, Message};
//!
//! #[derive(serde::Serialize)]
//! struct OrderCreated { order_id: u64 }
//!
//! # async fn go(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! // … the order's own rows, on `tx` …
//! let id = outbox::put(
//!     &mut tx,
//!     Message::json("orders.created", &OrderCreated { order_id: 7 })?
//!         .id("order-7-created")
//!         .ordering_key("order-7"),
//! )
//! .await?;
//! tx.commit().await?; // the message exists for the relay from here on
//! # let _ = id; Ok(()) }
//! ```

mod admin;
mod dialect;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod put;
mod relay;
pub mod sink;
#[cfg(feature = "sqlite")]
mod sqlite;

use std::collections::BTreeMap;

pub use crate::consumer::MessageId;
pub use admin::{backlog, list, purge, retry};
use dialect::NewRow;
pub use dialect::{Backlog, ListedMessage, MessageState, OutboxDatabase};
pub use put::{OutboxTx, put, put_all};
pub use relay::{Relay, RelayBuilder, RelayStats, Round};

use crate::error::{CodecError, StoreError};

/// One message to write into the outbox.
///
/// ```
/// use idem_runtime::outbox::Message;
/// let m = Message::bytes("audit", b"raw".to_vec()).id("a-1").header("tenant", "acme");
/// assert_eq!(m.topic(), "audit");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    topic: String,
    payload: Vec<u8>,
    ordering_key: Option<String>,
    headers: BTreeMap<String, String>,
    id: Option<String>,
}

impl Message {
    /// `value` as JSON on `topic` (a Redis stream, a NATS subject, a
    /// RabbitMQ routing key: the sink decides).
    pub fn json<T: serde::Serialize + ?Sized>(
        topic: impl Into<String>,
        value: &T,
    ) -> Result<Message, CodecError> {
        let payload = serde_json::to_vec(value).map_err(|e| CodecError::encoding(&e))?;
        Ok(Message::bytes(topic, payload))
    }

    /// Raw bytes on `topic`.
    pub fn bytes(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Message {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            ordering_key: None,
            headers: BTreeMap::new(),
            id: None,
        }
    }

    /// Messages with the same ordering key are published in the order their
    /// transactions committed, each after the one before it was confirmed.
    /// Writers of one key wait for each other's commit (that is what makes the
    /// order the commit order).
    pub fn ordering_key(mut self, key: impl Into<String>) -> Message {
        self.ordering_key = Some(key.into());
        self
    }

    /// A header the sink passes on (a stream field `h:<name>`, a NATS
    /// header, an AMQP header). [`put`] refuses a name that is not visible
    /// ASCII without `:` or is over 255 bytes, a value holding CR, LF or
    /// NUL (no broker carries those whole), and headers that take more than
    /// [`MAX_HEADERS_BYTES`] as stored.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Message {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The message id, instead of the one derived from the running call's key.
    /// Required outside an idempotent call. Writing again a message that
    /// exists already under this id is success and writes nothing; writing
    /// another message (other topic, ordering key, headers or payload) under
    /// it is [`OutboxError::IdTaken`]: consumers would take it for the first.
    pub fn id(mut self, id: impl Into<String>) -> Message {
        self.id = Some(id.into());
        self
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
}

/// Why a message could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// Outside an idempotent call a message needs an id of the caller's.
    #[error(
        "outbox message on `{topic}` has no id: outside an idempotent call, give one with `Message::id`"
    )]
    NoId {
        /// The message's topic.
        topic: String,
    },
    /// A topic, id or ordering key is empty, longer than the table or a
    /// broker holds, or holds a control character; or a header no broker can
    /// carry (see [`Message::header`]).
    #[error("outbox message {what} {problem}")]
    Invalid {
        /// Which field.
        what: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The message's id ([`Message::id`]) is held by a stored message with
    /// another topic, ordering key, headers or payload (or by another message
    /// of the same `put_all`). Brokers and consumers deduplicate on the id:
    /// this message would be taken for the other and never delivered. Roll
    /// the transaction back and give the message an id of its own.
    #[error(
        "outbox message id `{id}` is held by a message with another {part}: it would never be delivered; give this message an id of its own"
    )]
    IdTaken {
        /// The id.
        id: String,
        /// The first part in which the messages differ: `topic`,
        /// `ordering key`, `headers` or `payload`.
        part: &'static str,
    },
    /// The database refused the write (the caller's transaction is likely
    /// aborted: roll it back).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The longest topic, id or ordering key, in characters (MySQL indexes them
/// as `VARCHAR(255)`; the same limit everywhere keeps schemas
/// interchangeable).
pub const MAX_NAME_CHARS: usize = 255;

/// The longest topic, id and header name in bytes: an AMQP short string
/// (routing key, `message-id`, a header's name) is at most 255 bytes, and a
/// longer one breaks the frame for every message on the channel.
pub const MAX_NAME_BYTES: usize = 255;

/// The most a message's headers may take as stored: their JSON object, in
/// bytes. MySQL keeps them in a `TEXT` column (65 535 bytes); the same bound
/// everywhere keeps the three databases interchangeable, and it keeps a
/// message's header block well inside what a broker takes in one piece
/// (RabbitMQ's content header frame, NATS headers within `max_payload`).
pub const MAX_HEADERS_BYTES: usize = 65_535;

/// A topic, id or ordering key: not empty, within the table's characters
/// and (`on_the_wire`: the topic and the id, which brokers carry) AMQP's
/// bytes, no control characters.
fn check_name(what: &'static str, value: &str, on_the_wire: bool) -> Result<(), OutboxError> {
    let problem = if value.is_empty() {
        "is empty".to_owned()
    } else if value.chars().count() > MAX_NAME_CHARS {
        format!(
            "is {} characters, over {MAX_NAME_CHARS}",
            value.chars().count()
        )
    } else if on_the_wire && value.len() > MAX_NAME_BYTES {
        format!("is {} bytes, over {MAX_NAME_BYTES}", value.len())
    } else if let Some(c) = value.chars().find(|c| c.is_control()) {
        format!("holds the control character {c:?}")
    } else {
        return Ok(());
    };
    Err(OutboxError::Invalid { what, problem })
}

/// What every sink can carry as a header: a name of visible ASCII without
/// `:` (an HTTP token, as NATS requires; at most 255 bytes, as AMQP
/// requires) and a value without CR, LF or NUL (NATS ends a header line at
/// CR/LF: the rest would be lost, or read as another header).
fn check_header(name: &str, value: &str) -> Result<(), OutboxError> {
    let bad_name = if name.is_empty() {
        Some("is empty".to_owned())
    } else if name.len() > MAX_NAME_BYTES {
        Some(format!("is {} bytes, over {MAX_NAME_BYTES}", name.len()))
    } else {
        name.chars()
            .find(|c| !c.is_ascii_graphic() || *c == ':')
            .map(|c| format!("`{name}` holds {c:?}: use visible ASCII without `:`"))
    };
    if let Some(problem) = bad_name {
        return Err(OutboxError::Invalid {
            what: "header name",
            problem,
        });
    }
    match value.chars().find(|c| matches!(c, '\r' | '\n' | '\0')) {
        Some(c) => Err(OutboxError::Invalid {
            what: "header",
            problem: format!("`{name}` holds {c:?} in its value, which no broker carries"),
        }),
        None => Ok(()),
    }
}

impl Message {
    fn into_row(self) -> Result<NewRow, OutboxError> {
        check_name("topic", &self.topic, true)?;
        let explicit = self.id.is_some();
        let id = match self.id {
            Some(id) => id,
            None => match crate::flow::current_key() {
                Some(key) => key
                    .derive_message(
                        &self.topic,
                        self.ordering_key.as_deref(),
                        &self.headers,
                        &self.payload,
                    )
                    .to_hex()[..32]
                    .to_owned(),
                None => return Err(OutboxError::NoId { topic: self.topic }),
            },
        };
        check_name("id", &id, true)?;
        if let Some(k) = &self.ordering_key {
            check_name("ordering key", k, false)?;
        }
        for (name, value) in &self.headers {
            check_header(name, value)?;
        }
        let headers = if self.headers.is_empty() {
            None
        } else {
            let json = serde_json::to_string(&self.headers).expect("string maps encode");
            if json.len() > MAX_HEADERS_BYTES {
                return Err(OutboxError::Invalid {
                    what: "headers",
                    problem: format!(
                        "take {} bytes as stored (a JSON object), over {MAX_HEADERS_BYTES}",
                        json.len()
                    ),
                });
            }
            Some(json)
        };
        Ok(NewRow {
            id,
            topic: self.topic,
            ordering_key: self.ordering_key,
            headers,
            payload: self.payload,
            explicit,
        })
    }
}

/// A claimed message on its way to the broker.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The message id: what the broker and the consumer deduplicate on.
    pub id: MessageId,
    /// Where it goes.
    pub topic: String,
    /// Its ordering key, if any.
    pub ordering_key: Option<String>,
    /// Its headers.
    pub headers: BTreeMap<String, String>,
    /// Its body.
    pub payload: Vec<u8>,
    /// Which claim this is, from 1.
    pub attempt: u32,
}

#[cfg(test)]
mod tests;
