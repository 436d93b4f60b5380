//! HTTP: the `Idempotency-Key` header for tower and hyper services and for
//! axum (features `http` and `axum`).
//!
//! - [`IdempotencyLayer`]: a tower layer that makes any service idempotent
//!   per `Idempotency-Key` header, after the IETF httpapi draft and Stripe's
//!   behaviour: it validates the key (several different ones are 400),
//!   scopes it to the caller, fingerprints the request (under axum with the
//!   path the client sent, before nesting stripped a prefix), sends the
//!   service's own first response untouched, stores it (status, the headers
//!   that describe the body, selected headers, body; never `Set-Cookie`) in
//!   any idem store and replays it with `Idempotent-Replayed: true`; 400, 409
//!   (with `Retry-After`), 413 and 422 answer in `application/problem+json`.
//!   Streams (server-sent events) and bodies over
//!   [`max_response_bytes`](IdempotencyLayer::max_response_bytes) are sent at
//!   once, unrecorded, and release the key.
//! - [`ReplayedHeaderLayer`]: adds `Idempotent-Replayed: true` to responses
//!   of handlers whose `#[idempotent]` call replayed.
//! - with `axum`: `#[idempotent]` handlers may return `Json<T>` and
//!   `(StatusCode, Json<T>)`; [`Error`](crate::Error) is `IntoResponse`; the
//!   `IdempotencyKey` extractor reads and validates the header and scopes it
//!   to the caller named by the `KeyCaller` set on the router, which it
//!   requires.
//!
//! A request that does not finish (a crash, a panic in the handler, a request
//! future dropped because the client went away) leaves its key PROCESSING
//! until the lease runs out; then a retry takes it over and runs the handler
//! again. A response the layer does not store released the key before it was
//! sent. The README's "HTTP" section has the details.
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
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::axum::{IdempotencyKey, KeyCaller, ViaAxum};

/// The request header that carries the client's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replayed response (Stripe's name).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

// The two as `HeaderName`s: a map looked up or written by a `&str` parses
// the name every time.
const IDEMPOTENCY_KEY_NAME: http::HeaderName = http::HeaderName::from_static(IDEMPOTENCY_KEY);
const IDEMPOTENT_REPLAYED_NAME: http::HeaderName =
    http::HeaderName::from_static(IDEMPOTENT_REPLAYED);
