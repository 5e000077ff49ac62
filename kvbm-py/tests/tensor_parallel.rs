//! The connector under tensor parallelism, without vLLM: two workers, each
//! with its own shard of "vLLM's" KV cache, and one scheduler side. Each
//! rank stores and loads its own bytes in its own host-tier file, and a
//! batch is done only when every rank has reported it. (The real engine
//! with `tensor_parallel_size=2`: `tests/vllm/oracle.py`.)

use kvbm_py::config::Config;
use kvbm_py::scheduler::{Parallel, Scheduled, SchedulerSide, StepInput};
use kvbm_py::tiers::{Geometry, Shard};
use kvbm_py::worker::{KvTensor, WorkerSide};
use serde_json::json;

const BS: usize = 4;
const PAGE: usize = 32;
const BLOCKS: usize = 8;

fn geometry() -> Geometry {
    Geometry {
        num_gpu_blocks: BLOCKS,
        block_size: BS,
        num_layers: 1,
        page_bytes: PAGE,
    }
}

/// One rank's shard of the KV cache: a single layer, block-major.
struct Shard1 {
    bytes: Vec<u8>,
}

impl Shard1 {
    fn tensors(&mut self) -> Vec<KvTensor> {
        vec![KvTensor {
            name: "layer.0".into(),
            data_ptr: self.bytes.as_mut_ptr() as u64,
            nbytes: self.bytes.len() as u64,
            num_blocks: BLOCKS,
            block_stride_bytes: PAGE,
            contiguous: true,
            device: "cpu".into(),
            shape: vec![BLOCKS, PAGE],
        }]
    }

    fn block(&mut self, b: usize) -> &mut [u8] {
        &mut self.bytes[b * PAGE..(b + 1) * PAGE]
    }
}

fn step(req: &str, prompt: &[u32], before: usize, n: usize, blocks: &[u32]) -> StepInput {
    StepInput {
        scheduled: vec![Scheduled {
            request: req.into(),
            new_tokens: Vec::new(),
            prompt_len: prompt.len(),
            computed_before: before,
            scheduled: n,
            block_ids: Some(blocks.to_vec()),
        }],
        preempted: Vec::new(),
        g1_free: None,
        refused: Vec::new(),
    }
}

