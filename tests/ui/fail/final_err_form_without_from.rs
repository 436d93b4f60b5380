use idem_runtime::idempotent;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Declined {
    pub reason: String,
}

#[derive(Debug)]
pub enum PayError {
    Declined { reason: String },
    Idem(idem_runtime::Error),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e)
    }
}

// No `From<Declined> for PayError`: a replayed decline cannot be rebuilt.
impl PayError {
    fn declined(&self) -> Option<Declined> {
        match self {
            PayError::Declined { reason } => Some(Declined { reason: reason.clone() }),
            PayError::Idem(_) => None,
        }
    }
}

#[idempotent(key = "card", final_err = PayError::declined)]
async fn pay(card: String) -> Result<u64, PayError> {
    Err(PayError::Declined { reason: card })
}

fn main() {}
