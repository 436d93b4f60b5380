use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "order_id", ttl = "30s")]
async fn refund(order_id: u64) -> Result<u64, AppError> {
    Ok(order_id)
}

fn main() {}
