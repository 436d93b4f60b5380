//! When a failed attempt is worth another one, and how long to wait first.

use std::time::{Duration, SystemTime};

use http::{Method, StatusCode};
use reqwest::Response;

/// Attempts and delays; see [`IdempotencyMiddleware`](super::IdempotencyMiddleware).
#[derive(Debug, Clone, Copy)]
pub(super) struct Policy {
    pub(super) max_attempts: u32,
    pub(super) base_delay: Duration,
    pub(super) max_delay: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_attempts: 3,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(10),
        }
    }
}

impl Policy {
    /// How long to wait before retrying after `outcome`, the answer to the
    /// attempt that follows `retries` retries; `None` to hand `outcome` back.
    /// `keyed`: the request carries an `Idempotency-Key`, so a 409 (the
    /// server is still running the first request with that key) is worth
    /// another attempt.
    pub(super) fn wait(
        &self,
        retries: u32,
        outcome: &reqwest_middleware::Result<Response>,
        keyed: bool,
    ) -> Option<Duration> {
        let advertised = match outcome {
            Ok(response) if transient_status(response.status(), keyed) => retry_after(response),
            Err(e) if transient_error(e) => None,
            _ => return None,
        };
        let backoff = self.backoff(retries);
        match advertised {
            // Retrying sooner than the server asked only earns another refusal,
            // and waiting longer than `max_delay` is what the cap forbids: the
            // caller gets the response and decides.
            Some(after) if after > self.max_delay => None,
            // Never sooner than advertised, and never a tight loop on `Retry-After: 0`.
            Some(after) => Some(after.max(backoff)),
            None => Some(backoff),
        }
    }

    /// Exponential backoff with equal jitter: half of the doubling window
    /// (capped at `max_delay`) is always waited, the other half at random, so
    /// clients that failed together do not come back together.
    fn backoff(&self, retries: u32) -> Duration {
        let window = self
            .base_delay
            .saturating_mul(1u32 << retries.min(20))
            .min(self.max_delay);
        let half = window / 2;
        half + half.mul_f64(rand::random::<f64>())
    }
}

/// RFC 9110's idempotent methods: sending one twice has the effect of
/// sending it once, with or without a key.
pub(super) fn idempotent_method(method: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::PUT,
        Method::DELETE,
        Method::TRACE,
    ]
    .contains(method)
}

/// Answers that say "not now" rather than "no": a timeout, a rate limit, a
/// server or gateway that failed or is overloaded, and, to a keyed request,
/// a 409: the IETF Idempotency-Key draft's answer while a request with the
/// same key is still being processed (its first attempt, timed out here,
/// may still be running there). A keyless 409 is a real conflict.
fn transient_status(status: StatusCode, keyed: bool) -> bool {
    match status.as_u16() {
        408 | 429 | 500 | 502 | 503 | 504 => true,
        409 => keyed,
        _ => false,
    }
}

/// The request could not be sent (connect errors, a pooled connection closed
/// under it) or got no answer in time. Errors of other middleware, of the
/// request's own building, of redirects and of the body are not transient.
fn transient_error(e: &reqwest_middleware::Error) -> bool {
    match e {
        reqwest_middleware::Error::Reqwest(e) => e.is_connect() || e.is_timeout() || e.is_request(),
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

/// `Retry-After` in either of RFC 9110's forms: delay-seconds, or an
/// HTTP-date, read against this machine's clock (a date already past is a
/// wait of zero, so the backoff applies). A value in neither form is
/// ignored, as if the header were absent.
fn retry_after(response: &Response) -> Option<Duration> {
    let value = response.headers().get(http::header::RETRY_AFTER)?;
    let value = value.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, retry_after: Option<&str>) -> reqwest_middleware::Result<Response> {
        let mut builder = http::Response::builder().status(status);
        if let Some(after) = retry_after {
            builder = builder.header("retry-after", after);
        }
        Ok(Response::from(builder.body("").unwrap()))
    }

    const POLICY: Policy = Policy {
        max_attempts: 5,
        base_delay: Duration::from_millis(100),
        max_delay: Duration::from_secs(2),
    };

    #[test]
    fn backoff_doubles_within_a_jittered_window_up_to_the_cap() {
        for (retries, window) in [
            (0, 100),
            (1, 200),
            (2, 400),
            (4, 1600),
            (5, 2000),
            (40, 2000),
        ] {
            for _ in 0..50 {
                let d = POLICY.backoff(retries).as_millis();
                assert!(d >= window / 2 && d <= window, "retry {retries}: {d} ms");
            }
        }
    }

    #[test]
    fn only_transient_statuses_are_retried() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert!(
                POLICY.wait(0, &response(status, None), false).is_some(),
                "{status}"
            );
        }
        for status in [200, 201, 301, 400, 401, 403, 404, 409, 422, 501, 505] {
            assert_eq!(
                POLICY.wait(0, &response(status, None), false),
                None,
                "{status}"
            );
        }
    }

    #[test]
    fn a_409_is_retried_only_with_a_key() {
        assert!(POLICY.wait(0, &response(409, None), true).is_some());
        assert_eq!(POLICY.wait(0, &response(409, None), false), None);
        // The key changes nothing else: a 400 or a 422 is an answer.
        for status in [400, 422] {
            assert_eq!(POLICY.wait(0, &response(status, None), true), None);
        }
    }

    #[test]
    fn retry_after_in_seconds_is_waited_unless_it_is_past_the_cap() {
        assert_eq!(
            POLICY.wait(0, &response(503, Some("2")), false),
            Some(Duration::from_secs(2))
        );
        assert_eq!(POLICY.wait(0, &response(429, Some("3")), false), None);
        // Zero, a date already past or garbage: the backoff.
        for after in ["0", "Wed, 21 Oct 2015 07:28:00 GMT", "soon", "-5", "1.5"] {
            let d = POLICY.wait(0, &response(503, Some(after)), false).unwrap();
            assert!(
                d >= Duration::from_millis(50) && d <= Duration::from_millis(100),
                "{after}: {d:?}"
            );
        }
    }

    #[test]
    fn retry_after_as_an_http_date_is_waited_until_that_date() {
        // HTTP-dates have whole seconds: the date 2 s ahead, formatted, is
        // between 1 and 2 s away.
        let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(2));
        let d = POLICY.wait(0, &response(503, Some(&date)), false).unwrap();
        assert!(
            d > Duration::from_millis(900) && d <= Duration::from_secs(2),
            "{date}: {d:?}"
        );
        // Past the cap, it is the caller's.
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(60));
        assert_eq!(POLICY.wait(0, &response(503, Some(&later)), false), None);
    }

    #[test]
    fn only_rfc_9110_idempotent_methods_count_as_idempotent() {
        for m in ["GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"] {
            assert!(idempotent_method(&m.parse().unwrap()), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(!idempotent_method(&m.parse().unwrap()), "{m}");
        }
    }
}
