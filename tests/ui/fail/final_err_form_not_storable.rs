use idem_runtime::idempotent;

/// The stored form of the final errors, without serde.
#[derive(Debug, Clone)]
pub struct Declined {
    pub reason: String,
}

#[derive(Debug)]
pub enum PayError {
    Declined(Declined),
    Idem(idem_runtime::Error),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<Declined> for PayError {
    fn from(d: Declined) -> Self {
        PayError::Declined(d)
    }
}

impl PayError {
    fn declined(&self) -> Option<Declined> {
        match self {
            PayError::Declined(d) => Some(d.clone()),
            PayError::Idem(_) => None,
        }
    }
}

#[idempotent(key = "card", final_err = PayError::declined)]
async fn pay(card: String) -> Result<u64, PayError> {
    Err(PayError::Declined(Declined { reason: card }))
}

fn main() {}
