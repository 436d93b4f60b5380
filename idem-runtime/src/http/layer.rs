//! The `Idempotency-Key` tower layer.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, Limited};
use sha2::{Digest, Sha256};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::protocol::{self, Kind, Spec, StoredForm};
use crate::store::{AsStore, Store as _, StoreRef};

use super::key::{KeyProblem, KeyRules};
use super::problem::{NO_CALLER, for_error, problem};
use super::stored;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// What a [`IdempotencyLayer`] does; shared by its services.
#[derive(Clone)]
struct Config {
    store: Option<StoreRef>,
    spec: Spec,
    methods: Vec<Method>,
    required: bool,
    rules: KeyRules,
    caller: Arc<CallerFn>,
    max_body: usize,
    max_response: usize,
    keep_headers: Vec<HeaderName>,
    stores: Arc<StatusFn>,
    retry_min: Duration,
    retry_max: Duration,
}

/// Makes a tower service idempotent per `Idempotency-Key` request header.
///
/// For a request whose method it applies to (POST and PATCH by default):
///
/// 1. the key is read and validated ([`KeyRules`]); a missing key is 400 when
///    the key is [required](Self::required) (the default), and passes the
///    request through untouched when it is [optional](Self::optional); a
///    malformed key is 400;
/// 2. the key is scoped to the caller, as [`caller`](Self::caller) names it
///    from the request parts (a tenant, an API key, a user), and to the
///    layer's [`scope`](Self::scope): the same key from another caller is
///    another request;
/// 3. the body is read up to [`max_body_bytes`](Self::max_body_bytes) (a
///    larger one is 413, refused from its `Content-Length` when it has one,
///    and never buffered past the limit), and the method, the path as the
///    client sent it (with query; under axum the [`OriginalUri`], so a router
///    nested at `/eu` and at `/us` sees two paths) and the body make the
///    request's fingerprint;
/// 4. the first request with the key runs the service, and gets the
///    service's own response: status, every header, body bytes;
/// 5. that response is stored if its status is [one to
///    store](Self::store_status) (2xx and 4xx except 408, 409 and 429 by
///    default) and its body's length is known before it is sent and at most
///    [`max_response_bytes`](Self::max_response_bytes); any other response
///    (a 5xx, a stream such as server-sent events, an over-limit body) is
///    sent at once as it is, unrecorded, and the key is released, so a
///    retry runs the service again;
/// 6. a retry gets the stored response again, byte for byte, with
///    `Idempotent-Replayed: true`: its status, the headers that say how to
///    read the body (`Content-Type`, `Content-Encoding`, `Vary`), the
///    [headers kept](Self::store_headers) and the body. A replay never carries
///    `Set-Cookie` (a session or token minted for the first exchange), nor
///    the connection's or exchange's own headers (`Connection`,
///    `Transfer-Encoding`, `Content-Length`, `Date`…), even when named. A
///    retry with another fingerprint is 422; a retry while the first request
///    still runs is 409 with `Retry-After` (or waits up to [`wait`](Self::wait)
///    for its result).
///
/// Errors are `application/problem+json`. A store failure is 503 and the
/// request does not run.
///
/// A handler that compresses its own body has the encoded bytes stored and
/// replayed with their `Content-Encoding`, whatever the retry's
/// `Accept-Encoding`; put a compression layer outside this one instead, so
/// each replay is encoded for its own client.
///
/// [`OriginalUri`]: https://docs.rs/axum/0.8/axum/extract/struct.OriginalUri.html
///
/// The wrapped service gets the buffered body back through `From<Bytes>`
/// (axum's `Body` and `Full<Bytes>` have it; wrap hyper's `Incoming` first,
/// e.g. with axum's `Body::new`).
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("scope", &self.config.spec.scope)
            .field("methods", &self.config.methods)
            .field("required", &self.config.required)
            .finish_non_exhaustive()
    }
}

/// Half the stores' default cap on a stored result (1 MiB): the stored form
/// escapes JSON text, so a text body at the limit still fits. (A binary body
/// is written in hex, twice its size; a stored form over the store's cap is
/// passed through like an over-limit body.)
const DEFAULT_MAX_RESPONSE: usize = 512 * 1024;

/// By default every 2xx and 4xx is stored except 408 (the client may send it
/// again), 409 (a conflict that may clear) and 429 (rate limited); 5xx and
/// the rest release the key, so the retry runs.
fn default_stores(status: StatusCode) -> bool {
    (status.is_success() || status.is_client_error()) && !matches!(status.as_u16(), 408 | 409 | 429)
}

