//! `application/problem+json` answers (RFC 9457).

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

/// An `application/problem+json` response: `type` `about:blank`, `title` the
/// status's reason phrase, `detail` the explanation.
///
/// ```
/// use http::StatusCode;
/// let r = idem_runtime::http::problem(StatusCode::CONFLICT, "still running");
/// assert_eq!(r.headers()["content-type"], "application/problem+json");
/// ```
pub fn problem(status: StatusCode, detail: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut res = Response::new(Full::new(Bytes::from(body.to_string())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

/// The detail of the 400 for a request whose caller cannot be named.
pub(crate) const NO_CALLER: &str =
    "the request does not say who sends it, and idempotency keys are scoped to the caller";

/// `Retry-After` in whole seconds, rounded up, within `[min, max]`.
pub(crate) fn retry_after_secs(
    hint: std::time::Duration,
    min: std::time::Duration,
    max: std::time::Duration,
) -> u64 {
    let secs = hint.as_millis().div_ceil(1000) as u64;
    secs.clamp(
        min.as_secs().max(1),
        max.as_secs().max(min.as_secs()).max(1),
    )
}

/// What a 422 says was compared: the layer fingerprints the whole request,
/// the attribute only the fields its `fingerprint` names.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Compared {
    /// `IdempotencyLayer`: method, path and body.
    Request,
    /// `#[idempotent]` on a handler: its `fingerprint` fields.
    Fingerprint,
}

/// The answer to an idem error, as problem+json: 409 with `Retry-After` for a
/// call in progress, 422 for a key reused with another payload, 503 for a
/// store failure, 500 otherwise.
pub(crate) fn for_error(
    e: &crate::Error,
    compared: Compared,
    min: std::time::Duration,
    max: std::time::Duration,
) -> Response<Full<Bytes>> {
    use crate::Error;
    match e {
        Error::InProgress { retry_after, .. } => {
            let secs = retry_after_secs(*retry_after, min, max);
            let mut res = problem(
                StatusCode::CONFLICT,
                "a request with this idempotency key is still being processed; retry after the time in `Retry-After`",
            );
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            res
        }
        Error::KeyReuse { .. } => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            match compared {
                Compared::Request => {
                    "this idempotency key was already used with a different request (method, path or body); a new request needs a new key"
                }
                Compared::Fingerprint => {
                    "this idempotency key was already used with a different payload (the fields the endpoint compares differ); a new request needs a new key"
                }
            },
        ),
        Error::Store(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "the idempotency store is unavailable; the request was not processed, retry it with the same key",
        ),
        // The rest names scopes, sizes and types: for the logs, not the client.
        other => {
            tracing::error!(error = %other, "idempotent request failed");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the request's idempotency record could not be used",
            )
        }
    }
}
