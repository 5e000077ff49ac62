//! The connector's two sides in one process, driven the way vLLM drives
//! them (the call order observed on a real vLLM, see the README): a
//! request is computed and stored, the device cache is forgotten, a second
//! request with the same prefix gets an external hit, and its blocks come
//! back into "vLLM's" memory byte for byte. The real-engine tests in
//! `kvbm-py/tests/vllm/` do the same through vLLM itself; this one is the
//! fast layer.

use kvbm_events::bus::TapItem;
use kvbm_events::{BlockId, Event, EventKind, Tier};
use kvbm_py::config::Config;
use kvbm_py::meta::{Batch, Pair, Route, StepPlan, StepReport};
use kvbm_py::scheduler::{Parallel, Scheduled, SchedulerSide, StepInput};
use kvbm_py::tiers::{Geometry, Shard};
use kvbm_py::worker::{KvTensor, WorkerSide};
use serde_json::json;

const BS: usize = 4;
const PAGE: usize = 64;
const LAYERS: usize = 2;
const BLOCKS: usize = 16;

/// "vLLM's" KV cache: one buffer per layer, block-major.
struct Cache {
    layers: Vec<Vec<u8>>,
}

impl Cache {
    fn new() -> Self {
        Cache {
            layers: (0..LAYERS).map(|_| vec![0u8; BLOCKS * PAGE]).collect(),
        }
    }

    fn tensors(&mut self) -> Vec<KvTensor> {
        self.layers
            .iter_mut()
            .enumerate()
            .map(|(i, l)| KvTensor {
                name: format!("layer.{i}"),
                data_ptr: l.as_mut_ptr() as u64,
                nbytes: l.len() as u64,
                num_blocks: BLOCKS,
                block_stride_bytes: PAGE,
                contiguous: true,
                device: "cpu".into(),
                shape: vec![BLOCKS, PAGE],
            })
            .collect()
    }

    /// The forward pass "computes" block `b` for token block `j` of a
    /// prompt: bytes that depend on the prompt's tokens up to it.
    fn compute(&mut self, b: u32, prompt: &[u32], j: usize) {
        let seed: u64 = prompt[..(j + 1) * BS]
            .iter()
            .fold(7, |a, t| a.wrapping_mul(31).wrapping_add(u64::from(*t)));
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let page = &mut layer[b as usize * PAGE..(b as usize + 1) * PAGE];
            for (i, x) in page.iter_mut().enumerate() {
                *x = (seed.wrapping_add((l * 1000 + i) as u64) % 251) as u8;
            }
        }
    }

    fn block(&self, b: u32) -> Vec<u8> {
        self.layers
            .iter()
            .flat_map(|l| l[b as usize * PAGE..(b as usize + 1) * PAGE].to_vec())
            .collect()
    }

    fn wipe(&mut self, b: u32) {
        for l in &mut self.layers {
            l[b as usize * PAGE..(b as usize + 1) * PAGE].fill(0);
        }
    }
}

fn geometry() -> Geometry {
    Geometry {
        num_gpu_blocks: BLOCKS,
        block_size: BS,
        num_layers: LAYERS,
        page_bytes: PAGE,
    }
}

struct Rig {
    sched: SchedulerSide,
    worker: WorkerSide,
    cache: Cache,
    _dir: tempfile::TempDir,
}

fn rig(extra: serde_json::Value) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = extra;
    extra["shm_dir"] = json!(dir.path().to_str().unwrap());
    // These tests check what is moved, not how fast: on a loaded machine
    // the default 1 s for a step's transfers to reach the worker's queue
    // can pass, and the connector then (rightly) fails the load.
    if extra.get("ship_timeout_s").is_none() {
        extra["ship_timeout_s"] = json!(60.0);
    }
    if extra.get("disk_path").is_some() {
        extra["disk_path"] = json!(dir.path().join("g3.kvbm").to_str().unwrap());
    }
    let cfg = Config::from_json(&extra).unwrap();
    let mut cache = Cache::new();
    // The worker starts first, as in vLLM.
    let worker =
        unsafe { WorkerSide::start(&cfg, geometry(), "engine-1", cache.tensors(), Shard::ONE) }
            .unwrap();
    let sched = SchedulerSide::start(cfg, geometry(), "engine-1", Parallel::default()).unwrap();
    Rig {
        sched,
        worker,
        cache,
        _dir: dir,
    }
}

impl Rig {
    /// A request kvbm has never seen: its lookup finds nothing, and vLLM
    /// gives it `blocks`.
    fn admit_without_hit(&mut self, req: &str, prompt: &[u32], blocks: &[u32]) {
        assert_eq!(
            self.sched
                .get_num_new_matched_tokens(req, prompt, 0)
                .unwrap(),
            Some(0)
        );
        self.sched.update_state_after_alloc(req, blocks, 0).unwrap();
    }

