//! The client middleware (`idem_runtime::client`) against a loopback server
//! that answers from a script and records every request it receives with its
//! `Idempotency-Key` header values.
//!
//! Each case fails on a middleware that sends no key or another key, that
//! retries what cannot be repeated (a keyless POST, a 400, a streaming body),
//! that does not retry what can, that lets a request asking for a key go out
//! without one, or that retries sooner than `Retry-After`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_runtime::client::{DeriveKey, IdempotencyMiddleware, KeyName, OutsideIdempotentCall};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Key, current_key, idempotent, step};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Http(#[from] reqwest_middleware::Error),
}

/// One store for every call: a store built per call would remember nothing.
static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);

// ---------------------------------------------------------------------------
// The downstream server
// ---------------------------------------------------------------------------

/// One request as the server received it.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    /// Every `Idempotency-Key` value, in order: more than one is a bug.
    keys: Vec<String>,
    body: Bytes,
}

#[derive(Default)]
struct Downstream {
    seen: Mutex<Vec<Seen>>,
    /// The answers to give, in order (a status and a `Retry-After`); 200 once
    /// it runs out.
    script: Mutex<VecDeque<(u16, Option<&'static str>)>>,
    /// How many of the first requests to hold for two seconds before answering.
    slow: AtomicUsize,
}

impl Downstream {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Every request's key values.
    fn keys(&self) -> Vec<Vec<String>> {
        self.seen().into_iter().map(|s| s.keys).collect()
    }
}

async fn answer(
    State(d): State<Arc<Downstream>>,
    method: Method,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let keys = headers
        .get_all("idempotency-key")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    d.seen.lock().unwrap().push(Seen { method, keys, body });
    let slow = d
        .slow
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if slow {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let (status, retry_after) = d.script.lock().unwrap().pop_front().unwrap_or((200, None));
    let status = StatusCode::from_u16(status).unwrap();
    match retry_after {
        Some(DATE_IN_30_S) => {
            let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
            (status, [("retry-after", date)]).into_response()
        }
        Some(after) => (status, [("retry-after", after)]).into_response(),
        None => status.into_response(),
    }
}

/// In a script, a `Retry-After` answered as the HTTP-date 30 s after the
/// moment of the answer.
const DATE_IN_30_S: &str = "<the date in 30 s>";

/// Serves a fresh downstream that answers `script` first.
async fn serve(script: &[(u16, Option<&'static str>)]) -> (String, Arc<Downstream>) {
    let downstream = Arc::new(Downstream::default());
    downstream
        .script
        .lock()
        .unwrap()
        .extend(script.iter().copied());
    let app = Router::new()
        .fallback(answer)
        .with_state(downstream.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/charges"), downstream)
}

/// Four attempts at most, millisecond backoffs, `Retry-After` up to a minute.
fn client() -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(
            IdempotencyMiddleware::new()
                .max_attempts(4)
                .base_delay(Duration::from_millis(1))
                .max_delay(Duration::from_secs(60)),
        )
        .build()
}

const SERVICE_UNAVAILABLE: (u16, Option<&str>) = (503, None);

// ---------------------------------------------------------------------------
// The key
// ---------------------------------------------------------------------------

/// Charges once through the PSP; returns the status and the key the request
/// should have carried.
#[idempotent(key = "order_id", store = &*STORE)]
async fn charge(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<(u16, String), AppError> {
    let expected = current_key().unwrap().derive("psp:charge").to_hex();
    let response = psp
        .post(url)
        .derive_key("psp:charge")
        .body(r#"{"amount":100}"#)
        .send()
        .await?;
    Ok((response.status().as_u16(), expected))
}

#[tokio::test]
async fn a_post_is_retried_with_one_derived_key_and_a_replayed_call_sends_nothing() {
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE, SERVICE_UNAVAILABLE]).await;
    let client = client();

    let (status, expected) = charge(&client, &url, 1).await.unwrap();
    assert_eq!(status, 200);
    let seen = psp.seen();
    assert_eq!(seen.len(), 3, "two 503s, then the 200: {seen:?}");
    for request in &seen {
        assert_eq!(request.method, Method::POST);
        assert_eq!(
            request.keys,
            [expected.as_str()],
            "one key, the same every time"
        );
        assert_eq!(request.body, r#"{"amount":100}"#);
    }

    // The call is done: a retry of it replays and never reaches the PSP.
    assert_eq!(charge(&client, &url, 1).await.unwrap(), (200, expected));
    assert_eq!(psp.seen().len(), 3);
}

/// Two effects of the call and one of a step; returns the call's and the
/// step's keys.
#[idempotent(key = "order_id", store = &*STORE)]
async fn checkout(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<(String, String), AppError> {
    psp.post(url).derive_key("psp:charge").send().await?;
    psp.post(url)
        .with_extension(KeyName::new(format!("sms:receipt:{order_id}")))
        .send()
        .await?;
    let step_key = notify(psp, url).await?;
    Ok((current_key().unwrap().to_hex(), step_key))
}

#[step("notify")]
async fn notify(psp: &ClientWithMiddleware, url: &str) -> Result<String, AppError> {
    psp.post(url).derive_key("psp:charge").send().await?;
    Ok(current_key().unwrap().to_hex())
}

#[tokio::test]
async fn each_name_and_each_step_gets_its_own_key() {
    let (url, psp) = serve(&[]).await;

    let (call, step) = checkout(&client(), &url, 2).await.unwrap();
    let (call, step) = (Key::from_hex(&call).unwrap(), Key::from_hex(&step).unwrap());
    assert_ne!(call, step, "a step has a key of its own");
    let keys = psp.keys();
    assert_eq!(
        keys,
        [
            [call.derive("psp:charge").to_hex()],
            [call.derive("sms:receipt:2").to_hex()],
            // The same name in a step: derived from the step's key, not the call's.
            [step.derive("psp:charge").to_hex()],
        ]
    );
    assert_ne!(keys[0], keys[1]);
    assert_ne!(keys[0], keys[2]);
}

#[tokio::test]
async fn a_key_name_outside_any_call_is_an_error_and_nothing_is_sent() {
    let (url, psp) = serve(&[]).await;

    let err = client()
        .post(&url)
        .derive_key("psp:charge")
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(err) = err else {
        panic!("expected the middleware's error, got {err:?}");
    };
    let outside = err
        .downcast_ref::<OutsideIdempotentCall>()
        .unwrap_or_else(|| panic!("expected OutsideIdempotentCall, got {err:?}"));
    assert_eq!(outside.key_name(), "psp:charge");
    assert!(outside.to_string().contains("psp:charge"), "{outside}");
    assert!(psp.seen().is_empty(), "a request went out without its key");
}

/// Sends a request from a task spawned inside the body, which does not see
/// the call.
#[idempotent(key = "order_id", store = &*STORE)]
async fn charge_from_a_spawned_task(
    psp: ClientWithMiddleware,
    url: String,
    order_id: u64,
) -> Result<bool, AppError> {
    let sent = tokio::spawn(async move { psp.post(&url).derive_key("psp:charge").send().await })
        .await
        .unwrap();
    Ok(sent.is_err())
}

#[tokio::test]
async fn a_key_name_in_a_task_spawned_by_the_body_is_an_error_too() {
    let (url, psp) = serve(&[]).await;
    assert!(
        charge_from_a_spawned_task(client(), url, 3).await.unwrap(),
        "sent from a spawned task without a call's key"
    );
    assert!(psp.seen().is_empty());
}

#[idempotent(key = "order_id", store = &*STORE)]
async fn charge_with_own_key(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<u16, AppError> {
    let response = psp
        .post(url)
        .header("Idempotency-Key", "the-callers-own")
        .derive_key("psp:charge")
        .send()
        .await?;
    Ok(response.status().as_u16())
}

#[tokio::test]
async fn a_callers_own_key_is_kept_alone_and_retried_with() {
    // Inside a call, with a name as well: the caller's header wins.
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE]).await;
    assert_eq!(charge_with_own_key(&client(), &url, 4).await.unwrap(), 200);
    assert_eq!(psp.keys(), [["the-callers-own"], ["the-callers-own"]]);

    // Outside any call: a POST with its own key is safe to repeat.
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE]).await;
    let response = client()
        .post(&url)
        .header("Idempotency-Key", "k-1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(psp.keys(), [["k-1"], ["k-1"]]);
}

// ---------------------------------------------------------------------------
// What is retried, and what is not
// ---------------------------------------------------------------------------

/// A POST without a key name, inside a call: passed through, no key.
#[idempotent(key = "order_id", store = &*STORE)]
async fn post_without_a_name(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<u16, AppError> {
    Ok(psp.post(url).send().await?.status().as_u16())
}

#[tokio::test]
async fn a_post_without_a_key_is_sent_once_and_its_503_reaches_the_caller() {
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE; 4]).await;
    let client = client();

    let response = client.post(&url).body("order").send().await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(psp.seen().len(), 1, "a keyless POST was sent again");

    // Inside a call, a request without a name gets no key either.
    assert_eq!(post_without_a_name(&client, &url, 5).await.unwrap(), 503);
    let keys = psp.keys();
    assert_eq!(keys.len(), 2, "a keyless POST was sent again");
    assert!(keys.iter().all(Vec::is_empty), "{keys:?}");
}

#[tokio::test]
async fn a_get_without_a_key_is_retried() {
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE, (502, None)]).await;

    let response = client().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let seen = psp.seen();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|s| s.method == Method::GET && s.keys.is_empty())
    );
}

