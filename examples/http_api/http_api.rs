//! An order service over HTTP, idempotent two ways, on the embedded default
//! store (SQLite, one file):
//!
//! - `POST /orders`: the client sends an `Idempotency-Key` header and says who
//!   it is with `X-Tenant`; the [`IdempotencyLayer`] runs the first request,
//!   stores its response and replays it (`Idempotent-Replayed: true`) to
//!   retries; 400, 409, 413 and 422 answer in `application/problem+json`.
//! - `PUT /users/{user_id}/orders/{order_no}`: no header, the business fields
//!   are the key; `#[idempotent]` on the axum handler, which returns what axum
//!   handlers return.
//! - `POST /payments`: the client's `Idempotency-Key` header is the key
//!   (scoped to its `X-Tenant` by a `KeyCaller`), the amount and currency the
//!   fingerprint; two `#[step]`s (reserve the funds, charge the provider),
//!   the charge sent through [`IdempotencyMiddleware`] with a key derived from
//!   its step's key, and a `Location` header replayed with the response. The
//!   provider is a fake one in this process ([`fake_psp`]) that fails each
//!   new charge once with 503, which the middleware retries with the same key.
//! - `GET /orders`: every order created, for every tenant.
//!
//! Run: `cargo run -p example-http-api --example http_api` (127.0.0.1:3000, or `$PORT`), then
//!
//! ```text
//! curl -i localhost:3000/orders -H 'Idempotency-Key: 8e03978e' -H 'X-Tenant: acme' \
//!      -H 'Content-Type: application/json' -d '{"user_id": 1, "sku": "A-1", "qty": 2}'
//! ```
//!
//! and send it again: the same order comes back, marked as a replay.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use axum::{Extension, Json, Router};
use idem_runtime::client::{DeriveKey, IdempotencyMiddleware};
use idem_runtime::http::{IdempotencyKey, IdempotencyLayer, KeyCaller, ReplayedHeaderLayer};
use idem_runtime::store::StoreRef;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::{idempotent, step};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use serde::{Deserialize, Serialize};

/// What the client sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewOrder {
    pub user_id: u64,
    pub sku: String,
    pub qty: u32,
}

/// What the service creates and answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Order {
    pub id: u64,
    pub tenant: String,
    pub user_id: u64,
    pub sku: String,
    pub qty: u32,
}

/// A payment the client asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pay {
    pub order_id: u64,
    pub amount_cents: u64,
    pub currency: String,
}

/// A payment made: the provider's charge and the funds hold behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Payment {
    pub id: String,
    pub hold: u64,
    pub amount_cents: u64,
}

/// The payment provider: a client whose requests carry a derived
/// `Idempotency-Key` and are retried with it, and where it listens.
pub struct Psp {
    client: ClientWithMiddleware,
    url: String,
}

impl Psp {
    pub fn new(url: String) -> Psp {
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(IdempotencyMiddleware::new().max_attempts(4))
            .build();
        Psp { client, url }
    }
}

/// The service's state. Orders live in memory to keep the example short; a
/// real service writes them to its database.
pub struct App {
    pub store: StoreRef,
    orders: Mutex<Vec<Order>>,
    next_id: AtomicU64,
    /// Stands in for the slow part of placing an order (payment, stock).
    work: Duration,
    psp: Psp,
    /// Funds held, one per payment (the `reserve` step's effect).
    pub holds: AtomicU64,
}

impl App {
    pub fn new(store: StoreRef, work: Duration, psp_url: String) -> Arc<App> {
        Arc::new(App {
            store,
            orders: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            work,
            psp: Psp::new(psp_url),
            holds: AtomicU64::new(0),
        })
    }

    async fn create(&self, tenant: &str, req: NewOrder) -> Order {
        tokio::time::sleep(self.work).await;
        let order = Order {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            tenant: tenant.to_owned(),
            user_id: req.user_id,
            sku: req.sku,
            qty: req.qty,
        };
        self.orders.lock().unwrap().push(order.clone());
        order
    }
}

/// The service's errors; idem's own become problem+json answers.
#[derive(Debug)]
pub enum AppError {
    Idem(idem_runtime::Error),
    BadOrder(&'static str),
    Psp(String),
}

impl From<reqwest_middleware::Error> for AppError {
    fn from(e: reqwest_middleware::Error) -> Self {
        AppError::Psp(e.to_string())
    }
}

impl From<idem_runtime::Error> for AppError {
    fn from(e: idem_runtime::Error) -> Self {
        AppError::Idem(e)
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        match self {
            AppError::Idem(e) => e.into_response(),
            AppError::BadOrder(why) => (StatusCode::UNPROCESSABLE_ENTITY, why).into_response(),
            AppError::Psp(why) => (StatusCode::BAD_GATEWAY, why).into_response(),
        }
    }
}

/// `POST /orders`: made idempotent by the layer around it.
async fn create_order(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Json(req): Json<NewOrder>,
) -> Result<(StatusCode, Json<Order>), AppError> {
    if req.qty == 0 {
        return Err(AppError::BadOrder("qty must be at least 1"));
    }
    let tenant = headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    Ok((StatusCode::CREATED, Json(app.create(tenant, req).await)))
}

/// `PUT /users/{user_id}/orders/{order_no}`: the user's own order number is
/// the key, the whole body the fingerprint (the same number with another
/// body is 422).
#[idempotent(
    scope = "http_api.place_order",
    key = "user_id|order_no",
    fingerprint = "body",
    store = app.store
)]
async fn place_order(
    State(app): State<Arc<App>>,
    Path((user_id, order_no)): Path<(u64, String)>,
    body: Json<NewOrder>,
) -> Result<(StatusCode, Json<Order>), AppError> {
    let Json(req) = body;
    if req.user_id != user_id {
        return Err(AppError::BadOrder("the body's user_id is not the path's"));
    }
    let _ = order_no;
    Ok((StatusCode::CREATED, Json(app.create("", req).await)))
}

