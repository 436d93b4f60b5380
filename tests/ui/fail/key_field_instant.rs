use idem_runtime::idempotent;
use std::time::Instant;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Job {
    pub queue: String,
    pub received: Instant,
}

#[idempotent(key = "job.queue|job.received")]
async fn run(job: Job) -> Result<u64, AppError> {
    Ok(job.queue.len() as u64)
}

fn main() {}
