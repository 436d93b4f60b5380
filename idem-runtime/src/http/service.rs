//! The service of the `Idempotency-Key` layer: what it does with one
//! request (read and validate the key, scope it to the caller, buffer the
//! body up to the limit, fingerprint it, run the protocol around the inner
//! service) and which responses it stores or passes through.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, Limited};
use sha2::{Digest, Sha256};
use tower_service::Service;

use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::protocol::{self, StoredForm};
use crate::store::Store as _;

use super::key::KeyProblem;
use super::layer::Config;
use super::problem::{Compared, NO_CALLER, for_error, problem};
use super::stored;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service of [`IdempotencyLayer`](super::IdempotencyLayer).
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(super) fn new(inner: S, config: Arc<Config>) -> Self {
        IdempotencyService { inner, config }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("scope", &self.config.spec.scope)
            .finish_non_exhaustive()
    }
}

/// The future of [`IdempotencyService`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<Either<Full<Bytes>, B>>, E>> + Send>>;

/// Why the protocol's body did not produce a response to store.
enum Failure<E, B> {
    Idem(Error),
    /// A response not to store (a 5xx, a stream, an over-limit body…): sent
    /// as it is, key released.
    // Boxed: a response is large, and the `Err` side is moved through the protocol.
    Pass(Box<Response<Either<Full<Bytes>, B>>>),
    Inner(E),
}

impl<E, B> From<Error> for Failure<E, B> {
    fn from(e: Error) -> Self {
        Failure::Idem(e)
    }
}

/// What the protocol hands back: on the first execution the service's own
/// response (sent as it is) beside its stored form; on a replay the stored
/// form alone.
enum Recorded {
    First {
        encoded: Vec<u8>,
        response: Response<Full<Bytes>>,
    },
    Replay(Response<Full<Bytes>>),
}

// Only a body's result is stored; a replay comes from a record.
fn not_stored_again() -> serde_json::Error {
    serde::ser::Error::custom("a replayed response is not stored again")
}

/// The [`StoredForm`] marker of [`Recorded`]: its record is the stored form
/// of `stored.rs`, as it was when the layer stored that directly.
enum ViaLayer {}

impl StoredForm<ViaLayer> for Recorded {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        match self {
            Recorded::First { encoded, .. } => Ok(encoded.clone()),
            Recorded::Replay(_) => Err(not_stored_again()),
        }
    }

    fn stored_bytes(&self) -> Result<Cow<'_, [u8]>, serde_json::Error> {
        match self {
            Recorded::First { encoded, .. } => Ok(Cow::Borrowed(encoded)),
            Recorded::Replay(_) => Err(not_stored_again()),
        }
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        stored::decode(bytes).map(Recorded::Replay)
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + From<Bytes> + Send + 'static,
    ReqB::Data: Send,
    ReqB::Error: Into<BoxError>,
    ResB: Body + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<Either<Full<Bytes>, ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = self.config.clone();
        if !config.methods.contains(req.method()) {
            let fut = self.inner.call(req);
            return Box::pin(async move { Ok(fut.await?.map(Either::Right)) });
        }
        // The service polled ready is the one that must take this call; the
        // clone stays for the next (tower's usual dance).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(handle(config, inner, req))
    }
}

fn left<B>(res: Response<Full<Bytes>>) -> Response<Either<Full<Bytes>, B>> {
    res.map(Either::Left)
}

/// Sends the service's response as it is and releases the key.
fn pass<E, B>(parts: http::response::Parts, body: B) -> Result<Recorded, Failure<E, B>> {
    let res = Response::from_parts(parts, Either::Right(body));
    Err(Failure::Pass(Box::new(res)))
}

