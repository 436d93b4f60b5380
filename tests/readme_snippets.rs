//! README blocks that are the rustdoc example of no item, verbatim, with just
//! enough around them to compile (`tests/readme.rs` finds them here). Nothing
//! here runs: compiling is the test.

#![allow(dead_code)]

/// README, "HTTP": a handler keyed on the `Idempotency-Key` header, with
/// steps and a `Location` header stored and replayed.
#[rustfmt::skip] // the README's lines, as they are there
mod steps_and_headers {
    use axum::Json;
    use axum::extract::State;
    use axum::http::header::LOCATION;
    use axum::http::header::InvalidHeaderValue;
    use axum::http::{HeaderMap, HeaderValue, StatusCode};
    use axum::response::{IntoResponse, Response};
    use idem_runtime::http::IdempotencyKey;
    use idem_runtime::{idempotent, step};
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize)]
    struct Pay { amount_cents: u64, currency: String }

    #[derive(Serialize, Deserialize)]
    struct Payment { id: u64, hold: u64 }

    #[derive(Debug)]
    enum AppError { Idem(idem_runtime::Error), Header(InvalidHeaderValue) }
    impl From<idem_runtime::Error> for AppError {
        fn from(e: idem_runtime::Error) -> Self { AppError::Idem(e) }
    }
    impl From<InvalidHeaderValue> for AppError {
        fn from(e: InvalidHeaderValue) -> Self { AppError::Header(e) }
    }
    impl IntoResponse for AppError {
        fn into_response(self) -> Response {
            match self {
                AppError::Idem(e) => e.into_response(),
                AppError::Header(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            }
        }
    }

    #[derive(Clone)]
    struct Psp;
    impl Psp {
        #[step("charge")]
        async fn charge(&self, req: &Pay, hold: u64) -> Result<Payment, AppError> {
            Ok(Payment { id: hold + req.amount_cents, hold })
        }
    }

    #[step("reserve")]
    async fn reserve_funds(req: &Pay) -> Result<u64, AppError> { Ok(req.amount_cents) }

    #[idempotent(key = "key", fingerprint = "req.amount_cents|req.currency")]
    async fn pay(
        State(psp): State<Psp>,
        key: IdempotencyKey,
        Json(req): Json<Pay>,
    ) -> Result<(StatusCode, HeaderMap, Json<Payment>), AppError> {
        let hold = reserve_funds(&req).await?; // #[step("reserve")]: a retry replays it
        let payment = psp.charge(&req, hold).await?; // #[step("charge")]
        let mut headers = HeaderMap::new();
        headers.insert(LOCATION, HeaderValue::from_str(&format!("/payments/{}", payment.id))?);
        Ok((StatusCode::CREATED, headers, Json(payment)))
    }

    /// It is an axum handler.
    fn route() -> axum::Router {
        axum::Router::new().route("/payments", axum::routing::post(pay)).with_state(Psp)
    }
}
