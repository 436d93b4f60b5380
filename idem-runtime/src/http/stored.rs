//! The stored form of an HTTP response: status, selected headers and body.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use std::borrow::Cow;

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
/// carries. The layer and the attribute path's `HeaderMap` results both
/// store headers through it.
pub(crate) fn storable<'a>(
    name: &'a HeaderName,
    value: &'a HeaderValue,
) -> Option<(&'a str, WritingValue<'a>)> {
    if never_replayed(name) {
        return None;
    }
    Some((name.as_str(), WritingValue::of(value)))
}

/// A header value as it is written: a JSON string when it is UTF-8 (every
/// visible-ASCII value, the only form earlier versions wrote), else
/// `{"hex":"…"}`. HTTP carries a value's `obs-text` as opaque bytes (Latin-1
/// in a `Content-Disposition`), and JSON has no bytes.
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum WritingValue<'a> {
    Text(&'a str),
    Hex { hex: String },
}

impl<'a> WritingValue<'a> {
    fn of(value: &'a HeaderValue) -> Self {
        match std::str::from_utf8(value.as_bytes()) {
            Ok(s) => WritingValue::Text(s),
            Err(_) => WritingValue::Hex {
                hex: hex::encode(value.as_bytes()),
            },
        }
    }
}

/// A header value as it is read back, in either of [`WritingValue`]'s
/// forms; the string borrowed from the record where JSON did not escape it.
pub(crate) enum ReadingValue<'a> {
    Text(Cow<'a, str>),
    Hex(Cow<'a, str>),
}

impl ReadingValue<'_> {
    /// The value, or `None` for one no header can hold (bad hex, a control
    /// character): such a header is left out of the replay.
    pub(crate) fn to_header(&self) -> Option<HeaderValue> {
        match self {
            ReadingValue::Text(s) => HeaderValue::from_str(s).ok(),
            ReadingValue::Hex(h) => HeaderValue::from_bytes(&hex::decode(&**h).ok()?).ok(),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for ReadingValue<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = ReadingValue<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or {\"hex\": a string}")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ReadingValue::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ReadingValue::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(ReadingValue::Text(Cow::Owned(v)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                use serde::de::Error as _;
                let mut hex = None;
                while let Some(field) = map.next_key::<Text<'de>>()? {
                    if field.0 != "hex" || hex.is_some() {
                        return Err(A::Error::custom(
                            "a stored header value's object holds one field, `hex`",
                        ));
                    }
                    hex = Some(map.next_value::<Text<'de>>()?.0);
                }
                hex.map(ReadingValue::Hex)
                    .ok_or_else(|| A::Error::missing_field("hex"))
            }
        }
        d.deserialize_any(Visit)
    }
}

// The stored form of a response, as `encode` writes it and `decode` reads it:
// `{"status":201,"headers":[["content-type","…"]],"body":{"text":"…"}}`
// (`{"hex":"…"}` for a body, or in place of a header value's string, that is
// not UTF-8: JSON has no bytes). Two mirrors of that one layout, each
// borrowing what it can; the tests hold the owned form earlier versions
// wrote records with.

/// The record as it is written, from borrowed headers and body.
#[derive(Serialize)]
struct Writing<'a> {
    status: u16,
    headers: Vec<(&'a str, WritingValue<'a>)>,
    body: WritingBody<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum WritingBody<'a> {
    Text(&'a str),
    Hex(String),
}

/// The record as it is read back: strings borrowed from the record where
/// JSON did not escape them.
#[derive(Deserialize)]
struct Reading<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<(Text<'a>, ReadingValue<'a>)>,
    #[serde(borrow)]
    body: ReadingBody<'a>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum ReadingBody<'a> {
    Text(#[serde(borrow)] Text<'a>),
    Hex(#[serde(borrow)] Text<'a>),
}

/// A JSON string of the record: borrowed, or owned when it held escapes
/// (an `ETag`'s quotes, a body's newlines).
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(Visit).map(Text)
    }
}

/// The record of a response: `status`, the headers that describe the
/// body and those named in `keep` (less the ones never replayed), and
/// `body`.
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
        Ok(s) => WritingBody::Text(s),
        Err(_) => WritingBody::Hex(hex::encode(body)),
    };
    let record = Writing {
        status: status.as_u16(),
        headers,
        body,
    };
    serde_json::to_vec(&record).expect("a stored response is strings only")
}

