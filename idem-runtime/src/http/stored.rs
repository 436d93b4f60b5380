//! The stored form of an HTTP response: status, selected headers and body.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: StoredBody,
}

/// JSON has no bytes: text bodies are kept as they are, others in hex.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum StoredBody {
    Text(String),
    Hex(String),
}

impl StoredResponse {
    /// Keeps `status`, the headers named in `keep` and `body`.
    pub(crate) fn new(
        status: StatusCode,
        headers: &http::HeaderMap,
        keep: &[HeaderName],
        body: &Bytes,
    ) -> Self {
        let headers = keep
            .iter()
            .flat_map(|name| headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, v)| match v.to_str() {
                Ok(s) => Some((name.as_str().to_owned(), s.to_owned())),
                Err(_) => {
                    tracing::warn!(header = %name, "header value is not visible ASCII; not stored");
                    None
                }
            })
            .collect();
        let body = match std::str::from_utf8(body) {
            Ok(s) => StoredBody::Text(s.to_owned()),
            Err(_) => StoredBody::Hex(hex::encode(body)),
        };
        StoredResponse {
            status: status.as_u16(),
            headers,
            body,
        }
    }

    /// The response to send again.
    pub(crate) fn to_response(&self) -> Response<Full<Bytes>> {
        let body = match &self.body {
            StoredBody::Text(s) => Bytes::from(s.clone()),
            StoredBody::Hex(h) => Bytes::from(hex::decode(h).unwrap_or_default()),
        };
        let mut res = Response::new(Full::new(body));
        *res.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        for (name, value) in &self.headers {
            if let (Ok(n), Ok(v)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                res.headers_mut().append(n, v);
            }
        }
        res
    }
}
