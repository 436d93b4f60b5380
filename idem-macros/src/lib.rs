//! The attribute macros of idem. Depend on `idem-runtime`, which re-exports
//! them; the generated code needs it.
//!
//! Each macro is three stages: parse the options, check them against the
//! misuse catalog into a plan, expand the plan. For the two attributes they
//! are three modules, `args`, `check` (`Plan`, `StepPlan`) and `expand`; the
//! derive keeps its three in `key_part`. Problems from the first two are
//! collected and reported together, and the original function is emitted
//! beside them, so the user sees those errors and not a cascade of "cannot
//! find function" errors at every call site.

mod args;
mod check;
mod duration_literal;
mod errors;
mod expand;
mod key_part;
mod param_bindings;
mod segments;
mod suggest;

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::ItemFn;

use errors::Errors;

/// Makes an async fn returning `Result<T, E>` idempotent: the first call with a
/// key runs the body and records its result, duplicates get that result back.
///
/// ```
/// # use idem_runtime::idempotent;
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// # pub struct CreateOrder { user_id: u64, client_order_no: String, amount: u64 }
/// #[idempotent(scope = "orders.create", key = "req.user_id|req.client_order_no", ttl = "24h")]
/// async fn create_order(req: CreateOrder) -> Result<u64, AppError> {
///     Ok(req.amount) // runs once per (user_id, client_order_no) within 24h
/// }
/// ```
///
/// The function must be `async` and return `Result<T, E>` or an alias of one
/// (`io::Result<T>`). `T` must be `Serialize + DeserializeOwned`, because it
/// is stored and replayed; `E` must be `From<idem_runtime::Error>`, so that
/// idem's own errors (`InProgress`, `KeyReuse`, a store failure) reach the
/// caller as its error type. It works on free functions, on `&self` and
/// `&mut self` methods and on native `async fn` in trait impls, not under the
/// `async-trait` crate.
///
/// # Options
///
/// | option | meaning | default |
/// |---|---|---|
/// | `key = "req.user_id\|req.sku"` | `\|`-separated segments, each a parameter (or `self`, or a binding of a pattern such as `Json(req)`) with optional fields or tuple indices: `req.user_id`, `pair.0`. Name business fields that are the same on every retry of one intent | required |
/// | `ttl = "24h"` | how long the DONE record lives: it must cover the longest retry or redelivery window | `24h`; consumers `7d` |
/// | `lease = "30s"` | how long a PROCESSING claim holds before another caller may take it over; a running body renews it every third of the lease | `30s` |
/// | `scope = "orders.create"` | the namespace of the keys | module path + fn name; **required on methods**, see below |
/// | `store = expr` | the store for this call: a store, an `Arc` of one, a reference to one or a `StoreRef` | the one installed with `idem_runtime::install` |
/// | `consumer` | a message consumer: the ttl default and minimum suit redelivery | a call |
/// | `event = "SETTLE"` | with `consumer`: the event type, made the first part of the key | none |
/// | `fingerprint = "req.amount\|req.currency"` | segments that must match: the same key with another payload is `Error::KeyReuse`, never a silent replay | none |
/// | `wait = "2s"` | a duplicate waits this long for the first call's result instead of failing at once with `InProgress` | no waiting |
/// | `allow = "settle_date\|ttl"` | exempts names from the misuse checks below, and `ttl` from the consumer minimum; an entry that exempts nothing is an error | none |
/// | `final_err = path` | the errors that are final (a declined card): stored and replayed like a success, and with steps, the flow gives up and compensates. A `fn(&E) -> bool` stores the error itself (`E` must then be `Serialize + DeserializeOwned` too); a `fn(&E) -> Option<S>` stores `S`, a serde type of yours, and replays `E::from(s)` (see [below](#final-errors-of-an-error-type-that-is-not-serde)) | every `Err` releases the claim |
/// | `recover` | the arguments are stored with the claim, and a recovery worker finishes the call if its caller never comes back ([`recoverable!`] registers it). Each argument must be `Serialize + DeserializeOwned`; not on consumers, `tx` calls or axum handlers (a handler calls a `recover` method instead) | not recoverable |
/// | `tx = tx` | a `&mut` transaction (or connection) parameter: the claim and the record are written on it and commit or roll back with the business writes. Not with `store`, `wait`, `final_err` or `recover` | a separate record in the store |
/// | `crate = "path"` | where `idem_runtime` is, when it is reached through a re-export | `::idem_runtime` |
///
/// Expression options (`store`, `final_err`, `tx`) may also be written as
/// strings, serde style.
///
/// ## Final errors of an error type that is not serde
///
/// An error type that wraps `sqlx::Error`, `reqwest::Error` or
/// `idem_runtime::Error` cannot be stored whole. Name what its final errors
/// are stored as instead: a `final_err` function returning `Option<S>` marks
/// an error final by returning `Some`, `S` (`Serialize + DeserializeOwned`)
/// is stored, and a duplicate gets `E::from(s)`: the same error, as far as
/// `S` carries it.
///
/// ```
/// # use idem_runtime::idempotent;
/// #[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
/// pub struct Declined { reason: String }
///
/// #[derive(Debug)]
/// pub enum PayError {
///     Declined(Declined),
///     Idem(idem_runtime::Error), // not serde, never final
///     Io(std::io::Error),        // not serde, never final
/// }
/// impl From<Declined> for PayError {
///     fn from(d: Declined) -> Self { PayError::Declined(d) }
/// }
/// impl From<idem_runtime::Error> for PayError {
///     fn from(e: idem_runtime::Error) -> Self { PayError::Idem(e) }
/// }
/// impl PayError {
///     fn declined(&self) -> Option<Declined> {
///         match self { PayError::Declined(d) => Some(d.clone()), _ => None }
///     }
/// }
///
/// #[idempotent(scope = "payments.charge", key = "card", final_err = PayError::declined)]
/// async fn charge(card: String, cents: u64) -> Result<u64, PayError> {
///     Err(Declined { reason: format!("{card}: {cents} over the limit") }.into())
/// }
/// ```
///
/// ## Durations
///
/// `ttl`, `lease` and `wait` take a whole number and one unit: `500ms`, `30s`,
/// `15m`, `24h` or `7d` (no fractions, no `1h30m`). None may be zero; a `ttl`
/// under a minute is only a lock and is refused; a consumer's `ttl` under 24h
/// is refused unless `allow = "ttl"`; a `lease` longer than the `ttl` is
/// refused.
///
/// ## Methods need a `scope`
///
/// On a method (a `self` receiver, or `Self` anywhere in the signature) the
/// attribute requires `scope = "…"`. The default scope, module path and
/// function name, is the same for the `handle` of every impl in a module, so
/// two types' calls would share keys and replay each other's results; an
/// attribute cannot see which impl it is in. A written scope also keeps the
/// keys stable when the function is renamed or moved.
///
/// ## Misuse refused at compile time
///
/// A `key` or `fingerprint` segment named like a value that changes on every
/// retry is an error, since such a key never repeats: times (`created_at` and
/// other `*_at`, `timestamp`, `ts`, `now`, `*_time`, `*_date`), per-request
/// ids (`request_id`, `trace_id`, `nonce`, `random`), retry and delivery
/// counters (`retry_count`, `attempt`, `attempt_no`, `delivery_attempt`,
/// `redelivered`, `num_retries`) and parameters of clock types (`SystemTime`,
/// `Instant`, chrono and time types). Names are judged by whole words:
/// `candidate_id`, `update_count`, `delivery_address` and `max_retries` pass.
/// `allow = "name"` exempts a value that really is fixed per intent.
///
/// # What it expands to
///
/// Simplified (the real expansion also asserts the types' bounds on your own
/// tokens, so a type that cannot be cached is reported once, there), the
/// attribute turns the function into a call of
/// `idem_runtime::protocol::execute`: claim the key, run the body, record its
/// result (or release the claim on `Err`). The hand-written version below
/// derives the same key, so it replays what the annotated one stored:
///
/// ```
/// use std::sync::LazyLock;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::time::Duration;
///
/// use idem_runtime::protocol::{self, Kind, Spec};
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::{Fingerprint, Key, idempotent};
/// use idem_runtime::store::AsStore;
///
/// # #[derive(Debug)] pub struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// pub struct Pay { user_id: u64, client_order_no: String, amount: u64 }
///
/// static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
/// static RUNS: AtomicUsize = AtomicUsize::new(0);
///
/// #[idempotent(
///     scope = "orders.pay",
///     key = "req.user_id|req.client_order_no",
///     fingerprint = "req.amount",
///     ttl = "24h",
///     store = &*STORE,
/// )]
/// async fn pay(req: Pay) -> Result<u64, AppError> {
///     RUNS.fetch_add(1, Ordering::SeqCst);
///     Ok(req.amount)
/// }
///
/// // What `pay` becomes:
/// async fn pay_by_hand(req: Pay) -> Result<u64, AppError> {
///     // Fixed per call site. `Kind::Consumer` with `consumer`; `.wait(…)` with `wait`.
///     // (The expansion also gives the site a hidden `static` it names with
///     // `.site(…)`: the metric keys and timings its calls reuse.)
///     const SPEC: Spec = Spec::new("orders.pay", Kind::Call)
///         .ttl(Duration::from_secs(24 * 3600))
///         .lease(Duration::from_secs(30));
///     // The key: the scope, then (with `event`, the event type, then) each segment.
///     let key = Key::builder(SPEC.scope)
///         .part(&req.user_id)
///         .part(&req.client_order_no)
///         .finish();
///     let fingerprint = Some(Fingerprint::builder().part(&req.amount).finish());
///     // `None` without `store = …`: the installed store. (The expansion
///     // keeps the store's own type, `STORE.as_store()`, and polls its futures
///     // in place; `protocol::execute` takes any store as a `StoreRef`.)
///     let store = Some(STORE.store_ref());
///     // The body, moved into an `async move` block: `?` and `return` keep their meaning.
///     // With `final_err = f`: `protocol::execute_keeping_final(…, f, body)`; with
///     // `tx = tx`: `protocol::execute_in_tx(&SPEC, &mut *tx, key, fingerprint, known, async move |tx| …)`,
///     // `known` being `Some(())` for a `Result<(), E>` (the claim writes the record DONE at once).
///     protocol::execute(&SPEC, store, key, fingerprint, async move {
///         RUNS.fetch_add(1, Ordering::SeqCst);
///         Ok(req.amount)
///     })
///     .await
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let req = || Pay { user_id: 7, client_order_no: "c-1".into(), amount: 100 };
/// assert_eq!(pay(req()).await.unwrap(), 100);
/// assert_eq!(pay_by_hand(req()).await.unwrap(), 100); // replayed: same key, same store
/// assert_eq!(RUNS.load(Ordering::SeqCst), 1);
/// # });
/// ```
///
/// Inside the body, `idem_runtime::current_key()` is the call's key: pass a key
/// derived from it (`key.derive("psp:charge").to_hex()`) as the
/// `Idempotency-Key` of a payment or SMS provider.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = TokenStream2::from(item.clone());
    let func: ItemFn = match syn::parse(item) {
        Ok(f) => f,
        Err(e) => return with_errors(item2, e.to_compile_error()),
    };
    let mut errors = Errors::default();
    let mut args = args::parse_idempotent(attr.into(), &mut errors);
    let krate = expand::runtime_path(args.krate.take());
    let plan = check::idempotent(args, &func, &mut errors);
    if !errors.is_empty() {
        return with_errors(item2, errors.into_compile_errors());
    }
    expand::idempotent(&plan, &func, &krate).into()
}

