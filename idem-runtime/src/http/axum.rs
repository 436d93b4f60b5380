//! axum: the response types handlers return as stored forms and
//! `IntoResponse` for idem's errors (the `Idempotency-Key` extractor is in
//! `extract.rs`).

use std::time::Duration;

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::__private::CacheableSerialize;
use crate::error::Error;
use crate::key::{KeyEncoder, KeyPart};
use crate::protocol::StoredForm;

use super::problem::{Compared, for_error};
use super::stored::{ReadingValue, WritingValue, storable};

/// The [`StoredForm`] marker of axum's response types: `Json<T>` is stored as
/// the JSON of `T`, `(StatusCode, Json<T>)` as the status and that JSON,
/// `(StatusCode, HeaderMap, Json<T>)` and `(HeaderMap, Json<T>)` with the
/// handler's headers too (less `Set-Cookie` and the connection's own, which a
/// replay never carries). So an `#[idempotent]` handler returns what axum
/// handlers return:
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
impl<T: Serialize> CacheableSerialize<ViaAxum> for (HeaderMap, Json<T>) {}
impl<T: Serialize> CacheableSerialize<ViaAxum> for (StatusCode, HeaderMap, Json<T>) {}

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

#[derive(Serialize)]
struct WithHeadersRef<'a, T> {
    status: u16,
    headers: Vec<(&'a str, WritingValue<'a>)>,
    body: &'a T,
}

#[derive(Deserialize)]
struct WithHeaders<'a, T> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<(String, ReadingValue<'a>)>,
    body: T,
}

/// The headers a handler set, as stored: by the layer's rule (`storable`).
fn stored_headers(headers: &HeaderMap) -> Vec<(&str, WritingValue<'_>)> {
    headers.iter().filter_map(|(n, v)| storable(n, v)).collect()
}

fn encode_with_headers<T: Serialize>(
    status: StatusCode,
    headers: &HeaderMap,
    body: &T,
) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&WithHeadersRef {
        status: status.as_u16(),
        headers: stored_headers(headers),
        body,
    })
}

fn decode_with_headers<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(StatusCode, HeaderMap, T), serde_json::Error> {
    use serde::de::Error as _;
    let stored: WithHeaders<'_, T> = serde_json::from_slice(bytes)?;
    let status = StatusCode::from_u16(stored.status)
        .map_err(|_| serde_json::Error::custom("stored status is not an HTTP status"))?;
    let mut headers = HeaderMap::with_capacity(stored.headers.len());
    for (name, value) in stored.headers {
        let name = HeaderName::try_from(name)
            .map_err(|_| serde_json::Error::custom("stored header name is not valid"))?;
        let value = value
            .to_header()
            .ok_or_else(|| serde_json::Error::custom("stored header value is not valid"))?;
        headers.append(name, value);
    }
    Ok((status, headers, stored.body))
}

/// Status, the handler's headers (a `Location`, an `ETag`) and the JSON body,
/// replayed as they were; `Set-Cookie` and the connection's headers are never
/// stored (see the guide's [HTTP page](crate::guide::http)).
impl<T: Serialize + DeserializeOwned> StoredForm<ViaAxum> for (StatusCode, HeaderMap, Json<T>) {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        encode_with_headers(self.0, &self.1, &self.2.0)
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let (status, headers, body) = decode_with_headers(bytes)?;
        Ok((status, headers, Json(body)))
    }
}

/// `(StatusCode, HeaderMap, Json<T>)` with the status axum gives it: 200.
impl<T: Serialize + DeserializeOwned> StoredForm<ViaAxum> for (HeaderMap, Json<T>) {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        encode_with_headers(StatusCode::OK, &self.0, &self.1.0)
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let (_, headers, body) = decode_with_headers(bytes)?;
        Ok((headers, Json(body)))
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
        for_error(
            &self,
            Compared::Fingerprint,
            Duration::from_secs(1),
            Duration::from_secs(10),
        )
        .map(axum::body::Body::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    type WithHeaders = (StatusCode, HeaderMap, Json<u32>);

    /// A handler's header whose value is not visible ASCII is kept, byte for
    /// byte, as the layer keeps it; a record of strings only, as earlier
    /// versions wrote every one, still reads back.
    #[test]
    fn handler_headers_that_are_not_ascii_replay_byte_for_byte() {
        let latin1 = HeaderValue::from_bytes(b"attachment; filename=\"caf\xe9\"").unwrap();
        let utf8 = HeaderValue::from_bytes("/files/caf\u{e9}".as_bytes()).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_DISPOSITION, latin1.clone());
        headers.insert(http::header::LOCATION, utf8.clone());
        let first: WithHeaders = (StatusCode::CREATED, headers, Json(7));
        let stored = StoredForm::<ViaAxum>::to_stored(&first).unwrap();
        let (status, replayed, Json(body)) =
            <WithHeaders as StoredForm<ViaAxum>>::from_stored(&stored).unwrap();
        assert_eq!((status, body), (StatusCode::CREATED, 7));
        assert_eq!(replayed, first.1);

        let old = br#"{"status":201,"headers":[["location","/orders/7"]],"body":7}"#;
        let (_, replayed, _) = <WithHeaders as StoredForm<ViaAxum>>::from_stored(old).unwrap();
        assert_eq!(replayed[http::header::LOCATION], "/orders/7");
    }
}