    /// One vLLM step: build the plan, run it on the worker before the
    /// forward pass, compute what was scheduled, report back.
    /// vLLM's lookup of a waiting request, asked again on each (idle) step
    /// until it says `want` or 2 s have passed, as vLLM asks while the
    /// request waits: a store's blocks are registered in its tier once the
    /// worker's report is resolved, a moment after the step that names it.
    /// Returns the last answer and how many times it asked.
    fn lookup_until(&mut self, req: &str, prompt: &[u32], want: usize) -> (Option<usize>, usize) {
        let mut hit = None;
        let mut asked = 0;
        while asked < 400 {
            hit = self
                .sched
                .get_num_new_matched_tokens(req, prompt, 0)
                .unwrap();
            asked += 1;
            if hit == Some(want) {
                break;
            }
            self.step(StepInput::default(), &[]);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        (hit, asked)
    }

    fn step(&mut self, input: StepInput, compute: &[(u32, &[u32], usize)]) -> Vec<u32> {
        self.step_plan(input, compute).1
    }

    fn step_plan(
        &mut self,
        input: StepInput,
        compute: &[(u32, &[u32], usize)],
    ) -> (kvbm_py::meta::StepPlan, Vec<u32>) {
        let plan = self.sched.build_meta(input).unwrap();
        self.worker.bind(&plan.to_bytes()).unwrap();
        self.worker.run();
        let errors = self.worker.take_load_errors();
        for &(b, prompt, j) in compute {
            self.cache.compute(b, prompt, j);
        }
        let report: Vec<Vec<u8>> = self.worker.take_report().into_iter().collect();
        self.sched.update_connector_output(&report);
        (plan, errors)
    }
}

fn prompt(base: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn events(tap: &mut kvbm_events::bus::TapReceiver<Event>) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(TapItem::Event(e)) = tap.try_recv() {
        out.push(e);
    }
    out
}

/// One vLLM step that runs one request: `n` of prompt `p`'s tokens from
/// `before` on, in `blocks`, and the rest of G1 free.
fn one_run(
    req: &str,
    p: &[u32],
    before: usize,
    n: usize,
    blocks: &[u32],
    new: Vec<u32>,
) -> StepInput {
    StepInput {
        scheduled: vec![run(req, p, before, n, blocks, new)],
        preempted: Vec::new(),
        g1_free: Some(BLOCKS - blocks.len()),
        refused: Vec::new(),
    }
}

/// Takes the tap's events into `seen` until `done` says they are all
/// there or `within` has passed: completions are events of the
/// pipelines' own tasks, so they come a moment after the step.
fn collect_until(
    tap: &mut kvbm_events::bus::TapReceiver<Event>,
    seen: &mut Vec<Event>,
    within: std::time::Duration,
    done: impl Fn(&[Event]) -> bool,
) {
    let t = std::time::Instant::now();
    while t.elapsed() < within && !done(seen) {
        seen.extend(events(tap));
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Request A of `run_store_then_load`: 9 tokens, two full blocks,
/// computed into vLLM blocks 1, 2, 3, stored and finished. Returns the
/// two full blocks' bytes as computed, once vLLM may reuse them.
fn compute_and_store_a(r: &mut Rig, a: &[u32]) -> (Vec<u8>, Vec<u8>) {
    // Computed in one step.
    r.admit_without_hit("A", a, &[1, 2, 3]);
    r.step(
        one_run("A", a, 0, 9, &[1, 2, 3], Vec::new()),
        &[(1, a, 0), (2, a, 1)],
    );
    // Next step: A's stores (blocks 1 and 2) ship and run before the
    // forward pass; A decodes one token.
    r.step(one_run("A", a, 9, 1, &[1, 2, 3], vec![7]), &[]);
    let computed_1 = r.cache.block(1);
    let computed_2 = r.cache.block(2);
    if r.sched.request_finished("A", &[1, 2]).unwrap() {
        // Stores still out (lazy mode stores now; eager ones may not have
        // shipped yet): vLLM keeps the blocks until the worker reports A
        // finished sending. The next step, though it runs nothing (an
        // idle engine may take no other), ships them and names A.
        let (plan, _) = r.step_plan(StepInput::default(), &[]);
        assert_eq!(plan.finished_sending, ["A"], "{plan:?}");
        assert_eq!(r.sched.counters().early_frees, 1);
    }
    (computed_1, computed_2)
}

/// vLLM forgets its cache, then request B, sharing A's 8-token prefix,
/// gets an external hit of two blocks and loads them into vLLM blocks 5
/// and 6, byte for byte as A computed them. Returns B's prompt.
fn reload_a_as_b(r: &mut Rig, a: &[u32], computed: (Vec<u8>, Vec<u8>)) -> Vec<u32> {
    let (computed_1, computed_2) = computed;
    // vLLM forgets its cache (reset_prefix_cache) and reuses the blocks.
    for b in 1..4 {
        r.cache.wipe(b);
    }
    r.step(StepInput::default(), &[]);
    // Request B shares A's 8-token prefix: an external hit of two blocks.
    let mut b_prompt = a[..8].to_vec();
    b_prompt.extend(prompt(500, 3));
    // A's blocks are registered in G2 once the worker's report of their
    // store is resolved, a moment after vLLM freed them; vLLM asks again
    // on each step while B waits.
    assert_eq!(r.lookup_until("B", &b_prompt, 8).0, Some(8));
    r.sched
        .update_state_after_alloc("B", &[5, 6, 7], 8)
        .unwrap();
    let errors = r.step(one_run("B", &b_prompt, 8, 3, &[5, 6, 7], Vec::new()), &[]);
    assert!(errors.is_empty(), "{errors:?} {:?}", r.sched.counters());
    assert_eq!(r.cache.block(5), computed_1, "block 0 loaded byte for byte");
    assert_eq!(r.cache.block(6), computed_2, "block 1 loaded byte for byte");
    b_prompt
}

/// The transfers completed in `seen`, as (direction, blocks).
fn completed_transfers(seen: &[Event]) -> Vec<(String, u32)> {
    seen.iter()
        .filter_map(|e| match &e.kind {
            EventKind::TransferCompleted {
                direction, blocks, ..
            } => Some((direction.to_string(), *blocks)),
            _ => None,
        })
        .collect()
}

/// The batches the worker completed in `seen`, as (direction, blocks).
fn completed_batches(seen: &[Event]) -> Vec<(String, u32)> {
    seen.iter()
        .filter_map(|e| match &e.kind {
            EventKind::BatchCompleted {
                direction,
                ok: true,
                blocks,
                ..
            } => Some((direction.to_string(), *blocks)),
            _ => None,
        })
        .collect()
}

/// The G1 blocks `req` was given in `seen`, by mirror id, and how many
/// it released.
fn device_blocks(seen: &[Event], req: &str) -> (Vec<BlockId>, u32) {
    let (mut given, mut released) = (Vec::new(), 0);
    for e in seen.iter().filter(|e| e.request.as_deref() == Some(req)) {
        match &e.kind {
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks,
            } => given.extend_from_slice(blocks),
            EventKind::BlocksReleased {
                tier: Tier::Device,
                count,
            } => released += count,
            _ => {}
        }
    }
    (given, released)
}

/// The G1 blocks registered in `seen`, by mirror id.
fn registered_device_blocks(seen: &[Event]) -> std::collections::HashSet<BlockId> {
    seen.iter()
        .filter_map(|e| match &e.kind {
            EventKind::BlockRegistered {
                tier: Tier::Device,
                block,
                ..
            } => Some(*block),
            _ => None,
        })
        .collect()
}

/// `req`'s lookups on G1 in `seen`, as (blocks looked up, hit blocks,
/// hit tokens).
fn device_lookups(seen: &[Event], req: &str) -> Vec<(u32, u32, u32)> {
    seen.iter()
        .filter(|e| e.request.as_deref() == Some(req))
        .filter_map(|e| match &e.kind {
            EventKind::MatchResult {
                tier: Tier::Device,
                looked_up,
                hit_blocks,
                hit_tokens,
            } => Some((*looked_up, *hit_blocks, *hit_tokens)),
            _ => None,
        })
        .collect()
}

fn run_store_then_load(extra: serde_json::Value) {
    let mut r = rig(extra);
    let mut tap = r.sched.emitter().bus().take_tap().unwrap();
    let a = prompt(100, 9);
    let computed = compute_and_store_a(&mut r, &a);
    let b_prompt = reload_a_as_b(&mut r, &a, computed);
    // Completions are events of the pipelines' own tasks: give them a
    // moment.
    let mut seen = Vec::new();
    collect_until(
        &mut tap,
        &mut seen,
        std::time::Duration::from_secs(5),
        |seen| {
            completed_transfers(seen)
                .iter()
                .any(|(d, _)| d.ends_with("→G1"))
        },
    );
    let completed = completed_transfers(&seen);
    assert!(
        completed
            .iter()
            .any(|(d, n)| d.starts_with("G1→") && *n == 2),
        "{completed:?}"
    );
    assert!(
        completed.iter().any(|(d, n)| d.ends_with("→G1") && *n == 2),
        "{completed:?}"
    );
    // The worker reports a batch's bytes and time; its blocks are the
    // batch's own.
    let batch_blocks = completed_batches(&seen);
    assert!(
        batch_blocks.iter().all(|(_, n)| *n > 0)
            && batch_blocks.iter().any(|(d, _)| d.ends_with("→G1")),
        "{batch_blocks:?}"
    );
    // Each request's G1 blocks, by mirror id: A's two full blocks, given
    // and released when it finished; B's two loaded blocks, still held.
    let (a_given, a_released) = device_blocks(&seen, "A");
    assert_eq!((a_given.len(), a_released), (2, 2), "{a_given:?}");
    let (b_given, b_released) = device_blocks(&seen, "B");
    assert_eq!((b_given.len(), b_released), (2, 0), "{b_given:?}");
    // The allocations name the ids the registrations do (kvbm's mirror
    // ids), so a consumer maps a request to its prefix.
    let registered = registered_device_blocks(&seen);
    assert!(
        a_given.iter().all(|b| registered.contains(b)),
        "{a_given:?} {registered:?}"
    );
    // vLLM's own prefix-cache hit is G1's lookup: none for A and B (B's
    // came from G2); C arrives with one block found in vLLM's cache.
    let mut c_prompt = a[..BS].to_vec();
    c_prompt.extend(prompt(900, BS + 1));
    r.sched
        .get_num_new_matched_tokens("C", &c_prompt, BS)
        .unwrap();
    seen.extend(events(&mut tap));
    let full = |p: &[u32]| ((p.len() - 1) / BS) as u32;
    assert_eq!(device_lookups(&seen, "A"), [(full(&a), 0, 0)]);
    // B may have been asked about more than once while A's store landed.
    let b_lookups = device_lookups(&seen, "B");
    assert!(
        !b_lookups.is_empty() && b_lookups.iter().all(|l| *l == (full(&b_prompt), 0, 0)),
        "{b_lookups:?}"
    );
    assert_eq!(
        device_lookups(&seen, "C"),
        [(full(&c_prompt), 1, BS as u32)]
    );
    let c = r.sched.counters();
    assert_eq!(
        (c.late_loads, c.failed_load_blocks, c.unshippable_stores),
        (0, 0, 0)
    );
    // kvbm alone: whatever vLLM computed beyond its own hit, kvbm loaded.
    assert_eq!(external_hits(&seen), [], "{seen:?}");
    assert_eq!(c.external_hit_tokens, 0);
    r.sched.shutdown().unwrap();
}

#[test]
fn a_prefix_stored_on_the_host_comes_back_byte_for_byte() {
    run_store_then_load(json!({"host_capacity_tokens": 64}));
}

#[test]
fn with_only_a_disk_tier_too() {
    run_store_then_load(json!({
        "host_capacity_tokens": 0,
        "disk_path": "set by rig",
        "disk_capacity_tokens": 64,
    }));
}

#[test]
fn with_host_and_disk_and_lazy_offload() {
    run_store_then_load(json!({
        "host_capacity_tokens": 64,
        "disk_path": "set by rig",
        "disk_capacity_tokens": 64,
        "offload": "lazy",
    }));
}

/// Most decode steps add no block, and the Python side then passes no
/// block table (`None`): the one given before still maps the blocks that
/// fill later. Broken (a missing table read as empty), A's second block
/// would never be stored.
#[test]
fn a_step_without_a_block_table_keeps_the_last_one() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    let a = prompt(300, 9);
    r.admit_without_hit("A", &a, &[1, 2, 3]);
    let step = |before: usize, n: usize, blocks: Option<Vec<u32>>| StepInput {
        scheduled: vec![Scheduled {
            request: "A".into(),
            new_tokens: Vec::new(),
            prompt_len: a.len(),
            computed_before: before,
            scheduled: n,
            block_ids: blocks,
        }],
        preempted: Vec::new(),
        g1_free: None,
        refused: Vec::new(),
    };
    // A chunked prefill: 5 tokens (block 0 full), then 4 more (block 1
    // full) in a step that passes no table.
    let mut stored = Vec::new();
    let mut plans = vec![
        r.step_plan(step(0, 5, Some(vec![1, 2, 3])), &[(1, &a, 0)])
            .0,
    ];
    plans.push(r.step_plan(step(5, 4, None), &[(2, &a, 1)]).0);
    for _ in 0..50 {
        plans.push(r.step_plan(StepInput::default(), &[]).0);
        stored.extend(
            plans
                .drain(..)
                .flat_map(|p| p.stores)
                .flat_map(|b| b.pairs)
                .map(|p| p.src),
        );
        if stored.len() >= 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    stored.sort_unstable();
    assert_eq!(stored, [1, 2], "vLLM blocks stored");
    r.sched.shutdown().unwrap();
}

fn host_cfg(dir: &std::path::Path, extra: serde_json::Value) -> Config {
    let mut extra = extra;
    extra["shm_dir"] = json!(dir.to_str().unwrap());
    if extra.get("host_capacity_tokens").is_none() {
        extra["host_capacity_tokens"] = json!(64);
    }
    Config::from_json(&extra).unwrap()
}

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A block size no engine has, or more device blocks than can be
/// mirrored, is refused at start, naming the number, instead of aborting
/// on the first request.
#[test]
fn an_absurd_geometry_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (g, name) in [
        (
            Geometry {
                block_size: 1 << 40,
                ..geometry()
            },
            "block_size",
        ),
        (
            Geometry {
                num_gpu_blocks: 1 << 63,
                page_bytes: 1,
                ..geometry()
            },
            "num_gpu_blocks",
        ),
    ] {
        let cfg = host_cfg(dir.path(), json!({"host_capacity_tokens": 1u64 << 41}));
        let e = SchedulerSide::start(cfg, g, "engine-1", Parallel::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(name), "{g:?}: {e}");
    }
    assert!(files(dir.path()).is_empty(), "{:?}", files(dir.path()));
}

/// A start that fails after the host tier's file was made removes it (it
/// is a share of the machine's memory in /dev/shm).
#[test]
fn a_failed_start_leaves_no_shared_file() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let exists = dir.path().join("exists");
    std::fs::create_dir(&exists).unwrap();
    for extra in [
        json!({"record": exists.to_str().unwrap()}),
        json!({"disk_path": dir.path().to_str().unwrap(), "disk_capacity_tokens": 64}),
    ] {
        let e = SchedulerSide::start(
            host_cfg(&shm, extra.clone()),
            geometry(),
            "engine-1",
            Parallel::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(files(&shm).is_empty(), "{extra}: {e}: {:?}", files(&shm));
    }
    // The disk tier's file is named by its key.
    let e = SchedulerSide::start(
        host_cfg(
            &shm,
            json!({"disk_path": dir.path().to_str().unwrap(), "disk_capacity_tokens": 64}),
        ),
        geometry(),
        "engine-1",
        Parallel::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`disk_path`"), "{e}");
}

/// vLLM starts its worker first, so a worker makes the file when there is
/// none; if no scheduler ever claims it, the worker removes it when it
/// goes. One whose scheduler holds it leaves it to the scheduler.
#[test]
fn a_worker_removes_the_file_it_made_when_no_scheduler_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = Cache::new();
    let cfg = host_cfg(dir.path(), json!({}));
    let w = unsafe { WorkerSide::start(&cfg, geometry(), "alone", cache.tensors(), Shard::ONE) }
        .unwrap();
    assert_eq!(files(dir.path()).len(), 1);
    drop(w);
    assert!(files(dir.path()).is_empty(), "{:?}", files(dir.path()));

    let w = unsafe { WorkerSide::start(&cfg, geometry(), "paired", cache.tensors(), Shard::ONE) }
        .unwrap();
    let mut s =
        SchedulerSide::start(cfg.clone(), geometry(), "paired", Parallel::default()).unwrap();
    drop(w);
    assert_eq!(files(dir.path()).len(), 1, "the scheduler's tier is kept");
    s.shutdown().unwrap();
    assert!(files(dir.path()).is_empty(), "{:?}", files(dir.path()));
}

/// Engine ids that a file name would make equal are different files; the
/// same id twice is refused while the first engine holds its file, and
/// shutting one engine down never removes another's.
#[test]
fn each_engine_has_its_own_file_and_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = host_cfg(dir.path(), json!({}));
    let start = |id: &str| SchedulerSide::start(cfg.clone(), geometry(), id, Parallel::default());
    let mut a = start("eng/1").unwrap();
    let mut b = start("eng1").unwrap();
    let mut x = start("").unwrap();
    let mut y = start("\u{e9}\u{e9}").unwrap();
    assert_eq!(files(dir.path()).len(), 4, "{:?}", files(dir.path()));
    b.shutdown().unwrap();
    assert_eq!(files(dir.path()).len(), 3, "{:?}", files(dir.path()));
    let e = start("eng/1").unwrap_err().to_string();
    assert!(e.contains("same engine_id"), "{e}");
    assert_eq!(
        files(dir.path()).len(),
        3,
        "a refused engine removes nothing"
    );
    a.shutdown().unwrap();
    // Free again: a later engine with that id starts.
    start("eng/1").unwrap().shutdown().unwrap();
    x.shutdown().unwrap();
    y.shutdown().unwrap();
    assert!(files(dir.path()).is_empty(), "{:?}", files(dir.path()));
}

