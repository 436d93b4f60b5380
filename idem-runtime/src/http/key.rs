//! Validating the `Idempotency-Key` header.

use http::HeaderValue;

/// What a valid `Idempotency-Key` looks like.
///
/// By default 1 to 255 visible ASCII characters (`!` to `~`), like Stripe's
/// keys and the UUIDs the IETF draft recommends. The draft writes the key as a
/// structured-field string (`"8e03978e-…"`); the quotes of such a value are
/// removed before the checks, so both forms name the same key.
///
/// ```
/// use idem_runtime::http::KeyRules;
/// use http::HeaderValue;
///
/// let rules = KeyRules::default();
/// assert_eq!(rules.parse(&HeaderValue::from_static("abc-1")).unwrap(), "abc-1");
/// assert_eq!(rules.parse(&HeaderValue::from_static("\"abc-1\"")).unwrap(), "abc-1");
/// assert!(rules.parse(&HeaderValue::from_static("has space")).is_err());
/// assert!(KeyRules::default().max_len(8).parse(&HeaderValue::from_static("123456789")).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRules {
    min_len: usize,
    max_len: usize,
}

impl Default for KeyRules {
    fn default() -> Self {
        KeyRules {
            min_len: 1,
            max_len: 255,
        }
    }
}

/// Why a header value is not a valid key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The request has no `Idempotency-Key` header.
    #[error("the request has no `Idempotency-Key` header; send a unique key (a UUID) per intent")]
    Missing,
    /// The key is shorter or longer than allowed.
    #[error("the `Idempotency-Key` has {len} characters; it must have {min} to {max}")]
    Length {
        /// The key's length.
        len: usize,
        /// The shortest key allowed.
        min: usize,
        /// The longest key allowed.
        max: usize,
    },
    /// The key has a character that is not visible ASCII.
    #[error(
        "the `Idempotency-Key` may only contain visible ASCII characters (no spaces or control characters)"
    )]
    Characters,
    /// The request has several `Idempotency-Key` headers naming different
    /// keys: which one the client meant cannot be told.
    #[error(
        "the request has several `Idempotency-Key` headers with different keys; send exactly one key"
    )]
    Conflicting,
}

impl KeyRules {
    /// The default rules: 1 to 255 visible ASCII characters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the shortest key accepted (at least 1).
    pub fn min_len(mut self, n: usize) -> Self {
        self.min_len = n.max(1);
        self
    }

    /// Sets the longest key accepted.
    pub fn max_len(mut self, n: usize) -> Self {
        self.max_len = n;
        self
    }

    /// The key a header value carries, or why it carries none.
    pub fn parse(&self, value: &HeaderValue) -> Result<String, KeyProblem> {
        let raw = value.as_bytes();
        let raw = match raw {
            [b'"', inner @ .., b'"'] => inner,
            other => other,
        };
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyProblem::Characters);
        }
        if raw.len() < self.min_len || raw.len() > self.max_len {
            return Err(KeyProblem::Length {
                len: raw.len(),
                min: self.min_len,
                max: self.max_len,
            });
        }
        // Visible ASCII is UTF-8.
        Ok(String::from_utf8(raw.to_vec()).expect("ASCII"))
    }

    /// The key of the request's `Idempotency-Key` header.
    ///
    /// Several headers that name the same key (a proxy that added it again,
    /// one of them quoted) are that key; several that name different keys are
    /// [`KeyProblem::Conflicting`], never the first one.
    ///
    /// ```
    /// use http::{HeaderMap, HeaderValue};
    /// use idem_runtime::http::{KeyProblem, KeyRules};
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.append("idempotency-key", HeaderValue::from_static("k-1"));
    /// headers.append("idempotency-key", HeaderValue::from_static("\"k-1\""));
    /// assert_eq!(KeyRules::default().from_headers(&headers).unwrap(), "k-1");
    /// headers.append("idempotency-key", HeaderValue::from_static("k-2"));
    /// assert_eq!(KeyRules::default().from_headers(&headers), Err(KeyProblem::Conflicting));
    /// ```
    pub fn from_headers(&self, headers: &http::HeaderMap) -> Result<String, KeyProblem> {
        let mut values = headers.get_all(&super::IDEMPOTENCY_KEY_NAME).iter();
        let key = self.parse(values.next().ok_or(KeyProblem::Missing)?)?;
        for other in values {
            if self.parse(other)? != key {
                return Err(KeyProblem::Conflicting);
            }
        }
        Ok(key)
    }
}
