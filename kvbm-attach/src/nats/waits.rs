//! How long a consumer waited for its deliveries.
//!
//! A consumer that is never busy still gets its messages only as fast as
//! the server sends them; one that waits little was the bound itself.
//! [`DeliveryWaits`] wraps a consumer's stream and counts and times its
//! waits, so that a recorder and the plain consumers it is measured
//! against can say the same of themselves.

use futures_util::StreamExt;
use std::time::{Duration, Instant};

/// Times the waits for a delivery: from a poll that found nothing ready
/// to the next message, after the first message (before it, the stream
/// may simply be empty). Wrapping the consumer's stream, it counts only
/// while the loop asks for messages, not while a backlog holds it back.
pub struct DeliveryWaits<S> {
    inner: S,
    started: bool,
    since: Option<Instant>,
    times: u64,
    waited: Duration,
}

impl<S> DeliveryWaits<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        DeliveryWaits {
            inner,
            started: false,
            since: None,
            times: 0,
            waited: Duration::ZERO,
        }
    }

    /// Waits so far, after the first message.
    pub fn times(&self) -> u64 {
        self.times
    }

    /// Their time in all (a wait going on now not included).
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

impl<S: futures_util::Stream + Unpin> futures_util::Stream for DeliveryWaits<S> {
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let this = &mut *self;
        let got = this.inner.poll_next_unpin(cx);
        match &got {
            std::task::Poll::Pending => {
                if this.started && this.since.is_none() {
                    this.since = Some(Instant::now());
                    this.times += 1;
                }
            }
            std::task::Poll::Ready(_) => {
                this.started = true;
                if let Some(t) = this.since.take() {
                    this.waited += t.elapsed();
                }
            }
        }
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits between deliveries are counted and timed; the wait for
    /// the first message is not (the stream may simply be empty).
    #[test]
    fn delivery_waits_time_the_gaps_between_messages_not_before_the_first() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
            let mut s =
                DeliveryWaits::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
            let nothing = tokio::time::timeout(Duration::from_millis(30), s.next()).await;
            assert!(nothing.is_err(), "a message before any was sent");
            tx.send(1).unwrap();
            assert_eq!(s.next().await, Some(1));
            assert_eq!((s.times, s.waited), (0, Duration::ZERO));
            tx.send(2).unwrap();
            assert_eq!(s.next().await, Some(2), "ready: no wait");
            assert_eq!(s.times, 0);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(60)).await;
                tx.send(3).unwrap();
            });
            assert_eq!(s.next().await, Some(3));
            assert_eq!(s.times, 1);
            assert!(s.waited >= Duration::from_millis(50), "{:?}", s.waited);
        });
    }
}
