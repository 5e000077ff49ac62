//! The forward-pass event a transfer waits for before it may read its
//! source blocks (their bytes are being written until the pass is done).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use tokio::sync::Notify;

const PENDING: u8 = 0;
const MET: u8 = 1;
const ABANDONED: u8 = 2;

/// The state a trigger and its preconditions share. Waiters park on a
/// `Notify`, which wakes them oldest first: a pass's stores then reach the
/// batcher in the order they were queued, so a single-threaded runtime
/// (the simulator's, in virtual time) batches them the same way every run.
/// (A `watch` channel parks waiters in lists chosen at random.)
#[derive(Debug)]
struct State {
    value: AtomicU8,
    notify: Notify,
}

/// Raised by the engine when the forward pass is done. Dropping it without
/// [`trigger`](Self::trigger) abandons every waiter.
#[derive(Debug)]
pub struct PreconditionTrigger {
    state: Arc<State>,
}

/// What a container waits on. Cheap to clone: one trigger serves every
/// container of a forward pass.
#[derive(Debug, Clone)]
pub struct Precondition {
    state: Arc<State>,
}

/// The trigger was dropped without firing: the forward pass failed or was
/// abandoned, so the source bytes are not valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("precondition abandoned: its trigger was dropped without firing")]
pub struct PreconditionAbandoned;

/// A new, unmet precondition and its trigger.
pub fn precondition() -> (PreconditionTrigger, Precondition) {
    let state = Arc::new(State {
        value: AtomicU8::new(PENDING),
        notify: Notify::new(),
    });
    (
        PreconditionTrigger {
            state: state.clone(),
        },
        Precondition { state },
    )
}

impl PreconditionTrigger {
    /// Marks the forward pass done; every waiter proceeds.
    pub fn trigger(&self) {
        // Only from pending: a trigger cannot be both fired and abandoned.
        let _ =
            self.state
                .value
                .compare_exchange(PENDING, MET, Ordering::AcqRel, Ordering::Acquire);
        self.state.notify.notify_waiters();
    }
}

impl Drop for PreconditionTrigger {
    fn drop(&mut self) {
        if self
            .state
            .value
            .compare_exchange(PENDING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.state.notify.notify_waiters();
        }
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
        self.state.value.load(Ordering::Acquire) == MET
    }

    /// Waits for the trigger. Cancel-safe.
    pub async fn wait(&mut self) -> Result<(), PreconditionAbandoned> {
        loop {
            let notified = self.state.notify.notified();
            tokio::pin!(notified);
            // Registered before the state is read: a trigger between the
            // read and the await still wakes this waiter.
            notified.as_mut().enable();
            match self.state.value.load(Ordering::Acquire) {
                MET => return Ok(()),
                ABANDONED => return Err(PreconditionAbandoned),
                _ => notified.await,
            }
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

    /// On one thread, the waiters of a pass go on in the order they began
    /// waiting, every time (the simulator's virtual-time runs rely on it).
    #[test]
    fn waiters_proceed_in_the_order_they_began_waiting() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for _ in 0..20 {
            let order = rt.block_on(async {
                let (t, p) = precondition();
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                for i in 0..32 {
                    let (mut p, tx) = (p.clone(), tx.clone());
                    tokio::spawn(async move {
                        p.wait().await.unwrap();
                        tx.send(i).unwrap();
                    });
                }
                drop(tx);
                // Every waiter parked before the trigger.
                tokio::task::yield_now().await;
                t.trigger();
                let mut order = Vec::new();
                while let Some(i) = rx.recv().await {
                    order.push(i);
                }
                order
            });
            assert_eq!(order, (0..32).collect::<Vec<_>>());
        }
    }
}
