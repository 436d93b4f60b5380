//! The process-wide default store and key secret, installed once at start-up.

use std::sync::RwLock;

use crate::key::KeySecret;
use crate::store::{AsStore, StoreRef};

static DEFAULT: RwLock<Option<StoreRef>> = RwLock::new(None);

/// Installs the store that annotated calls without `store = …` use.
///
/// Call it once at start-up, before serving. Installing again replaces the
/// store for calls that start afterwards (tests use this).
///
/// ```
/// use idem_runtime::store::memory::MemoryStore;
///
/// idem_runtime::install(MemoryStore::new());
/// ```
pub fn install(store: impl AsStore) {
    let store = store.store_ref();
    *DEFAULT.write().unwrap_or_else(|p| p.into_inner()) = Some(store);
}

pub(crate) fn default_store() -> Option<StoreRef> {
    DEFAULT.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Installs the secret every key and fingerprint is hashed under
/// (HMAC-SHA-256), for annotated calls and [`crate::Key::builder`] alike.
///
/// Call it once at start-up, before serving, with the same secret on every
/// replica that shares a store; keys computed before it are plain SHA-256.
/// Without it keys are plain SHA-256 of guessable fields: see
/// [`crate::Key`] for what that exposes. Installing a different secret later
/// is a rotation, and a rotation changes every key: read
/// [`KeySecret`]'s section on rotation first.
///
/// ```no_run
/// use idem_runtime::KeySecret;
/// use idem_runtime::store::memory::MemoryStore;
///
/// let secret = KeySecret::from_env("IDEM_KEY_SECRET")?;
/// tracing::info!(key_secret = %secret.id(), "idempotency keys are keyed");
/// idem_runtime::install_key_secret(secret);
/// idem_runtime::install(MemoryStore::new());
/// # Ok::<(), idem_runtime::KeySecretError>(())
/// ```
pub fn install_key_secret(secret: KeySecret) {
    crate::key::install_secret(secret);
}
