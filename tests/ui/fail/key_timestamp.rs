use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "user_id|timestamp")]
async fn pay(user_id: u64, timestamp: i64) -> Result<u64, AppError> {
    Ok(user_id + timestamp as u64)
}

fn main() {}