/// Marks an async fn as a named step of an idempotent flow: called inside an
/// `#[idempotent]` call, it runs once per flow, and a retry of the flow gets
/// its saved output back instead of running it again.
///
/// `#[step("deduct_stock")]` or `#[step(name = "deduct_stock")]`. The name is
/// required and explicit, so that renaming the function never changes the
/// step's identity. A step is recorded under the flow's key, its name and how
/// many steps of that name the flow has already finished, so a step called in
/// a loop records each call. Only the step that failed and the ones after it
/// run again. Outside an idempotent call (or inside one with `tx = …`, whose
/// transaction already makes the call all-or-nothing) a step just runs.
///
/// A failed call hands its number back, so that a body retrying a flaky step
/// records the attempt that succeeded where a retry of the flow looks. In a
/// loop whose body goes on to the next item after a call failed, that number
/// would go to the next item: name what tells the items apart with
/// `key = "item.sku"` (segments as in `#[idempotent]`'s `key`, with the same
/// misuse checks and `allow`), and calls are numbered per item, so each item
/// keeps its record and its key (`current_key()`, the client middleware's
/// `Idempotency-Key`) whatever happened to the others.
///
/// Like `#[idempotent]`, the function must be `async` and return
/// `Result<T, E>` with a `Serialize + DeserializeOwned` `T` and an `E` that is
/// `From<idem_runtime::Error>`.
///
/// # Options
///
/// | option | meaning | default |
/// |---|---|---|
/// | `"deduct_stock"` or `name = "deduct_stock"` | the step's identity in its flow's records: keep it when the function is renamed | required |
/// | `key = "item.sku"` | segments (as in `#[idempotent]`'s `key`) telling apart the calls of this step in a loop, so each item keeps its record | calls numbered among all of this name |
/// | `allow = "settle_date"` | exempts `key` segments from the misuse checks | none |
/// | `compensate = "restore_stock"` | what undoes the step when its flow gives up (a `final_err` error): an async fn taking the step's output by value (on a method, another method taking `&self` and the output), run once, in reverse order of the steps (the guide's page on steps, `idem_runtime::guide::steps`) | not undone |
/// | `crate = "path"` | where `idem_runtime` is, when it is reached through a re-export | `::idem_runtime` |
///
/// ```
/// use idem_runtime::step;
/// # #[derive(Debug)] pub struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[step("deduct_stock", compensate = "restore_stock")]
/// async fn deduct_stock(sku: u64, qty: u32) -> Result<String, AppError> {
///     Ok(format!("ticket-{sku}-{qty}")) // the output: what the compensation gets
/// }
///
/// async fn restore_stock(ticket: String) -> Result<(), AppError> {
///     let _ = ticket; // put the stock back
///     Ok(())
/// }
/// ```
///
/// # What it expands to
///
/// Simplified (without the type assertions), the body moves into an
/// `async move` block handed to `idem_runtime::protocol::run_step`:
///
/// ```
/// use idem_runtime::protocol;
/// use idem_runtime::step;
///
/// # #[derive(Debug)] pub struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[step("deduct_stock")]
/// async fn deduct_stock(sku: u64, qty: u32) -> Result<u64, AppError> {
///     Ok(sku * u64::from(qty))
/// }
///
/// // What `deduct_stock` becomes:
/// async fn deduct_stock_by_hand(sku: u64, qty: u32) -> Result<u64, AppError> {
///     protocol::run_step("deduct_stock", async move { Ok(sku * u64::from(qty)) }).await
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // Outside an idempotent call both just run.
/// assert_eq!(deduct_stock(3, 2).await.unwrap(), 6);
/// assert_eq!(deduct_stock_by_hand(3, 2).await.unwrap(), 6);
/// # });
/// ```
///
/// With `key`, the item's key is built from the arguments before the body
/// takes them:
///
/// ```
/// use idem_runtime::protocol::{self, StepCall};
/// use idem_runtime::{Key, step};
///
/// # #[derive(Debug)] pub struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[step("charge_item", key = "sku")]
/// async fn charge_item(sku: u64, cents: u64) -> Result<u64, AppError> {
///     Ok(cents)
/// }
///
/// // What `charge_item` becomes:
/// async fn charge_item_by_hand(sku: u64, cents: u64) -> Result<u64, AppError> {
///     let item = Key::builder("charge_item").part(&sku).finish();
///     let call = StepCall::new("charge_item").item(item);
///     protocol::run_step(call, async move { Ok(cents) }).await
/// }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// # assert_eq!(charge_item(1, 250).await.unwrap(), 250);
/// # assert_eq!(charge_item_by_hand(1, 250).await.unwrap(), 250);
/// # });
/// ```
#[proc_macro_attribute]
pub fn step(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = TokenStream2::from(item.clone());
    let func: ItemFn = match syn::parse(item) {
        Ok(f) => f,
        Err(e) => return with_errors(item2, e.to_compile_error()),
    };
    let mut errors = Errors::default();
    let mut args = args::parse_step(attr.into(), &mut errors);
    let krate = expand::runtime_path(args.krate.take());
    let plan = check::step(args, &func, &mut errors);
    match plan {
        Some(plan) if errors.is_empty() => expand::step(&plan, &func, &krate).into(),
        _ => with_errors(item2, errors.into_compile_errors()),
    }
}

