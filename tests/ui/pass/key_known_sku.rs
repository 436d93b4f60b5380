//! `known_sku` contains `now`, but as letters, not as a word.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "user_id|known_sku")]
pub async fn reorder(user_id: u64, known_sku: String) -> Result<u64, AppError> {
    Ok(user_id + known_sku.len() as u64)
}

fn main() {}