#[tokio::test]
async fn attempts_are_bounded_and_the_last_answer_reaches_the_caller() {
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE; 6]).await;
    let response = client().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(psp.seen().len(), 4, "max_attempts(4)");
}

#[idempotent(key = "order_id", store = &*STORE)]
async fn charge_rejected(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<u16, AppError> {
    let response = psp.post(url).derive_key("psp:charge").send().await?;
    Ok(response.status().as_u16())
}

#[tokio::test]
async fn a_400_is_not_retried() {
    let (url, psp) = serve(&[(400, None), (400, None)]).await;
    let client = client();

    assert_eq!(client.get(&url).send().await.unwrap().status(), 400);
    assert_eq!(psp.seen().len(), 1);
    // Not with a key either: the same request would be refused the same way.
    assert_eq!(charge_rejected(&client, &url, 6).await.unwrap(), 400);
    assert_eq!(psp.seen().len(), 2);
}

#[idempotent(key = "order_id", store = &*STORE)]
async fn charge_with_a_timeout(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<u16, AppError> {
    let response = psp
        .post(url)
        .derive_key("psp:charge")
        .timeout(Duration::from_millis(300))
        .send()
        .await?;
    Ok(response.status().as_u16())
}

#[tokio::test]
async fn a_timeout_is_retried_with_the_same_key_but_not_without_one() {
    let (url, psp) = serve(&[]).await;
    let client = client();

    psp.slow.store(1, SeqCst);
    assert_eq!(charge_with_a_timeout(&client, &url, 7).await.unwrap(), 200);
    let keys = psp.keys();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0].len(), 1);
    assert_eq!(keys[0], keys[1]);

    // Keyless, the POST may have reached the server: it is not sent again.
    psp.slow.store(1, SeqCst);
    let err = client
        .post(&url)
        .timeout(Duration::from_millis(300))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(psp.seen().len(), 3);
}

