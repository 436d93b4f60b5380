use idem_runtime::idempotent;

#[derive(Debug)]
pub enum AppError {
    NotFound,
}

#[idempotent(key = "order_id")]
async fn load(order_id: u64) -> Result<u64, AppError> {
    if order_id == 0 {
        return Err(AppError::NotFound);
    }
    Ok(order_id)
}

fn main() {}
