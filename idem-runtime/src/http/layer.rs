//! The `Idempotency-Key` tower layer: [`IdempotencyLayer`] and its settings.
//! What its service does with a request is `service.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tower_layer::Layer;

use crate::protocol::{Kind, Spec};
use crate::store::{AsStore, StoreRef};

use super::key::KeyRules;
use super::service::IdempotencyService;

pub(super) type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
pub(super) type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// What a [`IdempotencyLayer`] does; shared by its services.
#[derive(Clone)]
pub(super) struct Config {
    pub(super) store: Option<StoreRef>,
    pub(super) spec: Spec,
    pub(super) methods: Vec<Method>,
    pub(super) required: bool,
    pub(super) rules: KeyRules,
    pub(super) caller: Arc<CallerFn>,
    pub(super) max_body: usize,
    pub(super) max_response: usize,
    pub(super) keep_headers: Vec<HeaderName>,
    pub(super) stores: Arc<StatusFn>,
    pub(super) retry_min: Duration,
    pub(super) retry_max: Duration,
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
        IdempotencyService::new(inner, self.config.clone())
    }
}