/// The URI the client sent. A router nested under a prefix sees the path
/// without it; axum keeps the full one in `OriginalUri`, so one key sent to
/// `/eu/orders` and then to `/us/orders` is two requests, not a replay.
fn original_uri(parts: &Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<::axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

/// The request's fingerprint: method, path with query, and the body's
/// SHA-256 in lower-case hex (the form every stored record was written with).
/// The hex is written into a stack buffer: `hex::encode` builds its `String`
/// a `char` at a time, which cost more than the SHA-256 it encodes.
fn request_fingerprint(method: &Method, path: &str, body: &[u8]) -> Fingerprint {
    let mut digest_hex = [0u8; 64];
    hex::encode_to_slice(Sha256::digest(body), &mut digest_hex).expect("64 bytes hold 32 in hex");
    Fingerprint::builder()
        .part(method.as_str())
        .part(path)
        .part(std::str::from_utf8(&digest_hex).expect("hex is ASCII"))
        .finish()
}

async fn handle<S, ReqB, ResB>(
    config: Arc<Config>,
    mut inner: S,
    req: Request<ReqB>,
) -> Result<Response<Either<Full<Bytes>, ResB>>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body + From<Bytes> + Send + 'static,
    ReqB::Data: Send,
    ReqB::Error: Into<BoxError>,
    ResB: Body + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let idem_key = match config.rules.from_headers(&parts.headers) {
        Ok(k) => k,
        Err(KeyProblem::Missing) if !config.required => {
            let req = Request::from_parts(parts, body);
            return Ok(inner.call(req).await?.map(Either::Right));
        }
        Err(problem_) => {
            return Ok(left(problem(
                StatusCode::BAD_REQUEST,
                &problem_.to_string(),
            )));
        }
    };
    let Some(caller) = (config.caller)(&parts) else {
        return Ok(left(problem(StatusCode::BAD_REQUEST, NO_CALLER)));
    };
    let too_large = || {
        left(problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "the request body is over {} bytes, the most this endpoint accepts",
                config.max_body
            ),
        ))
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body as u64) {
        return Ok(too_large());
    }
    // `Limited` stops reading at the limit: a body without (or lying about)
    // its length is never buffered past it.
    let bytes = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return Ok(too_large()),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the request body");
            return Ok(left(problem(
                StatusCode::BAD_REQUEST,
                "the request body could not be read",
            )));
        }
    };

    let spec = config.spec;
    let key = Key::builder(spec.scope)
        .part(caller.as_str())
        .part(idem_key.as_str())
        .finish();
    let uri = original_uri(&parts);
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path(), |pq| pq.as_str());
    let fingerprint = request_fingerprint(&parts.method, path, &bytes);
    let store = config.store.clone().or_else(crate::install::default_store);
    // Without a store the protocol answers `NoStore` before the body runs.
    let store_cap = store.as_ref().map_or(usize::MAX, |s| s.max_result_bytes());

    let body = async {
        let req = Request::from_parts(parts, ReqB::from(bytes));
        let res = inner.call(req).await.map_err(Failure::Inner)?;
        let (res_parts, res_body) = res.into_parts();
        if !(config.stores)(res_parts.status) {
            return pass(res_parts, res_body);
        }
        // Only a body whose length is known up front is read before it is
        // sent: a stream (server-sent events) may never end, and waiting for
        // it would hold its first bytes back and keep the key PROCESSING for
        // as long as the heartbeat renews it.
        let length = res_body.size_hint().exact();
        if length.is_none_or(|n| n > config.max_response as u64) {
            tracing::warn!(
                status = res_parts.status.as_u16(),
                length,
                limit = config.max_response,
                "the response is a stream or over max_response_bytes: sent unrecorded, and the key is released"
            );
            return pass(res_parts, res_body);
        }
        // The limit again, for a body whose size hint undersells it.
        let res_bytes = match Limited::new(res_body, config.max_response).collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                tracing::warn!(error = %e, "the response body failed; releasing the key");
                return Err(Failure::Pass(Box::new(left(problem(
                    StatusCode::BAD_GATEWAY,
                    "the response could not be read; retry the request with the same key",
                )))));
            }
        };
        let encoded = stored::encode(
            res_parts.status,
            &res_parts.headers,
            &config.keep_headers,
            &res_bytes,
        );
        let response = Response::from_parts(res_parts, Full::new(res_bytes));
        if encoded.len() > store_cap {
            // Stored, it would leave a too-large marker that answers every
            // retry with 500: treat it as the over-limit body it is.
            tracing::warn!(
                size = encoded.len(),
                limit = store_cap,
                "the stored response would be over the store's cap: sent unrecorded, and the key is released"
            );
            return Err(Failure::Pass(Box::new(left(response))));
        }
        Ok(Recorded::First { encoded, response })
    };
    let out = protocol::execute::<Recorded, ViaLayer, Failure<S::Error, ResB>, _>(
        &spec,
        store,
        key,
        Some(fingerprint),
        body,
    )
    .await;
    match out {
        Ok(Recorded::First { response, .. }) => Ok(left(response)),
        Ok(Recorded::Replay(mut res)) => {
            res.headers_mut().insert(
                super::IDEMPOTENT_REPLAYED_NAME,
                HeaderValue::from_static("true"),
            );
            Ok(left(res))
        }
        Err(Failure::Pass(res)) => Ok(*res),
        Err(Failure::Inner(e)) => Err(e),
        Err(Failure::Idem(e)) => Ok(left(for_error(
            &e,
            Compared::Request,
            config.retry_min,
            config.retry_max,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records already stored hold fingerprints made with `hex::encode`'s
    /// `String`: a retry after an upgrade must still match them.
    #[test]
    fn the_fingerprint_is_the_one_stored_records_hold() {
        for body in [&b""[..], b"{\"sku\":\"A-1\",\"qty\":2}", &[0xff; 300]] {
            let before = Fingerprint::builder()
                .part("POST")
                .part("/orders?x=1")
                .part(&hex::encode(Sha256::digest(body)))
                .finish();
            assert_eq!(
                request_fingerprint(&Method::POST, "/orders?x=1", body),
                before
            );
        }
        assert_ne!(
            request_fingerprint(&Method::POST, "/orders", b"a"),
            request_fingerprint(&Method::POST, "/orders", b"b")
        );
    }
}
