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

/// The record of a response, serialized from borrowed headers and body: the
/// same JSON as [`StoredResponse`] (whose fields and variants it mirrors),
/// without an owned `String` per header and for the body first.
#[derive(Serialize)]
struct Borrowed<'a> {
    status: u16,
    headers: Vec<(&'a str, &'a str)>,
    body: BorrowedBody<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum BorrowedBody<'a> {
    Text(&'a str),
    Hex(String),
}

impl StoredResponse {
    /// The record of a response: `status`, the headers that describe the
    /// body and those named in `keep` (less the ones never replayed), and
    /// `body`, as the JSON [`StoredResponse`] reads back.
    pub(crate) fn encode(
        status: StatusCode,
        headers: &http::HeaderMap,
        keep: &[HeaderName],
        body: &Bytes,
    ) -> Vec<u8> {
        let extra = keep
            .iter()
            .enumerate()
            .filter(|&(i, name)| !DESCRIBE_BODY.contains(name) && !keep[..i].contains(name))
            .map(|(_, name)| name);
        let headers = DESCRIBE_BODY
            .iter()
            .chain(extra)
            .flat_map(|name| headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, v)| storable(name, v))
            .collect();
        let body = match std::str::from_utf8(body) {
            Ok(s) => BorrowedBody::Text(s),
            Err(_) => BorrowedBody::Hex(hex::encode(body)),
        };
        let record = Borrowed {
            status: status.as_u16(),
            headers,
            body,
        };
        serde_json::to_vec(&record).expect("a stored response is strings only")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Records already stored must keep reading back: the borrowed encoding
    /// is the owned form's JSON, text and hex bodies alike, with the
    /// describing headers first and `keep`'s once each.
    #[test]
    fn the_borrowed_encoding_reads_back_as_the_stored_form() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
        headers.append("x-request-id", HeaderValue::from_static("r-1"));
        headers.append("x-request-id", HeaderValue::from_static("r-2"));
        let keep = [
            HeaderName::from_static("x-request-id"),
            header::CONTENT_TYPE,
            header::SET_COOKIE,
            HeaderName::from_static("x-request-id"),
        ];
        for body in [
            Bytes::from_static(b"{\"id\":7}"),
            Bytes::from_static(&[0xff, 0x00]),
        ] {
            let encoded = StoredResponse::encode(StatusCode::CREATED, &headers, &keep, &body);
            let stored: StoredResponse = serde_json::from_slice(&encoded).unwrap();
            assert_eq!(serde_json::to_vec(&stored).unwrap(), encoded);
            assert_eq!(stored.status, 201);
            assert_eq!(
                stored.headers,
                [
                    ("content-type".to_owned(), "application/json".to_owned()),
                    ("x-request-id".to_owned(), "r-1".to_owned()),
                    ("x-request-id".to_owned(), "r-2".to_owned()),
                ]
            );
            let res = stored.to_response();
            assert_eq!(
                futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(
                    res.into_body()
                ))
                .unwrap()
                .unwrap()
                .to_bytes(),
                body
            );
        }
        let text =
            StoredResponse::encode(StatusCode::OK, &headers, &[], &Bytes::from_static(b"ok"));
        assert_eq!(
            std::str::from_utf8(&text).unwrap(),
            r#"{"status":200,"headers":[["content-type","application/json"]],"body":{"text":"ok"}}"#
        );
    }
}
