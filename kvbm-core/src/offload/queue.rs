//! `CancellableQueue`: the bounded queue between pipeline stages.
//!
//! A priority queue (higher priority first, then first in, first out) with
//! a fixed capacity. Producers either fail fast (`try_push`, used by
//! `enqueue` so the engine never waits) or wait for room (`push`, used
//! between stages for backpressure). The single consumer waits with `pop`.
//! `sweep` lets the [cancel sweeper](super) pull cancelled work out of the
//! middle of the queue, so a stalled stage does not keep cancelled
//! containers (and whatever they hold) alive.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use tokio::sync::Notify;

/// Something with a queueing priority (higher goes first).
pub trait Prioritized {
    /// The priority.
    fn priority(&self) -> u32;
}

struct Entry<T> {
    priority: u32,
    seq: u64,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.priority == other.priority && self.seq == other.seq
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        // Max-heap: higher priority first, then the lower sequence number.
        self.priority
            .cmp(&other.priority)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

struct State<T> {
    heap: BinaryHeap<Entry<T>>,
    next_seq: u64,
    closed: bool,
}

/// A bounded priority queue with a sweep. See the module docs.
pub struct CancellableQueue<T> {
    state: Mutex<State<T>>,
    capacity: usize,
    items: Notify,
    space: Notify,
}

impl<T: Prioritized> CancellableQueue<T> {
    /// An empty queue holding at most `capacity` items (at least 1).
    pub fn new(capacity: usize) -> Self {
        CancellableQueue {
            state: Mutex::new(State {
                heap: BinaryHeap::new(),
                next_seq: 0,
                closed: false,
            }),
            capacity: capacity.max(1),
            items: Notify::new(),
            space: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing panics while holding this lock; a poisoned lock still
        // guards a consistent heap.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an item if there is room; otherwise hands it back.
    pub fn try_push(&self, item: T) -> Result<(), T> {
        {
            let mut st = self.lock();
            if st.closed || st.heap.len() >= self.capacity {
                return Err(item);
            }
            let seq = st.next_seq;
            st.next_seq += 1;
            st.heap.push(Entry {
                priority: item.priority(),
                seq,
                item,
            });
        }
        self.items.notify_one();
        Ok(())
    }

    /// Adds an item, waiting for room. Hands it back if the queue closes.
    pub async fn push(&self, mut item: T) -> Result<(), T> {
        loop {
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            match self.try_push(item) {
                Ok(()) => return Ok(()),
                Err(back) if self.is_closed() => return Err(back),
                Err(back) => item = back,
            }
            space.await;
        }
    }

    /// Takes the first item if there is one.
    pub fn try_pop(&self) -> Option<T> {
        self.try_pop_held(None)
    }

    /// Like [`try_pop`](Self::try_pop), and counts the item taken in `held`
    /// while the queue is still locked: a reader of [`len`](Self::len) then
    /// `held` never sees the item in neither (the taker lowers `held` once
    /// the item is counted wherever it goes next).
    pub fn try_pop_held(&self, held: Option<&AtomicUsize>) -> Option<T> {
        let item = {
            let mut st = self.lock();
            let item = st.heap.pop().map(|e| e.item);
            if let (Some(_), Some(h)) = (&item, held) {
                h.fetch_add(1, Ordering::SeqCst);
            }
            item
        };
        if item.is_some() {
            self.space.notify_one();
        }
        item
    }

    /// Takes the first item, waiting for one; `None` once the queue is
    /// closed and empty. Cancel-safe: an item is either returned or left in
    /// the queue.
    pub async fn pop(&self) -> Option<T> {
        self.pop_held(None).await
    }

    /// [`pop`](Self::pop), counting the item in `held` as
    /// [`try_pop_held`](Self::try_pop_held) does.
    pub async fn pop_held(&self, held: Option<&AtomicUsize>) -> Option<T> {
        loop {
            let items = self.items.notified();
            tokio::pin!(items);
            items.as_mut().enable();
            if let Some(item) = self.try_pop_held(held) {
                return Some(item);
            }
            if self.is_closed() {
                return None;
            }
            items.await;
        }
    }

    /// Calls `keep` on every item; items for which it returns `false` are
    /// removed. `keep` may also move parts of an item into `out` (a batch
    /// gives up its cancelled containers and stays if any are left).
    pub fn sweep<R>(&self, mut keep: impl FnMut(&mut T, &mut Vec<R>) -> bool) -> Vec<R> {
        let mut out = Vec::new();
        let removed_any = {
            let mut st = self.lock();
            let before = st.heap.len();
            let mut v = std::mem::take(&mut st.heap).into_vec();
            v.retain_mut(|e| keep(&mut e.item, &mut out));
            st.heap = BinaryHeap::from(v);
            st.heap.len() < before
        };
        if removed_any {
            self.space.notify_one();
        }
        out
    }

    /// Removes and returns the items matching `pred`, keeping the order of
    /// the rest.
    pub fn take_where(&self, mut pred: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut taken = Vec::new();
        {
            let mut st = self.lock();
            if !st.heap.iter().any(|e| pred(&e.item)) {
                return taken;
            }
            let mut kept = Vec::with_capacity(st.heap.len());
            for e in std::mem::take(&mut st.heap).into_vec() {
                if pred(&e.item) {
                    taken.push(e.item);
                } else {
                    kept.push(e);
                }
            }
            st.heap = BinaryHeap::from(kept);
        }
        self.space.notify_one();
        taken
    }

    /// Items queued now.
    pub fn len(&self) -> usize {
        self.lock().heap.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Refuses new items and wakes everyone; queued items can still be
    /// popped.
    pub fn close(&self) {
        self.lock().closed = true;
        self.items.notify_waiters();
        self.items.notify_one();
        self.space.notify_waiters();
    }

    /// True after `close`.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Removes and returns everything (shutdown).
    pub fn drain(&self) -> Vec<T> {
        let v = std::mem::take(&mut self.lock().heap).into_vec();
        self.space.notify_waiters();
        v.into_iter().map(|e| e.item).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[derive(Debug, PartialEq)]
    struct It(u32, &'static str);
    impl Prioritized for It {
        fn priority(&self) -> u32 {
            self.0
        }
    }

    #[tokio::test]
    async fn priority_then_fifo() {
        let q = CancellableQueue::new(10);
        for it in [It(0, "a"), It(5, "b"), It(0, "c"), It(5, "d")] {
            q.try_push(it).unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| q.try_pop()).map(|i| i.1).collect();
        assert_eq!(order, ["b", "d", "a", "c"]);
    }

    #[tokio::test]
    async fn bounded_and_backpressure() {
        let q = Arc::new(CancellableQueue::new(1));
        q.try_push(It(0, "a")).unwrap();
        assert_eq!(q.try_push(It(0, "b")), Err(It(0, "b")));
        let q2 = q.clone();
        let pusher = tokio::spawn(async move { q2.push(It(0, "c")).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!pusher.is_finished(), "push must wait for room");
        assert_eq!(q.pop().await, Some(It(0, "a")));
        pusher.await.unwrap().unwrap();
        assert_eq!(q.pop().await, Some(It(0, "c")));
    }

    #[tokio::test]
    async fn pop_waits_and_close_ends_it() {
        let q = Arc::new(CancellableQueue::<It>::new(4));
        let q2 = q.clone();
        let popper = tokio::spawn(async move { (q2.pop().await, q2.pop().await) });
        tokio::time::sleep(Duration::from_millis(10)).await;
        q.try_push(It(1, "x")).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        q.close();
        assert_eq!(popper.await.unwrap(), (Some(It(1, "x")), None));
        assert!(q.try_push(It(0, "late")).is_err());
    }

    #[tokio::test]
    async fn sweep_removes_from_the_middle() {
        let q = CancellableQueue::new(10);
        for (i, n) in ["a", "b", "c", "d"].into_iter().enumerate() {
            q.try_push(It(i as u32 % 2, n)).unwrap();
        }
        let removed: Vec<&str> = q.sweep(|it, out| {
            if it.1 == "b" || it.1 == "c" {
                out.push(it.1);
                false
            } else {
                true
            }
        });
        assert_eq!(removed.len(), 2);
        assert_eq!(q.len(), 2);
        assert_eq!(q.try_pop().map(|i| i.1), Some("d"));
        assert_eq!(q.try_pop().map(|i| i.1), Some("a"));
    }
}
