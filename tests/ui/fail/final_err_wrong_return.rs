use idem_runtime::idempotent;

#[derive(Debug)]
pub enum PayError {
    Declined,
    Idem(idem_runtime::Error),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e)
    }
}

impl PayError {
    /// A reason, not a verdict.
    fn reason(&self) -> &'static str {
        match self {
            PayError::Declined => "declined",
            PayError::Idem(_) => "idem",
        }
    }
}

#[idempotent(key = "card", final_err = PayError::reason)]
async fn pay(card: String) -> Result<u64, PayError> {
    let _ = card;
    Err(PayError::Declined)
}

fn main() {}
