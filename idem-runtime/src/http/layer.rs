//! The `Idempotency-Key` tower layer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
use crate::protocol::{self, Kind, Spec};
use crate::store::{AsStore, StoreRef};

use super::key::{KeyProblem, KeyRules};
use super::problem::{for_error, problem};
use super::stored::StoredResponse;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// What a [`IdempotencyLayer`] does; shared by its services.
struct Config {
    store: Option<StoreRef>,
    spec: Spec,
    methods: Vec<Method>,
    required: bool,
    rules: KeyRules,
    caller: Arc<CallerFn>,
    max_body: usize,
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
///    and never buffered past the limit), and the method, path (with query)
///    and body make the request's fingerprint;
/// 4. the first request with the key runs the service; its response (status,
///    the [headers kept](Self::store_headers), body) is stored if its status
///    is [one to store](Self::store_status) (2xx and 4xx except 408, 409 and
///    429 by default); any other status releases the key, so a retry runs;
/// 5. a retry gets the stored response again, byte for byte, with
///    `Idempotent-Replayed: true`; a retry with another fingerprint is 422; a
///    retry while the first request still runs is 409 with `Retry-After` (or
///    waits up to [`wait`](Self::wait) for its result).
///
/// Errors are `application/problem+json`. A store failure is 503 and the
/// request does not run.
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

/// By default every 2xx and 4xx is stored except 408 (the client may send it
/// again), 409 (a conflict that may clear) and 429 (rate limited); 5xx and
/// the rest release the key, so the retry runs.
fn default_stores(status: StatusCode) -> bool {
    (status.is_success() || status.is_client_error()) && !matches!(status.as_u16(), 408 | 409 | 429)
}

impl IdempotencyLayer {
    /// A layer with the defaults: the installed store ([`crate::install`]),
    /// scope `"http"`, POST and PATCH, key required, one caller for all
    /// requests, 1 MiB bodies, `Content-Type`, `Location`, `Content-Location`
    /// and `ETag` kept, ttl 24 h, lease 30 s, no waiting, `Retry-After`
    /// between 1 and 10 s.
    pub fn new() -> Self {
        IdempotencyLayer {
            config: Arc::new(Config {
                store: None,
                spec: Spec::new("http", Kind::Call),
                methods: vec![Method::POST, Method::PATCH],
                required: true,
                rules: KeyRules::default(),
                caller: Arc::new(|_| Some(String::new())),
                max_body: 1024 * 1024,
                keep_headers: vec![
                    header::CONTENT_TYPE,
                    header::LOCATION,
                    header::CONTENT_LOCATION,
                    header::ETAG,
                ],
                stores: Arc::new(default_stores),
                retry_min: Duration::from_secs(1),
                retry_max: Duration::from_secs(10),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        // Built once at start-up, before any service shares the config.
        let mut config = match Arc::try_unwrap(self.config) {
            Ok(c) => c,
            Err(shared) => Config {
                store: shared.store.clone(),
                spec: shared.spec,
                methods: shared.methods.clone(),
                required: shared.required,
                rules: shared.rules,
                caller: shared.caller.clone(),
                max_body: shared.max_body,
                keep_headers: shared.keep_headers.clone(),
                stores: shared.stores.clone(),
                retry_min: shared.retry_min,
                retry_max: shared.retry_max,
            },
        };
        f(&mut config);
        self.config = Arc::new(config);
        self
    }

    /// The store for the records (default: the one installed).
    pub fn store(self, store: impl AsStore) -> Self {
        let store = store.as_store();
        self.with(|c| c.store = Some(store))
    }

    /// The namespace of the keys; give each route or service its own.
    pub fn scope(self, scope: &'static str) -> Self {
        self.with(|c| c.spec.scope = scope)
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
    pub fn caller(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|c| c.caller = Arc::new(f))
    }

    /// The largest request body read (default 1 MiB); a larger one is 413.
    pub fn max_body_bytes(self, limit: usize) -> Self {
        self.with(|c| c.max_body = limit)
    }

    /// The response headers stored and replayed besides status and body.
    pub fn store_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names = names.into_iter().collect();
        self.with(|c| c.keep_headers = names)
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
enum Failure<E> {
    Idem(Error),
    /// A response not to store (a 5xx, a 429…): sent as it is, key released.
    Pass(Response<Full<Bytes>>),
    Inner(E),
}

impl<E> From<Error> for Failure<E> {
    fn from(e: Error) -> Self {
        Failure::Idem(e)
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
        return Ok(left(problem(
            StatusCode::BAD_REQUEST,
            "the request does not say who sends it, and idempotency keys are scoped to the caller",
        )));
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
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    let fingerprint = Fingerprint::builder()
        .part(parts.method.as_str())
        .part(path)
        .part(&hex::encode(Sha256::digest(&bytes)))
        .finish();

    let ran = AtomicBool::new(false);
    let body = async {
        ran.store(true, Ordering::Relaxed);
        let req = Request::from_parts(parts, ReqB::from(bytes));
        let res = inner.call(req).await.map_err(Failure::Inner)?;
        let (res_parts, res_body) = res.into_parts();
        let res_bytes = match res_body.collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                let e: BoxError = e.into();
                tracing::warn!(error = %e, "the response body failed; releasing the key");
                return Err(Failure::Pass(problem(
                    StatusCode::BAD_GATEWAY,
                    "the response could not be read; retry the request with the same key",
                )));
            }
        };
        if !(config.stores)(res_parts.status) {
            let res = Response::from_parts(res_parts, Full::new(res_bytes));
            return Err(Failure::Pass(res));
        }
        let stored = StoredResponse::new(
            res_parts.status,
            &res_parts.headers,
            &config.keep_headers,
            &res_bytes,
        );
        Ok(stored)
    };
    let out = protocol::execute::<StoredResponse, Failure<S::Error>, _>(
        &spec,
        config.store.clone(),
        key,
        Some(fingerprint),
        body,
    )
    .await;
    match out {
        Ok(stored) => {
            let mut res = stored.to_response();
            if !ran.load(Ordering::Relaxed) {
                res.headers_mut()
                    .insert(super::IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            }
            Ok(left(res))
        }
        Err(Failure::Pass(res)) => Ok(left(res)),
        Err(Failure::Inner(e)) => Err(e),
        Err(Failure::Idem(e)) => Ok(left(for_error(&e, config.retry_min, config.retry_max))),
    }
}
