//! [`Token`]: the random identity of one claim attempt, which fences owners
//! against each other.

use std::fmt;

/// The random identity of one claim attempt: its owner.
///
/// Completion and release carry it, and act only while it still owns the record,
/// so a stale owner finishing late can neither overwrite nor delete the record
/// of the caller that took over.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub(super) [u8; 16]);

thread_local! {
    /// Where this thread's tokens come from: a small, fast generator
    /// (xoshiro, 256 bits of state on 64-bit targets) seeded once from the
    /// operating system's entropy through `rand`'s `ThreadRng`. A token must
    /// be unique, never secret (it fences owners against each other and
    /// authenticates nothing), and 128-bit draws from generators seeded
    /// apart do not collide; a cryptographic generator per claim cost more
    /// than the memory store's whole claim. Like `ThreadRng`, it is not
    /// reseeded in a child process: a process that forks after making
    /// tokens must not claim from the thread that made them in both (a
    /// tokio runtime does not survive a fork anyway).
    static TOKENS: std::cell::RefCell<rand::rngs::SmallRng> =
        std::cell::RefCell::new(rand::SeedableRng::from_rng(&mut rand::rng()));
}

impl Token {
    /// A fresh random token, unique to this claim attempt.
    ///
    /// ```
    /// use idem_runtime::store::Token;
    /// assert_ne!(Token::random(), Token::random());
    /// ```
    pub fn random() -> Self {
        TOKENS
            .try_with(|rng| {
                // Two words, not sixteen bytes: `random::<[u8; 16]>` draws
                // a word per byte.
                let mut rng = rng.borrow_mut();
                let (a, b) = (
                    rand::RngCore::next_u64(&mut *rng),
                    rand::RngCore::next_u64(&mut *rng),
                );
                let mut bytes = [0; 16];
                bytes[..8].copy_from_slice(&a.to_le_bytes());
                bytes[8..].copy_from_slice(&b.to_le_bytes());
                Token(bytes)
            })
            // A claim made while the thread's locals are torn down, when
            // `ThreadRng`'s may be gone too: straight from the OS.
            .unwrap_or_else(|_| {
                let mut rng: rand::rngs::SmallRng = rand::SeedableRng::from_os_rng();
                Token(rand::Rng::random(&mut rng))
            })
    }

    /// A token read back from a store.
    ///
    /// ```
    /// use idem_runtime::store::Token;
    /// let t = Token::random();
    /// assert_eq!(Token::from_bytes(*t.as_bytes()), t);
    /// ```
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Token(bytes)
    }

    /// The token's 16 bytes, as a store writes them.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", hex::encode(self.0))
    }
}
