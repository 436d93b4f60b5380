use axum::response::{Html, IntoResponse, Response};
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

// An HTML page is not replayable: the error says to return `Json<T>` or
// `(StatusCode, Json<T>)` instead.
#[idempotent(key = "id")]
async fn page(id: u64) -> Result<Html<String>, AppError> {
    Ok(Html(format!("<p>{id}</p>")))
}

fn main() {}
