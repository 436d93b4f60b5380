//! Redis Streams consumer groups (feature `redis-streams`).
//!
//! - New entries come from `XREADGROUP … >`; an entry is acked (`XACK`) only
//!   after the handler's outcome is recorded.
//! - Entries left pending on a consumer that died (or that was slower than
//!   `claim_idle`) are taken over with `XAUTOCLAIM`, which counts a delivery.
//! - A redelivery later is the entry left pending with its idle time set back
//!   (`XCLAIM … IDLE … RETRYCOUNT … JUSTID`), so any consumer's `XAUTOCLAIM`
//!   takes it when the delay is over. `RETRYCOUNT` keeps Redis's delivery
//!   counter equal to the counted deliveries: an `InProgress` redelivery sets
//!   it one back, so the takeover that follows does not count.
//! - A parked entry is copied to the parking stream (`<stream>:parked` unless
//!   set) with its reason, and acked only once the copy is written, in one
//!   script (`park.lua`); [`parked`] reads it back.
//!
//! Delays are capped at `claim_idle`: Redis measures them as idle time.
//!
//! With [`Runner::concurrency`](super::Runner::concurrency) `n`, set
//! [`batch`](RedisStreamsBuilder::batch) to about `n`: one read then fills
//! every free slot. Entries read and waiting in this process's buffer behind
//! slower handlers are not lost to their idle time: one that has waited for
//! a tenth of `claim_idle` is handed out only after `keep.lua` has checked
//! that it is still this consumer's and set its idle time back to 0, which
//! Redis does not count as a delivery (the whole buffer in that one call). So
//! a handler always has at least nine tenths of `claim_idle`, and a consumer
//! that is slow but healthy has nothing taken over, counted twice or parked
//! for deliveries it never ran. An entry another consumer took over
//! meanwhile is dropped from the buffer, not run twice. Acks and redeliveries
//! go over a connection of their own, so they never queue behind the
//! blocking `XREADGROUP` that waits for new entries.
//!
//! A consumer that dies with entries in its buffer leaves them pending; the
//! consumer that takes them over counts a delivery for each, as Redis cannot
//! tell an entry that was run from one that waited. A `batch` near the
//! runner's concurrency keeps that count honest after a crash.
//!
//! ```no_run
//! use idem_runtime::consumer::Runner;
//! use idem_runtime::consumer::redis_streams::RedisStreamsSource;
//!
//! # #[derive(serde::Serialize, serde::Deserialize)] struct OrderPaid { order_id: String }
//! # struct Settlement;
//! # impl Settlement {
//! #     async fn on_order_paid(&self, e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
//! # }
//! # async fn go(svc: Settlement) -> Result<(), Box<dyn std::error::Error>> {
//! // Redis Streams (feature `redis-streams`)
//! let client = redis::Client::open("redis://127.0.0.1:6379")?;
//! let source = RedisStreamsSource::builder("orders", "settlement", "worker-1").connect(&client).await?;
//! let runner = Runner::new().max_deliveries(5);
//! runner.run(source, |e: OrderPaid| svc.on_order_paid(e)).await; // returns when the broker fails
//! # Ok(()) }
//! ```
//!
//! # Limits of Redis Streams
//!
//! What Redis (or Valkey) answers at its edges, and what idem makes of it: the
//! contract the consumer and `outbox::sink::RedisStreamsSink` are held to. A row
//! whose test says `none yet` is not checked against a real server.
//!
//! | limit or odd answer | what Redis does | what idem does | test |
//! |---|---|---|---|
//! | one argument (a payload, a field value) over `proto-max-bulk-len` (512 MiB by default) | `-ERR Protocol error: invalid bulk length` and the connection closes, failing every command queued on it | the sink reads the limit from the server at connect (512 MiB where `CONFIG` is refused; `max_bulk_len` sets it) and fails a message whose payload, id, topic or a header is larger alone, unsent; the rest of its batch is published. A parked copy carries the payload as one argument, as Redis took it, and the reason in a field of its own | `tests/outbox/sinks.rs::redis_streams_a_payload_over_proto_max_bulk_len_fails_alone` (at 1 MiB and one byte over) |
//! | neither `MULTI`/`EXEC` nor a script rolls back: a command that fails at run time (`WRONGTYPE`) leaves the others applied | `EXEC` runs the rest and reports that command's error in its reply; a script stops at the error | a park is `park.lua`: `XADD` to the parking stream, then `XACK` only if the copy was written. With the parking key holding another type, the park fails (the runner returns the error) and the entry stays pending, to come back through `XAUTOCLAIM` | `tests/consumer_redis.rs::a_park_that_cannot_write_its_copy_leaves_the_entry_pending` |
//! | entries trimmed or deleted while unread or pending (`MAXLEN ~` on the sink, `XTRIM`, `XDEL`) | `MAXLEN ~` trims the oldest entries (whole nodes, so about `n` are left) whether or not a group has read or acked them; a trimmed entry is never handed out; `XAUTOCLAIM` (7.0+) drops a deleted pending entry from the pending list and names it as deleted | the sink's `max_len` trims entries no group has read: the relay counted them published, no consumer sees them, and nothing counts or logs them (`max_len`'s rustdoc: set it far above any backlog, or trim yourself below what every group has read and acked). A deleted pending entry is not handed out; its neighbours are | unread: `tests/outbox/sinks.rs::redis_streams_max_len_below_the_backlog_trims_entries_no_group_has_read` (`max_len` above and below a 250-entry backlog); pending: `tests/consumer_redis.rs::an_entry_deleted_while_pending_is_dropped_not_handed_out` |
//! | the delivery counter | `XAUTOCLAIM`/`XCLAIM` add one per claim; `RETRYCOUNT` sets it | it is the attempt; a delayed redelivery sets it, an `InProgress` one sets it back by one | `tests/consumer_redis.rs::dead_consumer_is_taken_over`, `tests/consumer_redis.rs::poison_is_parked`, `tests/consumer_redis.rs::in_progress_is_not_a_failure` |
//! | redelivery is idle time: an entry pending longer than `claim_idle` may be claimed by anyone | `XAUTOCLAIM … min-idle-time` | delays are capped at `claim_idle`. Entries waiting in this process's buffer do not go idle: once one has waited a tenth of `claim_idle`, `keep.lua` sets the buffer's idle times back to 0 (`XCLAIM … JUSTID` to itself, not a delivery) and drops from the buffer those another consumer took over meanwhile; so a slow healthy consumer has nothing taken over, counted twice or parked unrun | delays: `tests/consumer_redis.rs::poison_is_parked`; the buffer: `tests/consumer_redis.rs::a_slow_healthy_consumer_has_nothing_taken_over_or_counted_twice` |
//! | connection lost mid-`XACK` or mid-park | the command may or may not have run | an entry left pending comes back through `XAUTOCLAIM`, counted, and the record replays it | `tests/consumer_redis.rs::dead_consumer_is_taken_over` (a consumer gone, not a reply lost) |

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use redis::streams::{
    StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamRangeReply, StreamReadReply,
};
use redis::{AsyncConnectionConfig, Client, RedisError, Script, Value};
use serde::Serialize;

