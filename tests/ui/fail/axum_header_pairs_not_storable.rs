use axum::Json;
use axum::http::{HeaderName, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_runtime::idempotent;

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

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Order {
    id: u64,
}

// Header pairs as an array are `IntoResponseParts` for axum but cannot be
// stored: one error, which says to return a `HeaderMap` instead.
#[idempotent(key = "id")]
async fn place(id: u64) -> Result<(StatusCode, [(HeaderName, &'static str); 1], Json<Order>), AppError> {
    Ok((StatusCode::CREATED, [(header::LOCATION, "/orders/1")], Json(Order { id })))
}

fn main() {}
