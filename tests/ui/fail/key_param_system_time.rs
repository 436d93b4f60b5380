use idem_runtime::idempotent;
use std::time::SystemTime;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "user_id|when")]
async fn check_in(user_id: u64, when: SystemTime) -> Result<u64, AppError> {
    let _ = when;
    Ok(user_id)
}

fn main() {}
