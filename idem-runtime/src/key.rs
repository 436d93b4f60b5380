//! Key derivation: business fields → an injective byte encoding → SHA-256.
//!
//! Every part is written with a type tag and, where its length varies, a length
//! prefix. The encoding of one part is therefore prefix-free, and a sequence of
//! parts decodes in exactly one way: `("a|b", "c")` and `("a", "b|c")` can never
//! share a key, as they would under a plain `String.join("|")`.
//!
//! Stores only ever see the 32-byte hash, never the raw values.

use std::borrow::Cow;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use sha2::{Digest, Sha256};

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

/// A derived idempotency key: the SHA-256 of the scope and the encoded parts.
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
    /// Starts a key in `scope` (a namespace such as `"orders::create"`).
    pub fn builder(scope: &str) -> KeyBuilder {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        enc.write_tagged_bytes(tag::SCOPE, scope.as_bytes());
        KeyBuilder { enc }
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
    /// child, and different labels never collide.
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

    /// Hashes the encoding into the key.
    pub fn finish(self) -> Key {
        Key(Sha256::digest(&self.enc.buf).into())
    }
}

/// A payload fingerprint: a hash of the fields that must match between a
/// request and the one whose result it would replay.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Starts a fingerprint; add the fields with [`FingerprintBuilder::part`].
    pub fn builder() -> FingerprintBuilder {
        let mut enc = KeyEncoder::new();
        enc.buf.push(ENCODING_VERSION);
        FingerprintBuilder { enc }
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

    /// Hashes the fields.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(Sha256::digest(&self.enc.buf).into())
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
