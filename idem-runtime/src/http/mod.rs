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
//!   requires; `IdempotencyKey<AuthUser>` scopes it to the caller the
//!   application's own authenticating extractor verified (see `Caller`).
//!
//! A request that does not finish (a crash, a panic in the handler, a request
//! future dropped because the client went away) leaves its key PROCESSING
//! until the lease runs out; then a retry takes it over and runs the handler
//! again. A response the layer does not store released the key before it was
//! sent. The guide's [http](crate::guide::http) page has the details.
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
//!
//! # Limits of HTTP clients and hyper
//!
//! What the peers of [`IdempotencyLayer`] (clients, proxies, and hyper serving
//! it) send or answer at the edges, and what the layer makes of it. A row whose
//! test says `none yet` is not checked over a real connection.
//!
//! | limit or odd answer | what the peer does | what idem does | test |
//! |---|---|---|---|
//! | the key's length and characters | the IETF draft sends a structured-field string (quoted); Stripe takes up to 255 characters | 1 to 255 visible ASCII characters, quotes removed first; 256 is 400 | `tests/http_layer.rs::a_missing_or_malformed_key_is_400` (255 and 256) |
//! | several `Idempotency-Key` headers (a proxy that adds it again) | sends them all | equal ones (quoted or not) are one key; different ones are 400 | `tests/http_layer.rs::two_different_keys_on_one_request_are_400_and_two_equal_ones_are_one_key` |
//! | request head over hyper's HTTP/1 buffer (8 KiB + 100 × 4 KiB, checked between reads: a head that arrives in large reads may pass up to about twice that) or more than 100 headers | hyper answers 431 before any service runs | the layer never sees it: nothing is claimed, the key stays free | `tests/http_layer.rs::a_head_over_hypers_limits_is_431_and_claims_nothing` (100 and 101 headers; a head of 400 KiB and one of 1 MiB) |
//! | request body: `Content-Length` over `max_body_bytes`, or chunked | — | a declared length over the limit is 413 before reading (a client waiting on `Expect: 100-continue` is never asked for the body); a body without one is cut at the limit, 413; a body of exactly the limit runs | `tests/http_layer.rs::a_body_over_the_limit_is_413` (2 MiB on 1 MiB), `tests/http_layer.rs::a_body_without_a_length_is_cut_at_the_limit` (6 400 on 1 024), `tests/http_layer.rs::a_body_at_the_limit_is_taken_and_one_byte_more_is_413_with_or_without_a_length` (1 024 and 1 025 on 1 024, with `Content-Length` and chunked), `tests/http_layer.rs::expect_100_continue_over_the_limit_is_413_before_the_body_is_asked_for` (1 024 gets `100 Continue`, 1 025 gets 413 and is not asked for its body) |
//! | response header values that are not visible ASCII (`obs-text`, UTF-8 in `Location` or `Content-Disposition`) | HTTP carries them as opaque bytes | stored and replayed byte for byte: a UTF-8 value as text, other bytes in hex (as a binary body is); records written before still replay | `tests/http_layer.rs::response_header_values_are_replayed_byte_for_byte_ascii_or_not` (visible ASCII; UTF-8 and Latin-1 bytes) |
//! | response body of unknown length (a stream, server-sent events), over `max_response_bytes` (512 KiB), or whose stored form is over the store's cap (a binary body is stored in hex, twice its size) | — | sent at once, unrecorded, and the key released: a retry runs again | `tests/http_layer.rs::a_streaming_response_is_sent_at_once_and_does_not_hold_the_key`, `tests/http_layer.rs::a_response_over_the_default_cap_passes_through_and_releases_the_key`, `tests/http_layer.rs::the_stored_response_cap_is_configurable` (2 000 and 10 bytes on 1 024), `tests/http_layer.rs::a_binary_body_whose_hex_is_over_the_stores_cap_passes_through_and_releases_the_key` (1 024 bytes, about 2 130 stored, on store caps of 2 200 and 2 000) |
//! | the client goes away mid-request | hyper drops the service's future | the key stays PROCESSING until its lease runs out, then a retry runs | `tests/http_layer.rs::a_dropped_request_holds_the_key_until_its_lease_ends_then_a_retry_runs` |

mod key;
mod layer;
mod problem;
mod replayed;
mod service;
mod stored;

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "axum")]
mod extract;

pub use key::{KeyProblem, KeyRules};
pub use layer::IdempotencyLayer;
pub use problem::problem;
pub use replayed::{ReplayedHeaderLayer, ReplayedHeaderService};
pub use service::{IdempotencyService, ResponseFuture};

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::axum::ViaAxum;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::extract::{Caller, FromKeyCaller, IdempotencyKey, KeyCaller};

/// The request header that carries the client's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replayed response (Stripe's name).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

// The two as `HeaderName`s: a map looked up or written by a `&str` parses
// the name every time.
const IDEMPOTENCY_KEY_NAME: http::HeaderName = http::HeaderName::from_static(IDEMPOTENCY_KEY);
const IDEMPOTENT_REPLAYED_NAME: http::HeaderName =
    http::HeaderName::from_static(IDEMPOTENT_REPLAYED);