use super::{BrokerError, Delivery, Parked, Source};

/// The entry field holding the JSON message.
pub const PAYLOAD_FIELD: &str = "payload";

/// The entry field holding the message id, when the publisher set one (the
/// outbox's relay always does); see [`Delivery::message_id`].
pub const MESSAGE_ID_FIELD: &str = "message-id";

static KEEP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("keep.lua")));
static PARK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("park.lua")));

// The fields a parked entry carries besides the message's own.
const REASON_FIELD: &str = "reason";
const STREAM_FIELD: &str = "stream";
const ENTRY_ID_FIELD: &str = "id";
const DELIVERIES_FIELD: &str = "deliveries";

fn broker(e: RedisError) -> BrokerError {
    BrokerError::new("redis", e)
}

/// Appends `message` as JSON to `stream` (in the field [`PAYLOAD_FIELD`]) and
/// returns the entry id.
pub async fn publish<C, M>(conn: &mut C, stream: &str, message: &M) -> Result<String, BrokerError>
where
    C: redis::aio::ConnectionLike + Send,
    M: Serialize + ?Sized,
{
    let body = serde_json::to_vec(message).map_err(|e| BrokerError::new("redis", e))?;
    publish_raw(conn, stream, &body, None).await
}

/// Appends `payload` as it is to `stream`, framed as [`publish`] frames JSON
/// (and, given an id, as the outbox's relay does, in [`MESSAGE_ID_FIELD`]),
/// and returns the entry id. Bytes that are not the handler's JSON are how a
/// test makes a poison message: the runner parks it as undecodable.
///
/// ```no_run
/// use idem_runtime::consumer::redis_streams;
///
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let mut conn = client.get_multiplexed_async_connection().await?;
/// redis_streams::publish_raw(&mut conn, "orders", b"{\"order_id\": 7", Some("m-1")).await?;
/// # Ok(()) }
/// ```
pub async fn publish_raw<C>(
    conn: &mut C,
    stream: &str,
    payload: &[u8],
    message_id: Option<&str>,
) -> Result<String, BrokerError>
where
    C: redis::aio::ConnectionLike + Send,
{
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*").arg(PAYLOAD_FIELD).arg(payload);
    if let Some(id) = message_id {
        cmd.arg(MESSAGE_ID_FIELD).arg(id);
    }
    cmd.query_async(conn).await.map_err(broker)
}

