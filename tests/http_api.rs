//! `examples/http_api/http_api.rs` over real loopback HTTP with reqwest: the contract
//! the example documents.

#[path = "../examples/http_api/http_api.rs"]
mod http_api;

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use http_api::{App, AppError, Order, Payment, fake_psp, router};
use idem_runtime::client::{DeriveKey, IdempotencyMiddleware};
use idem_runtime::idempotent;
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use reqwest::StatusCode;
use reqwest_middleware::ClientBuilder;
use serde_json::json;

async fn serve(work: Duration) -> String {
    let store = SqliteStore::in_memory().await.unwrap();
    let app = App::new(StoreRef::new(store), work, fake_psp().await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(app)).await.unwrap() });
    format!("http://{addr}")
}

fn order_body() -> serde_json::Value {
    json!({"user_id": 1, "sku": "A-1", "qty": 2})
}

async fn post_order(
    c: &reqwest::Client,
    base: &str,
    key: Option<&str>,
    tenant: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    let mut rb = c
        .post(format!("{base}/orders"))
        .header("x-tenant", tenant)
        .json(body);
    if let Some(k) = key {
        rb = rb.header("idempotency-key", k);
    }
    rb.send().await.unwrap()
}

async fn orders(c: &reqwest::Client, base: &str) -> Vec<Order> {
    let r = c.get(format!("{base}/orders")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicate_posts_create_one_order() {
    let base = serve(Duration::from_millis(300)).await;
    let c = reqwest::Client::new();
    let calls = (0..50).map(|_| {
        let (c, base) = (c.clone(), base.clone());
        tokio::spawn(async move {
            let r = post_order(&c, &base, Some("dup-50"), "acme", &order_body()).await;
            (r.status(), r.bytes().await.unwrap())
        })
    });
    let results = futures_util::future::join_all(calls).await;
    let mut ok_bodies = std::collections::HashSet::new();
    for r in results {
        let (status, body) = r.unwrap();
        if status.is_success() {
            assert_eq!(status, StatusCode::CREATED);
            ok_bodies.insert(body);
        } else {
            assert_eq!(
                status,
                StatusCode::CONFLICT,
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
    }
    assert_eq!(ok_bodies.len(), 1, "every 2xx carries the same body");
    assert_eq!(orders(&c, &base).await.len(), 1, "one order");
}

#[tokio::test]
async fn a_replay_after_completion_is_byte_identical_and_marked() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    let first = post_order(&c, &base, Some("k-1"), "acme", &order_body()).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = first.bytes().await.unwrap();
    let order: Order = serde_json::from_slice(&first).unwrap();
    assert_eq!(
        (order.user_id, order.sku.as_str(), order.qty),
        (1, "A-1", 2)
    );

    let again = post_order(&c, &base, Some("k-1"), "acme", &order_body()).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first);
    assert_eq!(orders(&c, &base).await, vec![order]);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    assert_eq!(
        post_order(&c, &base, Some("k-2"), "acme", &order_body())
            .await
            .status(),
        201
    );
    let other = json!({"user_id": 1, "sku": "A-1", "qty": 3});
    let r = post_order(&c, &base, Some("k-2"), "acme", &other).await;
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert_eq!(orders(&c, &base).await.len(), 1);
}

#[tokio::test]
async fn a_missing_key_is_400() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    let r = post_order(&c, &base, None, "acme", &order_body()).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert!(orders(&c, &base).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_duplicate_is_409_with_retry_after() {
    let base = serve(Duration::from_secs(2)).await;
    let c = reqwest::Client::new();
    let first = tokio::spawn({
        let (c, base) = (c.clone(), base.clone());
        async move { post_order(&c, &base, Some("k-3"), "acme", &order_body()).await }
    });
    // Until one request holds the key while another asks (no fixed sleep):
    // the asker gets 409. On a loaded machine the spawned request can start
    // after the loop's first one, which then runs the work itself; then the
    // spawned one is the duplicate.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let (dup, owner) = loop {
        let r = post_order(&c, &base, Some("k-3"), "acme", &order_body()).await;
        if r.status() == StatusCode::CONFLICT {
            break (r, first.await.unwrap().status());
        }
        if r.status() == StatusCode::CREATED && !r.headers().contains_key("idempotent-replayed") {
            break (first.await.unwrap(), r.status());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no request was ever in flight beside another: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(dup.status(), StatusCode::CONFLICT);
    assert_eq!(dup.headers()["content-type"], "application/problem+json");
    let retry: u64 = dup.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1..30).contains(&retry),
        "Retry-After {retry} is a hint, not the lease"
    );
    assert_eq!(owner, StatusCode::CREATED);
    assert_eq!(orders(&c, &base).await.len(), 1);
}

#[tokio::test]
async fn a_two_mib_body_is_413() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    let big = json!({"user_id": 1, "sku": "x".repeat(2 * 1024 * 1024), "qty": 2});
    let r = post_order(&c, &base, Some("k-4"), "acme", &big).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert!(orders(&c, &base).await.is_empty());
}

#[tokio::test]
async fn the_same_key_from_another_tenant_creates_its_own_order() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    let a = post_order(&c, &base, Some("k-5"), "acme", &order_body()).await;
    let b = post_order(&c, &base, Some("k-5"), "globex", &order_body()).await;
    assert_eq!(
        (a.status(), b.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(b.headers().get("idempotent-replayed").is_none());
    let (a, b): (Order, Order) = (a.json().await.unwrap(), b.json().await.unwrap());
    assert_ne!(a.id, b.id);
    assert_eq!((a.tenant.as_str(), b.tenant.as_str()), ("acme", "globex"));
    assert_eq!(orders(&c, &base).await.len(), 2);
}

#[tokio::test]
async fn the_business_key_route_replays_with_the_attribute() {
    let base = serve(Duration::ZERO).await;
    let c = reqwest::Client::new();
    let put = |body: serde_json::Value| {
        c.put(format!("{base}/users/1/orders/n-77"))
            .json(&body)
            .send()
    };
    let first = put(order_body()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Order = first.json().await.unwrap();

    let again = put(order_body()).await.unwrap();
    assert_eq!(
        again.status(),
        StatusCode::CREATED,
        "the stored status replays too"
    );
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Order>().await.unwrap(), first);

    // The whole body is the fingerprint: the same order number with another body.
    let other = put(json!({"user_id": 1, "sku": "A-1", "qty": 9}))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.headers()["content-type"], "application/problem+json");
    assert_eq!(orders(&c, &base).await.len(), 1);
}

/// `POST /payments`: two steps and a provider call through the middleware.
/// The provider fails each new charge once with 503: the middleware retries
/// it with the same derived key, so one charge is made from two requests; a
/// client retry of the payment replays it (`Location` included) and reaches
/// neither the steps nor the provider; another amount under the key is 422.
#[tokio::test]
async fn a_payment_charges_once_through_the_middlewares_retry_and_replays() {
    let store = SqliteStore::in_memory().await.unwrap();
    let psp = fake_psp().await;
    let app = App::new(StoreRef::new(store), Duration::ZERO, psp.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn({
        let app = app.clone();
        async move { axum::serve(listener, router(app)).await.unwrap() }
    });
    let c = reqwest::Client::new();
    let pay = |amount: u64| {
        c.post(format!("{base}/payments"))
            .header("x-tenant", "acme")
            .header("idempotency-key", "pay-1")
            .json(&json!({"order_id": 7, "amount_cents": amount, "currency": "EUR"}))
            .send()
    };
    let charges = || async {
        let r = c.get(format!("{psp}/charges/count")).send().await.unwrap();
        r.json::<serde_json::Value>().await.unwrap()
    };

    let first = pay(1250).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let payment: Payment = first.json().await.unwrap();
    assert_eq!(location, format!("/payments/{}", payment.id));
    assert_eq!(charges().await, json!({"charges": 1, "requests": 2}));

    let again = pay(1250).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["location"].to_str().unwrap(), location);
    assert_eq!(again.json::<Payment>().await.unwrap(), payment);
    assert_eq!(charges().await, json!({"charges": 1, "requests": 2}));
    assert_eq!(app.holds.load(std::sync::atomic::Ordering::SeqCst), 1);

    let other = pay(9999).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(charges().await, json!({"charges": 1, "requests": 2}));
}

/// One request as the service answered it: its key, status and whether it
/// was a replay.
type Answered = (String, StatusCode, bool);

/// Serves the example with each request run to its end in a task of its own,
/// as behind a proxy that keeps the upstream request when its client goes
/// away (hyper alone drops a request whose client left); records what each
/// request with an `Idempotency-Key` was answered, in the order the answers
/// were made.
async fn serve_to_the_end(work: Duration) -> (String, Arc<Mutex<Vec<Answered>>>) {
    let store = SqliteStore::in_memory().await.unwrap();
    let app = App::new(StoreRef::new(store), work, fake_psp().await);
    let answered = Arc::new(Mutex::new(Vec::new()));
    let log = answered.clone();
    let to_the_end = axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let log = log.clone();
            async move {
                let Some(key) = req.headers().get("idempotency-key") else {
                    return next.run(req).await;
                };
                let key = key.to_str().unwrap().to_owned();
                // Logged by the task: the answer to a client that left is
                // made all the same.
                tokio::spawn(async move {
                    let res = next.run(req).await;
                    let replayed = res.headers().contains_key("idempotent-replayed");
                    log.lock().unwrap().push((key, res.status(), replayed));
                    res
                })
                .await
                .unwrap()
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(app).layer(to_the_end);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), answered)
}