#[idempotent(key = "order_id", store = &*STORE)]
async fn charge_streamed(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<u16, AppError> {
    // A wrapped body is a stream to reqwest, whatever it wraps: not cloneable.
    let body = reqwest::Body::wrap(String::from(r#"{"amount":100}"#));
    let response = psp
        .post(url)
        .derive_key("psp:charge")
        .body(body)
        .send()
        .await?;
    Ok(response.status().as_u16())
}

#[tokio::test]
async fn a_streaming_body_is_sent_once() {
    let (url, psp) = serve(&[SERVICE_UNAVAILABLE]).await;
    assert_eq!(charge_streamed(&client(), &url, 8).await.unwrap(), 503);
    let seen = psp.seen();
    assert_eq!(seen.len(), 1, "a body that cannot be cloned was sent again");
    assert_eq!(seen[0].body, r#"{"amount":100}"#);
    assert_eq!(seen[0].keys.len(), 1, "it still carries its key");
}

// ---------------------------------------------------------------------------
// A call taken over
// ---------------------------------------------------------------------------

/// `charge` on a one-second lease.
#[idempotent(key = "order_id", store = &*STORE, lease = "1s")]
async fn charge_on_a_short_lease(
    psp: &ClientWithMiddleware,
    url: &str,
    order_id: u64,
) -> Result<(u16, String), AppError> {
    let expected = current_key().unwrap().derive("psp:charge").to_hex();
    let response = psp.post(url).derive_key("psp:charge").send().await?;
    Ok((response.status().as_u16(), expected))
}

/// A call that stopped after its request reached the server (a crash: here
/// its future dropped) is taken over once its lease ends, and sends the same
/// key again: the server deduplicates it only while it still remembers the
/// key, which is why the lease and recovery must stay well inside the
/// server's window (Stripe's 24 hours).
#[tokio::test]
async fn a_call_taken_over_after_its_lease_sends_its_key_again() {
    let (url, psp) = serve(&[]).await;
    let client = client();
    psp.slow.store(1, SeqCst);
    let crashed = tokio::time::timeout(
        Duration::from_millis(300),
        charge_on_a_short_lease(&client, &url, 20),
    )
    .await;
    assert!(crashed.is_err(), "the first run was meant to be cut off");
    assert_eq!(psp.seen().len(), 1, "its request reached the server");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, expected) = charge_on_a_short_lease(&client, &url, 20).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        psp.keys(),
        vec![vec![expected]; 2],
        "the takeover's key is the first run's"
    );
}

// ---------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------

// On a paused clock, which moves only when every task waits on a timer: the
// 30 s wait takes no real time, and the clock shows what was waited.
#[tokio::test(start_paused = true)]
async fn retry_after_is_waited_out_in_full() {
    let (url, psp) = serve(&[(503, Some("30")), (429, Some("20"))]).await;

    let started = tokio::time::Instant::now();
    let response = client().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(psp.seen().len(), 3);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(50),
        "retried after {waited:?}, before the 30 s and 20 s the server asked for"
    );
}

#[tokio::test]
async fn a_retry_after_past_max_delay_is_handed_to_the_caller() {
    let (url, psp) = serve(&[(429, Some("3600"))]).await;

    let response = client().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(
        response.headers()["retry-after"],
        "3600",
        "the caller sees when to come back"
    );
    assert_eq!(psp.seen().len(), 1);
}

// On a paused clock, as above; the date is read against the wall clock,
// which the pause does not stop, so the wait is the date's 29 to 30 s.
#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_waited_until_that_date() {
    let (url, psp) = serve(&[(503, Some(DATE_IN_30_S))]).await;

    let started = tokio::time::Instant::now();
    let response = client().get(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(psp.seen().len(), 2);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(28),
        "retried after {waited:?}, before the date the server gave"
    );
}

