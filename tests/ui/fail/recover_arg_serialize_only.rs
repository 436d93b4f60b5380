use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[derive(serde::Serialize)]
pub struct CreateOrder {
    pub order_no: String,
}

#[idempotent(key = "req.order_no", recover)]
async fn create_order(req: CreateOrder) -> Result<u64, AppError> {
    Ok(req.order_no.len() as u64)
}

fn main() {}
