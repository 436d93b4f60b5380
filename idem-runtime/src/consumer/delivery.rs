//! What a broker adapter supplies: a [`Source`] of [`Delivery`]s, the
//! actions the runner takes on one, and the error a broker answers with.

use std::fmt;
use std::time::Duration;

/// A broker failed to take an ack, a redelivery or a parked copy (or to hand
/// out the next message). The message is then redelivered by the broker, and
/// the record turns that redelivery into a replay.
#[derive(Debug)]
pub struct BrokerError {
    broker: &'static str,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl BrokerError {
    /// Wraps a client error.
    ///
    /// ```
    /// let e = idem_runtime::consumer::BrokerError::new("redis", std::io::Error::other("reset"));
    /// assert_eq!(e.to_string(), "broker redis: reset");
    /// ```
    pub fn new(
        broker: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        BrokerError {
            broker,
            source: source.into(),
        }
    }

    /// The broker's name.
    pub fn broker(&self) -> &'static str {
        self.broker
    }
}

impl fmt::Display for BrokerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "broker {}: {}", self.broker, self.source)
    }
}

impl std::error::Error for BrokerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// One delivered message and what the broker can do with it: the page of
/// code a broker adapter is.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::consumer::{BrokerError, Delivery};
///
/// /// A queue that is a `Vec`: enough to show the shape.
/// struct VecDelivery { body: Vec<u8>, attempt: u32, log: std::sync::Arc<std::sync::Mutex<Vec<String>>> }
///
/// #[async_trait::async_trait]
/// impl Delivery for VecDelivery {
///     fn payload(&self) -> Option<&[u8]> { Some(&self.body) }
///     fn attempt(&self) -> u32 { self.attempt }
///     async fn ack(self) -> Result<(), BrokerError> { self.log.lock().unwrap().push("ack".into()); Ok(()) }
///     async fn retry(self, after: Duration) -> Result<(), BrokerError> {
///         self.log.lock().unwrap().push(format!("retry in {after:?}")); Ok(())
///     }
///     async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
///         self.log.lock().unwrap().push(format!("defer {after:?}")); Ok(None)
///     }
///     async fn park(self, reason: &str) -> Result<(), BrokerError> {
///         self.log.lock().unwrap().push(format!("park: {reason}")); Ok(())
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait Delivery: Send + Sized {
    /// The message body (JSON of the handler's message type), or `None` when
    /// the message has no body this adapter recognises (it is parked).
    fn payload(&self) -> Option<&[u8]>;

    /// The counted delivery this is, from 1: failed attempts and crashes of a
    /// consumer holding it count, `InProgress` redeliveries do not. A crash
    /// must count even when no handler saw the message's verdict: the runner
    /// parks a delivery past `max_deliveries` without running the handler.
    fn attempt(&self) -> u32;

    /// The id the message was published under, when it carries one (the
    /// outbox's relay always sets it): what an [`Envelope`](super::Envelope)
    /// handler is keyed on.
    fn message_id(&self) -> Option<&str> {
        None
    }

    /// The outcome is recorded: remove the message for good.
    async fn ack(self) -> Result<(), BrokerError>;

    /// A counted failure: deliver it again, to any consumer, no sooner than
    /// `after` (never an immediate requeue, which turns a hot failure into a
    /// busy loop).
    async fn retry(self, after: Duration) -> Result<(), BrokerError>;

    /// `InProgress`: deliver it again no sooner than `after` without counting
    /// a failure. A broker that cannot delay a redelivery without counting it
    /// keeps the message instead, waits `after` (telling the broker it is still
    /// being worked on) and returns it, and the runner runs it again.
    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError>;

    /// Move it where an operator sees it (a dead-letter queue, a parking
    /// stream), with the reason, and remove it from the live queue.
    async fn park(self, reason: &str) -> Result<(), BrokerError>;
}

/// Where deliveries come from: a consumer in a group, a queue subscription.
#[async_trait::async_trait]
pub trait Source: Send {
    /// What this source hands out.
    type Delivery: Delivery;

    /// The next delivery, waiting for one.
    async fn next(&mut self) -> Result<Self::Delivery, BrokerError>;
}

/// Why a message was acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acked {
    /// The handler's body ran and its result was recorded.
    Processed,
    /// A recorded outcome was replayed: a duplicate or a redelivery.
    Deduplicated,
    /// The body ran and returned an error its `final_err` stores: recorded
    /// like a success, and replayed to duplicates.
    FinalError,
}

/// What the runner did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Acked after the outcome was recorded.
    Acked(Acked),
    /// A counted failure, redelivered after `after`.
    Retried {
        /// The backoff.
        after: Duration,
        /// The counted delivery that failed.
        attempt: u32,
    },
    /// `InProgress`: redelivered after `after`, not counted as a failure.
    Deferred {
        /// The delay.
        after: Duration,
    },
    /// Parked where an operator sees it.
    Parked {
        /// Why.
        reason: String,
    },
}
