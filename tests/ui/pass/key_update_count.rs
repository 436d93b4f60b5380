//! `update_count` contains `date`, but as letters, not as a word.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "profile_id|update_count")]
pub async fn save_profile(profile_id: u64, update_count: u32) -> Result<u64, AppError> {
    Ok(profile_id + u64::from(update_count))
}

fn main() {}