/// What update_state_after_alloc is given must be what vLLM can give: its
/// own block ids, and no more external tokens than the lookup promised. A
/// refused call changes nothing, and leaves no entry behind.
#[test]
fn update_state_after_alloc_refuses_what_vllm_cannot_mean() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    let p = prompt(100, 9);
    assert_eq!(
        r.sched.get_num_new_matched_tokens("A", &p, 0).unwrap(),
        Some(0)
    );
    for (blocks, ext, what) in [
        (vec![1, 99_999, 3], 0, "block id 99999"),
        (vec![1, u32::MAX], 0, "block id 4294967295"),
        (vec![1, BLOCKS as u32], 0, "block id 16"),
        (vec![1, 2, 3], 8, "num_external_tokens 8"),
    ] {
        let e = r
            .sched
            .update_state_after_alloc("A", &blocks, ext)
            .unwrap_err()
            .to_string();
        assert!(e.contains("request A:") && e.contains(what), "{e}");
    }
    r.sched
        .update_state_after_alloc("A", &[1, 2, 3], 0)
        .unwrap();
    // Requests kvbm never looked up are refused, and not kept.
    for i in 0..1000 {
        assert!(
            r.sched
                .update_state_after_alloc(&format!("ghost-{i}"), &[1], 0)
                .is_err()
        );
    }
    assert!(
        format!("{:?}", r.sched).contains("requests: 1,"),
        "{:?}",
        r.sched
    );
    // A refused request_finished changes nothing either.
    assert!(r.sched.request_finished("A", &[1, 70_000]).is_err());
    r.sched.shutdown().unwrap();
}

