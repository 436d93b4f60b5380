use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "order_id|traceId")]
#[allow(non_snake_case)]
async fn ship(order_id: u64, traceId: String) -> Result<u64, AppError> {
    Ok(order_id + traceId.len() as u64)
}

fn main() {}