/// Up to `count` entries of `parking_stream` (`<stream>:parked` unless the
/// consumer set another), oldest first, each with why it was parked.
///
/// Reading leaves them parked (`XRANGE`); remove one once handled with
/// `XDEL <parking_stream> <position>`.
///
/// A poison message, from publishing to reading it parked (the guide's
/// consumers page shows it too):
///
/// ```no_run
/// use idem_runtime::consumer::redis_streams::{self, RedisStreamsSource};
/// use idem_runtime::consumer::{Runner, Source};
///
/// # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
/// # async fn settle(e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
/// # async fn go() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let mut conn = client.get_multiplexed_async_connection().await?;
/// redis_streams::publish_raw(&mut conn, "orders", b"{\"order_id\": 7", Some("m-1")).await?;
///
/// let mut source = RedisStreamsSource::builder("orders", "settlement", "test-1").connect(&client).await?;
/// let runner = Runner::new();
/// runner.process(source.next().await?, &settle).await?; // parked: it does not decode
///
/// let parked = redis_streams::parked(&mut conn, "orders:parked", 10).await?;
/// assert_eq!(parked[0].payload, b"{\"order_id\": 7");
/// assert!(parked[0].reason.starts_with("undecodable: "));
/// assert_eq!(parked[0].message_id.as_deref(), Some("m-1"));
/// # Ok(()) }
/// ```
pub async fn parked<C>(
    conn: &mut C,
    parking_stream: &str,
    count: usize,
) -> Result<Vec<Parked>, BrokerError>
where
    C: redis::aio::ConnectionLike + Send,
{
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(parking_stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await
        .map_err(broker)?;
    Ok(reply
        .ids
        .into_iter()
        .map(|e| Parked {
            payload: e.get(PAYLOAD_FIELD).unwrap_or_default(),
            reason: e.get(REASON_FIELD).unwrap_or_default(),
            message_id: e.get(MESSAGE_ID_FIELD),
            origin: e.get(STREAM_FIELD),
            deliveries: e.get(DELIVERIES_FIELD),
            parked_at: entry_time(&e.id),
            position: Some(e.id),
        })
        .collect())
}

/// The time in an entry id Redis generated (`<unix ms>-<seq>`).
fn entry_time(id: &str) -> Option<SystemTime> {
    let ms = id.split_once('-')?.0.parse().ok()?;
    Some(UNIX_EPOCH + Duration::from_millis(ms))
}

struct Names {
    stream: String,
    group: String,
    consumer: String,
    parking: String,
    claim_idle: Duration,
}

/// Settings of a [`RedisStreamsSource`] consumer.
pub struct RedisStreamsBuilder {
    names: Names,
    block: Duration,
    batch: usize,
}

impl RedisStreamsBuilder {
    /// Where parked entries go (default `<stream>:parked`).
    pub fn parking_stream(mut self, stream: impl Into<String>) -> Self {
        self.names.parking = stream.into();
        self
    }

    /// How long an entry stays pending on a consumer before another takes it
    /// over (default 30 s). Longer than the handler ever takes; also the cap on
    /// redelivery delays.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.names.claim_idle = idle;
        self
    }

    /// How long one `XREADGROUP` waits for new entries (default 1 s); also how
    /// often due redeliveries are looked for when the stream is quiet.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Entries read at once (default 10); about the runner's
    /// [`concurrency`](super::Runner::concurrency) when that is higher.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Opens two connections of its own, one for the blocking reads and one
    /// for acks and redeliveries (a blocking read must not stall a store
    /// sharing the connection, nor the acks of deliveries in flight), and
    /// creates the group, reading from the start of the stream, if it does not
    /// exist.
    pub async fn connect(self, client: &Client) -> Result<RedisStreamsSource, BrokerError> {
        let config = AsyncConnectionConfig::new()
            .set_response_timeout(Some(self.block + Duration::from_secs(10)));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(broker)?;
        let actions = client
            .get_multiplexed_async_connection()
            .await
            .map_err(broker)?;
        let created: Result<Value, RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.names.stream)
            .arg(&self.names.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Ok(_) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(broker(e)),
        }
        Ok(RedisStreamsSource {
            conn,
            actions,
            names: Arc::new(self.names),
            block: self.block,
            batch: self.batch,
            cursor: "0-0".to_owned(),
            next_takeover: Instant::now(),
            buffer: VecDeque::new(),
        })
    }
}