/// A request id is said once, clipped: ids come from the caller.
#[test]
fn a_refusal_names_the_request_once_and_clipped() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    let long = format!("req-{}", "9".repeat(100_000));
    let e = r
        .sched
        .update_state_after_alloc(&long, &[1], 0)
        .unwrap_err()
        .to_string();
    assert!(e.len() < 400, "{} bytes", e.len());
    assert_eq!(e.matches("req-9").count(), 1, "{e}");
    let e = r
        .sched
        .update_state_after_alloc("req-42", &[1], 0)
        .unwrap_err()
        .to_string();
    assert_eq!(e.matches("req-42").count(), 1, "{e}");
    r.sched.shutdown().unwrap();
}

/// One scheduled request whose numbers cannot be is left out of its step;
/// the others in the same step are followed (here: B's block is stored).
#[test]
fn one_unusable_request_does_not_fail_the_step() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    let a = prompt(100, 9);
    let b = prompt(700, 9);
    r.admit_without_hit("A", &a, &[1, 2, 3]);
    r.admit_without_hit("B", &b, &[4, 5, 6]);
    let s = |req: &str, before: usize, n: usize, blocks: Vec<u32>| Scheduled {
        request: req.into(),
        new_tokens: Vec::new(),
        prompt_len: 9,
        computed_before: before,
        scheduled: n,
        block_ids: Some(blocks),
    };
    let mut stored = Vec::new();
    for bad in [
        s("A", usize::MAX, 2, vec![1, 2, 3]),
        s("A", 0, 9, vec![1, 2, 99_999]),
    ] {
        let input = StepInput {
            scheduled: vec![bad, s("B", 0, 9, vec![4, 5, 6])],
            ..StepInput::default()
        };
        let (plan, _) = r.step_plan(input, &[(4, &b, 0), (5, &b, 1)]);
        stored.extend(
            plan.stores
                .iter()
                .flat_map(|b| b.pairs.iter().map(|p| p.src)),
        );
    }
    assert_eq!(r.sched.counters().refused_scheduled, 2);
    for _ in 0..50 {
        let (plan, _) = r.step_plan(StepInput::default(), &[]);
        stored.extend(
            plan.stores
                .iter()
                .flat_map(|b| b.pairs.iter().map(|p| p.src)),
        );
        if stored.len() >= 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    stored.sort_unstable();
    assert_eq!(stored, [4, 5], "B's blocks stored");
    r.sched.shutdown().unwrap();
}

