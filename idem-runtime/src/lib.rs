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
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[derive(Debug)]
//! enum AppError { Idem(idem_runtime::Error), OutOfStock }
//! impl From<idem_runtime::Error> for AppError {
//!     fn from(e: idem_runtime::Error) -> Self { AppError::Idem(e) }
//! }
//!
//! struct CreateOrder { user_id: u64, sku: String, client_order_no: String }
//!
//! #[idempotent(key = "req.user_id|req.sku|req.client_order_no", ttl = "24h")]
//! async fn create_order(req: CreateOrder) -> Result<u64, AppError> {
//!     let ticket = reserve_stock(&req.sku).await?;
//!     Ok(ticket * 10)
//! }
//!
//! #[step("reserve_stock")]
//! async fn reserve_stock(sku: &str) -> Result<u64, AppError> {
//!     if sku.is_empty() { return Err(AppError::OutOfStock); }
//!     Ok(42)
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let req = || CreateOrder { user_id: 1, sku: "SKU-1".into(), client_order_no: "c-1".into() };
//! assert_eq!(create_order(req()).await.unwrap(), 420);
//! assert_eq!(create_order(req()).await.unwrap(), 420); // replayed
//! # });
//! ```
//!
//! See the README for the misuse checks, the stores and their guarantees.

#![warn(missing_docs)]
// docs.rs builds with `--cfg docsrs` and marks each gated item with its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod clock;
pub mod consumer;
mod error;
mod flow;
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
mod spec;
pub mod store;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod unique;

// Their documentation (options, durations, what they expand to) is on the
// macros themselves: rustdoc shows it here, and would put any doc comment on
// these lines in front of it.
pub use idem_macros::{KeyPart, idempotent, step};

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
