//! [`KeyPart`]: how a value is written into a key, and the injective
//! encoding ([`KeyEncoder`]) every part goes through.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

/// Version byte mixed into every key, so a future change of encoding can never
/// silently collide with records written by this one.
pub(super) const ENCODING_VERSION: u8 = 1;

pub(super) mod tag {
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
    pub(super) buf: Encoding,
}

/// A key's encoding: the scope and a few fields fit inline (a scope of 40
/// bytes and three integer fields take 100); longer ones spill to the heap.
pub(super) type Encoding = smallvec::SmallVec<[u8; 128]>;

impl KeyEncoder {
    /// An empty encoder. Most code uses [`Key::builder`](super::Key::builder) instead.
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

    pub(super) fn write_tagged_bytes(&mut self, t: u8, v: &[u8]) {
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
