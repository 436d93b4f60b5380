//! A crate's own `Result` aliases are results too.
use idem_runtime::{idempotent, step};

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub type AppResult<T> = std::result::Result<T, AppError>;
pub type Result<T> = std::result::Result<T, AppError>;

#[idempotent(key = "order_id")]
pub async fn by_app_result(order_id: u64) -> AppResult<u64> {
    Ok(order_id)
}

#[idempotent(key = "order_id")]
pub async fn by_local_result(order_id: u64) -> Result<u64> {
    Ok(order_id)
}

#[step("load")]
pub async fn load(order_id: u64) -> AppResult<String> {
    Ok(order_id.to_string())
}

fn main() {}
