//! [`KeySecret`], and the one the process installed: what keys and
//! fingerprints are hashed under.

use std::fmt;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A per-deployment secret that keys every idempotency key and fingerprint:
/// hashes become HMAC-SHA-256 under it instead of plain SHA-256.
///
/// With a secret, a stored hash says nothing to whoever reads the store (a
/// replica, a backup, a dump, a downstream provider given a derived
/// `Idempotency-Key`) unless they also hold the secret: the fields cannot be
/// recovered by hashing guesses. Install it once at start-up with
/// [`crate::install_key_secret`], or pass it to [`Key::keyed_builder`](crate::Key::keyed_builder) in code
/// that does not use the process-wide one.
///
/// The secret must be the same on every replica that shares a store, and the
/// same from one start to the next: generate it once (32 random bytes, e.g.
/// `openssl rand -hex 32`), keep it in the deployment's secret store, never
/// generate it at start-up.
///
/// # Rotation changes every key
///
/// A key is a function of the secret, so a new secret gives every call a new
/// key, and every key derived from it (steps, downstream `Idempotency-Key`s)
/// and fingerprint with it. There is no lookup under the old secret:
///
/// - a retry that straddles the change (first attempt under the old secret,
///   retry under the new) finds no record and **runs its body again**; a claim
///   still PROCESSING under the old key does not hold it back either;
/// - a flow resumed after the change runs again the steps it had finished, and
///   downstream providers get new `Idempotency-Key`s, so they do not
///   deduplicate those calls either;
/// - replicas on different secrets do not see each other's records: during a
///   rolling deploy, the whole rollout is that window;
/// - the records written under the old secret are unreachable; they stay until
///   their ttl (Redis deletes them, a sweeper purges them from SQL).
///
/// Turning a secret on for the first time is such a rotation too (from the
/// plain hash to the keyed one). To rotate safely, do it when no retry of an
/// earlier request can still arrive: stop taking requests (pause consumers),
/// let calls in flight finish and the clients' retry windows (a consumer's
/// redelivery window) pass, switch every replica at once, then resume. If
/// that cannot be done, the duplicates of that window are stopped only by the
/// business table's own unique constraint, which should be there anyway.
/// Rotate because a secret leaked, not on a schedule.
///
/// The secret never appears in `Debug` output; [`KeySecret::id`] names it in
/// logs without revealing it.
///
/// ```
/// use idem_runtime::{Key, KeySecret};
///
/// // An example only: load yours from the deployment's secret store.
/// let secret = KeySecret::from_bytes(b"example secret, never use this one!!")?;
/// let keyed = Key::keyed_builder("orders::create", &secret).part(&734211u64).finish();
/// let plain = Key::builder("orders::create").part(&734211u64).finish();
/// assert_ne!(keyed, plain);
/// assert!(!format!("{secret:?}").contains("example"));
/// # Ok::<(), idem_runtime::KeySecretError>(())
/// ```
#[derive(Clone)]
pub struct KeySecret {
    // The HMAC state after absorbing the secret: each hash clones it instead of
    // keying a fresh one.
    mac: HmacSha256,
}

impl KeySecret {
    /// The shortest secret accepted, in bytes: as long as the hash, as RFC 2104
    /// advises for an HMAC key.
    pub const MIN_LEN: usize = 32;

    /// A secret from raw bytes (at least [`KeySecret::MIN_LEN`]).
    ///
    /// ```
    /// use idem_runtime::KeySecret;
    ///
    /// assert!(KeySecret::from_bytes(&[7; 32]).is_ok());
    /// assert!(KeySecret::from_bytes(b"password").is_err());
    /// ```
    pub fn from_bytes(bytes: &[u8]) -> Result<KeySecret, KeySecretError> {
        if bytes.len() < Self::MIN_LEN {
            return Err(KeySecretError::TooShort { len: bytes.len() });
        }
        let mac = HmacSha256::new_from_slice(bytes).expect("HMAC takes a key of any length");
        Ok(KeySecret { mac })
    }

