use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "sku|now")]
async fn restock(sku: String, now: u64) -> Result<u64, AppError> {
    Ok(sku.len() as u64 + now)
}

fn main() {}