/// One consumer of a Redis Streams consumer group: a [`Source`] for
/// [`super::Runner`].
pub struct RedisStreamsSource {
    conn: MultiplexedConnection,
    actions: MultiplexedConnection,
    names: Arc<Names>,
    block: Duration,
    batch: usize,
    cursor: String,
    /// When to look for entries to take over next (`XAUTOCLAIM`).
    next_takeover: Instant,
    /// Entries read and not handed out yet, with when they were read.
    buffer: VecDeque<(Instant, RedisStreamsDelivery)>,
}

/// How often a busy consumer looks for entries to take over: a redelivery
/// falls due at most this much later than its delay says, and a consumer
/// reading new entries back to back makes one `XAUTOCLAIM` per interval, not
/// one per batch (at batch 1, that halved its round trips per message).
const TAKEOVER_EVERY: Duration = Duration::from_millis(100);

impl RedisStreamsSource {
    /// A consumer named `consumer` in `group` on `stream`. Names must be
    /// unique per live process: two processes under one name share pending
    /// entries.
    pub fn builder(stream: &str, group: &str, consumer: &str) -> RedisStreamsBuilder {
        RedisStreamsBuilder {
            names: Names {
                stream: stream.to_owned(),
                group: group.to_owned(),
                consumer: consumer.to_owned(),
                parking: format!("{stream}:parked"),
                claim_idle: Duration::from_secs(30),
            },
            block: Duration::from_secs(1),
            batch: 10,
        }
    }

    fn delivery(&self, entry: StreamId, attempt: u32) -> RedisStreamsDelivery {
        let payload = entry.get::<Vec<u8>>(PAYLOAD_FIELD);
        let message_id = entry.get::<String>(MESSAGE_ID_FIELD);
        RedisStreamsDelivery {
            message_id,
            conn: self.actions.clone(),
            names: self.names.clone(),
            id: entry.id,
            payload,
            attempt,
        }
    }

