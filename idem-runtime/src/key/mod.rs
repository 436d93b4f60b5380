//! Key derivation: business fields → an injective byte encoding → SHA-256, or
//! HMAC-SHA-256 under a [`KeySecret`].
//!
//! Every part is written with a type tag and, where its length varies, a length
//! prefix. The encoding of one part is therefore prefix-free, and a sequence of
//! parts decodes in exactly one way: `("a|b", "c")` and `("a", "b|c")` can never
//! share a key, as they would under a plain `String.join("|")`.
//!
//! Stores only ever see the 32-byte hash, never the raw values. Without a
//! secret that hash hides only what cannot be guessed: see [`Key`] for what a
//! plain hash exposes, and [`KeySecret`] for the keyed one.
//!
//! - `part.rs`: [`KeyPart`] and the encoding every part goes through;
//! - `secret.rs`: [`KeySecret`] and the process-wide one;
//! - `fingerprint.rs`: [`Fingerprint`], hashed like a key.

use std::fmt;

use sha2::{Digest, Sha256};

mod fingerprint;
mod part;
mod secret;
#[cfg(test)]
mod tests;

pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use part::{KeyEncoder, KeyPart};
pub(crate) use secret::install as install_secret;
pub use secret::{KeySecret, KeySecretError};

use part::{ENCODING_VERSION, tag};

/// The hash of an encoding: keyed when there is a secret.
fn hash(secret: Option<&KeySecret>, encoding: &[u8]) -> [u8; 32] {
    match secret {
        Some(secret) => secret.hash(encoding),
        None => Sha256::digest(encoding).into(),
    }
}

/// A derived idempotency key: the hash of the scope and the encoded parts,
/// HMAC-SHA-256 under the [`KeySecret`] if one is installed (or given to
/// [`Key::keyed_builder`]), plain SHA-256 otherwise.
///
/// **What a plain SHA-256 key exposes.** Without a secret, the hash is of a
/// public encoding of the scope and the fields, so it hides only what cannot
/// be guessed. Whoever can read the store (a replica, a backup, a dump, a
/// support tool) or is handed a key derived from it (a downstream
/// `Idempotency-Key`) can test candidate field values offline, at millions per
/// second: a user id, an order number, a date, a small amount is recovered in
/// seconds, and with it which user did what, when. The raw values are not in
/// the store, but they are not protected either. Install a [`KeySecret`]
/// wherever that matters.
///
/// ```
/// use idem_runtime::Key;
///
/// let a = Key::builder("orders::create").part(&42u64).part("SKU-1").finish();
/// let b = Key::builder("orders::create").part(&42u64).part("SKU-1").finish();
/// assert_eq!(a, b);
/// assert_eq!(a.to_hex().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key([u8; 32]);

impl Key {
    /// Starts a key in `scope` (a namespace such as `"orders::create"`),
    /// hashed under the installed [`KeySecret`] if there is one (see
    /// [`crate::install_key_secret`]), with plain SHA-256 otherwise.
    pub fn builder(scope: &str) -> KeyBuilder {
        Key::start(scope, secret::installed())
    }

    /// Starts a key in `scope` hashed under `secret`, whatever is installed:
    /// for code that does not use the process-wide secret.
    ///
    /// ```
    /// use idem_runtime::{Key, KeySecret};
    ///
    /// let secret = KeySecret::from_bytes(&[42; 32])?;
    /// let a = Key::keyed_builder("orders::create", &secret).part(&7u64).finish();
    /// let b = Key::keyed_builder("orders::create", &secret).part(&7u64).finish();
    /// assert_eq!(a, b);
    /// # Ok::<(), idem_runtime::KeySecretError>(())
    /// ```
    pub fn keyed_builder(scope: &str, secret: &KeySecret) -> KeyBuilder {
        Key::start(scope, Some(secret.clone()))
    }

    fn start(scope: &str, secret: Option<KeySecret>) -> KeyBuilder {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::SCOPE, scope.as_bytes());
        KeyBuilder { enc, secret }
    }

    /// Wraps a hash read back from a store.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Key(bytes)
    }

    /// The 32 hash bytes, as stores keep them.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex of the hash: safe to log, to put in a trace or to pass on.
    pub fn to_hex(&self) -> String {
        // Every Redis call names its record by this: encode into a buffer rather
        // than through `hex::encode`'s char-by-char iterator.
        let mut buf = [0u8; 64];
        hex::encode_to_slice(self.0, &mut buf).expect("64 bytes hold 32 in hex");
        String::from_utf8(buf.to_vec()).expect("hex digits are ASCII")
    }

    /// Parses the 64-character hex form produced by [`Key::to_hex`].
    pub fn from_hex(s: &str) -> Result<Self, KeyParseError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| KeyParseError { input_len: s.len() })?;
        Ok(Key(out))
    }

    /// A key derived from this one and a label, stable across retries.
    ///
    /// Use it for the `Idempotency-Key` of each downstream call a body makes, or
    /// as the key of a step: the same parent and label always give the same
    /// child, and different labels never collide. The child is the SHA-256 of
    /// the parent's hash and the label: keyed whenever the parent is, since
    /// nobody can compute the parent without the secret.
    ///
    /// ```
    /// use idem_runtime::Key;
    ///
    /// let order = Key::builder("orders::create").part(&7u64).finish();
    /// assert_eq!(order.derive("charge"), order.derive("charge"));
    /// assert_ne!(order.derive("charge"), order.derive("refund"));
    /// ```
    pub fn derive(&self, label: &str) -> Key {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::LABEL, &self.0);
        enc.write_str(label);
        Key(Sha256::digest(&enc.buf).into())
    }
}

