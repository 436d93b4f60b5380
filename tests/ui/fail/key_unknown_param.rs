use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Refund {
    pub order_id: u64,
}

#[idempotent(key = "reqest.order_id")]
async fn refund(request: Refund) -> Result<u64, AppError> {
    Ok(request.order_id)
}

fn main() {}
