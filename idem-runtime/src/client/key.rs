//! Which key an outgoing request carries: the caller's own `Idempotency-Key`
//! header, or one derived from the current call's key with the request's
//! [`KeyName`].

use std::borrow::Cow;

use http::{Extensions, HeaderName, HeaderValue};
use reqwest::Request;

/// The same header the server side reads (`http::IDEMPOTENCY_KEY`), named
/// here too so that `client` does not need the `http` feature.
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The label a request's `Idempotency-Key` is derived with: the request is
/// sent with `current_key().derive(name).to_hex()` (see
/// [`Key::derive`](crate::Key::derive)).
///
/// A per-request extension for
/// [`IdempotencyMiddleware`](super::IdempotencyMiddleware); [`DeriveKey`]
/// sets it in one call. Give each downstream effect of a body its own name
/// (`"psp:charge"`, `"sms:receipt"`): two requests with the same name in the
/// same call (or step) carry the same key, and a provider answers the second
/// with the first one's result.
///
/// ```no_run
/// use idem_runtime::client::KeyName;
///
/// # async fn call(psp: reqwest_middleware::ClientWithMiddleware, item: u32) -> reqwest_middleware::Result<()> {
/// psp.post("https://psp.example/charges")
///     .with_extension(KeyName::new("psp:charge"))
///     .send()
///     .await?;
/// // Names built at run time, for one effect per item of a loop:
/// psp.post("https://psp.example/charges")
///     .with_extension(KeyName::new(format!("psp:charge:{item}")))
///     .send()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyName(Cow<'static, str>);

impl KeyName {
    /// A name: a `&'static str` is kept as is, a `String` when the name is
    /// built at run time.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        KeyName(name.into())
    }

    /// The label the key is derived with.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&'static str> for KeyName {
    fn from(name: &'static str) -> Self {
        KeyName::new(name)
    }
}

impl From<String> for KeyName {
    fn from(name: String) -> Self {
        KeyName::new(name)
    }
}

/// `.derive_key(name)` on a request builder: the same as
/// `.with_extension(KeyName::new(name))`.
///
/// ```no_run
/// use idem_runtime::client::DeriveKey;
///
/// # async fn call(psp: reqwest_middleware::ClientWithMiddleware) -> reqwest_middleware::Result<()> {
/// psp.post("https://psp.example/charges").derive_key("psp:charge").send().await?;
/// # Ok(()) }
/// ```
pub trait DeriveKey {
    /// Sends the request with an `Idempotency-Key` derived from the current
    /// call's key with `name`.
    fn derive_key(self, name: impl Into<Cow<'static, str>>) -> Self;
}

impl DeriveKey for reqwest_middleware::RequestBuilder {
    fn derive_key(self, name: impl Into<Cow<'static, str>>) -> Self {
        self.with_extension(KeyName::new(name))
    }
}

/// A request asked for a derived key ([`KeyName`]) outside any idempotent
/// call, where there is no key to derive it from: it was not sent.
///
/// Sending it without a key would let a retry of the caller repeat the
/// effect downstream, which is what the name asked to prevent. It usually
/// means the request was sent from a task spawned inside the body
/// (`current_key()` is task-local), or from code that is not under
/// `#[idempotent]` at all.
///
/// The middleware returns it as [`reqwest_middleware::Error::Middleware`]:
///
/// ```
/// use idem_runtime::client::OutsideIdempotentCall;
///
/// fn outside_a_call(e: &reqwest_middleware::Error) -> Option<&OutsideIdempotentCall> {
///     match e {
///         reqwest_middleware::Error::Middleware(e) => e.downcast_ref(),
///         reqwest_middleware::Error::Reqwest(_) => None,
///     }
/// }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "the request asked for an Idempotency-Key derived with `{}`, but it runs outside any idempotent call (no current_key() on this task), so it was not sent",
    .key_name.as_str()
)]
pub struct OutsideIdempotentCall {
    key_name: KeyName,
}

impl OutsideIdempotentCall {
    /// The name the request asked its key to be derived with.
    pub fn key_name(&self) -> &str {
        self.key_name.as_str()
    }
}

/// Gives `req` its key, if it has one; `Ok(true)` when it goes out keyed.
/// The caller's own header wins over a name: never two headers.
pub(super) fn attach(
    req: &mut Request,
    extensions: &Extensions,
) -> Result<bool, OutsideIdempotentCall> {
    if req.headers().contains_key(&IDEMPOTENCY_KEY) {
        return Ok(true);
    }
    let Some(name) = extensions.get::<KeyName>() else {
        return Ok(false);
    };
    let Some(call) = crate::current_key() else {
        return Err(OutsideIdempotentCall {
            key_name: name.clone(),
        });
    };
    let value = HeaderValue::try_from(call.derive(name.as_str()).to_hex())
        .expect("hex digits are a valid header value");
    req.headers_mut().insert(IDEMPOTENCY_KEY, value);
    Ok(true)
}
