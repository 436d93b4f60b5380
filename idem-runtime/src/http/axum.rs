//! axum: the response types handlers return as stored forms, `IntoResponse`
//! for idem's errors, and an `Idempotency-Key` extractor.

use std::time::Duration;

use axum::Json;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::__private::CacheableSerialize;
use crate::error::Error;
use crate::key::{KeyEncoder, KeyPart};
use crate::protocol::StoredForm;

use super::key::KeyRules;
use super::problem::{for_error, problem};

/// The [`StoredForm`] marker of axum's response types: `Json<T>` is stored as
/// the JSON of `T`, `(StatusCode, Json<T>)` as the status and that JSON. So
/// an `#[idempotent]` handler returns what axum handlers return:
///
/// ```
/// use axum::{Json, extract::State, http::StatusCode, response::{IntoResponse, Response}};
/// use idem_runtime::idempotent;
///
/// #[derive(serde::Deserialize)]
/// struct Place { user_id: u64, order_no: String }
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Order { id: u64 }
///
/// enum AppError { Idem(idem_runtime::Error) }
/// impl From<idem_runtime::Error> for AppError {
///     fn from(e: idem_runtime::Error) -> Self { AppError::Idem(e) }
/// }
/// impl IntoResponse for AppError {
///     fn into_response(self) -> Response {
///         match self { AppError::Idem(e) => e.into_response() }
///     }
/// }
///
/// #[idempotent(key = "req.user_id|req.order_no")]
/// async fn place(State(next_id): State<u64>, Json(req): Json<Place>)
///     -> Result<(StatusCode, Json<Order>), AppError>
/// {
///     Ok((StatusCode::CREATED, Json(Order { id: next_id })))
/// }
/// ```
#[derive(Debug)]
pub enum ViaAxum {}

impl<T: Serialize> CacheableSerialize<ViaAxum> for Json<T> {}
impl<T: Serialize> CacheableSerialize<ViaAxum> for (StatusCode, Json<T>) {}

impl<T: Serialize + DeserializeOwned> StoredForm<ViaAxum> for Json<T> {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&self.0)
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes).map(Json)
    }
}

#[derive(Serialize)]
struct WithStatusRef<'a, T> {
    status: u16,
    body: &'a T,
}

#[derive(Deserialize)]
struct WithStatus<T> {
    status: u16,
    body: T,
}

impl<T: Serialize + DeserializeOwned> StoredForm<ViaAxum> for (StatusCode, Json<T>) {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&WithStatusRef {
            status: self.0.as_u16(),
            body: &self.1.0,
        })
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let stored: WithStatus<T> = serde_json::from_slice(bytes)?;
        let status = StatusCode::from_u16(stored.status)
            .map_err(|_| serde::de::Error::custom("stored status is not an HTTP status"))?;
        Ok((status, Json(stored.body)))
    }
}

/// The JSON of the whole body, so `fingerprint = "body"` on a `body: Json<T>`
/// parameter binds the key to the entire payload (`T: Serialize`; its fields
/// serialize in a fixed order unless it holds a `HashMap`).
impl<T: Serialize> KeyPart for Json<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        match serde_json::to_vec(&self.0) {
            Ok(bytes) => enc.write_bytes(&bytes),
            // Nothing to compare: no fingerprint mismatch can be told apart.
            Err(_) => enc.write_none(),
        }
    }
}

/// 409 with `Retry-After` (1 to 10 s) for `InProgress`, 422 for `KeyReuse`,
/// 503 for a store failure, 500 otherwise; all `application/problem+json`. The
/// detail never names scopes or stored data.
impl IntoResponse for Error {
    fn into_response(self) -> Response {
        for_error(&self, Duration::from_secs(1), Duration::from_secs(10)).map(axum::body::Body::new)
    }
}

/// The request's `Idempotency-Key`, validated; a missing or malformed key is
/// 400 in `application/problem+json`.
///
/// The rules are [`KeyRules`] from the request's extensions when a layer put
/// them there (`axum::Extension(rules)`), the defaults otherwise. Use it as a
/// key segment, scoped to the caller:
///
/// ```
/// use axum::{Json, http::HeaderMap};
/// use idem_runtime::{http::IdempotencyKey, idempotent};
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[idempotent(key = "tenant|key")]
/// async fn pay(key: IdempotencyKey, tenant: String) -> Result<Json<u64>, AppError> {
///     Ok(Json(7))
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(pub String);

impl KeyPart for IdempotencyKey {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        self.0.encode_key(enc);
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let rules = parts
            .extensions
            .get::<KeyRules>()
            .copied()
            .unwrap_or_default();
        rules
            .from_headers(&parts.headers)
            .map(IdempotencyKey)
            .map_err(|e| {
                problem(StatusCode::BAD_REQUEST, &e.to_string()).map(axum::body::Body::new)
            })
    }
}
