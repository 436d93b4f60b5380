//! Consumers: one runner that turns what an idempotent handler did into what
//! the broker does with the message, the same way for every broker.
//!
//! | what the handler's call did | broker action | counts toward `max_deliveries` |
//! |---|---|---|
//! | ran and recorded `Ok`, or a stored final error (`final_err`) | ack | — |
//! | replayed a recorded outcome (a duplicate) | ack | — |
//! | `InProgress`: another delivery of the same key is running | redeliver after `in_progress_delay` | no |
//! | a retryable `Err`, or the store could not claim or record | redeliver after a backoff; park at `max_deliveries` | yes |
//! | recorded or replayed `Ok`, then the handler returned `Err` | the same: what failed after the call is in no record | yes |
//! | the handler panicked | the same | yes |
//! | `KeyReuse`, a stored result that no longer decodes | park at once | — |
//! | the payload does not decode into the message type (or an [`Envelope`] handler's message carries no id) | park at once | — |
//! | nothing yet: the delivery's count is already past `max_deliveries` | park without running the handler | — |
//!
//! The ack is sent only after the store has recorded the outcome: "process,
//! then mark". Marking first would lose the message for good if the process
//! died in between; acking after means a crash redelivers it, and the record
//! turns the redelivery into a replay. An `Err` is acked only when the record
//! holds that very error.
//!
//! A delivery that ends without a verdict (the process crashed or was killed,
//! or the handler hung past the broker's redelivery timeout) still counts, so
//! a message that takes its consumer down every time reaches
//! `max_deliveries` and is parked before it can take the next one down.
//!
//! The runner learns what the annotated call did from the protocol itself
//! (the outcome it also counts in `idem_calls_total`), so the handler's error
//! type needs nothing beyond `Debug`: no trait to implement, no wrapper to
//! return. Write the handler as the attribute already wants it:
//!
//! ```
//! use idem_runtime::consumer::{Acked, Action, Runner, testing::Memory};
//! use idem_runtime::idempotent;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPaid { order_id: String }
//!
//! #[derive(Debug)]
//! enum SettleError { Idem(idem_runtime::Error) }
//! impl From<idem_runtime::Error> for SettleError {
//!     fn from(e: idem_runtime::Error) -> Self { SettleError::Idem(e) }
//! }
//!
//! #[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "doc.settle")]
//! async fn settle(e: OrderPaid) -> Result<(), SettleError> {
//!     Ok(()) // write the settlement
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let runner = Runner::new();
//! let msg = br#"{"order_id":"o-1"}"#;
//! let first = runner.process(Memory::new(msg), &settle).await.unwrap();
//! let again = runner.process(Memory::new(msg), &settle).await.unwrap();
//! assert_eq!(first, Action::Acked(Acked::Processed));
//! assert_eq!(again, Action::Acked(Acked::Deduplicated));
//! # });
//! ```
//!
//! Each broker is a [`Source`] of [`Delivery`]s: `redis_streams` (feature
//! `redis-streams`), `rabbitmq` (feature `rabbitmq`) and `jetstream` (feature
//! `jetstream`). Another broker needs only those two traits:
//!
//! ```
//! use std::time::Duration;
//! use idem_runtime::consumer::{BrokerError, Delivery, Source};
//! # mod my_broker {
//! #     use std::{io, time::Duration};
//! #     pub struct Message { body: Vec<u8>, deliveries: u32 }
//! #     impl Message {
//! #         pub fn body(&self) -> &[u8] { &self.body }
//! #         pub fn delivery_count(&self) -> u32 { self.deliveries }
//! #         pub async fn ack(self) -> io::Result<()> { Ok(()) }
//! #         pub async fn nack(self, _redeliver_after: Duration) -> io::Result<()> { Ok(()) }
//! #         pub async fn dead_letter(self, _reason: &str) -> io::Result<()> { Ok(()) }
//! #     }
//! #     pub struct Subscription;
//! #     impl Subscription {
//! #         pub async fn next(&mut self) -> io::Result<Message> {
//! #             Ok(Message { body: b"{}".to_vec(), deliveries: 1 })
//! #         }
//! #     }
//! # }
//!
//! struct MyDelivery { msg: my_broker::Message }
//!
//! #[async_trait::async_trait]
//! impl Delivery for MyDelivery {
//!     fn payload(&self) -> Option<&[u8]> { Some(self.msg.body()) }
//!     fn attempt(&self) -> u32 { self.msg.delivery_count() }   // counted deliveries, from 1
//!     async fn ack(self) -> Result<(), BrokerError> { self.msg.ack().await.map_err(|e| BrokerError::new("my", e)) }
//!     async fn retry(self, after: Duration) -> Result<(), BrokerError> {
//!         // redeliver no sooner than `after`, counted
//!         self.msg.nack(after).await.map_err(|e| BrokerError::new("my", e))
//!     }
//!     async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
//!         // the same without counting; or keep it: wait `after` and return Some(self)
//!         tokio::time::sleep(after).await;
//!         Ok(Some(self))
//!     }
//!     async fn park(self, reason: &str) -> Result<(), BrokerError> {
//!         // dead-letter with the reason, then ack
//!         self.msg.dead_letter(reason).await.map_err(|e| BrokerError::new("my", e))
//!     }
//! }
//!
//! struct MySource { sub: my_broker::Subscription }
//!
//! #[async_trait::async_trait]
//! impl Source for MySource {
//!     type Delivery = MyDelivery;
//!     async fn next(&mut self) -> Result<MyDelivery, BrokerError> {
//!         let msg = self.sub.next().await.map_err(|e| BrokerError::new("my", e))?;
//!         Ok(MyDelivery { msg })
//!     }
//! }
//! ```
//!
//! Each of the three also has what a test or an operator needs around the
//! runner: `publish_raw`, which publishes bytes as they are (a poison message
//! is bytes that do not decode), and `parked`, which reads parked messages
//! back as [`Parked`], with why.

#[cfg(feature = "jetstream")]
#[cfg_attr(docsrs, doc(cfg(feature = "jetstream")))]
pub mod jetstream;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;

mod delivery;
mod drive;
mod envelope;
mod parked;
mod runner;
pub mod testing;
#[cfg(test)]
mod tests;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
mod transaction;

pub use delivery::{Acked, Action, BrokerError, Delivery, Source};
pub use envelope::{Envelope, FromDelivery, MessageId};
pub use parked::Parked;
pub use runner::{Runner, Stats};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use transaction::TxError;

use crate::protocol::report;

/// Tells the runner that what the handler's annotated call recorded did not
/// last: the caller's transaction carrying the record (`tx = tx`) failed to
/// commit. The delivery then counts as a retryable failure instead of being
/// acked on a record that does not exist. `Runner::run_in_tx` (SQL features) does this
/// itself; only a handler that begins and commits its own transaction needs it
/// (and should ask `TxConnection::commit_refused` before its commit: a
/// PostgreSQL transaction aborted by a swallowed error "commits" with `Ok`).
///
/// ```
/// # struct Tx; impl Tx { async fn commit(self) -> Result<(), std::io::Error> { Ok(()) } }
/// # async fn handler(tx: Tx) -> Result<(), std::io::Error> {
/// // let mut tx = pool.begin().await?;
/// // settle(&mut tx, e).await?;   // #[idempotent(consumer, tx = tx, …)]
/// if let Err(e) = tx.commit().await {
///     idem_runtime::consumer::mark_rolled_back();
///     return Err(e);
/// }
/// # Ok(()) }
/// ```
pub fn mark_rolled_back() {
    report::rolled_back();
}