/// The response a record says to send again. Read straight from the
/// record's bytes: one copy of the body, none of the header strings.
pub(crate) fn decode(record: &[u8]) -> Result<Response<Full<Bytes>>, serde_json::Error> {
    let stored: Reading<'_> = serde_json::from_slice(record)?;
    let body = match stored.body {
        ReadingBody::Text(Text(Cow::Borrowed(s))) => Bytes::copy_from_slice(s.as_bytes()),
        ReadingBody::Text(Text(Cow::Owned(s))) => Bytes::from(s),
        ReadingBody::Hex(h) => Bytes::from(hex::decode(&*h.0).unwrap_or_default()),
    };
    let mut res = Response::new(Full::new(body));
    *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = res.headers_mut();
    for (Text(name), value) in stored.headers {
        if let (Ok(n), Some(v)) = (HeaderName::from_bytes(name.as_bytes()), value.to_header()) {
            // Records written before these headers were refused may hold them.
            if !never_replayed(&n) {
                headers.append(n, v);
            }
        }
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    /// The owned form earlier versions wrote every record with (and read
    /// back); records they stored must keep replaying.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Owned {
        status: u16,
        headers: Vec<(String, String)>,
        body: OwnedBody,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum OwnedBody {
        Text(String),
        Hex(String),
    }

    fn body_of(res: Response<Full<Bytes>>) -> Bytes {
        futures_util::FutureExt::now_or_never(res.into_body().collect())
            .unwrap()
            .unwrap()
            .to_bytes()
    }

    /// `encode` writes the owned form's JSON, byte for byte, with the
    /// describing headers first and `keep`'s once each; `decode` reads it
    /// back as the response, text and hex bodies alike.
    #[test]
    fn a_record_encoded_reads_back_as_the_response_and_as_the_owned_form() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
        headers.append("x-request-id", HeaderValue::from_static("r-1"));
        headers.append("x-request-id", HeaderValue::from_static("r-2"));
        headers.insert(header::ETAG, HeaderValue::from_static("\"v\\1\""));
        let keep = [
            HeaderName::from_static("x-request-id"),
            header::CONTENT_TYPE,
            header::SET_COOKIE,
            HeaderName::from_static("x-request-id"),
            header::ETAG,
        ];
        for body in [
            Bytes::from_static(b"{\"id\":7}"),
            Bytes::from_static("line\n\"quoted\" \u{e9}t\u{e9}".as_bytes()),
            Bytes::from_static(&[0xff, 0x00]),
        ] {
            let encoded = encode(StatusCode::CREATED, &headers, &keep, &body);
            let owned: Owned = serde_json::from_slice(&encoded).unwrap();
            assert_eq!(serde_json::to_vec(&owned).unwrap(), encoded);
            assert_eq!(owned.status, 201);
            let pairs = [
                ("content-type", "application/json"),
                ("x-request-id", "r-1"),
                ("x-request-id", "r-2"),
                ("etag", "\"v\\1\""),
            ];
            let expected: Vec<_> = pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect();
            assert_eq!(owned.headers, expected);

            let res = decode(&encoded).unwrap();
            assert_eq!(res.status(), StatusCode::CREATED);
            let replayed: Vec<_> = res
                .headers()
                .iter()
                .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
                .collect();
            assert_eq!(replayed, pairs);
            assert_eq!(body_of(res), body);
        }
        let text = encode(StatusCode::OK, &headers, &[], &Bytes::from_static(b"ok"));
        assert_eq!(
            std::str::from_utf8(&text).unwrap(),
            r#"{"status":200,"headers":[["content-type","application/json"]],"body":{"text":"ok"}}"#
        );
    }

    /// A header value that is not visible ASCII is stored: UTF-8 as the
    /// string earlier versions could read, other bytes as hex; either replays
    /// byte for byte. A visible-ASCII value keeps the string form.
    #[test]
    fn header_values_that_are_not_ascii_are_stored_and_replayed_byte_for_byte() {
        let utf8 = HeaderValue::from_bytes("/files/caf\u{e9}".as_bytes()).unwrap();
        let latin1 = HeaderValue::from_bytes(b"attachment; filename=\"caf\xe9.txt\"").unwrap();
        let mut headers = http::HeaderMap::new();
        headers.insert(header::LOCATION, utf8.clone());
        headers.insert(header::CONTENT_DISPOSITION, latin1.clone());
        headers.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        let keep = [header::LOCATION, header::CONTENT_DISPOSITION, header::ETAG];
        let encoded = encode(StatusCode::OK, &headers, &keep, &Bytes::new());
        let json: serde_json::Value = serde_json::from_slice(&encoded).unwrap();
        assert_eq!(
            json["headers"],
            serde_json::json!([
                ["location", "/files/caf\u{e9}"],
                ["content-disposition", {"hex": hex::encode(latin1.as_bytes())}],
                ["etag", "\"v1\""],
            ])
        );
        let res = decode(&encoded).unwrap();
        assert_eq!(res.headers()[header::LOCATION].as_bytes(), utf8.as_bytes());
        assert_eq!(
            res.headers()[header::CONTENT_DISPOSITION].as_bytes(),
            latin1.as_bytes()
        );
        assert_eq!(res.headers()[header::ETAG], "\"v1\"");
        // What is not a stored value is an error, not a header made up.
        for bad in [r#"{"hex":"6f","text":"o"}"#, r#"{"text":"o"}"#, "1"] {
            let record =
                format!(r#"{{"status":200,"headers":[["etag",{bad}]],"body":{{"text":""}}}}"#);
            assert!(decode(record.as_bytes()).is_err(), "{bad}");
        }
    }

    /// A record written before `Set-Cookie` was refused replays without it;
    /// one that is not a stored response is an error, not an empty reply.
    #[test]
    fn decode_drops_headers_never_replayed_and_refuses_what_is_not_a_record() {
        let old = Owned {
            status: 200,
            headers: vec![
                ("set-cookie".into(), "session=1".into()),
                ("Content-Type".into(), "text/plain".into()),
            ],
            body: OwnedBody::Hex("6f6b".into()),
        };
        let res = decode(&serde_json::to_vec(&old).unwrap()).unwrap();
        assert!(res.headers().get(header::SET_COOKIE).is_none());
        assert_eq!(res.headers()[header::CONTENT_TYPE], "text/plain");
        assert_eq!(body_of(res), Bytes::from_static(b"ok"));
        assert!(decode(b"{\"status\":200}").is_err());
        assert!(decode(b"[1,2]").is_err());
    }
}