#[test]
fn a_null_tensor_is_said_to_be_null() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = Cache::new();
    let mut t = cache.tensors();
    t[1].data_ptr = 0;
    let cfg = host_cfg(dir.path(), json!({}));
    let e = unsafe { WorkerSide::start(&cfg, geometry(), "e", t, Shard::ONE) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer.1") && e.contains("null"), "{e}");
}

/// vLLM's tensors on a GPU, as the worker side sees them: device memory
/// at addresses this process must never read, in a layout kvbm's copies do
/// not take (a per-layer `[2, blocks, ...]` view).
fn cuda_tensors(cache: &mut Cache) -> Vec<KvTensor> {
    let mut t = cache.tensors();
    for (i, t) in t.iter_mut().enumerate() {
        t.device = "cuda:0".into();
        t.data_ptr = 0x7f00_0000_0000 + (i as u64) * 0x1000_0000;
        t.num_blocks = 2;
        t.block_stride_bytes *= 7;
        t.contiguous = false;
    }
    t
}

#[test]
fn an_observer_takes_tensors_on_any_device_and_never_touches_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = Cache::new();
    let observer = host_cfg(dir.path(), json!({"host_capacity_tokens": 0}));
    assert!(observer.observes_only());
    let mut w = unsafe {
        WorkerSide::start(
            &observer,
            geometry(),
            "o",
            cuda_tensors(&mut cache),
            Shard::ONE,
        )
    }
    .unwrap();
    assert!(files(dir.path()).is_empty(), "an observer opens no tier");
    // Its plans are empty; a plan naming a copy anyway is reported failed,
    // without a byte of the tensors read.
    w.bind_plan(StepPlan::default());
    w.run();
    assert_eq!(w.take_report(), None);
    w.bind_plan(StepPlan {
        step: 1,
        stores: vec![Batch {
            route: Route::DeviceToHost,
            id: 9,
            pairs: vec![Pair {
                src: 0,
                dst: 0,
                hash: 1,
            }],
        }],
        ..StepPlan::default()
    });
    w.run();
    let report = StepReport::from_bytes(&w.take_report().unwrap()).unwrap();
    let error = report.done[0].error.as_deref().unwrap_or("");
    assert!(error.contains("no DeviceToHost engine"), "{error}");

    // Tensors missing a layer are still refused.
    let mut short = cuda_tensors(&mut cache);
    short.pop();
    let e = unsafe { WorkerSide::start(&observer, geometry(), "o", short, Shard::ONE) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensors for"), "{e}");

    // kvbm with a tier copies bytes: CUDA tensors need the `cuda`
    // feature (and, to start, a GPU: none here or in CI).
    let tiered = host_cfg(dir.path(), json!({}));
    let e = unsafe {
        WorkerSide::start(
            &tiered,
            geometry(),
            "t",
            cuda_tensors(&mut cache),
            Shard::ONE,
        )
    }
    .unwrap_err()
    .to_string();
    #[cfg(not(feature = "cuda"))]
    assert!(
        e.contains("cuda:0")
            && e.contains("no CUDA support")
            && e.contains("--features python,pyo3/extension-module,cuda"),
        "{e}"
    );
    #[cfg(feature = "cuda")]
    if kvbm_core::storage::cuda_available().is_err() {
        assert!(e.contains("cuda:0") && e.contains("CUDA"), "{e}");
    }
}

