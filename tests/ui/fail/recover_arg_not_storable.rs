use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

/// A handle, not data: it cannot be stored for a worker to call again with.
pub struct Db;

#[idempotent(key = "order_no", recover)]
async fn create_order(db: &Db, order_no: String) -> Result<u64, AppError> {
    let _ = db;
    Ok(order_no.len() as u64)
}

fn main() {}
