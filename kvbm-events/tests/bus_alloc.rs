//! `EventBus::publish` with nobody listening allocates nothing, and with the
//! tap attached it allocates nothing either (the tap's ring is allocated
//! once, when it is taken). Checked with a counting global allocator, which
//! is why this is an integration test of its own: the allocator covers the
//! whole binary.

use kvbm_events::bus::{BusConfig, EventBus, TapItem};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    // Per thread, so that the test harness's own threads do not disturb the
    // count.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: the slot may be gone while the thread is exiting.
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

#[derive(Clone)]
struct Event([u64; 8]);

#[test]
fn publishing_allocates_nothing_without_listeners_or_with_a_warm_tap() {
    let bus = EventBus::<Event>::new(BusConfig {
        broadcast_capacity: 16,
        tap_capacity: 64,
    })
    .unwrap();

    let before = allocs();
    for i in 0..10_000 {
        bus.publish(Event([i; 8]));
    }
    assert_eq!(allocs() - before, 0, "no-listener publish allocated");

    // Warm up (nothing should need it, but a first-use allocation would be
    // harmless; steady state is what matters).
    let mut tap = bus.take_tap().unwrap();
    for round in 0..3 {
        for i in 0..64 {
            bus.publish(Event([i; 8]));
        }
        while let Ok(item) = tap.try_recv() {
            assert!(
                matches!(item, TapItem::Event(Event(v)) if v[0] < 64),
                "round {round}"
            );
        }
    }
    let before = allocs();
    for _ in 0..100 {
        for i in 0..64 {
            bus.publish(Event([i; 8]));
        }
        while tap.try_recv().is_ok() {}
    }
    assert_eq!(allocs() - before, 0, "tap publish or receive allocated");
    assert_eq!(bus.counters().tap_dropped, 0);
}