    /// A secret from hex digits (surrounding whitespace, such as the newline
    /// at the end of a secret file, is ignored).
    ///
    /// ```
    /// use idem_runtime::KeySecret;
    ///
    /// let hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n";
    /// assert!(KeySecret::from_hex(hex).is_ok());
    /// assert!(KeySecret::from_hex("not hex").is_err());
    /// ```
    pub fn from_hex(hex: &str) -> Result<KeySecret, KeySecretError> {
        let bytes = hex::decode(hex.trim()).map_err(|_| KeySecretError::NotHex)?;
        KeySecret::from_bytes(&bytes)
    }

    /// A secret from the hex digits in an environment variable.
    ///
    /// ```no_run
    /// use idem_runtime::KeySecret;
    ///
    /// idem_runtime::install_key_secret(KeySecret::from_env("IDEM_KEY_SECRET")?);
    /// # Ok::<(), idem_runtime::KeySecretError>(())
    /// ```
    pub fn from_env(var: &str) -> Result<KeySecret, KeySecretError> {
        let value = std::env::var(var).map_err(|_| KeySecretError::Missing {
            var: var.to_owned(),
        })?;
        KeySecret::from_hex(&value).map_err(|e| match e {
            KeySecretError::NotHex => KeySecretError::NotHexIn {
                var: var.to_owned(),
            },
            other => other,
        })
    }

    /// A short name for this secret, safe to log: the first 8 hex digits of
    /// its HMAC of a fixed label. Log it at start-up on every replica; they
    /// must all show the same one.
    ///
    /// ```
    /// use idem_runtime::KeySecret;
    ///
    /// let a = KeySecret::from_bytes(&[1; 32]).unwrap();
    /// assert_eq!(a.id(), KeySecret::from_bytes(&[1; 32]).unwrap().id());
    /// assert_ne!(a.id(), KeySecret::from_bytes(&[2; 32]).unwrap().id());
    /// ```
    pub fn id(&self) -> String {
        hex::encode(&self.hash(b"idem key secret id")[..4])
    }

    pub(super) fn hash(&self, bytes: &[u8]) -> [u8; 32] {
        let mut mac = self.mac.clone();
        mac.update(bytes);
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySecret").field("id", &self.id()).finish()
    }
}

/// A [`KeySecret`] that could not be made. Never shows the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeySecretError {
    /// Fewer bytes than [`KeySecret::MIN_LEN`].
    #[error(
        "a key secret needs at least {min} bytes, got {len}: generate one with `openssl rand -hex 32`",
        min = KeySecret::MIN_LEN
    )]
    TooShort {
        /// How many bytes were given.
        len: usize,
    },
    /// The text is not hex digits.
    #[error("a key secret must be hex digits")]
    NotHex,
    /// The environment variable is not hex digits.
    #[error("the key secret in ${var} must be hex digits")]
    NotHexIn {
        /// The variable's name.
        var: String,
    },
    /// The environment variable is not set (or not Unicode).
    #[error("no key secret: ${var} is not set")]
    Missing {
        /// The variable's name.
        var: String,
    },
}

static INSTALLED: RwLock<Option<KeySecret>> = RwLock::new(None);
// Every key derivation asks for the secret; most processes never install
// one, and they should not pay a lock for that answer.
static HAS_INSTALLED: AtomicBool = AtomicBool::new(false);

/// Makes `secret` the one [`Key::builder`](super::Key::builder) and
/// [`Fingerprint::builder`](super::Fingerprint::builder) hash under (see
/// [`crate::install_key_secret`]).
pub(crate) fn install(secret: KeySecret) {
    *INSTALLED.write().unwrap_or_else(|p| p.into_inner()) = Some(secret);
    HAS_INSTALLED.store(true, Ordering::Release);
}

/// The installed secret, if any.
pub(super) fn installed() -> Option<KeySecret> {
    if !HAS_INSTALLED.load(Ordering::Acquire) {
        return None;
    }
    INSTALLED.read().unwrap_or_else(|p| p.into_inner()).clone()
}