/// One request run in a step.
fn run(req: &str, p: &[u32], before: usize, n: usize, blocks: &[u32], new: Vec<u32>) -> Scheduled {
    Scheduled {
        request: req.into(),
        new_tokens: new,
        prompt_len: p.len(),
        computed_before: before,
        scheduled: n,
        block_ids: Some(blocks.to_vec()),
    }
}

/// The blocks each request loaded from G2 into G1 in `seen`, by request:
/// the completed host-to-device transfers, each credited to the request
/// that planned it.
fn loaded_from_g2(seen: &[Event]) -> std::collections::BTreeMap<String, u32> {
    let owner: std::collections::HashMap<u64, String> = seen
        .iter()
        .filter_map(|e| match (&e.kind, e.request.as_deref()) {
            (EventKind::TransferPlanned { transfer, .. }, Some(req)) => {
                Some((*transfer, req.to_string()))
            }
            _ => None,
        })
        .collect();
    let mut out = std::collections::BTreeMap::new();
    for e in seen {
        if let EventKind::TransferCompleted {
            transfer,
            direction,
            blocks,
        } = &e.kind
            && direction.src == Tier::Host
            && direction.dst == Tier::Device
            && let Some(req) = owner.get(transfer)
        {
            *out.entry(req.clone()).or_insert(0) += *blocks;
        }
    }
    out
}

/// The tiers of `req`'s lookups in `seen`, in the order they were said.
fn lookup_tiers(seen: &[Event], req: &str) -> Vec<Tier> {
    seen.iter()
        .filter(|e| e.request.as_deref() == Some(req))
        .filter_map(|e| match &e.kind {
            EventKind::MatchResult { tier, .. } => Some(*tier),
            _ => None,
        })
        .collect()
}

