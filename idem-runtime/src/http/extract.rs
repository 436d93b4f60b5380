//! axum: the `Idempotency-Key` extractor and who its key belongs to, named
//! by a function of the request parts ([`KeyCaller`]) or by the
//! application's own authenticating extractor ([`Caller`]).

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use crate::key::{KeyEncoder, KeyPart};

use super::key::{KeyProblem, KeyRules};
use super::problem::{NO_CALLER, problem};

/// Who sends a request, for [`IdempotencyKey`]: a tenant, an API key, a
/// user, read from the request parts. Set it once on the router as an
/// `axum::Extension`; the extractor requires it, and scopes every key to its
/// value, so tenant B sending tenant A's key value never replays A's response.
///
/// The function is the one [`IdempotencyLayer::caller`] takes: `None` means
/// the request cannot be placed, and is 400. An application with one caller
/// says so with `KeyCaller::new(|_| Some(String::new()))`.
///
/// Read only what the client cannot choose: a header an authenticating
/// gateway in front of the server sets (and strips from what clients send),
/// or an extension an authentication layer inserted. When the server itself
/// authenticates, in an extractor, take `IdempotencyKey<YourUser>` instead
/// (see [`Caller`]).
///
/// ```
/// use axum::{Extension, Router, routing::post};
/// use idem_runtime::http::KeyCaller;
///
/// # async fn pay() {}
/// let app: Router = Router::new().route("/pay", post(pay)).layer(Extension(KeyCaller::new(
///     |parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned),
/// )));
/// ```
///
/// [`IdempotencyLayer::caller`]: super::IdempotencyLayer::caller
#[derive(Clone)]
pub struct KeyCaller(Arc<CallerFn>);

type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

impl KeyCaller {
    /// The caller named by `f` from the request parts.
    pub fn new(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        KeyCaller(Arc::new(f))
    }
}

impl std::fmt::Debug for KeyCaller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyCaller").finish_non_exhaustive()
    }
}

/// An identity the server verified, owning the idempotency keys its requests
/// send: what `IdempotencyKey<C>` scopes its key to.
///
/// Implement it on what the application's authenticating extractor yields
/// (an `AuthUser: FromRequestParts` that validated a bearer token or a
/// session), and take `IdempotencyKey<AuthUser>` in the handler. The
/// extractor runs `AuthUser`'s first: a request it rejects gets its rejection
/// (a 401) before the key is even read, so nothing is claimed; an accepted
/// one has its key scoped to [`caller_id`](Caller::caller_id). The verified
/// value is in the key, [`IdempotencyKey::identity`]: the handler need not
/// take (and validate) `AuthUser` a second time.
///
/// **Why not a tenant field of the body.** The client writes the body, so a
/// `tenant_id` there is what the client claims, not who it is. Keys scoped
/// by it let any client that sends another tenant's id with a key value of
/// that tenant's (guessed, leaked in a log, reused from a UUID it saw) be
/// handed that tenant's stored response, a receipt or an order, as a replay,
/// without the handler running or checking anything. Keys must be scoped by
/// what the server verified; the body's tenant is then only checked against
/// it.
///
/// ```
/// use axum::extract::FromRequestParts;
/// use axum::http::{StatusCode, request::Parts};
/// use axum::{Json, Router, routing::post};
/// use idem_runtime::http::{Caller, IdempotencyKey};
/// use idem_runtime::idempotent;
///
/// /// The tenant a valid bearer token belongs to.
/// struct AuthUser { tenant: String }
///
/// impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
///     type Rejection = StatusCode;
///     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
///         let token = parts.headers.get("authorization").and_then(|v| v.to_str().ok());
///         match token {
///             // A real service verifies a signature or looks the token up.
///             Some("Bearer acme-secret") => Ok(AuthUser { tenant: "acme".into() }),
///             _ => Err(StatusCode::UNAUTHORIZED),
///         }
///     }
/// }
///
/// impl Caller for AuthUser {
///     fn caller_id(&self) -> String { self.tenant.clone() }
/// }
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// # impl axum::response::IntoResponse for AppError {
/// #     fn into_response(self) -> axum::response::Response { StatusCode::INTERNAL_SERVER_ERROR.into_response() }
/// # }
/// # #[derive(serde::Deserialize)] struct Pay { amount_cents: u64 }
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Receipt { tenant: String, amount_cents: u64 }
/// #[idempotent(key = "key")]
/// async fn pay(key: IdempotencyKey<AuthUser>, Json(req): Json<Pay>) -> Result<Json<Receipt>, AppError> {
///     let tenant = key.identity().tenant.clone();
///     Ok(Json(Receipt { tenant, amount_cents: req.amount_cents }))
/// }
///
/// // No `KeyCaller` needed: the caller is the one `AuthUser` verified.
/// let app: Router = Router::new().route("/pay", post(pay));
/// ```
pub trait Caller {
    /// The identity whose keys these are: a tenant's id when its users share
    /// keys, a user's for keys of their own. Two callers with equal ids share
    /// their keys, so ids of two kinds (tenants and API clients) must not
    /// collide: prefix them (`"tenant:42"`).
    fn caller_id(&self) -> String;
}

/// The caller of a plain [`IdempotencyKey`]: named by the [`KeyCaller`] set
/// on the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FromKeyCaller(());

