//! Outgoing calls that carry the key (feature `client`): a
//! [`reqwest_middleware`] middleware that sends each request with an
//! `Idempotency-Key` derived from the current idempotent call's key, and
//! retries transient failures with that same key.
//!
//! A retry of the whole call (after a crash, a release, a redelivery) derives
//! the same key again, so a payment provider that deduplicates by
//! `Idempotency-Key` charges once however often idem or this middleware
//! retries.
//!
//! - [`IdempotencyMiddleware`]: the middleware, its attempts and delays, and
//!   which requests it retries (a POST without a key never);
//! - [`KeyName`] and [`DeriveKey`]: the label a request's key is derived
//!   with (`current_key().derive(label)`);
//! - [`OutsideIdempotentCall`]: the error of a request that asked for a key
//!   outside any idempotent call, which is not sent.
//!
//! The README's "downstream keys" snippet is this example:
//!
//! ```no_run
//! use idem_runtime::client::{DeriveKey, IdempotencyMiddleware};
//! use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
//! # #[derive(Debug)] struct AppError;
//! # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
//! # impl From<reqwest_middleware::Error> for AppError { fn from(_: reqwest_middleware::Error) -> Self { AppError } }
//!
//! let psp: ClientWithMiddleware = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new().max_attempts(4))
//!     .build();
//!
//! #[idem_runtime::idempotent(key = "order_id")]
//! async fn pay(psp: &ClientWithMiddleware, order_id: u64) -> Result<u16, AppError> {
//!     // Idempotency-Key: current_key().derive("psp:charge").to_hex(), on every attempt
//!     let charge = psp.post("https://psp.example/charges").derive_key("psp:charge");
//!     Ok(charge.send().await?.status().as_u16())
//! }
//! ```

mod key;
mod middleware;
mod retry;

pub use key::{DeriveKey, KeyName, OutsideIdempotentCall};
pub use middleware::IdempotencyMiddleware;
