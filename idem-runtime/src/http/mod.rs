//! HTTP: the `Idempotency-Key` header for tower and hyper services and for
//! axum (features `tower` and `axum`).
//!
//! - [`IdempotencyLayer`]: a tower layer that makes any service idempotent
//!   per `Idempotency-Key` header, after the IETF httpapi draft and Stripe's
//!   behaviour: it validates the key, scopes it to the caller, fingerprints
//!   the request, stores the response (status, selected headers, body) in any
//!   idem store and replays it with `Idempotent-Replayed: true`; 400, 409 (with
//!   `Retry-After`), 413 and 422 answer in `application/problem+json`.
//! - [`ReplayedHeaderLayer`]: adds `Idempotent-Replayed: true` to responses
//!   of handlers whose `#[idempotent]` call replayed.
//! - with `axum`: `#[idempotent]` handlers may return `Json<T>` and
//!   `(StatusCode, Json<T>)`; [`Error`](crate::Error) is `IntoResponse`; the
//!   [`IdempotencyKey`] extractor reads and validates the header.
//!
//! ```
//! use axum::{Router, routing::post, Json};
//! use idem_runtime::http::IdempotencyLayer;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! async fn create(Json(order): Json<serde_json::Value>) -> Json<serde_json::Value> {
//!     Json(order)
//! }
//!
//! let app: Router = Router::new().route("/orders", post(create)).layer(
//!     IdempotencyLayer::new()
//!         .store(MemoryStore::new())
//!         .scope("orders.create")
//!         // Keys are scoped to the caller: tenant A's key never replays tenant B's response.
//!         .caller(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)),
//! );
//! ```

mod key;
mod layer;
mod problem;
mod replayed;
mod stored;

#[cfg(feature = "axum")]
mod axum;

pub use key::{KeyProblem, KeyRules};
pub use layer::{IdempotencyLayer, IdempotencyService, ResponseFuture};
pub use problem::problem;
pub use replayed::{ReplayedHeaderLayer, ReplayedHeaderService};

#[cfg(feature = "axum")]
pub use self::axum::{IdempotencyKey, ViaAxum};

/// The request header that carries the client's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replayed response (Stripe's name).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
