//! The stored form of an HTTP response: status, selected headers and body.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use serde::{Deserialize, Serialize};

/// The headers that say how to read the body: stored with every response, so
/// a replay of a gzip body is labelled gzip and caches see the same `Vary`.
pub(crate) const DESCRIBE_BODY: [HeaderName; 3] =
    [header::CONTENT_TYPE, header::CONTENT_ENCODING, header::VARY];

/// Headers a replay never carries, even when named in `store_headers`.
///
/// `Set-Cookie` hands out state (a session, a CSRF token) meant for the one
/// exchange that created it: replayed, whoever retries with the key would get
/// that state again. The others belong to the connection or to the exchange
/// (`Content-Length` is recomputed from the body, `Date` is the replay's own,
/// `Idempotent-Replayed` is the layer's to set).
pub(crate) fn never_replayed(name: &HeaderName) -> bool {
    const NAMES: [&str; 13] = [
        "set-cookie",
        "set-cookie2",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "content-length",
        "date",
        super::IDEMPOTENT_REPLAYED,
    ];
    NAMES.contains(&name.as_str())
}

/// One header as a record keeps it: `None` for a header a replay never
/// carries, and for a value that is not visible ASCII (JSON holds text),
/// which is logged. The layer and the attribute path's `HeaderMap` results
/// both store headers through it.
pub(crate) fn storable<'a>(
    name: &'a HeaderName,
    value: &'a HeaderValue,
) -> Option<(&'a str, &'a str)> {
    if never_replayed(name) {
        return None;
    }
    match value.to_str() {
        Ok(v) => Some((name.as_str(), v)),
        Err(_) => {
            tracing::warn!(header = %name, "header value is not visible ASCII; not stored");
            None
        }
    }
}

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
    /// Keeps `status`, the headers that describe the body and those named in
    /// `keep` (less the ones never replayed), and `body`.
    pub(crate) fn new(
        status: StatusCode,
        headers: &http::HeaderMap,
        keep: &[HeaderName],
        body: &Bytes,
    ) -> Self {
        let mut names: Vec<&HeaderName> = DESCRIBE_BODY.iter().collect();
        for name in keep {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let headers = names
            .into_iter()
            .flat_map(|name| headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, v)| storable(name, v))
            .map(|(name, v)| (name.to_owned(), v.to_owned()))
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
                // Records written before these headers were refused may hold them.
                if !never_replayed(&n) {
                    res.headers_mut().append(n, v);
                }
            }
        }
        res
    }
}