/// The request's `Idempotency-Key`, validated, and the caller it belongs to.
///
/// `IdempotencyKey` (that is `IdempotencyKey<FromKeyCaller>`) takes its
/// caller from the [`KeyCaller`] set on the router, which is required:
/// without it the extractor answers 500 (the server could not keep one
/// caller's keys from another's), and a request whose caller it cannot name
/// is 400. `IdempotencyKey<C>` for an authenticating extractor `C` that
/// implements [`Caller`] runs `C` first and answers with its rejection (a 401)
/// when it rejects; no `KeyCaller` is needed. A missing or malformed key, or
/// several different keys, is 400. idem's answers are
/// `application/problem+json`.
///
/// As a key segment it stands for the caller's id and the key together, so
/// `key = "key"` is already scoped to the caller. The rules are [`KeyRules`]
/// from the request's extensions when a layer put them there
/// (`axum::Extension(rules)`), the defaults otherwise.
///
/// ```
/// use axum::{Extension, Json, Router, routing::post};
/// use idem_runtime::{http::{IdempotencyKey, KeyCaller}, idempotent};
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// # impl axum::response::IntoResponse for AppError {
/// #     fn into_response(self) -> axum::response::Response { unreachable!() }
/// # }
/// # #[derive(serde::Deserialize)] struct Pay { amount_cents: u64 }
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Receipt { amount_cents: u64 }
/// # async fn charge(req: &Pay) -> Result<Receipt, AppError> { Ok(Receipt { amount_cents: req.amount_cents }) }
/// #[idempotent(key = "key")]
/// async fn pay(key: IdempotencyKey, Json(req): Json<Pay>) -> Result<Json<Receipt>, AppError> {
///     Ok(Json(charge(&req).await?))
/// }
///
/// let app: Router = Router::new().route("/pay", post(pay)).layer(Extension(KeyCaller::new(
///     |p| p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned),
/// )));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey<C = FromKeyCaller> {
    caller: String,
    key: String,
    identity: C,
}

impl IdempotencyKey {
    /// The key `key` of `caller`, as the extractor would make it.
    ///
    /// ```
    /// let k = idem_runtime::http::IdempotencyKey::new("acme", "8e03978e");
    /// assert_eq!((k.caller(), k.key()), ("acme", "8e03978e"));
    /// ```
    pub fn new(caller: impl Into<String>, key: impl Into<String>) -> Self {
        IdempotencyKey {
            caller: caller.into(),
            key: key.into(),
            identity: FromKeyCaller(()),
        }
    }
}

impl<C: Caller> IdempotencyKey<C> {
    /// The key `key` of the verified `identity`, as the extractor would make
    /// it: for calling a handler from a test or a job.
    ///
    /// ```
    /// use idem_runtime::http::{Caller, IdempotencyKey};
    /// struct Tenant(u32);
    /// impl Caller for Tenant { fn caller_id(&self) -> String { format!("tenant:{}", self.0) } }
    ///
    /// let k = IdempotencyKey::of(Tenant(7), "8e03978e");
    /// assert_eq!((k.caller(), k.key(), k.identity().0), ("tenant:7", "8e03978e", 7));
    /// ```
    pub fn of(identity: C, key: impl Into<String>) -> Self {
        IdempotencyKey {
            caller: identity.caller_id(),
            key: key.into(),
            identity,
        }
    }
}

impl<C> IdempotencyKey<C> {
    /// The client's key, as sent (unquoted).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who sent it: the id [`KeyCaller`] or [`Caller::caller_id`] gave.
    pub fn caller(&self) -> &str {
        &self.caller
    }

    /// The caller as its extractor verified it (an `AuthUser`).
    pub fn identity(&self) -> &C {
        &self.identity
    }

    /// The caller as its extractor verified it, taken out.
    pub fn into_identity(self) -> C {
        self.identity
    }
}

impl<C> KeyPart for IdempotencyKey<C> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_seq_len(2);
        self.caller.encode_key(enc);
        self.key.encode_key(enc);
    }
}

fn reject(status: StatusCode, detail: &str) -> Response {
    problem(status, detail).map(axum::body::Body::new)
}

fn key_of(parts: &Parts) -> Result<String, KeyProblem> {
    let rules = parts
        .extensions
        .get::<KeyRules>()
        .copied()
        .unwrap_or_default();
    rules.from_headers(&parts.headers)
}

fn bad_key(e: KeyProblem) -> Response {
    reject(StatusCode::BAD_REQUEST, &e.to_string())
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let Some(caller_of) = parts.extensions.get::<KeyCaller>().cloned() else {
            tracing::error!(
                "IdempotencyKey needs a KeyCaller on the router (`.layer(Extension(KeyCaller::new(...)))`) to scope keys to their caller"
            );
            return Err(reject(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the server cannot scope idempotency keys to their caller; the request was not processed",
            ));
        };
        let key = key_of(parts).map_err(bad_key)?;
        let Some(caller) = (caller_of.0)(parts) else {
            return Err(reject(StatusCode::BAD_REQUEST, NO_CALLER));
        };
        Ok(IdempotencyKey::new(caller, key))
    }
}

/// The caller's extractor first: a request it rejects is answered before its
/// key is read, so an unauthenticated client learns nothing of the key rules.
impl<S, C> FromRequestParts<S> for IdempotencyKey<C>
where
    S: Send + Sync,
    C: Caller + FromRequestParts<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let identity = C::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let key = key_of(parts).map_err(bad_key)?;
        Ok(IdempotencyKey {
            caller: identity.caller_id(),
            key,
            identity,
        })
    }
}