// ---------------------------------------------------------------------------
// 409: the first request with this key is still being processed
// ---------------------------------------------------------------------------

const STILL_PROCESSING: (u16, Option<&str>) = (409, None);

#[tokio::test(start_paused = true)]
async fn a_keyed_409_is_retried_with_the_same_key_after_its_retry_after() {
    let (url, psp) = serve(&[STILL_PROCESSING, (409, Some("5"))]).await;

    let started = tokio::time::Instant::now();
    let (status, expected) = charge(&client(), &url, 409).await.unwrap();
    assert_eq!(status, 200, "the 409 was handed to the body as the answer");
    let keys = psp.keys();
    assert_eq!(keys, vec![vec![expected]; 3], "one key, three attempts");
    assert!(started.elapsed() >= Duration::from_secs(5));
}

#[tokio::test]
async fn a_keyed_409_on_every_attempt_reaches_the_caller_once_the_attempts_are_spent() {
    let (url, psp) = serve(&[STILL_PROCESSING; 6]).await;

    let (status, _) = charge(&client(), &url, 410).await.unwrap();
    assert_eq!(status, 409);
    assert_eq!(psp.seen().len(), 4, "max_attempts(4)");
}

#[tokio::test]
async fn a_keyless_409_is_a_conflict_and_is_not_retried() {
    let (url, psp) = serve(&[STILL_PROCESSING, STILL_PROCESSING]).await;

    // Even a GET, which is retried on a 503: a keyless 409 is an answer.
    assert_eq!(client().get(&url).send().await.unwrap().status(), 409);
    assert_eq!(psp.seen().len(), 1);
}
