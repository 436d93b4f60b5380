//! Recovery: abandoned flows finish on their own.
//!
//! A multi-step flow resumes when its caller calls again. A caller that never
//! comes back (a killed process, a client that gave up) leaves the flow half
//! done: the stock deducted and no order, and no compensation either. With
//! `#[idempotent(…, recover)]` the call's arguments are stored with its
//! claim, and a [`Worker`] that finds the claim's lease run out runs the
//! function again with them. Its own claim takes the record over, so the
//! finished steps replay, the rest run, a final error (`final_err`)
//! compensates, and the caller who does come back replays the result.
//!
//! ```
//! use idem_runtime::recovery::{Recovery, Worker};
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::{idempotent, recoverable, step};
//!
//! # #[derive(Debug)] struct AppError;
//! # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
//! #[idempotent(scope = "orders.create", key = "order_no", lease = "5s", recover)]
//! async fn create_order(order_no: String, qty: u32) -> Result<String, AppError> {
//!     let ticket = deduct_stock(qty).await?;
//!     Ok(format!("{order_no}: {ticket}"))
//! }
//!
//! #[step("deduct_stock")]
//! async fn deduct_stock(qty: u32) -> Result<u64, AppError> { Ok(u64::from(qty)) }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! idem_runtime::install(store.clone());
//! // At start-up, one line per function, and the worker beside the service:
//! let recovery = Recovery::new().register(recoverable!(create_order));
//! let worker = Worker::builder(store, recovery).build();
//! tokio::spawn(async move { worker.run().await });
//! # });
//! ```
//!
//! - [`Recovery`]: which function resumes which scope; [`Recoverable`] is
//!   what `recoverable!` returns for one;
//! - [`Worker`]: its settings, its passes and how it shuts down;
//!   [`WorkerStats`] and [`Pass`]: what it did.
//!
//! The guide's [recovery](crate::guide::recovery) page says what is stored,
//! what runs again, what a crash, a panic or a dropped worker does, and what
//! recovery does not cover.

mod metrics;
mod registry;
mod stats;
mod turn;
mod worker;

#[doc(hidden)]
pub use registry::{Ended, Prepared};
pub use registry::{Recoverable, Recovery};
pub use stats::{Pass, WorkerStats};
pub use worker::{Worker, WorkerBuilder};
