use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use idem_runtime::http::IdempotencyKey;
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        ().into_response()
    }
}

pub struct App;

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Reserve {
    pub seats: u32,
}

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Reservation {
    pub id: u64,
}

// A handler's extractors come from the request, which a worker does not have.
#[idempotent(scope = "reservations.create", key = "key", recover)]
async fn reserve(
    State(app): State<Arc<App>>,
    key: IdempotencyKey,
    Json(req): Json<Reserve>,
) -> Result<Json<Reservation>, AppError> {
    let _ = (app, key);
    Ok(Json(Reservation { id: u64::from(req.seats) }))
}

fn main() {}