/// Issue 40: the console showed no G2 hit for any of vLLM's requests,
/// because the connector said a lookup's host result before vLLM's device
/// one (on every step a request waited) and the reducer let the device
/// result wipe it. After a reset-and-reload round, the reducer folded from
/// the connector's own events credits each reloaded request, asked about
/// on several steps before it got in, the G2 hit tokens it loaded: its
/// blocks moved G2 → G1 × the block size.
#[test]
fn each_reloaded_request_is_credited_the_g2_hits_it_loaded() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    let mut tap = r.sched.emitter().bus().take_tap().unwrap();
    let a = [prompt(100, 9), prompt(300, 9)];
    let (ra, rb) = (["A1", "A2"], ["B1", "B2"]);
    let a_blocks: [&[u32]; 2] = [&[1, 2, 3], &[4, 5, 6]];
    let b_blocks: [&[u32]; 2] = [&[7, 8, 9], &[10, 11, 12]];
    for i in 0..2 {
        r.admit_without_hit(ra[i], &a[i], a_blocks[i]);
    }
    let input = |runs: Vec<Scheduled>, used: usize| StepInput {
        scheduled: runs,
        preempted: Vec::new(),
        g1_free: Some(BLOCKS - used),
        refused: Vec::new(),
    };
    r.step(
        input(
            (0..2)
                .map(|i| run(ra[i], &a[i], 0, 9, a_blocks[i], Vec::new()))
                .collect(),
            6,
        ),
        &[(1, &a[0], 0), (2, &a[0], 1), (4, &a[1], 0), (5, &a[1], 1)],
    );
    r.step(
        input(
            (0..2)
                .map(|i| run(ra[i], &a[i], 9, 1, a_blocks[i], vec![7]))
                .collect(),
            6,
        ),
        &[],
    );
    let mut sending: Vec<String> = Vec::new();
    for i in 0..2 {
        if !r.sched.request_finished(ra[i], &a_blocks[i][..2]).unwrap() {
            sending.push(ra[i].to_string());
        }
    }
    for _ in 0..100 {
        if sending.len() == 2 {
            break;
        }
        let (plan, _) = r.step_plan(StepInput::default(), &[]);
        sending.extend(plan.finished_sending);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        sending.len(),
        2,
        "A1 and A2 never finished sending: {sending:?}"
    );
    // vLLM forgets its cache (reset_prefix_cache) and reuses the blocks.
    for b in 1..7 {
        r.cache.wipe(b);
    }
    r.step(StepInput::default(), &[]);
    // B1 and B2 share A1's and A2's 8-token prefixes. Once A's stores are
    // registered, they wait three steps (vLLM asks about a waiting request
    // on each), then get in.
    let b: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            let mut p = a[i][..8].to_vec();
            p.extend(prompt(500 + 100 * i as u32, 3));
            p
        })
        .collect();
    let mut asked = [0; 2];
    for i in 0..2 {
        let (hit, n) = r.lookup_until(rb[i], &b[i], 8);
        assert_eq!(hit, Some(8), "{}", rb[i]);
        asked[i] = n;
    }
    for _ in 0..3 {
        for i in 0..2 {
            let hit = r.sched.get_num_new_matched_tokens(rb[i], &b[i], 0);
            assert_eq!(hit.unwrap(), Some(8), "{}", rb[i]);
        }
        r.step(StepInput::default(), &[]);
    }
    for i in 0..2 {
        assert_eq!(
            r.sched.get_num_new_matched_tokens(rb[i], &b[i], 0).unwrap(),
            Some(8)
        );
        r.sched
            .update_state_after_alloc(rb[i], b_blocks[i], 8)
            .unwrap();
    }
    let errors = r.step(
        input(
            (0..2)
                .map(|i| run(rb[i], &b[i], 8, 3, b_blocks[i], Vec::new()))
                .collect(),
            12,
        ),
        &[],
    );
    assert!(errors.is_empty(), "{errors:?} {:?}", r.sched.counters());
    // Completions are events of the pipelines' own tasks.
    let mut seen = Vec::new();
    collect_until(
        &mut tap,
        &mut seen,
        std::time::Duration::from_secs(10),
        |seen| loaded_from_g2(seen).len() >= 2,
    );
    seen.extend(events(&mut tap));
    let loaded = loaded_from_g2(&seen);
    assert_eq!(
        loaded,
        [("B1".to_string(), 2), ("B2".to_string(), 2)].into(),
        "each B loads its two blocks from G2"
    );
    // The connector says a lookup's device result first: each of B's
    // device results comes right before its host one.
    for (req, asked) in rb.into_iter().zip(asked) {
        let tiers = lookup_tiers(&seen, req);
        assert_eq!(tiers, [Tier::Device, Tier::Host].repeat(asked + 4), "{req}");
    }
    let state = kvbm_events::reducer::fold(&seen);
    for req in rb {
        let slot = state.slot(req).unwrap();
        assert_eq!(
            slot.hit_tokens,
            [0, u64::from(loaded[req]) * BS as u64, 0],
            "{req}"
        );
    }
    // A1 and A2 were computed: no hit.
    for req in ra {
        assert_eq!(state.slot(req).unwrap().hit_tokens, [0, 0, 0], "{req}");
    }
    r.sched.shutdown().unwrap();
}

