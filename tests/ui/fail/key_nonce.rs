use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "user_id|nonce")]
async fn redeem(user_id: u64, nonce: String) -> Result<u64, AppError> {
    Ok(user_id + nonce.len() as u64)
}

fn main() {}
