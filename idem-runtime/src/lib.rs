//! Idempotency for Rust services, written as attributes.
//!
//! Annotate a handler or a message consumer once. The expansion derives a
//! stable key from business fields, claims it in a store in two phases
//! (PROCESSING → DONE), replays the saved result to duplicates, resumes
//! multi-step flows from the step that failed, and refuses at compile time the
//! keys that can never deduplicate.
//!
//! ```
//! use idem_runtime::{idempotent, step};
//! # use std::sync::atomic::{AtomicU32, Ordering};
//! # #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
//! # struct Order { id: u64, sku: u64 }
//! # #[derive(serde::Serialize, serde::Deserialize)]
//! # struct StockTicket(u64);
//! # struct CreateOrder { user_id: u64, sku: u64, qty: u32, client_order_no: String }
//! # #[derive(serde::Deserialize)]
//! # struct OrderPaid { order_id: String }
//! # #[derive(Debug)]
//! # struct AppError(idem_runtime::Error);
//! # impl From<idem_runtime::Error> for AppError { fn from(e: idem_runtime::Error) -> Self { AppError(e) } }
//! # type SettleError = AppError;
//! # #[derive(Default)]
//! # struct Inventory { reserved: AtomicU32 }
//! # impl Inventory {
//! #     async fn reserve(&self, _sku: u64, qty: u32) -> Result<StockTicket, AppError> {
//! #         Ok(StockTicket(self.reserved.fetch_add(qty, Ordering::SeqCst).into()))
//! #     }
//! # }
//! # #[derive(Default)]
//! # struct Ledger;
//! # impl Ledger { async fn settle(&self, _e: &OrderPaid) -> Result<(), SettleError> { Ok(()) } }
//! # #[derive(Default)]
//! # struct Shop { inventory: Inventory, ledger: Ledger }
//! # impl Shop {
//!
//! #[idempotent(scope = "orders.create", key = "req.user_id|req.sku|req.client_order_no", ttl = "24h")]
//! async fn create_order(&self, req: CreateOrder) -> Result<Order, AppError> {
//!     let ticket = self.deduct_stock(req.sku, req.qty).await?; // a step
//!     let order = self.insert_order(&req, ticket).await?;        // a step
//!     self.issue_coupon(order.id).await?;                        // a step
//!     Ok(order)
//! }
//!
//! #[step("deduct_stock")]
//! async fn deduct_stock(&self, sku: u64, qty: u32) -> Result<StockTicket, AppError> {
//!     self.inventory.reserve(sku, qty).await
//! }
//!
//! #[idempotent(scope = "settlement.on_order_paid", consumer, event = "SETTLE", key = "e.order_id")]   // ttl defaults to 7d
//! async fn on_order_paid(&self, e: OrderPaid) -> Result<(), SettleError> {
//!     self.ledger.settle(&e).await
//! }
//! # #[step("insert_order")]
//! # async fn insert_order(&self, req: &CreateOrder, ticket: StockTicket) -> Result<Order, AppError> {
//! #     Ok(Order { id: ticket.0 + 1, sku: req.sku })
//! # }
//! # #[step("issue_coupon")]
//! # async fn issue_coupon(&self, _order_id: u64) -> Result<(), AppError> { Ok(()) }
//! # }
//!
//! use idem_runtime::store::memory::MemoryStore;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let shop = Shop::default();
//! let req = || CreateOrder { user_id: 1, sku: 42, qty: 2, client_order_no: "c-1".into() };
//! let order = shop.create_order(req()).await.unwrap();
//! assert_eq!(shop.create_order(req()).await.unwrap(), order); // replayed
//! assert_eq!(shop.inventory.reserved.load(Ordering::SeqCst), 2); // the stock moved once
//! # });
//! ```
//!
//! The [`guide`] holds the rest, one page per topic: steps and
//! compensation, recovery, transactions, the stores and what each
//! guarantees, HTTP, consumers, the outbox, locks and unique constraints,
//! proving your own handlers idempotent, and operating (CLI, metrics,
//! troubleshooting).

#![warn(missing_docs)]
// docs.rs builds with `--cfg docsrs` and marks each gated item with its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod abort;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod clock;
pub mod consumer;
mod error;
mod flow;
pub mod guide;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
mod install;
mod key;
#[cfg(any(feature = "redis", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "redis", feature = "postgres"))))]
pub mod lock;
mod observe;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod outbox;
pub mod protocol;
pub mod recovery;
// The store's and the Redis Streams sink's (an outbox sink: only with a
// database).
#[cfg(any(
    feature = "redis",
    all(
        feature = "redis-streams",
        any(feature = "sqlite", feature = "postgres", feature = "mysql")
    )
))]
mod redis_limits;
mod site;
mod spec;
pub mod store;
pub mod supervisor;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod unique;

// Their documentation (options, durations, what they expand to) is on the
// macros themselves: rustdoc shows it here, and would put any doc comment on
// these lines in front of it.
pub use idem_macros::{KeyPart, idempotent, recoverable, step};

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{CodecError, Error, StoreError};
pub use flow::{current_fence, current_key, lease_lost};
pub use install::{install, install_key_secret};
pub use key::{
    Fingerprint, FingerprintBuilder, Key, KeyBuilder, KeyEncoder, KeyParseError, KeyPart,
    KeySecret, KeySecretError, ShortKey,
};
pub use observe::CallOutcome;

/// What expansions of `#[idempotent]` and `#[step]` name. Not a public API:
/// it changes without notice.
#[doc(hidden)]
#[path = "private/mod.rs"]
pub mod __private;
