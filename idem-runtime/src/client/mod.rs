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
//! The guide's [attribute](crate::guide::attribute) page shows it where it
//! introduces `current_key()`:
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
//!
//! # Limits of the servers called
//!
//! What a server that deduplicates by `Idempotency-Key` (a payment provider,
//! another service behind idem's own layer) answers at the edges, and what the
//! middleware makes of it. A row whose test says `none yet` is not checked over
//! a real connection.
//!
//! | limit or odd answer | what the server does | what idem does | test |
//! |---|---|---|---|
//! | the key's length and characters | Stripe takes up to 255 characters; the IETF draft, a structured-field string | sends 64 lower-case hex characters, the same on every attempt and every retry of the call; a key the caller set is kept alone | `tests/client.rs::a_post_is_retried_with_one_derived_key_and_a_replayed_call_sends_nothing`, `tests/client.rs::a_callers_own_key_is_kept_alone_and_retried_with` |
//! | a retry that meets the first attempt still running | 409 (the IETF draft, Stripe, idem's layer with `Retry-After`) | a keyed request's 409 is retried with the same key after its `Retry-After` (within `max_delay`), up to `max_attempts`; a keyless 409 is a conflict and reaches the caller. A server that stops the request its client left (idem's layer on plain hyper does) holds the key until its lease ends: the attempts may run out first, and the caller gets the last 409 | `tests/client.rs::a_keyed_409_is_retried_with_the_same_key_after_its_retry_after`, `tests/client.rs::a_keyed_409_on_every_attempt_reaches_the_caller_once_the_attempts_are_spent`, `tests/client.rs::a_keyless_409_is_a_conflict_and_is_not_retried`; against idem's own layer, served so that a request runs to its end when its client leaves: `tests/http_api.rs::a_caller_that_times_out_waits_out_the_409_and_gets_the_one_order` |
//! | the same key with another body | 422 (the IETF draft, idem's layer); Stripe answers 400 | not retried: the caller gets it | unit only: `idem-runtime/src/client/retry.rs::tests::only_transient_statuses_are_retried` |
//! | `Retry-After` | seconds or an HTTP date | either is waited in full (a date against this machine's clock; one already past gets the backoff), unless over `max_delay`: then the caller gets the answer | `tests/client.rs::retry_after_is_waited_out_in_full`, `tests/client.rs::a_retry_after_past_max_delay_is_handed_to_the_caller`, `tests/client.rs::retry_after_as_an_http_date_is_waited_until_that_date` |
//! | connection lost or timed out after the request was sent | may have acted on it | retried with the same key; without a key, only an idempotent method | `tests/client.rs::a_timeout_is_retried_with_the_same_key_but_not_without_one` |
//! | the server forgets a key (Stripe: after 24 hours) | the same key is then a new request | a call taken over (after a crash, once its lease ran out) sends the first run's key again, so the server deduplicates it only inside its window; taken over after that, it is charged again: keep the call's lease and recovery well inside the server's window | `tests/client.rs::a_call_taken_over_after_its_lease_sends_its_key_again` (the same key after a takeover; the window itself is the server's, not tested) |

mod key;
mod middleware;
mod retry;

pub use key::{DeriveKey, KeyName, OutsideIdempotentCall};
pub use middleware::IdempotencyMiddleware;
