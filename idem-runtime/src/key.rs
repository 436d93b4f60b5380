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

use std::borrow::Cow;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// Version byte mixed into every key, so a future change of encoding can never
/// silently collide with records written by this one.
const ENCODING_VERSION: u8 = 1;

mod tag {
    pub const UINT: u8 = 0x01;
    pub const NEG_INT: u8 = 0x02;
    pub const BOOL: u8 = 0x03;
    pub const STR: u8 = 0x04;
    pub const BYTES: u8 = 0x05;
    pub const NONE: u8 = 0x06;
    pub const SOME: u8 = 0x07;
    pub const SEQ: u8 = 0x08;
    pub const CHAR: u8 = 0x09;
    pub const SCOPE: u8 = 0x0a;
    pub const LABEL: u8 = 0x0b;
}

/// A value that can be part of an idempotency key.
///
/// Implemented for integers, `bool`, `char`, strings, byte strings, `Option`,
/// slices, `Vec`, references and smart pointers. Clock types (`SystemTime`,
/// `Instant`, chrono and time types) deliberately do **not** implement it: a key
/// that contains "now" changes on every retry and never deduplicates. Floats do
/// not either: `0.1 + 0.2` and `0.3` are different keys, which is never what a
/// business key means.
///
/// Implement it for your own stable identifiers by encoding their fields:
///
/// ```
/// use idem_runtime::{KeyEncoder, KeyPart};
///
/// struct Sku(u64);
///
/// impl KeyPart for Sku {
///     fn encode_key(&self, enc: &mut KeyEncoder) {
///         self.0.encode_key(enc);
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be part of an idempotency key",
    label = "a segment of this key has type `{Self}`, which is not a `KeyPart`",
    note = "a key must be the same on every retry of one business intent: clock values (`SystemTime`, `Instant`, chrono/time types) and per-request random ids change every time, so such a key never deduplicates",
    note = "build the key from business fields (user id, sku, client order number); for your own stable id types, implement `idem_runtime::KeyPart`"
)]
pub trait KeyPart {
    /// Appends this value's tagged, length-prefixed encoding.
    fn encode_key(&self, enc: &mut KeyEncoder);
}

/// The byte sink [`KeyPart`] implementations write into.
///
/// Its methods are the only way to write bytes, and each one writes a tag and,
/// for variable-length data, a length prefix, so every composition stays
/// injective.
#[derive(Debug, Clone, Default)]
pub struct KeyEncoder {
    buf: Vec<u8>,
}

impl KeyEncoder {
    /// An empty encoder. Most code uses [`Key::builder`] instead.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes an unsigned integer. Every unsigned and non-negative signed
    /// integer type shares this encoding, so widening a field from `u32` to
    /// `u64` keeps existing keys.
    pub fn write_uint(&mut self, v: u128) {
        self.buf.push(tag::UINT);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    /// Writes a signed integer (non-negative values encode as unsigned ones).
    pub fn write_int(&mut self, v: i128) {
        match u128::try_from(v) {
            Ok(u) => self.write_uint(u),
            Err(_) => {
                self.buf.push(tag::NEG_INT);
                self.buf.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    /// Writes a boolean.
    pub fn write_bool(&mut self, v: bool) {
        self.buf.push(tag::BOOL);
        self.buf.push(u8::from(v));
    }

    /// Writes a character.
    pub fn write_char(&mut self, v: char) {
        self.buf.push(tag::CHAR);
        self.buf.extend_from_slice(&u32::from(v).to_be_bytes());
    }

    /// Writes a UTF-8 string, length-prefixed.
    pub fn write_str(&mut self, v: &str) {
        self.write_tagged_bytes(tag::STR, v.as_bytes());
    }

    /// Writes raw bytes, length-prefixed and tagged apart from strings.
    pub fn write_bytes(&mut self, v: &[u8]) {
        self.write_tagged_bytes(tag::BYTES, v);
    }

    /// Writes the absence of an optional value.
    pub fn write_none(&mut self) {
        self.buf.push(tag::NONE);
    }

    /// Announces that one value follows (the `Some` of an `Option`).
    pub fn write_some(&mut self) {
        self.buf.push(tag::SOME);
    }

    /// Announces a sequence of `len` values; write each of them next.
    pub fn write_seq_len(&mut self, len: usize) {
        self.buf.push(tag::SEQ);
        self.buf.extend_from_slice(&(len as u64).to_be_bytes());
    }

    /// The bytes written so far (for tests and diagnostics).
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    fn write_tagged_bytes(&mut self, t: u8, v: &[u8]) {
        self.buf.push(t);
        self.buf.extend_from_slice(&(v.len() as u64).to_be_bytes());
        self.buf.extend_from_slice(v);
    }
}

macro_rules! uint_parts {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            fn encode_key(&self, enc: &mut KeyEncoder) {
                enc.write_uint(u128::from(*self));
            }
        }
    )*};
}
uint_parts!(u8, u16, u32, u64, u128);

macro_rules! int_parts {
    ($($t:ty),*) => {$(
        impl KeyPart for $t {
            fn encode_key(&self, enc: &mut KeyEncoder) {
                enc.write_int(i128::from(*self));
            }
        }
    )*};
}
int_parts!(i8, i16, i32, i64, i128);

impl KeyPart for usize {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_uint(*self as u128);
    }
}