/// The `ExternalHit`s in `seen`, as (request, from token, tokens).
fn external_hits(seen: &[Event]) -> Vec<(String, u32, u32)> {
    seen.iter()
        .filter_map(|e| match (&e.kind, e.request.as_deref()) {
            (EventKind::ExternalHit { from_token, tokens }, Some(r)) => {
                Some((r.to_string(), *from_token, *tokens))
            }
            _ => None,
        })
        .collect()
}

/// kvbm beside another connector in vLLM's `MultiConnector`: the other
/// one wins X's lookup (kvbm is told 0 external tokens) and vLLM schedules
/// X with its own hit and the other connector's tokens computed. kvbm says
/// what the other provided once, at that first schedule, and nothing for a
/// request computed from its own hit alone.
#[test]
fn another_connectors_tokens_are_said_as_external_hits() {
    for extra in [
        json!({"host_capacity_tokens": 0}),
        json!({"host_capacity_tokens": 64}),
    ] {
        let mut r = rig(extra.clone());
        let mut tap = r.sched.emitter().bus().take_tap().unwrap();
        let x = prompt(700, 4 * BS + 1);
        let y = prompt(800, 2 * BS + 1);
        // vLLM's own cache holds X's first block; the other connector
        // holds its next two.
        assert_eq!(
            r.sched.get_num_new_matched_tokens("X", &x, BS).unwrap(),
            Some(0)
        );
        r.sched
            .update_state_after_alloc("X", &[1, 2, 3, 4, 5], 0)
            .unwrap();
        r.admit_without_hit("Y", &y, &[6, 7, 8]);
        let both = |xb: usize, xn: usize, yb: usize, yn: usize| StepInput {
            scheduled: vec![
                run("X", &x, xb, xn, &[1, 2, 3, 4, 5], Vec::new()),
                run("Y", &y, yb, yn, &[6, 7, 8], Vec::new()),
            ],
            preempted: Vec::new(),
            g1_free: Some(BLOCKS - 8),
            refused: Vec::new(),
        };
        r.step(both(3 * BS, BS + 1, 0, 2 * BS + 1), &[]);
        r.step(both(4 * BS + 1, 1, 2 * BS + 1, 1), &[]);
        let seen = events(&mut tap);
        assert_eq!(
            external_hits(&seen),
            [("X".to_string(), BS as u32, 2 * BS as u32)],
            "{extra}"
        );
        assert_eq!(r.sched.counters().external_hit_tokens, 2 * BS as u64);
        // What the console's model credits X: the other connector's
        // tokens among its hits.
        let mut state = kvbm_events::reducer::EngineState::new();
        state.apply_all(&seen);
        let slot = state.slot("X").unwrap();
        assert_eq!(
            (slot.external_tokens, slot.total_hit_tokens()),
            (2 * BS as u64, 3 * BS as u64)
        );
        r.sched.shutdown().unwrap();
    }
}

fn tokens_scheduled(seen: &[Event]) -> usize {
    seen.iter()
        .filter(|e| matches!(e.kind, EventKind::TokensScheduled { .. }))
        .count()
}

/// With sync scheduling, a step's following and planning run after its
/// plan was returned: kvbm's runtime takes them while vLLM waits for the
/// worker, and vLLM's next call runs them first when that has not
/// happened, so every call sees the steps before it whole. (A step with a
/// load is never deferred: the store-then-load tests above check that its
/// load ships in its own plan, byte for byte.)
#[test]
fn a_step_is_followed_after_its_plan_returns_and_before_the_next_call() {
    let mut r = rig(json!({"host_capacity_tokens": 64}));
    // As the Python module runs it (it runs `run_deferred` on the runtime
    // after each call that leaves work).
    r.sched.defer_to_runtime(true);
    let mut tap = r.sched.emitter().bus().take_tap().unwrap();
    let a = prompt(100, 9);
    r.admit_without_hit("A", &a, &[1, 2, 3]);
    events(&mut tap);
    let plan = r
        .sched
        .build_meta(one_run("A", &a, 0, 9, &[1, 2, 3], Vec::new()))
        .unwrap();
    assert!(plan.loads.is_empty() && plan.stores.is_empty(), "{plan:?}");
    assert_eq!(r.sched.counters().deferred_steps, 1);
    assert_eq!(tokens_scheduled(&events(&mut tap)), 0);
    // vLLM's next call follows the step before it does anything else.
    r.sched.update_connector_output(&[]);
    assert_eq!(tokens_scheduled(&events(&mut tap)), 1);

    // The next step: the runtime's run follows it, once.
    let plan = r
        .sched
        .build_meta(one_run("A", &a, 9, 1, &[1, 2, 3], vec![7]))
        .unwrap();
    let mut stored: usize = plan.stores.iter().map(|b| b.pairs.len()).sum();
    assert_eq!(r.sched.counters().deferred_steps, 2);
    r.sched.run_deferred(true);
    assert_eq!(tokens_scheduled(&events(&mut tap)), 1);
    r.sched.run_deferred(true);
    r.sched.update_connector_output(&[]);
    assert_eq!(tokens_scheduled(&events(&mut tap)), 0);
    // The first step's stores (A's two full blocks), released when vLLM
    // reported its forward pass done, ship with a later step once the
    // pipeline's tasks have batched them.
    for _ in 0..400 {
        if stored >= 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        let plan = r.sched.build_meta(StepInput::default()).unwrap();
        stored += plan.stores.iter().map(|b| b.pairs.len()).sum::<usize>();
        r.sched.update_connector_output(&[]);
    }
    assert_eq!(stored, 2);
    assert_eq!(r.sched.counters().deferred_loads, 0);
}
