//! [`Fingerprint`]: the hash of the fields a replay must match.

use std::fmt;

use super::part::{ENCODING_VERSION, KeyEncoder, KeyPart};
use super::{KeySecret, hash, secret};

/// A payload fingerprint: a hash of the fields that must match between a
/// request and the one whose result it would replay.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Starts a fingerprint; add the fields with [`FingerprintBuilder::part`].
    /// Keyed like [`Key::builder`](super::Key::builder): a fingerprint is stored next to its key
    /// and its fields can be as guessable.
    pub fn builder() -> FingerprintBuilder {
        Fingerprint::start(secret::installed())
    }

    /// Starts a fingerprint hashed under `secret`, whatever is installed.
    pub fn keyed_builder(secret: &KeySecret) -> FingerprintBuilder {
        Fingerprint::start(Some(secret.clone()))
    }

    fn start(secret: Option<KeySecret>) -> FingerprintBuilder {
        let mut enc = KeyEncoder::new();
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