impl KeyPart for isize {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_int(*self as i128);
    }
}

impl KeyPart for bool {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_bool(*self);
    }
}

impl KeyPart for char {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_char(*self);
    }
}

impl KeyPart for str {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_str(self);
    }
}

impl KeyPart for String {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_str(self);
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        match self {
            None => enc.write_none(),
            Some(v) => {
                enc.write_some();
                v.encode_key(enc);
            }
        }
    }
}

impl<T: KeyPart> KeyPart for [T] {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        enc.write_seq_len(self.len());
        for v in self {
            v.encode_key(enc);
        }
    }
}

impl<T: KeyPart, const N: usize> KeyPart for [T; N] {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        self.as_slice().encode_key(enc);
    }
}

impl<T: KeyPart> KeyPart for Vec<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        self.as_slice().encode_key(enc);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &T {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        (**self).encode_key(enc);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &mut T {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        (**self).encode_key(enc);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Box<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        (**self).encode_key(enc);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Arc<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        (**self).encode_key(enc);
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Rc<T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        (**self).encode_key(enc);
    }
}

impl<T: KeyPart + ToOwned + ?Sized> KeyPart for Cow<'_, T> {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        self.as_ref().encode_key(enc);
    }
}

/// A per-deployment secret that keys every idempotency key and fingerprint:
/// hashes become HMAC-SHA-256 under it instead of plain SHA-256.
///
/// With a secret, a stored hash says nothing to whoever reads the store (a
/// replica, a backup, a dump, a downstream provider given a derived
/// `Idempotency-Key`) unless they also hold the secret: the fields cannot be
/// recovered by hashing guesses. Install it once at start-up with
/// [`crate::install_key_secret`], or pass it to [`Key::keyed_builder`] in code
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

    fn hash(&self, bytes: &[u8]) -> [u8; 32] {
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
        Key::start(scope, crate::install::key_secret())
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
        // Room for the scope and a few fields up front: growing the buffer
        // field by field was several reallocations per key.
        let mut enc = KeyEncoder {
            buf: Vec::with_capacity(64 + scope.len()),
        };
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
    /// The first 16 hex digits: enough to find a record in logs, short enough to read.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..8])
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

/// A payload fingerprint: a hash of the fields that must match between a
/// request and the one whose result it would replay.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Starts a fingerprint; add the fields with [`FingerprintBuilder::part`].
    /// Keyed like [`Key::builder`]: a fingerprint is stored next to its key
    /// and its fields can be as guessable.
    pub fn builder() -> FingerprintBuilder {
        Fingerprint::start(crate::install::key_secret())
    }

    /// Starts a fingerprint hashed under `secret`, whatever is installed.
    pub fn keyed_builder(secret: &KeySecret) -> FingerprintBuilder {
        Fingerprint::start(Some(secret.clone()))
    }

    fn start(secret: Option<KeySecret>) -> FingerprintBuilder {
        let mut enc = KeyEncoder {
            buf: Vec::with_capacity(64),
        };
        enc.buf.push(ENCODING_VERSION);
        FingerprintBuilder { enc, secret }
    }

    /// Wraps a fingerprint read back from a store.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The 32 hash bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// Accumulates the parts of a [`Fingerprint`].
#[derive(Debug, Clone)]
pub struct FingerprintBuilder {
    enc: KeyEncoder,
    secret: Option<KeySecret>,
}

impl FingerprintBuilder {
    /// Appends one field.
    pub fn part<P: KeyPart + ?Sized>(mut self, part: &P) -> Self {
        part.encode_key(&mut self.enc);
        self
    }

    /// Appends one field in place.
    pub fn push<P: KeyPart + ?Sized>(&mut self, part: &P) {
        part.encode_key(&mut self.enc);
    }

    /// Hashes the fields (keyed if the builder has a secret).
    pub fn finish(self) -> Fingerprint {
        Fingerprint(hash(self.secret.as_ref(), &self.enc.buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    /// One key part of any supported shape.
    #[derive(Debug, Clone)]
    enum Part {
        U(u64),
        I(i64),
        B(bool),
        C(char),
        S(String),
        O(Option<String>),
        V(Vec<u32>),
    }

    /// What a part means, after the deliberate normalisation (every
    /// non-negative integer is one integer, whatever its type).
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Decoded {
        UInt(u128),
        NegInt(i128),
        Bool(bool),
        Char(char),
        Str(String),
        None,
        Some(Box<Decoded>),
        Seq(Vec<Decoded>),
    }

    fn normalise(p: &Part) -> Decoded {
        match p {
            Part::U(v) => Decoded::UInt(u128::from(*v)),
            Part::I(v) if *v >= 0 => Decoded::UInt(*v as u128),
            Part::I(v) => Decoded::NegInt(i128::from(*v)),
            Part::B(v) => Decoded::Bool(*v),
            Part::C(v) => Decoded::Char(*v),
            Part::S(v) => Decoded::Str(v.clone()),
            Part::O(None) => Decoded::None,
            Part::O(Some(v)) => Decoded::Some(Box::new(Decoded::Str(v.clone()))),
            Part::V(v) => Decoded::Seq(v.iter().map(|x| Decoded::UInt(u128::from(*x))).collect()),
        }
    }

    fn encode(parts: &[Part]) -> Vec<u8> {
        let mut b = Key::builder("scope");
        for p in parts {
            match p {
                Part::U(v) => b.push(v),
                Part::I(v) => b.push(v),
                Part::B(v) => b.push(v),
                Part::C(v) => b.push(v),
                Part::S(v) => b.push(v),
                Part::O(v) => b.push(v),
                Part::V(v) => b.push(v),
            }
        }
        b.encoding().to_vec()
    }

    /// A decoder for the encoding: if it recovers every part list exactly,
    /// no two different lists can share an encoding.
    fn decode(mut buf: &[u8]) -> Vec<Decoded> {
        fn take<'a>(buf: &mut &'a [u8], n: usize) -> &'a [u8] {
            let (head, tail) = buf.split_at(n);
            *buf = tail;
            head
        }
        fn len(buf: &mut &[u8]) -> usize {
            u64::from_be_bytes(take(buf, 8).try_into().unwrap()) as usize
        }
        fn one(buf: &mut &[u8]) -> Decoded {
            match take(buf, 1)[0] {
                tag::UINT => Decoded::UInt(u128::from_be_bytes(take(buf, 16).try_into().unwrap())),
                tag::NEG_INT => {
                    Decoded::NegInt(i128::from_be_bytes(take(buf, 16).try_into().unwrap()))
                }
                tag::BOOL => Decoded::Bool(take(buf, 1)[0] == 1),
                tag::CHAR => Decoded::Char(
                    char::from_u32(u32::from_be_bytes(take(buf, 4).try_into().unwrap())).unwrap(),
                ),
                tag::STR => {
                    let n = len(buf);
                    Decoded::Str(String::from_utf8(take(buf, n).to_vec()).unwrap())
                }
                tag::NONE => Decoded::None,
                tag::SOME => Decoded::Some(Box::new(one(buf))),
                tag::SEQ => {
                    let n = len(buf);
                    Decoded::Seq((0..n).map(|_| one(buf)).collect())
                }
                t => panic!("unknown tag {t}"),
            }
        }
        assert_eq!(take(&mut buf, 1)[0], ENCODING_VERSION);
        assert_eq!(take(&mut buf, 1)[0], tag::SCOPE);
        let n = len(&mut buf);
        assert_eq!(take(&mut buf, n), b"scope");
        let mut out = Vec::new();
        while !buf.is_empty() {
            out.push(one(&mut buf));
        }
        out
    }

    fn part() -> impl Strategy<Value = Part> {
        prop_oneof![
            any::<u64>().prop_map(Part::U),
            any::<i64>().prop_map(Part::I),
            any::<bool>().prop_map(Part::B),
            any::<char>().prop_map(Part::C),
            // Separators and prefixes of each other are the interesting strings.
            "[a|b:,]{0,6}".prop_map(Part::S),
            proptest::option::of("[a|b]{0,4}").prop_map(Part::O),
            proptest::collection::vec(0u32..4, 0..4).prop_map(Part::V),
        ]
    }

    proptest! {
        #[test]
        fn encoding_decodes_to_exactly_the_parts(parts in proptest::collection::vec(part(), 0..6)) {
            let expected: Vec<Decoded> = parts.iter().map(normalise).collect();
            prop_assert_eq!(decode(&encode(&parts)), expected);
        }

        #[test]
        fn distinct_part_lists_never_share_a_key(
            a in proptest::collection::vec(part(), 0..5),
            b in proptest::collection::vec(part(), 0..5),
        ) {
            let same_meaning = a.iter().map(normalise).eq(b.iter().map(normalise));
            prop_assert_eq!(encode(&a) == encode(&b), same_meaning);
        }
    }

    fn secret(byte: u8) -> KeySecret {
        KeySecret::from_bytes(&[byte; 32]).unwrap()
    }

    fn keyed(secret: &KeySecret, parts: &[Part]) -> Key {
        let mut b = Key::keyed_builder("scope", secret);
        for p in parts {
            match p {
                Part::U(v) => b.push(v),
                Part::I(v) => b.push(v),
                Part::B(v) => b.push(v),
                Part::C(v) => b.push(v),
                Part::S(v) => b.push(v),
                Part::O(v) => b.push(v),
                Part::V(v) => b.push(v),
            }
        }
        b.finish()
    }

    proptest! {
        #[test]
        fn keyed_keys_are_as_distinct_as_their_parts(
            a in proptest::collection::vec(part(), 0..5),
            b in proptest::collection::vec(part(), 0..5),
        ) {
            let same_meaning = a.iter().map(normalise).eq(b.iter().map(normalise));
            let s = secret(0x5a);
            prop_assert_eq!(keyed(&s, &a) == keyed(&s, &b), same_meaning);
        }
    }

    #[test]
    fn plain_keys_are_the_sha256_of_the_encoding() {
        let b = Key::builder("orders").part(&734211u64);
        let expected: [u8; 32] = Sha256::digest(b.encoding()).into();
        assert_eq!(b.finish().as_bytes(), &expected);
    }

    #[test]
    fn keyed_keys_are_the_hmac_sha256_of_the_encoding() {
        let raw = [0x5a; 32];
        let b =
            Key::keyed_builder("orders", &KeySecret::from_bytes(&raw).unwrap()).part(&734211u64);
        let mut mac = HmacSha256::new_from_slice(&raw).unwrap();
        mac.update(b.encoding());
        let expected: [u8; 32] = mac.finalize().into_bytes().into();
        let key = b.finish();
        assert_eq!(key.as_bytes(), &expected);
        assert_ne!(key, Key::builder("orders").part(&734211u64).finish());
    }

    #[test]
    fn a_secret_gives_stable_keys_and_two_secrets_different_ones() {
        let (a, b) = (secret(1), secret(2));
        let parts = [Part::U(734211), Part::S("SKU-1".into())];
        assert_eq!(keyed(&a, &parts), keyed(&a, &parts));
        assert_eq!(keyed(&a, &parts), keyed(&a.clone(), &parts));
        assert_ne!(keyed(&a, &parts), keyed(&b, &parts));
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn derived_keys_stay_keyed() {
        let plain = Key::builder("orders").part(&1u8).finish();
        let keyed = Key::keyed_builder("orders", &secret(3)).part(&1u8).finish();
        assert_ne!(keyed.derive("charge"), plain.derive("charge"));
        assert_ne!(
            keyed.derive_indexed("charge", 0),
            plain.derive_indexed("charge", 0)
        );
        let other = Key::keyed_builder("orders", &secret(4)).part(&1u8).finish();
        assert_ne!(keyed.derive("charge"), other.derive("charge"));
    }

    #[test]
    fn fingerprints_are_keyed_too() {
        let plain = Fingerprint::builder().part(&100u32).finish();
        let a = Fingerprint::keyed_builder(&secret(1))
            .part(&100u32)
            .finish();
        assert_ne!(a, plain);
        assert_eq!(
            a,
            Fingerprint::keyed_builder(&secret(1))
                .part(&100u32)
                .finish()
        );
        assert_ne!(
            a,
            Fingerprint::keyed_builder(&secret(2))
                .part(&100u32)
                .finish()
        );
    }

    #[test]
    fn the_secret_never_shows_in_debug_output() {
        let raw: Vec<u8> = (0xa0..0xc0).collect();
        let hex = hex::encode(&raw);
        let s = KeySecret::from_bytes(&raw).unwrap();
        let shown = [
            format!("{s:?}"),
            format!("{s:#?}"),
            format!("{:?}", Key::keyed_builder("orders", &s).part(&1u8)),
            format!("{:?}", Fingerprint::keyed_builder(&s).part(&1u8)),
        ];
        for shown in shown {
            assert!(shown.contains(&s.id()), "{shown}");
            assert!(!shown.contains(&hex[..8]), "the secret leaked: {shown}");
            assert!(!shown.contains("160, 161"), "the secret leaked: {shown}");
        }
    }

    #[test]
    fn weak_or_malformed_secrets_are_refused_without_echoing_them() {
        let e = KeySecret::from_bytes(b"hunter2").unwrap_err();
        assert_eq!(e, KeySecretError::TooShort { len: 7 });
        assert!(!e.to_string().contains("hunter2"));
        let e = KeySecret::from_hex("zz-secret-zz").unwrap_err();
        assert_eq!(e, KeySecretError::NotHex);
        assert!(!e.to_string().contains("secret-zz"));
        assert!(KeySecret::from_hex(&format!("  {}\n", "ab".repeat(32))).is_ok());
        let e = KeySecret::from_env("IDEM_TEST_NO_SUCH_VARIABLE_FOR_KEY_SECRET").unwrap_err();
        assert!(matches!(e, KeySecretError::Missing { .. }), "{e}");
    }

    #[test]
    fn joined_strings_do_not_collide() {
        let a = Key::builder("s").part("a|b").part("c").finish();
        let b = Key::builder("s").part("a").part("b|c").finish();
        assert_ne!(a, b);
    }

    #[test]
    fn scope_separates_keys() {
        let a = Key::builder("orders").part(&1u8).finish();
        let b = Key::builder("refunds").part(&1u8).finish();
        assert_ne!(a, b);
    }

    #[test]
    fn widening_an_integer_keeps_the_key() {
        let a = Key::builder("s").part(&5u32).finish();
        let b = Key::builder("s").part(&5u64).finish();
        let c = Key::builder("s").part(&5i64).finish();
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_ne!(c, Key::builder("s").part(&-5i64).finish());
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let k = Key::builder("s").part("x").finish();
        assert_eq!(Key::from_hex(&k.to_hex()).unwrap(), k);
        let err = Key::from_hex("not-a-key").unwrap_err();
        assert!(err.to_string().contains("64 hexadecimal digits"));
    }
}
