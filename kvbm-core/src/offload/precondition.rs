//! The forward-pass event a transfer waits for before it may read its
//! source blocks (their bytes are being written until the pass is done).

use tokio::sync::watch;

/// Raised by the engine when the forward pass is done. Dropping it without
/// [`trigger`](Self::trigger) abandons every waiter.
#[derive(Debug)]
pub struct PreconditionTrigger {
    tx: watch::Sender<bool>,
}

/// What a container waits on. Cheap to clone: one trigger serves every
/// container of a forward pass.
#[derive(Debug, Clone)]
pub struct Precondition {
    rx: watch::Receiver<bool>,
}

/// The trigger was dropped without firing: the forward pass failed or was
/// abandoned, so the source bytes are not valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("precondition abandoned: its trigger was dropped without firing")]
pub struct PreconditionAbandoned;

/// A new, unmet precondition and its trigger.
pub fn precondition() -> (PreconditionTrigger, Precondition) {
    let (tx, rx) = watch::channel(false);
    (PreconditionTrigger { tx }, Precondition { rx })
}

impl PreconditionTrigger {
    /// Marks the forward pass done; every waiter proceeds.
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }
}

impl Precondition {
    /// A precondition that is already met.
    pub fn met() -> Self {
        let (t, p) = precondition();
        t.trigger();
        p
    }

    /// True once triggered.
    pub fn is_met(&self) -> bool {
        *self.rx.borrow()
    }

    /// Waits for the trigger. Cancel-safe.
    pub async fn wait(&mut self) -> Result<(), PreconditionAbandoned> {
        match self.rx.wait_for(|met| *met).await {
            Ok(_) => Ok(()),
            Err(_) => Err(PreconditionAbandoned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn trigger_and_abandon() {
        let (t, mut p) = precondition();
        let mut q = p.clone();
        assert!(!p.is_met());
        t.trigger();
        assert_eq!(p.wait().await, Ok(()));
        assert_eq!(q.wait().await, Ok(()));
        let (t, mut p) = precondition();
        drop(t);
        assert_eq!(p.wait().await, Err(PreconditionAbandoned));
        assert!(Precondition::met().is_met());
    }
}
