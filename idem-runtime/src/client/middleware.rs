//! The middleware: the key goes on first, then the same request is sent
//! until it gets an answer that is not transient or runs out of attempts.

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use super::key;
use super::retry::{Policy, idempotent_method};

/// A [`reqwest_middleware`] middleware that sends each request with the key
/// of the idempotent call it is made from, and retries transient failures
/// with that same key.
///
/// **The key.** A request with a [`KeyName`](super::KeyName) (set with
/// [`DeriveKey::derive_key`](super::DeriveKey::derive_key)) is sent with
/// `Idempotency-Key: current_key().derive(name).to_hex()`: inside a
/// `#[step]` the step's key, else the `#[idempotent]` call's. A request that
/// already has an `Idempotency-Key` header keeps it, name or not (never two
/// headers). A name outside any idempotent call is an error,
/// [`OutsideIdempotentCall`](super::OutsideIdempotentCall), and nothing is
/// sent: a keyless request is what the name was there to prevent.
///
/// **Retries.** An attempt that fails to connect, times out, loses its
/// connection before the answer, or is answered 408, 429, 500, 502, 503 or
/// 504 is sent again, up to [`max_attempts`](Self::max_attempts) in all,
/// after an exponential backoff with jitter (from
/// [`base_delay`](Self::base_delay), at most [`max_delay`](Self::max_delay)).
/// A keyed request answered 409 is sent again too: under the IETF
/// Idempotency-Key draft, 409 says a request with that key is still being
/// processed (typically the attempt this middleware gave up on). A server
/// that answers a keyed request 409 for a conflict of its own (a version
/// clash) is retried the same way, up to `max_attempts`, before the caller
/// gets the 409. A keyless 409 is a conflict and reaches the caller at once.
/// A `Retry-After`, in seconds or as an HTTP-date, is waited out in full; one
/// longer than `max_delay` is not retried, and the caller gets that response.
/// The last attempt's response or error is what the caller gets.
///
/// Only a request that is safe to repeat is retried:
///
/// - one with a key (derived or the caller's), whatever its method;
/// - one without a key whose method is idempotent: GET, HEAD, OPTIONS, PUT,
///   DELETE, TRACE.
///
/// A POST, PATCH or other method without a key is sent once, never again:
/// the server cannot tell a retry from a second order. A request whose body
/// cannot be cloned (a streaming body; [`reqwest::Request::try_clone`]
/// returns `None`) is sent once too.
///
/// The key is read from the task the request is sent from: a request sent
/// from a task spawned inside the body sees no current call. Do not also add
/// another retrying middleware, whose attempts would multiply with these.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::client::IdempotencyMiddleware;
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(
///         IdempotencyMiddleware::new()
///             .max_attempts(5)
///             .base_delay(Duration::from_millis(100))
///             .max_delay(Duration::from_secs(5)),
///     )
///     .build();
/// ```
#[derive(Debug, Clone, Default)]
pub struct IdempotencyMiddleware {
    policy: Policy,
}

impl IdempotencyMiddleware {
    /// Three attempts, 200 ms base delay, 10 s at most between two attempts.
    pub fn new() -> Self {
        IdempotencyMiddleware::default()
    }

    /// How many times a request may be sent in all, the first included
    /// (default 3). `1` sends every request once; `0` counts as `1`.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy.max_attempts = attempts.max(1);
        self
    }

    /// The backoff's first window (default 200 ms): the n-th retry waits
    /// between half and all of `base_delay × 2ⁿ⁻¹`, capped at `max_delay`.
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.policy.base_delay = delay;
        self
    }

    /// The longest wait between two attempts (default 10 s), and the longest
    /// `Retry-After` that is waited for rather than handed to the caller.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.policy.max_delay = delay;
        self
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let keyed =
            key::attach(&mut req, extensions).map_err(reqwest_middleware::Error::middleware)?;
        let repeatable = keyed || idempotent_method(req.method());
        let mut retries = 0;
        loop {
            // Cloned before sending: the attempt consumes the request. The
            // clone carries the key header, so every attempt has the same one.
            let spare = (repeatable && retries + 1 < self.policy.max_attempts)
                .then(|| req.try_clone())
                .flatten();
            let outcome = next.clone().run(req, extensions).await;
            let Some(spare) = spare else {
                return outcome;
            };
            let Some(wait) = self.policy.wait(retries, &outcome, keyed) else {
                return outcome;
            };
            // The status or the kind of error, not the error itself: its
            // message carries the URL, and a query string may hold a secret.
            let failed = match &outcome {
                Ok(response) => response.status().as_str().to_owned(),
                Err(e) if e.is_timeout() => "timeout".to_owned(),
                Err(e) if e.is_connect() => "connect".to_owned(),
                Err(_) => "send".to_owned(),
            };
            tracing::debug!(failed, ?wait, retries, "retrying with the same key");
            drop(outcome);
            tokio::time::sleep(wait).await;
            req = spare;
            retries += 1;
        }
    }
}