/// `POST /payments`: keyed on the `Idempotency-Key` header, bound to the
/// amount and currency; a retry after a crash or a 5xx replays the steps that
/// finished, and a duplicate gets the first response, `Location` included.
#[idempotent(
    scope = "http_api.pay",
    key = "key",
    fingerprint = "req.amount_cents|req.currency",
    store = app.store
)]
async fn pay(
    State(app): State<Arc<App>>,
    key: IdempotencyKey,
    Json(req): Json<Pay>,
) -> Result<(StatusCode, HeaderMap, Json<Payment>), AppError> {
    let hold = reserve_funds(&app, &req).await?; // #[step("reserve")]: a retry replays it
    let payment = charge(&app, &req, hold).await?; // #[step("charge")]
    let mut headers = HeaderMap::new();
    let location = format!("/payments/{}", payment.id);
    headers.insert(LOCATION, HeaderValue::from_str(&location).expect("ASCII"));
    Ok((StatusCode::CREATED, headers, Json(payment)))
}

#[step("reserve")]
async fn reserve_funds(app: &App, req: &Pay) -> Result<u64, AppError> {
    let _ = req.order_id;
    Ok(app.holds.fetch_add(1, Ordering::SeqCst) + 1)
}

/// The provider's charge: no key and no retry loop written here. The
/// middleware sends `current_key().derive("psp:charge")` (this step's key)
/// as `Idempotency-Key` and retries a 503 with the same one.
#[step("charge")]
async fn charge(app: &App, req: &Pay, hold: u64) -> Result<Payment, AppError> {
    let answer = app
        .psp
        .client
        .post(format!("{}/charges", app.psp.url))
        .derive_key("psp:charge")
        .json(&serde_json::json!({"amount_cents": req.amount_cents, "currency": req.currency}))
        .send()
        .await?;
    if !answer.status().is_success() {
        return Err(AppError::Psp(format!(
            "the provider answered {}",
            answer.status()
        )));
    }
    let charge: serde_json::Value = answer
        .json()
        .await
        .map_err(|e| AppError::Psp(e.to_string()))?;
    Ok(Payment {
        id: charge["id"].as_str().unwrap_or_default().to_owned(),
        hold,
        amount_cents: req.amount_cents,
    })
}

/// A payment provider that deduplicates on `Idempotency-Key` (as Stripe and
/// Adyen do) and fails each new charge once with 503. Answers
/// `GET /charges/count` with how many charges it made and how many requests
/// it got.
pub async fn fake_psp() -> String {
    #[derive(Default)]
    struct Psp {
        charges: Mutex<std::collections::HashMap<String, (String, bool)>>,
        requests: AtomicU64,
    }
    async fn charge(State(psp): State<Arc<Psp>>, headers: HeaderMap) -> Response {
        psp.requests.fetch_add(1, Ordering::SeqCst);
        let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
            return (StatusCode::BAD_REQUEST, "Idempotency-Key required").into_response();
        };
        let mut charges = psp.charges.lock().unwrap();
        let n = charges.len();
        let (id, failed_once) = charges
            .entry(key.to_owned())
            .or_insert_with(|| (format!("ch_{}", n + 1), false));
        if !*failed_once {
            *failed_once = true;
            return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
        }
        Json(serde_json::json!({ "id": id })).into_response()
    }
    async fn count(State(psp): State<Arc<Psp>>) -> Json<serde_json::Value> {
        let charges = psp.charges.lock().unwrap().len();
        let requests = psp.requests.load(Ordering::SeqCst);
        Json(serde_json::json!({ "charges": charges, "requests": requests }))
    }
    let app = Router::new()
        .route("/charges", post(charge))
        .route("/charges/count", axum::routing::get(count))
        .with_state(Arc::new(Psp::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// `GET /orders`.
async fn list_orders(State(app): State<Arc<App>>) -> Json<Vec<Order>> {
    Json(app.orders.lock().unwrap().clone())
}

/// The whole service.
pub fn router(app: Arc<App>) -> Router {
    let by_header = IdempotencyLayer::new()
        .store(app.store.clone())
        .scope("http_api.orders")
        .caller(|parts| {
            let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
            (!tenant.is_empty()).then(|| tenant.to_owned())
        });
    // The attribute path's header key is scoped to the tenant, as the layer's.
    let tenant = KeyCaller::new(|parts| {
        let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
        (!tenant.is_empty()).then(|| tenant.to_owned())
    });
    Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .layer(by_header)
        .route("/payments", post(pay).layer(ReplayedHeaderLayer))
        .route(
            "/users/{user_id}/orders/{order_no}",
            put(place_order).layer(ReplayedHeaderLayer),
        )
        .layer(Extension(tenant))
        .with_state(app)
}

#[allow(dead_code)] // The tests include this file for `router` and have their own main.
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open("http_api.db").await?;
    let app = App::new(
        StoreRef::new(store),
        Duration::from_millis(200),
        fake_psp().await,
    );
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    println!("http_api listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(app)).await?;
    Ok(())
}
