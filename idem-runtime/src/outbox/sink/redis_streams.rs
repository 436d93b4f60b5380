//! Publishing to Redis Streams: one `XADD` per message, pipelined.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Value};

use super::{Outgoing, Sink};
use crate::consumer::BrokerError;
use crate::consumer::redis_streams::{MESSAGE_ID_FIELD, PAYLOAD_FIELD};

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
}

impl RedisStreamsSink {
    /// On a connection of its own that reconnects after Redis went away (a
    /// relay outlives a Redis restart; the publishes meanwhile fail and are
    /// retried).
    pub async fn connect(client: &Client) -> Result<RedisStreamsSink, BrokerError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
            .set_response_timeout(Some(std::time::Duration::from_secs(10)));
        let conn = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(|e| BrokerError::new("redis", e))?;
        Ok(RedisStreamsSink::new(conn))
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisStreamsSink<C> {
    /// On a connection the application already has.
    pub fn new(conn: C) -> RedisStreamsSink<C> {
        RedisStreamsSink {
            conn,
            max_len: None,
        }
    }

    /// Trims each stream to about `n` entries as it appends (`MAXLEN ~`).
    pub fn max_len(mut self, n: usize) -> RedisStreamsSink<C> {
        self.max_len = Some(n);
        self
    }
}

#[async_trait::async_trait]
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Sink for RedisStreamsSink<C> {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for m in batch {
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
        let mut conn = self.conn.clone();
        match pipe.query_async::<Vec<Value>>(&mut conn).await {
            Ok(replies) => batch
                .iter()
                .enumerate()
                .map(|(i, _)| match replies.get(i) {
                    Some(Value::ServerError(e)) => Err(BrokerError::new(
                        "redis",
                        redis::RedisError::from(e.clone()),
                    )),
                    Some(_) => Ok(()),
                    None => Err(BrokerError::new("redis", "no reply to XADD")),
                })
                .collect(),
            Err(e) => {
                let why = e.to_string();
                batch
                    .iter()
                    .map(|_| Err(BrokerError::new("redis", why.clone())))
                    .collect()
            }
        }
    }
}
