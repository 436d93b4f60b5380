use idem_runtime::idempotent;
use sqlx::{Sqlite, Transaction};

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

// `tx` must name a parameter.
#[idempotent(key = "order_no", tx = txn)]
async fn unknown(tx: &mut Transaction<'_, Sqlite>, order_no: String) -> Result<u64, AppError> {
    let _ = tx;
    Ok(order_no.len() as u64)
}

// The transaction must be passed as `&mut`: the caller commits it.
#[idempotent(key = "order_no", tx = tx)]
async fn by_value(tx: Transaction<'static, Sqlite>, order_no: String) -> Result<u64, AppError> {
    let _ = tx;
    Ok(order_no.len() as u64)
}

// With `tx` there is no store, and a duplicate already waits on the row lock.
#[idempotent(key = "order_no", tx = tx, store = idem_runtime::store::memory::MemoryStore::new(), wait = "2s")]
async fn contradictory(tx: &mut Transaction<'_, Sqlite>, order_no: String) -> Result<u64, AppError> {
    let _ = tx;
    Ok(order_no.len() as u64)
}

fn main() {}