/// The callers' own store, for their `#[idempotent]` calls.
static CALLER_STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);

/// Orders through the middleware from an idempotent call: the order's key
/// is derived from the call's, each attempt given `timeout`; the status and
/// order the caller ends with.
#[idempotent(key = "order_no", store = &*CALLER_STORE)]
async fn order_through_the_middleware(
    base: &str,
    timeout: Duration,
    order_no: u64,
) -> Result<(u16, Option<Order>), AppError> {
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new()
                .max_attempts(4)
                .base_delay(Duration::from_millis(50)),
        )
        .build();
    let answer = client
        .post(format!("{base}/orders"))
        .header("x-tenant", "acme")
        .derive_key("orders:create")
        .timeout(timeout)
        .json(&order_body())
        .send()
        .await?;
    let status = answer.status().as_u16();
    Ok((status, answer.json().await.ok()))
}

/// The caller gives up on its first attempt while the service still works
/// on it; the retry, with the same key, meets 409 and its `Retry-After`, and
/// the one after that the first attempt's 201, replayed. One order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_times_out_waits_out_the_409_and_gets_the_one_order() {
    let (base, answered) = serve_to_the_end(Duration::from_millis(800)).await;
    let c = reqwest::Client::new();

    // Under: the attempt outlasts the work, one request.
    let (status, order) = order_through_the_middleware(&base, Duration::from_secs(5), 1)
        .await
        .unwrap();
    assert_eq!(status, 201);
    let seen = std::mem::take(&mut *answered.lock().unwrap());
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!((seen[0].1, seen[0].2), (StatusCode::CREATED, false));
    assert_eq!(orders(&c, &base).await, vec![order.unwrap()]);

    // Over: the first attempt times out at 300 ms and runs on to 800 ms.
    let (status, order) = order_through_the_middleware(&base, Duration::from_millis(300), 2)
        .await
        .unwrap();
    let seen = answered.lock().unwrap().clone();
    assert_eq!(status, 201, "{seen:?}");
    assert!(
        seen.iter().all(|(k, ..)| *k == seen[0].0 && k.len() == 64),
        "one derived key on every attempt: {seen:?}"
    );
    let statuses: Vec<_> = seen.iter().map(|(_, s, r)| (*s, *r)).collect();
    assert!(
        statuses.contains(&(StatusCode::CONFLICT, false)),
        "the retry met the first attempt: {seen:?}"
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == (StatusCode::CREATED, false))
            .count(),
        1,
        "the order was made once: {seen:?}"
    );
    assert_eq!(
        statuses.last(),
        Some(&(StatusCode::CREATED, true)),
        "the caller ended with the first attempt's 201: {seen:?}"
    );
    let all = orders(&c, &base).await;
    assert_eq!(all.len(), 2, "one order per call: {all:?}");
    assert_eq!(order.as_ref(), all.last());
}
