//! The `Idempotency-Key` layer, over real loopback HTTP with a real client.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::routing::post;
use idem_runtime::http::{IdempotencyLayer, KeyRules};
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use tower::ServiceExt;

#[derive(Default)]
struct Counter {
    runs: AtomicUsize,
}

/// Echoes the body with a run number; `status`, `sleep_ms` and `pad` (that
/// many spaces after the JSON) in the query pick the answer, how long it
/// takes and how large it is; with `panic` it panics.
async fn handler(
    State(c): State<Arc<Counter>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
    body: String,
) -> (StatusCode, HeaderMap, String) {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    assert!(!q.contains_key("panic"), "the handler panics, as asked");
    if let Some(ms) = q.get("sleep_ms") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    let status = q.get("status").map_or(StatusCode::CREATED, |s| {
        s.parse::<u16>().unwrap().try_into().unwrap()
    });
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("location", format!("/things/{n}").parse().unwrap());
    headers.insert("x-not-kept", "1".parse().unwrap());
    let pad = " ".repeat(q.get("pad").map_or(0, |p| p.parse().unwrap()));
    (
        status,
        headers,
        format!(r#"{{"run":{n},"body":{body:?}}}{pad}"#),
    )
}

fn layer(store: StoreRef) -> IdempotencyLayer {
    IdempotencyLayer::new()
        .store(store)
        .scope("http_layer.things")
        .caller(|p| p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
        .max_body_bytes(64 * 1024)
}

async fn serve(layer: IdempotencyLayer) -> (String, Arc<Counter>) {
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route("/things", post(handler).get(handler).put(handler))
        .layer(layer)
        .with_state(counter.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/things"), counter)
}

fn key() -> String {
    format!("k-{}", rand_suffix())
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

async fn post_with(
    c: &reqwest::Client,
    url: &str,
    tenant: &str,
    key: Option<&str>,
    body: &str,
) -> reqwest::Response {
    let mut rb = c.post(url).header("x-tenant", tenant).body(body.to_owned());
    if let Some(k) = key {
        rb = rb.header("idempotency-key", k);
    }
    rb.send().await.unwrap()
}

fn is_problem(r: &reqwest::Response) -> bool {
    r.headers()["content-type"] == "application/problem+json"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_run_once_and_agree() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    let url = format!("{url}?sleep_ms=200");
    let calls = (0..50).map(|_| {
        let (c, url, k) = (c.clone(), url.clone(), k.clone());
        tokio::spawn(async move {
            let r = post_with(&c, &url, "t1", Some(&k), r#"{"a":1}"#).await;
            let status = r.status();
            let retry = r.headers().get("retry-after").cloned();
            (status, retry, r.bytes().await.unwrap())
        })
    });
    let results = futures_util::future::join_all(calls).await;
    assert_eq!(counter.runs.load(SeqCst), 1, "the handler ran once");
    let mut bodies = std::collections::HashSet::new();
    for r in results {
        let (status, retry, body) = r.unwrap();
        match status {
            StatusCode::CREATED => {
                bodies.insert(body);
            }
            StatusCode::CONFLICT => assert!(retry.is_some(), "409 without Retry-After"),
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(bodies.len(), 1, "every 2xx carries the same body");
}

#[tokio::test]
async fn a_replay_is_byte_identical_and_marked() {
    for store in [
        StoreRef::new(MemoryStore::new()),
        StoreRef::new(SqliteStore::in_memory().await.unwrap()),
    ] {
        let (url, counter) = serve(layer(store)).await;
        let c = reqwest::Client::new();
        let k = key();
        let first = post_with(&c, &url, "t1", Some(&k), "hello").await;
        assert_eq!(first.status(), StatusCode::CREATED);
        assert!(first.headers().get("idempotent-replayed").is_none());
        let first_loc = first.headers()["location"].clone();
        let first_body = first.bytes().await.unwrap();

        let again = post_with(&c, &url, "t1", Some(&k), "hello").await;
        assert_eq!(again.status(), StatusCode::CREATED);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(
            again.headers()["location"],
            first_loc,
            "kept headers replay"
        );
        assert_eq!(again.headers()["content-type"], "application/json");
        assert!(again.headers().get("x-not-kept").is_none());
        assert_eq!(again.bytes().await.unwrap(), first_body);
        assert_eq!(counter.runs.load(SeqCst), 1);
    }
}

#[tokio::test]
async fn the_same_key_with_another_payload_is_422() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    assert_eq!(post_with(&c, &url, "t1", Some(&k), "a").await.status(), 201);
    let other = post_with(&c, &url, "t1", Some(&k), "b").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&other));
    let detail = other.text().await.unwrap();
    assert!(detail.contains("method, path or body"), "{detail}");
    // Another path with the same key and body is another request too.
    let path = c
        .post(format!("{url}?x=1"))
        .header("x-tenant", "t1")
        .header("idempotency-key", &k)
        .body("a")
        .send()
        .await
        .unwrap();
    assert_eq!(path.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_400() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    for k in [None, Some("has space"), Some(&*"x".repeat(256)), Some("")] {
        let r = post_with(&c, &url, "t1", k, "a").await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{k:?}");
        assert!(is_problem(&r));
        let p: serde_json::Value = r.json().await.unwrap();
        assert_eq!(p["status"], 400);
    }
    // 255 visible characters is the longest default key; a quoted one is accepted.
    let long = "y".repeat(255);
    assert_eq!(
        post_with(&c, &url, "t1", Some(&long), "a").await.status(),
        201
    );
    assert_eq!(
        post_with(&c, &url, "t1", Some("\"quoted-1\""), "a")
            .await
            .status(),
        201
    );
    // A request with no caller cannot be scoped.
    let r = c
        .post(&url)
        .header("idempotency-key", "k")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(counter.runs.load(SeqCst), 2);
}

#[tokio::test]
async fn key_rules_are_configurable_and_the_key_can_be_optional() {
    let store = StoreRef::new(MemoryStore::new());
    let (url, counter) = serve(
        layer(store)
            .optional()
            .key_rules(KeyRules::new().min_len(8).max_len(10)),
    )
    .await;
    let c = reqwest::Client::new();
    assert_eq!(
        post_with(&c, &url, "t1", Some("short"), "a").await.status(),
        400
    );
    assert_eq!(
        post_with(&c, &url, "t1", Some("12345678901"), "a")
            .await
            .status(),
        400
    );
    assert_eq!(
        post_with(&c, &url, "t1", Some("12345678"), "a")
            .await
            .status(),
        201
    );
    // Optional: without the header the request runs, every time.
    assert_eq!(post_with(&c, &url, "t1", None, "a").await.status(), 201);
    assert_eq!(post_with(&c, &url, "t1", None, "a").await.status(), 201);
    assert_eq!(counter.runs.load(SeqCst), 3);
}

#[tokio::test]
async fn an_in_flight_duplicate_is_409_with_an_honest_retry_after() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    let slow = format!("{url}?sleep_ms=1500");
    let first = tokio::spawn({
        let (c, slow, k) = (c.clone(), slow.clone(), k.clone());
        async move { post_with(&c, &slow, "t1", Some(&k), "a").await.status() }
    });
    // Poll until the first one is running (no fixed sleep).
    while counter.runs.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dup = post_with(&c, &slow, "t1", Some(&k), "a").await;
    assert_eq!(dup.status(), StatusCode::CONFLICT);
    assert!(is_problem(&dup));
    let retry: u64 = dup.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Within the default bounds, and nowhere near the 30 s lease.
    assert!((1..=10).contains(&retry), "Retry-After: {retry}");
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn with_wait_a_duplicate_gets_the_first_response() {
    let (url, counter) =
        serve(layer(StoreRef::new(MemoryStore::new())).wait(Duration::from_secs(20))).await;
    let c = reqwest::Client::new();
    let k = key();
    let slow = format!("{url}?sleep_ms=300");
    let first = tokio::spawn({
        let (c, slow, k) = (c.clone(), slow.clone(), k.clone());
        async move {
            post_with(&c, &slow, "t1", Some(&k), "a")
                .await
                .bytes()
                .await
                .unwrap()
        }
    });
    while counter.runs.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dup = post_with(&c, &slow, "t1", Some(&k), "a").await;
    assert_eq!(dup.status(), StatusCode::CREATED);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(dup.bytes().await.unwrap(), first.await.unwrap());
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let big = "x".repeat(2 * 1024 * 1024);
    let r = post_with(&c, &url, "t1", Some(&key()), &big).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(is_problem(&r));
    assert_eq!(counter.runs.load(SeqCst), 0);
}

#[tokio::test]
async fn a_body_without_a_length_is_cut_at_the_limit() {
    // In process, around a plain tower service: the request declares no
    // `Content-Length`, so only the bounded read can refuse it.
    let svc = tower::service_fn(|req: axum::http::Request<axum::body::Body>| async move {
        let _ = req;
        Ok::<_, std::convert::Infallible>(axum::http::Response::new(axum::body::Body::empty()))
    });
    let svc = tower::Layer::layer(
        &IdempotencyLayer::new()
            .store(MemoryStore::new())
            .max_body_bytes(1024),
        svc,
    );
    let chunks = (0..64).map(|_| Ok::<_, std::io::Error>(vec![b'x'; 100]));
    let body = axum::body::Body::from_stream(futures_util::stream::iter(chunks));
    let req = axum::http::Request::post("/x")
        .header("idempotency-key", "k1")
        .body(body)
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn the_same_key_from_another_tenant_is_its_own_request() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    let a = post_with(&c, &url, "tenant-a", Some(&k), "same").await;
    let b = post_with(&c, &url, "tenant-b", Some(&k), "same").await;
    assert_eq!(
        (a.status(), b.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(b.headers().get("idempotent-replayed").is_none());
    assert_ne!(a.bytes().await.unwrap(), b.bytes().await.unwrap());
    assert_eq!(counter.runs.load(SeqCst), 2);
}

#[tokio::test]
async fn a_5xx_and_a_429_release_the_key_and_a_4xx_is_stored() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    let s500 = post_with(&c, &format!("{url}?status=500"), "t1", Some(&k), "a").await;
    assert_eq!(s500.status(), 500);
    let retry = post_with(&c, &format!("{url}?status=500"), "t1", Some(&k), "a").await;
    assert_eq!(retry.status(), 500);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(counter.runs.load(SeqCst), 2, "the retry ran");

    let k2 = key();
    let url429 = format!("{url}?status=429");
    assert_eq!(
        post_with(&c, &url429, "t1", Some(&k2), "a").await.status(),
        429
    );
    assert_eq!(
        post_with(&c, &url429, "t1", Some(&k2), "a").await.status(),
        429
    );
    assert_eq!(counter.runs.load(SeqCst), 4, "429 is not stored");

    let k3 = key();
    let url404 = format!("{url}?status=404");
    assert_eq!(
        post_with(&c, &url404, "t1", Some(&k3), "a").await.status(),
        404
    );
    let again = post_with(&c, &url404, "t1", Some(&k3), "a").await;
    assert_eq!(again.status(), 404);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(counter.runs.load(SeqCst), 5, "404 is stored");
}

#[tokio::test]
async fn stored_statuses_and_methods_are_configurable() {
    let (url, counter) = serve(
        layer(StoreRef::new(MemoryStore::new()))
            .store_status(|s| s.is_success())
            .methods([axum::http::Method::PUT]),
    )
    .await;
    let c = reqwest::Client::new();
    let k = key();
    // POST is no longer covered: it runs every time, even without a key.
    assert_eq!(c.post(&url).send().await.unwrap().status(), 201);
    let put = |u: String| {
        c.put(u)
            .header("x-tenant", "t1")
            .header("idempotency-key", &k)
            .send()
    };
    assert_eq!(
        put(format!("{url}?status=404")).await.unwrap().status(),
        404
    );
    assert_eq!(
        put(format!("{url}?status=404")).await.unwrap().status(),
        404
    );
    assert_eq!(counter.runs.load(SeqCst), 3, "404 is not stored here");
    // GET passes through untouched.
    assert_eq!(c.get(&url).send().await.unwrap().status(), 201);
}

/// Serves `app` on loopback; the base URL.
async fn serve_app(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// `{"ok":true}` gzipped (mtime 0), as a handler that encodes its own body sends it.
const GZIPPED: &[u8] = &[
    0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x03, 0xab, 0x56, 0xca, 0xcf, 0x56, 0xb2,
    0x2a, 0x29, 0x2a, 0x4d, 0xad, 0x05, 0x00, 0x90, 0x5f, 0xd4, 0xa7, 0x0b, 0x00, 0x00, 0x00,
];

/// A handler that answers with a session cookie, a request id and a gzip body.
async fn with_cookie_and_gzip(State(c): State<Arc<Counter>>) -> (StatusCode, HeaderMap, Vec<u8>) {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let mut h = HeaderMap::new();
    h.insert("content-type", "application/json".parse().unwrap());
    h.insert("content-encoding", "gzip".parse().unwrap());
    h.insert("vary", "accept-encoding".parse().unwrap());
    h.insert(
        "set-cookie",
        format!("session=s{n}; HttpOnly").parse().unwrap(),
    );
    h.insert("x-request-id", format!("req-{n}").parse().unwrap());
    (StatusCode::CREATED, h, GZIPPED.to_vec())
}

fn cookie_app(layer: IdempotencyLayer) -> (Router, Arc<Counter>) {
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route("/login", post(with_cookie_and_gzip))
        .layer(layer)
        .with_state(counter.clone());
    (app, counter)
}

#[tokio::test]
async fn the_first_response_is_the_handlers_own_and_a_replay_is_labelled_like_it() {
    let (app, counter) = cookie_app(layer(StoreRef::new(MemoryStore::new())));
    let url = format!("{}/login", serve_app(app).await);
    let c = reqwest::Client::new();
    let k = key();
    let first = post_with(&c, &url, "t1", Some(&k), "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let h = first.headers();
    assert_eq!(h["set-cookie"], "session=s1; HttpOnly", "{h:?}");
    assert_eq!(h["x-request-id"], "req-1", "{h:?}");
    assert_eq!(h["content-encoding"], "gzip", "{h:?}");
    assert_eq!(h["vary"], "accept-encoding", "{h:?}");
    assert_eq!(h["content-type"], "application/json");
    assert!(h.get("idempotent-replayed").is_none());
    assert_eq!(first.bytes().await.unwrap(), GZIPPED);

    let again = post_with(&c, &url, "t1", Some(&k), "{}").await;
    assert_eq!(again.status(), StatusCode::CREATED);
    let h = again.headers();
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(
        h["content-encoding"], "gzip",
        "a replay is labelled as encoded: {h:?}"
    );
    assert_eq!(h["vary"], "accept-encoding", "{h:?}");
    assert_eq!(h["content-type"], "application/json");
    assert!(
        h.get("set-cookie").is_none(),
        "a replay never sets a cookie: {h:?}"
    );
    assert_eq!(again.bytes().await.unwrap(), GZIPPED);
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn set_cookie_is_never_replayed_even_when_named_in_store_headers() {
    let (app, counter) = cookie_app(
        layer(StoreRef::new(MemoryStore::new()))
            .store_headers([axum::http::header::SET_COOKIE, axum::http::header::LOCATION]),
    );
    let url = format!("{}/login", serve_app(app).await);
    let c = reqwest::Client::new();
    let k = key();
    assert_eq!(
        post_with(&c, &url, "t1", Some(&k), "{}").await.status(),
        201
    );
    let again = post_with(&c, &url, "t1", Some(&k), "{}").await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(
        again.headers().get("set-cookie").is_none(),
        "{:?}",
        again.headers()
    );
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn the_same_key_on_two_nested_mounts_is_two_requests() {
    let counter = Arc::new(Counter::default());
    let orders = Router::new()
        .route("/orders", post(handler))
        .layer(layer(StoreRef::new(MemoryStore::new())))
        .with_state(counter.clone());
    let app = Router::new()
        .nest("/eu", orders.clone())
        .nest("/us", orders);
    let base = serve_app(app).await;
    let c = reqwest::Client::new();
    let k = key();
    let us = post_with(&c, &format!("{base}/us/orders"), "t1", Some(&k), "same").await;
    assert_eq!(us.status(), StatusCode::CREATED);
    let eu = post_with(&c, &format!("{base}/eu/orders"), "t1", Some(&k), "same").await;
    assert!(
        eu.headers().get("idempotent-replayed").is_none(),
        "/eu/orders replayed /us/orders' response"
    );
    assert_eq!(eu.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&eu));
    // Each mount still replays its own.
    let us_again = post_with(&c, &format!("{base}/us/orders"), "t1", Some(&k), "same").await;
    assert_eq!(us_again.headers()["idempotent-replayed"], "true");
    assert_eq!(counter.runs.load(SeqCst), 1);
}

/// Server-sent events: one event, then nothing, forever.
async fn one_event_then_silence(
    State(c): State<Arc<Counter>>,
) -> axum::response::sse::Sse<
    impl futures_util::Stream<Item = Result<axum::response::sse::Event, std::convert::Infallible>>,
> {
    use futures_util::StreamExt;
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let first = futures_util::stream::once(async move {
        Ok(axum::response::sse::Event::default().data(format!("run {n}")))
    });
    axum::response::sse::Sse::new(first.chain(futures_util::stream::pending()))
}

#[tokio::test]
async fn a_streaming_response_is_sent_at_once_and_does_not_hold_the_key() {
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route("/events", post(one_event_then_silence))
        .layer(layer(StoreRef::new(MemoryStore::new())).lease(Duration::from_secs(1)))
        .with_state(counter.clone());
    let url = format!("{}/events", serve_app(app).await);
    let c = reqwest::Client::new();
    let k = key();
    let first_chunk = |k: String| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let limit = Duration::from_secs(5);
            let mut r = tokio::time::timeout(limit, post_with(&c, &url, "t1", Some(&k), "{}"))
                .await
                .expect("no response within 5 s: the layer held the stream back");
            let status = r.status();
            let chunk = tokio::time::timeout(limit, r.chunk())
                .await
                .expect("no first chunk within 5 s")
                .unwrap();
            // The response stays open: the stream is still running.
            (status, chunk, r)
        }
    };
    let (status, chunk, _open) = first_chunk(k.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(chunk.unwrap(), "data: run 1\n\n");
    // Several leases later, the first stream still open: the key is not
    // PROCESSING (that would be a 409); the retry runs and streams too.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, chunk, _open2) = first_chunk(k).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(chunk.unwrap(), "data: run 2\n\n");
    assert_eq!(counter.runs.load(SeqCst), 2);
}

#[tokio::test]
async fn a_response_over_the_default_cap_passes_through_and_releases_the_key() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let k = key();
    // 2 MiB: over the default cap of a stored response.
    let url = format!("{url}?pad={}", 2 * 1024 * 1024);
    let first = post_with(&c, &url, "t1", Some(&k), "a").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.bytes().await.unwrap().len() > 2 * 1024 * 1024);
    let again = post_with(&c, &url, "t1", Some(&k), "a").await;
    assert_eq!(again.status(), StatusCode::CREATED, "{:?}", again.headers());
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert!(again.bytes().await.unwrap().len() > 2 * 1024 * 1024);
    assert_eq!(counter.runs.load(SeqCst), 2, "unrecorded, so the retry ran");
}

#[tokio::test]
async fn the_stored_response_cap_is_configurable() {
    let (url, counter) =
        serve(layer(StoreRef::new(MemoryStore::new())).max_response_bytes(1024)).await;
    let c = reqwest::Client::new();
    let (big, small) = (format!("{url}?pad=2000"), format!("{url}?pad=10"));
    let k = key();
    for _ in 0..2 {
        let r = post_with(&c, &big, "t1", Some(&k), "a").await;
        assert_eq!(r.status(), StatusCode::CREATED);
        assert!(r.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(counter.runs.load(SeqCst), 2, "over the cap: not stored");
    let k = key();
    assert_eq!(
        post_with(&c, &small, "t1", Some(&k), "a").await.status(),
        201
    );
    let again = post_with(&c, &small, "t1", Some(&k), "a").await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(counter.runs.load(SeqCst), 3);
}

/// Answers `n` bytes that are not UTF-8 (so stored in hex, twice their size).
fn binary_app(layer: IdempotencyLayer, n: usize) -> (Router, Arc<Counter>) {
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route(
            "/blob",
            post(move |State(c): State<Arc<Counter>>| async move {
                c.runs.fetch_add(1, SeqCst);
                let mut h = HeaderMap::new();
                h.insert("content-type", "application/octet-stream".parse().unwrap());
                (StatusCode::CREATED, h, vec![0xff_u8; n])
            }),
        )
        .layer(layer)
        .with_state(counter.clone());
    (app, counter)
}

#[tokio::test]
async fn a_binary_body_whose_hex_is_over_the_stores_cap_passes_through_and_releases_the_key() {
    // 1 024 bytes: at `max_response_bytes`, and under either store cap as
    // they are; in hex, with the record around them, about 2 130.
    for (store_cap, stored) in [(2_200, true), (2_000, false)] {
        let store = MemoryStore::builder().max_result_bytes(store_cap).build();
        let (app, counter) = binary_app(layer(StoreRef::new(store)).max_response_bytes(1024), 1024);
        let url = format!("{}/blob", serve_app(app).await);
        let c = reqwest::Client::new();
        let k = key();
        for _ in 0..2 {
            let r = post_with(&c, &url, "t1", Some(&k), "a").await;
            assert_eq!(r.status(), StatusCode::CREATED, "cap {store_cap}");
            assert_eq!(r.bytes().await.unwrap(), vec![0xff_u8; 1024]);
        }
        let again = post_with(&c, &url, "t1", Some(&k), "a").await;
        assert_eq!(again.status(), StatusCode::CREATED, "cap {store_cap}");
        assert_eq!(
            again.headers().get("idempotent-replayed").is_some(),
            stored,
            "cap {store_cap}: {:?}",
            again.headers()
        );
        let runs = if stored { 1 } else { 3 };
        assert_eq!(
            counter.runs.load(SeqCst),
            runs,
            "cap {store_cap}: unrecorded, each retry runs"
        );
    }
}

/// Answers `Location` and `Content-Disposition` with the run number in
/// them: visible ASCII, or (with `opaque` in the query) bytes of 0x80 and
/// above: UTF-8 in the path, a Latin-1 `é` (0xe9, not UTF-8) in the file name.
async fn with_opaque_headers(
    State(c): State<Arc<Counter>>,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> (StatusCode, HeaderMap, &'static str) {
    let n = c.runs.fetch_add(1, SeqCst) + 1;
    let (location, file) = if q.contains_key("opaque") {
        (
            format!("/files/caf\u{e9}-{n}").into_bytes(),
            [
                &b"attachment; filename=\"caf\xe9-"[..],
                n.to_string().as_bytes(),
                b".txt\"",
            ]
            .concat(),
        )
    } else {
        (
            format!("/files/cafe-{n}").into_bytes(),
            format!("attachment; filename=\"cafe-{n}.txt\"").into_bytes(),
        )
    };
    let mut h = HeaderMap::new();
    h.insert("location", HeaderValue::from_bytes(&location).unwrap());
    h.insert(
        "content-disposition",
        HeaderValue::from_bytes(&file).unwrap(),
    );
    (StatusCode::CREATED, h, "ok")
}

#[tokio::test]
async fn response_header_values_are_replayed_byte_for_byte_ascii_or_not() {
    use axum::http::header::{CONTENT_DISPOSITION, LOCATION};
    let counter = Arc::new(Counter::default());
    let app = Router::new()
        .route("/files", post(with_opaque_headers))
        .layer(
            layer(StoreRef::new(MemoryStore::new())).store_headers([LOCATION, CONTENT_DISPOSITION]),
        )
        .with_state(counter.clone());
    let base = format!("{}/files", serve_app(app).await);
    let c = reqwest::Client::new();
    for (query, runs) in [("", 1), ("?opaque", 2)] {
        let url = format!("{base}{query}");
        let k = key();
        let first = post_with(&c, &url, "t1", Some(&k), "a").await;
        assert_eq!(first.status(), StatusCode::CREATED);
        let again = post_with(&c, &url, "t1", Some(&k), "a").await;
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        for name in [LOCATION, CONTENT_DISPOSITION] {
            let sent = first.headers()[&name].as_bytes();
            assert_eq!(
                again.headers().get(&name).map(|v| v.as_bytes()),
                Some(sent),
                "{name} {query}: sent {:?}",
                String::from_utf8_lossy(sent)
            );
        }
        assert_eq!(counter.runs.load(SeqCst), runs, "{query}");
    }
}

/// The address `serve` listens on, from its URL.
fn addr_of(url: &str) -> &str {
    url.trim_start_matches("http://")
        .trim_end_matches("/things")
}

/// Reads one response head (up to its empty line) off a raw connection;
/// its lines, the status line first.
async fn read_head(r: &mut (impl tokio::io::AsyncBufRead + Unpin)) -> Vec<String> {
    use tokio::io::AsyncBufReadExt;
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        let n = tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut line))
            .await
            .expect("a response within 5 s")
            .unwrap();
        if n == 0 || line == "\r\n" {
            return lines;
        }
        lines.push(line.trim_end().to_owned());
    }
}

/// Sends `head` and `body` as they are on a fresh connection; the first
/// response's status line. The body is written from another task: a server
/// that stops reading (a head over its limit) answers meanwhile.
async fn raw_status(url: &str, head: String, body: &'static [u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let stream = tokio::net::TcpStream::connect(addr_of(url)).await.unwrap();
    let (r, mut w) = stream.into_split();
    let writing = tokio::spawn(async move {
        // The server may close first: what it answered is what counts.
        let _ = w.write_all(head.as_bytes()).await;
        let _ = w.write_all(body).await;
        w
    });
    let status = read_head(&mut tokio::io::BufReader::new(r)).await.remove(0);
    drop(writing.await);
    status
}

/// A head with `x-tenant`, `idempotency-key`, `content-length` and `host`
/// and `extra` headers more.
fn head_with(k: &str, extra: &[(String, String)]) -> String {
    let mut head = format!(
        "POST /things HTTP/1.1\r\nhost: x\r\nx-tenant: t1\r\nidempotency-key: {k}\r\ncontent-length: 1\r\n"
    );
    for (name, value) in extra {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head + "\r\n"
}

#[tokio::test]
async fn a_head_over_hypers_limits_is_431_and_claims_nothing() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let pads = |n: usize| -> Vec<(String, String)> {
        (0..n).map(|i| (format!("x-pad-{i}"), "1".into())).collect()
    };
    let big = |kib: usize| vec![("x-big".to_owned(), "b".repeat(kib * 1024))];
    // hyper's defaults: 100 headers (four of `head_with`'s own, and 96 or
    // 97 more), and a head buffer of 8 KiB + 100 × 4 KiB (408 KiB). A head
    // under it is always taken; the buffer is checked between reads, and one
    // read may fill up to twice that, so 1 MiB is surely over.
    let k = key();
    for extra in [pads(97), big(1024)] {
        let status = raw_status(&url, head_with(&k, &extra), b"a").await;
        assert!(status.starts_with("HTTP/1.1 431"), "{status}");
    }
    assert_eq!(counter.runs.load(SeqCst), 0);
    // Nothing was claimed: the key is free, not PROCESSING nor a replay.
    let c = reqwest::Client::new();
    let r = post_with(&c, &url, "t1", Some(&k), "a").await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(r.headers().get("idempotent-replayed").is_none());
    assert_eq!(counter.runs.load(SeqCst), 1);

    for extra in [pads(96), big(400)] {
        let status = raw_status(&url, head_with(&key(), &extra), b"a").await;
        assert!(status.starts_with("HTTP/1.1 201"), "{status}");
    }
    assert_eq!(counter.runs.load(SeqCst), 3);
}

#[tokio::test]
async fn a_body_at_the_limit_is_taken_and_one_byte_more_is_413_with_or_without_a_length() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new())).max_body_bytes(1024)).await;
    let c = reqwest::Client::new();
    let send = |n: usize, chunked: bool| {
        let body = if chunked {
            // A stream of its frames has no length: sent chunked, so only
            // the bounded read can refuse it.
            let frames = http_body_util::BodyStream::new(http_body_util::Full::new(
                axum::body::Bytes::from(vec![b'x'; n]),
            ));
            reqwest::Body::wrap(http_body_util::StreamBody::new(frames))
        } else {
            reqwest::Body::from(vec![b'x'; n])
        };
        c.post(&url)
            .header("x-tenant", "t1")
            .header("idempotency-key", key())
            .body(body)
            .send()
    };
    for chunked in [false, true] {
        let at = send(1024, chunked).await.unwrap();
        assert_eq!(at.status(), StatusCode::CREATED, "chunked: {chunked}");
        let over = send(1025, chunked).await.unwrap();
        assert_eq!(
            over.status(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "chunked: {chunked}"
        );
        assert!(is_problem(&over));
    }
    assert_eq!(
        counter.runs.load(SeqCst),
        2,
        "only the bodies at the limit ran"
    );
}

#[tokio::test]
async fn expect_100_continue_over_the_limit_is_413_before_the_body_is_asked_for() {
    use tokio::io::AsyncWriteExt;
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new())).max_body_bytes(1024)).await;
    for (length, status) in [(1024, "201"), (1025, "413")] {
        let stream = tokio::net::TcpStream::connect(addr_of(&url)).await.unwrap();
        let (r, mut w) = stream.into_split();
        let mut r = tokio::io::BufReader::new(r);
        let head = format!(
            "POST /things HTTP/1.1\r\nhost: x\r\nx-tenant: t1\r\nidempotency-key: {}\r\n\
             content-length: {length}\r\nexpect: 100-continue\r\n\r\n",
            key()
        );
        w.write_all(head.as_bytes()).await.unwrap();
        let mut answer = read_head(&mut r).await.remove(0);
        if answer.starts_with("HTTP/1.1 100") {
            // Asked for: the body is sent, and the answer follows it.
            w.write_all(&vec![b'x'; length]).await.unwrap();
            answer = read_head(&mut r).await.remove(0);
            assert_eq!(length, 1024, "the body over the limit was asked for");
        }
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{length}: {answer}"
        );
    }
    assert_eq!(
        counter.runs.load(SeqCst),
        1,
        "the body over the limit never ran"
    );
}