/// The function a `#[idempotent(…, recover)]` call registers with a
/// recovery worker: `recoverable!(create_order)` for a free function,
/// `recoverable!(OrderService::create_order, service)` for a `&self` method
/// (the service, or an `Arc` of it, that the worker calls the method on).
///
/// ```
/// use idem_runtime::recovery::Recovery;
/// use idem_runtime::{idempotent, recoverable};
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[derive(Clone)]
/// struct Orders;
///
/// impl Orders {
///     #[idempotent(scope = "orders.create", key = "order_no", recover)]
///     async fn create(&self, order_no: &str) -> Result<u64, AppError> {
///         Ok(order_no.len() as u64)
///     }
/// }
///
/// #[idempotent(scope = "orders.cancel", key = "order_no", recover)]
/// async fn cancel(order_no: String) -> Result<(), AppError> {
///     Ok(())
/// }
///
/// let recovery = Recovery::new()
///     .register(recoverable!(Orders::create, Orders))
///     .register(recoverable!(cancel));
/// # drop(recovery);
/// ```
///
/// A function without `recover` has nothing to register: the compile error
/// says "`create_order` has no `recover`" and to add it. (A `recover`
/// function defined in another module is named by its path,
/// `recoverable!(orders::create_order)`; there, a missing `recover` is
/// rustc's "cannot find function `__idem_recover_create_order`", the hidden
/// item `recover` adds.) A `&self` method is registered with the service
/// it runs on; without one, the error says so.
#[proc_macro]
pub fn recoverable(input: TokenStream) -> TokenStream {
    match expand::recoverable(input.into()) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// Derives `idem_runtime::KeyPart` for a struct, a tuple struct or an enum, so
/// a whole business value can be a key segment (`key = "req.line"`) with the
/// same misuse checks as the segments of `#[idempotent]`.
///
/// ```
/// use idem_runtime::{Key, KeyPart, idempotent};
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// # async fn insert_line(_: &OrderLine, _: &Payer) -> Result<u64, AppError> { Ok(1) }
///
/// #[derive(KeyPart)]
/// struct OrderLine { sku: String, warehouse: u32 }
///
/// #[derive(KeyPart)]
/// enum Payer { Account { user_id: u64 }, Card(String) }
///
/// #[derive(KeyPart)]
/// struct Sku(u64); // a newtype keys exactly like the u64 it wraps
///
/// #[idempotent(scope = "orders.line", key = "line|payer")]
/// async fn add_line(line: OrderLine, payer: Payer) -> Result<u64, AppError> {
///     insert_line(&line, &payer).await
/// }
///
/// let line = OrderLine { sku: "SKU-1".into(), warehouse: 3 };
/// let a = Key::builder("orders").part(&line).part(&Payer::Card("4242".into())).finish();
/// let b = Key::builder("orders").part(&line).part(&Payer::Account { user_id: 4242 }).finish();
/// assert_ne!(a, b);
/// assert_eq!(
///     Key::builder("s").part(&Sku(7)).finish(),
///     Key::builder("s").part(&7u64).finish(),
/// );
/// ```
///
/// # Encoding
///
/// Injective for a given type: a newtype (a tuple struct of one field) encodes
/// as its field; any other struct writes its field count and then each field in
/// declaration order; an enum writes the variant's name, then its field count
/// and fields. So renaming a field keeps the keys, while reordering fields,
/// renaming a variant or adding a field changes them, as changing the key
/// segments of an attribute would. Every field must itself be a `KeyPart`;
/// generic parameters get a `KeyPart` bound.
///
/// # Refused at compile time
///
/// - a field named like a value that changes on every retry, by the rules of
///   `#[idempotent]`'s segments (`created_at`, `timestamp`, `request_id`,
///   `nonce`, `retry_count`, `delivery_attempt`, …), and a field of a clock
///   type; `#[key_part(allow)]` on the field exempts a value that really is
///   fixed per intent (an `allow` that exempts nothing is an error too);
/// - `f32` and `f64` anywhere in a field's type: equal amounts differ in their
///   last bits and NaN never equals itself;
/// - maps and sets (`HashMap`, `HashSet`, `BTreeMap`, `BTreeSet`, `IndexMap`,
///   …): a hashed one iterates in a per-process order, and a whole collection
///   changes key when one entry is added;
/// - unions.
///
/// `#[key_part(crate = "path")]` on the type names where `idem_runtime` is,
/// when it is reached through a re-export.
#[proc_macro_derive(KeyPart, attributes(key_part))]
pub fn derive_key_part(item: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse(item) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error().into(),
    };
    let mut errors = Errors::default();
    let mut args = key_part::parse(&input, &mut errors);
    let krate = expand::runtime_path(args.krate.take());
    match key_part::check(args, &input, &mut errors) {
        Some(plan) if errors.is_empty() => key_part::expand(&plan, &krate).into(),
        // A derive is not re-emitted: the type itself is still there.
        _ => errors.into_compile_errors().into(),
    }
}

/// The item unchanged, plus the errors: one clear report instead of fifty.
fn with_errors(item: TokenStream2, errors: TokenStream2) -> TokenStream {
    quote!(#item #errors).into()
}