impl Key {
    /// The first 16 hex digits: enough to find a record in logs, short
    /// enough to read. Written only when displayed: tracing evaluates span
    /// fields even with no subscriber when its `log` feature is on (sqlx turns
    /// it on), and a `String` here would allocate on every call.
    ///
    /// ```
    /// let key = idem_runtime::Key::builder("doc").part("k").finish();
    /// assert_eq!(key.short().to_string(), key.to_hex()[..16]);
    /// ```
    pub fn short(&self) -> ShortKey<'_> {
        ShortKey(self)
    }

    /// The id of an outbox message written under this key (a call's or a
    /// step's): a hash of the key and the whole message, so a retry that
    /// writes the same message meets its row, and one that writes another
    /// message (or the same one in another order) cannot take an id the
    /// first run's messages hold.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn derive_message(
        &self,
        topic: &str,
        ordering_key: Option<&str>,
        headers: &std::collections::BTreeMap<String, String>,
        payload: &[u8],
    ) -> Key {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::LABEL, &self.0);
        enc.write_str("outbox");
        enc.write_str(topic);
        match ordering_key {
            Some(k) => {
                enc.write_some();
                enc.write_str(k);
            }
            None => enc.write_none(),
        }
        enc.write_seq_len(headers.len());
        for (name, value) in headers {
            enc.write_str(name);
            enc.write_str(value);
        }
        enc.write_bytes(payload);
        Key(Sha256::digest(&enc.buf).into())
    }

    /// The key of the `index`-th call of `label` under this key (steps).
    pub(crate) fn derive_indexed(&self, label: &str, index: u64) -> Key {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::LABEL, &self.0);
        enc.write_str(label);
        enc.write_uint(u128::from(index));
        Key(Sha256::digest(&enc.buf).into())
    }

    /// The key of the `index`-th call of step `label` for one item (the key
    /// `#[step(key = …)]` built from the call's arguments). The item is
    /// written as tagged bytes where [`Key::derive_indexed`] writes the
    /// number, so no keyed call shares a key with an unkeyed one.
    pub(crate) fn derive_item(&self, label: &str, item: &Key, index: u64) -> Key {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::LABEL, &self.0);
        enc.write_str(label);
        enc.write_tagged_bytes(tag::LABEL, &item.0);
        enc.write_uint(u128::from(index));
        Key(Sha256::digest(&enc.buf).into())
    }
}

/// The seal of a recoverable call's stored arguments: a hash of the key, the
/// scope and the argument bytes, keyed under the installed [`KeySecret`]
/// like keys and fingerprints. A worker recomputes it before running the
/// call, so arguments written into the store by anyone without the secret
/// (or corrupted there) are refused rather than run.
pub(crate) fn seal(key: &Key, scope: &str, args: &[u8]) -> [u8; 32] {
    let mut enc = KeyEncoder {
        buf: part::Encoding::with_capacity(args.len() + scope.len() + 64),
    };
    enc.buf.push(ENCODING_VERSION);
    enc.write_str("idem:recovery-args");
    enc.write_bytes(&key.0);
    enc.write_str(scope);
    enc.write_bytes(args);
    hash(secret::installed().as_ref(), &enc.buf)
}

/// Hashes a [`Key`] for a `HashMap` by taking eight of its bytes: keys are
/// SHA-256 digests, already uniform, and SipHash over all 32 on every lookup
/// is work for nothing. Maps keyed by anything that is not uniform bytes (a
/// digest, a random token) must not use it.
#[derive(Clone, Copy, Default)]
pub(crate) struct DigestHasher(u64);

impl DigestHasher {
    /// For `static` maps, which need a `const` hasher.
    pub(crate) const fn new() -> DigestHasher {
        DigestHasher(0)
    }
}

impl std::hash::BuildHasher for DigestHasher {
    type Hasher = DigestHasher;
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(0)
    }
}

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Bytes 8..16 of the digest: maps sharded by key pick the shard by
        // byte 0, so these stay uniform within a shard.
        if let Some(word) = bytes.get(8..16) {
            self.0 = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        }
    }
    fn write_usize(&mut self, _: usize) {
        // The length prefix of a fixed-size digest says nothing.
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.to_hex())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A string that is not the 64-digit hex form of a [`Key`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("not an idempotency key: expected 64 hexadecimal digits, got {input_len} characters")]
pub struct KeyParseError {
    input_len: usize,
}

/// Accumulates the parts of a [`Key`].
#[derive(Debug, Clone)]
pub struct KeyBuilder {
    enc: KeyEncoder,
    secret: Option<KeySecret>,
}

impl KeyBuilder {
    /// Appends one part.
    pub fn part<P: KeyPart + ?Sized>(mut self, part: &P) -> Self {
        part.encode_key(&mut self.enc);
        self
    }

    /// Appends one part in place.
    pub fn push<P: KeyPart + ?Sized>(&mut self, part: &P) {
        part.encode_key(&mut self.enc);
    }

    /// The encoding so far: scope and parts, before hashing.
    pub fn encoding(&self) -> &[u8] {
        self.enc.as_bytes()
    }

    /// Hashes the encoding into the key (keyed if the builder has a secret).
    pub fn finish(self) -> Key {
        Key(hash(self.secret.as_ref(), &self.enc.buf))
    }
}

/// The short form of a [`Key`] ([`Key::short`]), for logs.
#[derive(Debug, Clone, Copy)]
pub struct ShortKey<'a>(&'a Key);

impl fmt::Display for ShortKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.0[..8].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}