impl IdempotencyLayer {
    /// A layer with the defaults: the installed store ([`crate::install`]),
    /// scope `"http"`, POST and PATCH, key required, one caller for all
    /// requests, 1 MiB request bodies, 512 KiB stored responses, `Location`,
    /// `Content-Location` and `ETag` kept besides the headers that describe
    /// the body, ttl 24 h, lease 30 s, no waiting, `Retry-After` between 1
    /// and 10 s.
    pub fn new() -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                store: None,
                spec: Spec::new("http", Kind::Call).with_shared_site(),
                methods: vec![Method::POST, Method::PATCH],
                required: true,
                rules: KeyRules::default(),
                caller: Arc::new(|_| Some(String::new())),
                max_body: 1024 * 1024,
                max_response: DEFAULT_MAX_RESPONSE,
                keep_headers: vec![header::LOCATION, header::CONTENT_LOCATION, header::ETAG],
                stores: Arc::new(default_stores),
                retry_min: Duration::from_secs(1),
                retry_max: Duration::from_secs(10),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        // Built once at start-up, before any service shares the config.
        let mut config = Arc::unwrap_or_clone(self.config);
        f(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// The store for the records (default: the one installed).
    pub fn store(self, store: impl AsStore) -> Self {
        let store = store.store_ref();
        self.with(|c| c.store = Some(store))
    }

    /// The namespace of the keys; give each route or service its own.
    pub fn scope(self, scope: &'static str) -> Self {
        // The scope's call site, found here rather than on every request:
        // its metric keys and its calls' average are then one load each.
        self.with(|c| {
            c.spec.scope = scope;
            c.spec = c.spec.with_shared_site();
        })
    }

    /// How long a response is kept for replays (default 24 h; Stripe keeps 24 h).
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.spec.ttl = ttl)
    }

    /// How long a running request's claim holds without a heartbeat (default 30 s).
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.spec.lease = lease)
    }

    /// A duplicate of a running request waits up to `wait` for its response
    /// instead of getting 409 at once.
    pub fn wait(self, wait: Duration) -> Self {
        self.with(|c| c.spec.wait = Some(wait))
    }

    /// The methods the layer applies to (default POST and PATCH); others pass
    /// through untouched.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.with(|c| c.methods = methods)
    }

    /// A request without the header is 400 (the default).
    pub fn required(self) -> Self {
        self.with(|c| c.required = true)
    }

    /// A request without the header passes through, not idempotent.
    pub fn optional(self) -> Self {
        self.with(|c| c.required = false)
    }

    /// What a valid key looks like (default: 1 to 255 visible ASCII characters).
    pub fn key_rules(self, rules: KeyRules) -> Self {
        self.with(|c| c.rules = rules)
    }

    /// Who the caller is, from the request parts: keys are scoped to it, so
    /// one caller's key never replays another's response. `None` answers 400
    /// (the caller cannot be told apart). Default: one caller for all.
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use idem_runtime::http::IdempotencyLayer;
    ///
    /// # async fn create_order() {}
    /// let app: Router = Router::new().route("/orders", post(create_order)).layer(
    ///     IdempotencyLayer::new()
    ///         .scope("orders.create")
    ///         .caller(|p| p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)),
    /// );
    /// ```
    pub fn caller(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|c| c.caller = Arc::new(f))
    }

    /// The largest request body read (default 1 MiB); a larger one is 413.
    pub fn max_body_bytes(self, limit: usize) -> Self {
        self.with(|c| c.max_body = limit)
    }

    /// The response headers stored and replayed besides status, body and the
    /// headers that describe the body (`Content-Type`, `Content-Encoding`,
    /// `Vary`, always stored). `Set-Cookie` and the connection's and
    /// exchange's own headers are never stored, even when named here.
    ///
    /// ```
    /// use http::header;
    /// use idem_runtime::http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new()
    ///     .store_headers([header::LOCATION, header::ETAG, header::CACHE_CONTROL]);
    /// ```
    pub fn store_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.with(|c| c.keep_headers = names)
    }

    /// The largest response body stored for replays (default 512 KiB).
    ///
    /// Only a body whose length is known before it is sent (axum's `Json`,
    /// `String`, `Bytes`…) is read and stored. A larger one, and any body
    /// without a known length (server-sent events, a stream, a body
    /// compressed by a layer inside this one), is sent at once as it is,
    /// unrecorded, and releases the key: the layer never holds a response
    /// back, and such a request is not made idempotent (a retry runs again).
    ///
    /// ```
    /// use idem_runtime::http::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new().max_response_bytes(64 * 1024);
    /// ```
    pub fn max_response_bytes(self, limit: usize) -> Self {
        self.with(|c| c.max_response = limit)
    }

    /// Which statuses are stored and replayed; the others release the key so
    /// a retry runs again.
    pub fn store_status(self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.with(|c| c.stores = Arc::new(f))
    }

    /// Bounds of `Retry-After` on a 409 (default 1 to 10 s). Within them the
    /// value is when the running request is likely done, from how long such
    /// requests took (see [`crate::Error::InProgress`]).
    pub fn retry_after_bounds(self, min: Duration, max: Duration) -> Self {
        self.with(|c| {
            c.retry_min = min;
            c.retry_max = max;
        })
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service of [`IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
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
        Err(Failure::Idem(e)) => Ok(left(for_error(&e, config.retry_min, config.retry_max))),
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
