//! Publishing to Redis Streams: one `XADD` per message, pipelined.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Value};

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;
use crate::consumer::redis_streams::{MESSAGE_ID_FIELD, PAYLOAD_FIELD};
use crate::redis_limits::{self, DEFAULT_PROTO_MAX_BULK_LEN};

/// Appends each message to the stream named by its topic, with the fields
/// the [`RedisStreamsSource`](crate::consumer::redis_streams::RedisStreamsSource)
/// reads: `payload`, `message-id`, and `h:<name>` per header.
///
/// ```no_run
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let sink = idem_runtime::outbox::sink::RedisStreamsSink::connect(&client).await?
///     .max_len(1_000_000);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStreamsSink<C = ConnectionManager> {
    conn: C,
    max_len: Option<usize>,
    max_bulk_len: usize,
}

impl RedisStreamsSink {
    /// On a connection of its own that reconnects after Redis went away (a
    /// relay outlives a Redis restart; the publishes meanwhile fail and are
    /// retried). Reads the server's `proto-max-bulk-len` (see
    /// [`max_bulk_len`](RedisStreamsSink::max_bulk_len)).
    pub async fn connect(client: &Client) -> Result<RedisStreamsSink, BrokerError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
            .set_response_timeout(Some(std::time::Duration::from_secs(10)));
        let conn = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(|e| BrokerError::new("redis", e))?;
        let max_bulk_len = redis_limits::proto_max_bulk_len(&mut conn.clone())
            .await
            .map_err(|e| BrokerError::new("redis", e))?;
        Ok(RedisStreamsSink::new(conn).max_bulk_len(max_bulk_len))
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStreamsSink<C> {
    /// On a connection the application already has.
    pub fn new(conn: C) -> RedisStreamsSink<C> {
        RedisStreamsSink {
            conn,
            max_len: None,
            max_bulk_len: DEFAULT_PROTO_MAX_BULK_LEN,
        }
    }

    /// Trims each stream to about `n` entries as it appends (`MAXLEN ~`).
    ///
    /// Redis trims the oldest entries whether or not a consumer group has
    /// read or acked them: entries behind a backlog longer than `n` (a
    /// consumer down, a relay catching up) are gone, never delivered, and
    /// nothing counts or logs them; the relay marks them sent. Set `n` far
    /// above any backlog the consumers may fall behind by, or leave it unset
    /// and trim from a job of your own below what every group has both read
    /// and acked (its last-delivered-id from `XINFO GROUPS`, its oldest
    /// pending entry from `XPENDING`, then `XTRIM … MINID`).
    pub fn max_len(mut self, n: usize) -> RedisStreamsSink<C> {
        self.max_len = Some(n);
        self
    }

    /// The largest argument the server reads, its `proto-max-bulk-len`
    /// (512 MiB unless set otherwise; [`connect`](RedisStreamsSink::connect)
    /// reads it from the server). A message whose payload, id, topic or a
    /// header is larger fails alone, without being sent: Redis would close
    /// the connection over it and fail the whole batch, every round. Set it
    /// for a connection given to [`new`](RedisStreamsSink::new) whose server
    /// was set otherwise.
    pub fn max_bulk_len(mut self, n: usize) -> RedisStreamsSink<C> {
        self.max_bulk_len = n;
        self
    }
}

/// Why Redis would close the connection over `m`: an argument of its `XADD`
/// over `proto-max-bulk-len`.
fn refused(m: &Outgoing, max_bulk_len: usize) -> Option<BrokerError> {
    let headers = m.headers.iter().flat_map(|(name, value)| {
        [
            ("a header name", 2 + name.len()),
            ("a header value", value.len()),
        ]
    });
    let (what, size) = [
        ("the payload", m.payload.len()),
        ("the id", m.id.as_str().len()),
        ("the topic", m.topic.len()),
    ]
    .into_iter()
    .chain(headers)
    .find(|&(_, size)| size > max_bulk_len)?;
    Some(BrokerError::new(
        "redis",
        format!(
            "{what} is {size} bytes, over the server's proto-max-bulk-len of {max_bulk_len}: \
             Redis would close the connection"
        ),
    ))
}

#[async_trait::async_trait]
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Sink for RedisStreamsSink<C> {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut out: Vec<Option<Result<(), BrokerError>>> = Vec::with_capacity(batch.len());
        // Where each pipelined `XADD`'s message is in `batch`.
        let mut sent = Vec::with_capacity(batch.len());
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for (i, m) in batch.iter().enumerate() {
            if let Some(e) = refused(m, self.max_bulk_len) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            sent.push(i);
            let cmd = pipe.cmd("XADD").arg(&m.topic);
            if let Some(n) = self.max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*")
                .arg(PAYLOAD_FIELD)
                .arg(&m.payload)
                .arg(MESSAGE_ID_FIELD)
                .arg(m.id.as_str());
            for (name, value) in &m.headers {
                cmd.arg(format!("h:{name}")).arg(value);
            }
        }
        if !sent.is_empty() {
            let mut conn = self.conn.clone();
            match pipe.query_async::<Vec<Value>>(&mut conn).await {
                Ok(replies) => {
                    for (k, &i) in sent.iter().enumerate() {
                        out[i] = Some(match replies.get(k) {
                            Some(Value::ServerError(e)) => Err(BrokerError::new(
                                "redis",
                                redis::RedisError::from(e.clone()),
                            )),
                            Some(_) => Ok(()),
                            None => Err(BrokerError::new("redis", "no reply to XADD")),
                        });
                    }
                }
                Err(e) => {
                    let why = e.to_string();
                    for &i in &sent {
                        out[i] = Some(Err(BrokerError::new("redis", why.clone())));
                    }
                }
            }
        }
        out.into_iter()
            .map(|answer| answer.expect("every message answered"))
            .collect()
    }
}
