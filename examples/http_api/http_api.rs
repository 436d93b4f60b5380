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
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use axum::{Json, Router};
use idem_runtime::http::{IdempotencyLayer, ReplayedHeaderLayer};
use idem_runtime::idempotent;
use idem_runtime::store::StoreRef;
use idem_runtime::store::sql::SqliteStore;
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

/// The service's state. Orders live in memory to keep the example short; a
/// real service writes them to its database.
pub struct App {
    pub store: StoreRef,
    orders: Mutex<Vec<Order>>,
    next_id: AtomicU64,
    /// Stands in for the slow part of placing an order (payment, stock).
    work: Duration,
}

impl App {
    pub fn new(store: StoreRef, work: Duration) -> Arc<App> {
        Arc::new(App {
            store,
            orders: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            work,
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
pub enum AppError {
    Idem(idem_runtime::Error),
    BadOrder(&'static str),
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
    Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .layer(by_header)
        .route(
            "/users/{user_id}/orders/{order_no}",
            put(place_order).layer(ReplayedHeaderLayer),
        )
        .with_state(app)
}

#[allow(dead_code)] // The tests include this file for `router` and have their own main.
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open("http_api.db").await?;
    let app = App::new(StoreRef::new(store), Duration::from_millis(200));
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    println!("http_api listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(app)).await?;
    Ok(())
}