    /// Entries pending on any consumer for longer than `claim_idle`: dead
    /// consumers' entries and redeliveries whose delay is over.
    async fn take_over(&mut self) -> Result<(), BrokerError> {
        let n = &self.names;
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&n.stream)
            .arg(&n.group)
            .arg(&n.consumer)
            .arg(n.claim_idle.as_millis() as u64)
            .arg(&self.cursor)
            .arg("COUNT")
            .arg(self.batch)
            .query_async(&mut self.conn)
            .await
            .map_err(broker)?;
        self.cursor = reply.next_stream_id;
        let now = Instant::now();
        for entry in reply.claimed {
            // The claim counted this delivery; the counter is the attempt.
            let pending: StreamPendingCountReply = redis::cmd("XPENDING")
                .arg(&self.names.stream)
                .arg(&self.names.group)
                .arg(&entry.id)
                .arg(&entry.id)
                .arg(1)
                .query_async(&mut self.conn)
                .await
                .map_err(broker)?;
            let attempt = pending
                .ids
                .first()
                .map_or(1, |p| p.times_delivered.max(1) as u32);
            let d = self.delivery(entry, attempt);
            self.buffer.push_back((now, d));
        }
        Ok(())
    }

    /// Sets the buffered entries' idle time back to 0 and drops those no
    /// longer this consumer's (`keep.lua`).
    async fn keep_buffer(&mut self) -> Result<(), BrokerError> {
        let n = &self.names;
        let mut keep = KEEP.key(&n.stream);
        keep.arg(&n.group).arg(&n.consumer);
        for (_, d) in &self.buffer {
            keep.arg(&d.id);
        }
        let kept: Vec<String> = keep.invoke_async(&mut self.actions).await.map_err(broker)?;
        let kept: HashSet<String> = kept.into_iter().collect();
        let now = Instant::now();
        self.buffer.retain_mut(|(read, d)| {
            *read = now;
            kept.contains(&d.id)
        });
        Ok(())
    }

    async fn read_new(&mut self) -> Result<(), BrokerError> {
        let n = &self.names;
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&n.group)
            .arg(&n.consumer)
            .arg("COUNT")
            .arg(self.batch)
            .arg("BLOCK")
            .arg(self.block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&n.stream)
            .arg(">")
            .query_async(&mut self.conn)
            .await
            .map_err(broker)?;
        let now = Instant::now();
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            for entry in key.ids {
                let d = self.delivery(entry, 1);
                self.buffer.push_back((now, d));
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Source for RedisStreamsSource {
    type Delivery = RedisStreamsDelivery;

    async fn next(&mut self) -> Result<RedisStreamsDelivery, BrokerError> {
        loop {
            if let Some((read, d)) = self.buffer.pop_front() {
                if read.elapsed() < self.names.claim_idle / 10 {
                    return Ok(d);
                }
                self.buffer.push_front((read, d));
                self.keep_buffer().await?;
                continue;
            }
            // Redeliveries first: they have waited longest.
            let now = Instant::now();
            if now >= self.next_takeover {
                self.take_over().await?;
                // A cursor past the start: more pending entries to look
                // through, at once; back at the start: after the interval.
                self.next_takeover = if self.cursor == "0-0" {
                    now + TAKEOVER_EVERY
                } else {
                    now
                };
            }
            if self.buffer.is_empty() {
                self.read_new().await?;
            }
        }
    }
}

/// One stream entry handed to this consumer.
pub struct RedisStreamsDelivery {
    conn: MultiplexedConnection,
    names: Arc<Names>,
    id: String,
    payload: Option<Vec<u8>>,
    message_id: Option<String>,
    attempt: u32,
}

impl RedisStreamsDelivery {
    /// The entry id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Leaves the entry pending on this consumer, due for `XAUTOCLAIM` after
    /// `after`, with Redis's delivery counter set to `count`.
    async fn pend(mut self, after: Duration, count: u32) -> Result<(), BrokerError> {
        let n = &self.names;
        let idle = n.claim_idle.saturating_sub(after);
        let _: Value = redis::cmd("XCLAIM")
            .arg(&n.stream)
            .arg(&n.group)
            .arg(&n.consumer)
            .arg(0)
            .arg(&self.id)
            .arg("IDLE")
            .arg(idle.as_millis() as u64)
            .arg("RETRYCOUNT")
            .arg(count)
            .arg("JUSTID")
            .query_async(&mut self.conn)
            .await
            .map_err(broker)?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Delivery for RedisStreamsDelivery {
    fn payload(&self) -> Option<&[u8]> {
        self.payload.as_deref()
    }

    fn attempt(&self) -> u32 {
        self.attempt
    }

    fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    async fn ack(mut self) -> Result<(), BrokerError> {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.names.stream)
            .arg(&self.names.group)
            .arg(&self.id)
            .query_async(&mut self.conn)
            .await
            .map_err(broker)?;
        Ok(())
    }

    async fn retry(self, after: Duration) -> Result<(), BrokerError> {
        let count = self.attempt;
        self.pend(after, count).await
    }

    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
        let count = self.attempt.saturating_sub(1);
        self.pend(after, count).await.map(|()| None)
    }

    async fn park(mut self, reason: &str) -> Result<(), BrokerError> {
        let n = &self.names;
        let mut park = PARK.key(&n.stream);
        park.key(&n.parking)
            .arg(&n.group)
            .arg(&self.id)
            .arg(PAYLOAD_FIELD)
            .arg(self.payload.as_deref().unwrap_or_default())
            .arg(REASON_FIELD)
            .arg(reason)
            .arg(STREAM_FIELD)
            .arg(&n.stream)
            .arg(ENTRY_ID_FIELD)
            .arg(&self.id)
            .arg(DELIVERIES_FIELD)
            .arg(self.attempt);
        if let Some(id) = &self.message_id {
            park.arg(MESSAGE_ID_FIELD).arg(id);
        }
        let _: Value = park.invoke_async(&mut self.conn).await.map_err(broker)?;
        Ok(())
    }
}
