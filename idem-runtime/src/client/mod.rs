//! Outgoing calls that carry the key (feature `client`): a
//! [`reqwest_middleware`] middleware that sends each request with an
//! `Idempotency-Key` derived from the current idempotent call's key, and
//! retries transient failures with that same key.
//!
//! A retry of the whole call (after a crash, a release, a redelivery) derives
//! the same key again, so a payment provider that deduplicates by
//! `Idempotency-Key` charges once however often idem or this middleware
//! retries.
//!
//! - [`IdempotencyMiddleware`]: the middleware, its attempts and delays, and
//!   which requests it retries (a POST without a key never);
//! - [`KeyName`] and [`DeriveKey`]: the label a request's key is derived
//!   with (`current_key().derive(label)`);
//! - [`OutsideIdempotentCall`]: the error of a request that asked for a key
//!   outside any idempotent call, which is not sent.
//!
//! The README shows this example where it introduces `current_key()` (a
//! unit test below keeps the two the same):
//!
//! ```no_run
//! use idem_runtime::client::{DeriveKey, IdempotencyMiddleware};
//! use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
//! # #[derive(Debug)] struct AppError;
//! # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
//! # impl From<reqwest_middleware::Error> for AppError { fn from(_: reqwest_middleware::Error) -> Self { AppError } }
//!
//! let psp: ClientWithMiddleware = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new().max_attempts(4))
//!     .build();
//!
//! #[idem_runtime::idempotent(key = "order_id")]
//! async fn pay(psp: &ClientWithMiddleware, order_id: u64) -> Result<u16, AppError> {
//!     // Idempotency-Key: current_key().derive("psp:charge").to_hex(), on every attempt
//!     let charge = psp.post("https://psp.example/charges").derive_key("psp:charge");
//!     Ok(charge.send().await?.status().as_u16())
//! }
//! ```

mod key;
mod middleware;
mod retry;

pub use key::{DeriveKey, KeyName, OutsideIdempotentCall};
pub use middleware::IdempotencyMiddleware;

#[cfg(test)]
mod tests {
    /// The README's snippet is this module's example, less its hidden lines:
    /// the README's copy is not compiled, this one is.
    #[test]
    fn the_readme_shows_the_module_example() {
        let example: String = include_str!("mod.rs")
            .lines()
            .skip_while(|l| *l != "//! ```no_run")
            .skip(1)
            .take_while(|l| *l != "//! ```")
            .map(|l| {
                l.strip_prefix("//!")
                    .unwrap_or(l)
                    .strip_prefix(' ')
                    .unwrap_or("")
            })
            // rustdoc's hidden lines: `#` alone or followed by a space (not `#[`).
            .filter(|l| *l != "#" && !l.starts_with("# "))
            .map(|l| l.to_owned() + "\n")
            .collect();
        assert!(
            example.contains("IdempotencyMiddleware::new()"),
            "{example}"
        );
        let readme = include_str!("../../../README.md");
        assert!(
            readme.contains(&format!("```rust\n{example}```\n")),
            "the README's client snippet differs from the module example:\n{example}"
        );
    }
}
