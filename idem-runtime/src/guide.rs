//! The guide: every surface's semantics, what a crash, a panic or a dropped
//! future does to it, and a compiled example, one page per topic.
//!
//! Read in this order for a first service: [`attribute`], [`steps`],
//! [`stores`], then the surface you need ([`http`], [`consumers`],
//! [`outbox`]). The pages are the Markdown files of `idem-runtime/guide/`,
//! and `cargo test --doc` compiles (and, where no server is needed, runs)
//! every example in them.
//!
//! | page | what it covers |
//! |---|---|
//! | [`attribute`] | `#[idempotent]`'s requirements and options, `current_key()`, keys for providers |
//! | [`steps`] | `#[step]`, resuming a flow, compensation when a flow gives up |
//! | [`recovery`] | `recover`: a worker finishes flows whose caller never came back |
//! | [`keys`] | the misuse caught at compile time, `#[derive(KeyPart)]` |
//! | [`protocol`] | keys, claim, complete, release, fences, failures |
//! | [`stores`] | each store's guarantees, how it claims, how it fails |
//! | [`transactions`] | `tx = tx`: the record in your transaction; what no store gives |
//! | [`http`] | the `Idempotency-Key` layer and axum handlers |
//! | [`consumers`] | the runner and the four brokers |
//! | [`outbox`] | publishing exactly what committed |
//! | [`locks`] | locks, and unique constraints as the backstop |
//! | [`supervisor`] | the relay, the consumers and the recovery worker run together, their health, their shutdown |
//! | [`testing`] | the explorer: proving your handlers idempotent |
//! | [`operating`] | the CLI, metrics, spans, troubleshooting |
//!
//! A page whose examples need a feature is there when the feature is on
//! (docs.rs builds with all of them).
//!
//! The smallest service the pages build on: one annotated function, the
//! in-process store, a duplicate answered from the record.
//!
//! ```
//! use idem_runtime::idempotent;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[idempotent(scope = "guide.hello", key = "order_no")]
//! async fn place(order_no: String) -> Result<String, idem_runtime::Error> {
//!     Ok(format!("placed {order_no}"))
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! assert_eq!(place("A-1".into()).await.unwrap(), "placed A-1");
//! assert_eq!(place("A-1".into()).await.unwrap(), "placed A-1"); // the record's answer
//! # });
//! ```

#[doc = include_str!("../guide/attribute.md")]
#[cfg(all(feature = "sqlite", feature = "client"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "sqlite", feature = "client"))))]
pub mod attribute {}

#[doc = include_str!("../guide/steps.md")]
pub mod steps {}

#[doc = include_str!("../guide/recovery.md")]
pub mod recovery {}

#[doc = include_str!("../guide/keys.md")]
pub mod keys {}

#[doc = include_str!("../guide/protocol.md")]
pub mod protocol {}

#[doc = include_str!("../guide/stores.md")]
pub mod stores {}

#[doc = include_str!("../guide/transactions.md")]
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod transactions {}

#[doc = include_str!("../guide/http.md")]
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod http {}

#[doc = include_str!("../guide/consumers.md")]
#[cfg(all(
    feature = "postgres",
    feature = "redis-streams",
    feature = "rabbitmq",
    feature = "jetstream",
    feature = "kafka"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(all(
        feature = "postgres",
        feature = "redis-streams",
        feature = "rabbitmq",
        feature = "jetstream",
        feature = "kafka"
    )))
)]
pub mod consumers {}

#[doc = include_str!("../guide/outbox.md")]
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod outbox {}

#[doc = include_str!("../guide/locks.md")]
#[cfg(all(feature = "redis", feature = "sqlite", feature = "postgres"))]
#[cfg_attr(
    docsrs,
    doc(cfg(all(feature = "redis", feature = "sqlite", feature = "postgres")))
)]
pub mod locks {}

#[doc = include_str!("../guide/supervisor.md")]
#[cfg(all(feature = "sqlite", feature = "axum"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "sqlite", feature = "axum"))))]
pub mod supervisor {}

#[doc = include_str!("../guide/testing.md")]
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing {}

#[doc = include_str!("../guide/operating.md")]
pub mod operating {}