#[tokio::test]
async fn two_different_keys_on_one_request_are_400_and_two_equal_ones_are_one_key() {
    let (url, counter) = serve(layer(StoreRef::new(MemoryStore::new()))).await;
    let c = reqwest::Client::new();
    let two = |a: String, b: String| {
        c.post(&url)
            .header("x-tenant", "t1")
            .header("idempotency-key", a)
            .header("idempotency-key", b)
            .body("a")
            .send()
    };
    let (k1, k2) = (key(), format!("{}-other", key()));
    let r = two(k1.clone(), k2.clone()).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(is_problem(&r));
    assert_eq!(counter.runs.load(SeqCst), 0);

    // The same key twice (a proxy that adds it again) names one key; its
    // quoted form is the same key too.
    let r = two(k1.clone(), format!("\"{k1}\"")).await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let again = post_with(&c, &url, "t1", Some(&k1), "a").await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(counter.runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_dropped_request_holds_the_key_until_its_lease_ends_then_a_retry_runs() {
    let (url, counter) =
        serve(layer(StoreRef::new(MemoryStore::new())).lease(Duration::from_millis(1500))).await;
    let k = key();
    let slow = format!("{url}?sleep_ms=2500");
    // The client gives up and closes its connection; hyper drops the
    // request's future, handler and heartbeat with it.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let dropped = impatient
        .post(&slow)
        .header("x-tenant", "t1")
        .header("idempotency-key", &k)
        .body("a")
        .send()
        .await;
    assert!(dropped.unwrap_err().is_timeout());
    let c = reqwest::Client::new();
    let soon = post_with(&c, &slow, "t1", Some(&k), "a").await;
    assert_eq!(soon.status(), StatusCode::CONFLICT, "still PROCESSING");
    // Past the lease, before the dropped handler would have finished: had it
    // kept running, its heartbeat would still hold the key (409).
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let later = post_with(&c, &slow, "t1", Some(&k), "a").await;
    assert_eq!(
        later.status(),
        StatusCode::CREATED,
        "the lease ended: taken over"
    );
    assert!(later.headers().get("idempotent-replayed").is_none());
    assert_eq!(counter.runs.load(SeqCst), 2);
}

#[tokio::test]
async fn a_panicking_handler_holds_the_key_until_its_lease_ends() {
    let (url, counter) =
        serve(layer(StoreRef::new(MemoryStore::new())).lease(Duration::from_millis(1000))).await;
    let c = reqwest::Client::new();
    let k = key();
    let panics = format!("{url}?panic=1");
    // The panic ends the connection's task: no response at all.
    let r = c
        .post(&panics)
        .header("x-tenant", "t1")
        .header("idempotency-key", &k)
        .body("a")
        .send()
        .await;
    assert!(r.is_err(), "{r:?}");
    let soon = post_with(&c, &panics, "t1", Some(&k), "a").await;
    assert_eq!(soon.status(), StatusCode::CONFLICT, "still PROCESSING");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(
        c.post(&panics)
            .header("x-tenant", "t1")
            .header("idempotency-key", &k)
            .body("a")
            .send()
            .await
            .is_err(),
        "the lease ended: the retry ran the handler again"
    );
    assert_eq!(counter.runs.load(SeqCst), 2);
}

/// Steps under the layer: the handler's `#[step]` is recorded under the
/// layer's key, so a retry after a 5xx (which releases the key) replays the
/// step instead of running it again, and `current_key()` is the same key on
/// both runs; inside the step it is the step's own key.
mod steps_under_the_layer {
    use super::*;

    #[derive(Default)]
    struct Shop {
        reserved: AtomicUsize,
        attempts: AtomicUsize,
        keys: std::sync::Mutex<Vec<(String, String)>>,
    }

    #[derive(Debug)]
    struct StepError;
    impl From<idem_runtime::Error> for StepError {
        fn from(e: idem_runtime::Error) -> Self {
            panic!("idem failed inside the test's step: {e}")
        }
    }

    /// Reserves once per request; returns the key it saw inside the step.
    #[idem_runtime::step("reserve")]
    async fn reserve(shop: &Shop) -> Result<String, StepError> {
        shop.reserved.fetch_add(1, SeqCst);
        Ok(idem_runtime::current_key()
            .expect("inside the step")
            .to_hex())
    }

    /// Fails with 503 after the step on its first attempt.
    async fn checkout(State(shop): State<Arc<Shop>>) -> (StatusCode, String) {
        let outer = idem_runtime::current_key()
            .expect("the layer's call is running")
            .to_hex();
        let inner = reserve(&shop).await.unwrap();
        shop.keys.lock().unwrap().push((outer, inner));
        if shop.attempts.fetch_add(1, SeqCst) == 0 {
            return (StatusCode::SERVICE_UNAVAILABLE, "try again".into());
        }
        (StatusCode::CREATED, "ok".into())
    }

    #[tokio::test]
    async fn a_retry_after_a_5xx_replays_the_finished_step() {
        let shop = Arc::new(Shop::default());
        let app = Router::new()
            .route("/checkout", post(checkout))
            .layer(layer(StoreRef::new(MemoryStore::new())))
            .with_state(shop.clone());
        let base = serve_app(app).await;
        let c = reqwest::Client::new();
        let k = key();
        let send = || {
            c.post(format!("{base}/checkout"))
                .header("x-tenant", "t")
                .header("idempotency-key", &k)
                .send()
        };
        assert_eq!(
            send().await.unwrap().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(send().await.unwrap().status(), StatusCode::CREATED);
        assert_eq!(shop.attempts.load(SeqCst), 2, "the 503 released the key");
        assert_eq!(shop.reserved.load(SeqCst), 1, "the retry replayed the step");
        let keys = shop.keys.lock().unwrap().clone();
        assert_eq!(keys[0], keys[1], "the same keys on both runs");
        assert_ne!(keys[0].0, keys[0].1, "a step has a key of its own");
        // A third request is a replay of the stored 201: nothing runs.
        assert_eq!(send().await.unwrap().status(), StatusCode::CREATED);
        assert_eq!(shop.attempts.load(SeqCst), 2);
    }
}