#[test]
fn each_rank_keeps_its_own_shard_and_a_batch_waits_for_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::from_json(&json!({
        "host_capacity_tokens": 64,
        "shm_dir": dir.path().to_str().unwrap(),
        "ship_timeout_s": 60.0,
    }))
    .unwrap();
    let mut shards: Vec<Shard1> = (0..2)
        .map(|_| Shard1 {
            bytes: vec![0; BLOCKS * PAGE],
        })
        .collect();
    let mut workers: Vec<WorkerSide> = shards
        .iter_mut()
        .enumerate()
        .map(|(rank, s)| {
            let shard = Shard { rank, ranks: 2 };
            // SAFETY: the shards outlive the workers; nothing else touches
            // them while a plan runs.
            unsafe { WorkerSide::start(&cfg, geometry(), "tp", s.tensors(), shard) }.unwrap()
        })
        .collect();
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "a host-tier file per rank: {files:?}");
    assert!(
        files[0].ends_with(".tp0.g2") && files[1].ends_with(".tp1.g2"),
        "{files:?}"
    );
    let parallel = Parallel {
        ranks: 2,
        ..Parallel::default()
    };
    let mut sched = SchedulerSide::start(cfg, geometry(), "tp", parallel).unwrap();
    assert!(
        sched.summary().contains("tensor parallel 2"),
        "{}",
        sched.summary()
    );

    // A 9-token prompt: two full blocks, computed into vLLM blocks 1 and 2
    // with different bytes in each rank (each holds other KV heads).
    let a: Vec<u32> = (100..109).collect();
    assert_eq!(
        sched.get_num_new_matched_tokens("A", &a, 0).unwrap(),
        Some(0)
    );
    sched.update_state_after_alloc("A", &[1, 2, 3], 0).unwrap();
    let run = |workers: &mut Vec<WorkerSide>, plan: &kvbm_py::meta::StepPlan| -> Vec<Vec<u8>> {
        workers
            .iter_mut()
            .filter_map(|w| {
                w.bind(&plan.to_bytes()).unwrap();
                w.run();
                assert!(w.take_load_errors().is_empty());
                w.take_report()
            })
            .collect()
    };
    let plan = sched.build_meta(step("A", &a, 0, 9, &[1, 2, 3])).unwrap();
    run(&mut workers, &plan);
    for (rank, s) in shards.iter_mut().enumerate() {
        s.block(1).fill(10 + rank as u8);
        s.block(2).fill(20 + rank as u8);
    }
    sched.update_connector_output(&[]);
    // The stores ship; each rank copies its own shard.
    let mut reports = Vec::new();
    for _ in 0..100 {
        let plan = sched.build_meta(StepInput::default()).unwrap();
        reports = run(&mut workers, &plan);
        if !reports.is_empty() {
            break;
        }
        sched.update_connector_output(&[]);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(reports.len(), 2, "both ranks ran the stores");
    // Rank 0's report alone does not complete them: A keeps its blocks.
    sched.update_connector_output(&reports[..1]);
    assert!(
        sched.request_finished("A", &[1, 2]).unwrap(),
        "stores still out on rank 1"
    );
    sched.update_connector_output(&reports[1..]);
    let mut drained = false;
    for _ in 0..100 {
        let plan = sched.build_meta(StepInput::default()).unwrap();
        run(&mut workers, &plan);
        sched.update_connector_output(&[]);
        if plan.finished_sending == ["A"] {
            drained = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(drained, "A finished sending once both ranks reported");

    // vLLM reuses the blocks; B shares A's 8-token prefix and loads it into
    // blocks 5 and 6: each rank gets its own shard back.
    for s in &mut shards {
        s.bytes.fill(0);
    }
    let mut b = a[..8].to_vec();
    b.extend([7, 8, 9]);
    assert_eq!(
        sched.get_num_new_matched_tokens("B", &b, 0).unwrap(),
        Some(8)
    );
    sched.update_state_after_alloc("B", &[5, 6, 7], 8).unwrap();
    let plan = sched.build_meta(step("B", &b, 8, 3, &[5, 6, 7])).unwrap();
    assert_eq!(plan.loads.len(), 1, "{plan:?}");
    let reports = run(&mut workers, &plan);
    sched.update_connector_output(&reports);
    for (rank, s) in shards.iter_mut().enumerate() {
        assert_eq!(
            s.block(5),
            vec![10 + rank as u8; PAGE],
            "rank {rank} block 0"
        );
        assert_eq!(
            s.block(6),
            vec![20 + rank as u8; PAGE],
            "rank {rank} block 1"
        );
    }
    drop(workers);
    sched.shutdown().unwrap();
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing left behind"
    );
}

/// A host-tier file a killed engine left (no lock held on it) is removed by
/// the next start in that directory, which says so; a living engine's stays.
#[test]
fn a_start_removes_a_dead_engines_file_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let dead = dir.path().join("kvbm-dead-0123456789abcdef.g2");
    std::fs::write(&dead, vec![0u8; 4096]).unwrap();
    let cfg = Config::from_json(&json!({
        "host_capacity_tokens": 64,
        "shm_dir": dir.path().to_str().unwrap(),
    }))
    .unwrap();
    let mut living =
        SchedulerSide::start(cfg.clone(), geometry(), "living", Parallel::default()).unwrap();
    assert!(!dead.exists());
    let notes = living.start_notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains(&dead.display().to_string()) && notes[0].contains("4.0 KiB"),
        "{notes:?}"
    );
    let mut next = SchedulerSide::start(cfg, geometry(), "next", Parallel::default()).unwrap();
    assert!(
        next.start_notes().is_empty(),
        "the living engine's file is kept"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    living.shutdown().unwrap();
    next.shutdown().unwrap();
}
