//! `candidate_id` contains `date`, but as letters, not as a word.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Apply {
    pub candidate_id: u64,
    pub job_id: u64,
}

#[idempotent(key = "req.candidate_id|req.job_id")]
pub async fn apply(req: Apply) -> Result<u64, AppError> {
    Ok(req.candidate_id + req.job_id)
}

fn main() {}
