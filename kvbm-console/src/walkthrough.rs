//! `kvbm-console walkthrough`: the CPU-offload walk-through, as text.
//!
//! It runs the CPU-offload walk-through with
//! real pools, real bytes, real transfer engines and the offload pipeline,
//! and prints what happened: request A is computed on G1 and offloaded
//! eagerly (after its forward pass) to G2 and G3; request C pushes A out of
//! G1 and G2, and one of its offloads is cancelled before the upgrade;
//! request B shares A's prefix, misses on G1 and G2, hits on G3, and its
//! prefix is onboarded G3 → G2 → G1 and checked byte for byte against what
//! A's forward pass wrote.
//!
//! Host memory stands in for G1 (no GPU needed); G3 is a file in a temporary
//! directory that is removed on exit.

use anyhow::{Context, Result, bail, ensure};
use kvbm_core::assembly::{LocalTiers, Pools, TierSizes};
use kvbm_core::block::ComputeDone;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutError, LayoutKind};
use kvbm_core::link::HostTier;
// What the simulated forward pass writes into a block: derived from its
// sequence hash, so any later copy can be checked.
use kvbm_core::offload::{
    OffloadPipeline, PipelineConfig, TransferHandle, TransferStatus, precondition,
};
use kvbm_core::storage::DiskStorage;
use kvbm_core::{BlockPool, ImmutableBlock, SaltHash, TokenSequence};
use kvbm_sim::sim::kv_bytes;
use std::io::Write;
use std::sync::Arc;

/// Walk-through settings (from the command line).
#[derive(Debug, Clone, clap::Args)]
pub struct WalkthroughArgs {
    /// Tokens per block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub block_size: u16,
}

struct Tiers {
    g1: HostTier,
    g2: HostTier,
    g3: BlockPool,
    g3_disk: Arc<DiskStorage>,
    offload_12: Arc<OffloadPipeline>,
    offload_23: Arc<OffloadPipeline>,
    onboard_32: Arc<OffloadPipeline>,
    onboard_21: Arc<OffloadPipeline>,
    _dir: tempfile::TempDir,
}

fn layout(blocks: usize, page: usize) -> Result<Layout, LayoutError> {
    // A small model: 2 layers, K and V, 8 heads × 16 dims, fp16.
    Layout::new(
        LayoutConfig {
            num_blocks: blocks,
            num_layers: 2,
            outer_dim: 2,
            page_size: page,
            inner_dim: 128,
            dtype_bytes: 2,
        },
        LayoutKind::FullyContiguous,
    )
}

fn build(block_size: usize) -> Result<Tiers> {
    let sizes = TierSizes {
        block_size,
        device_blocks: 6,
        host_blocks: 4,
        disk_blocks: 16,
        eviction: Default::default(),
    };
    let pools = Pools::new(&sizes, None)?;
    let dir = tempfile::tempdir().context("creating a temporary directory for G3")?;
    let local = LocalTiers::create(
        &pools,
        |n| layout(n, block_size),
        Some(&dir.path().join("g3.kvbm")),
    )?;
    let c = local.connect(None, |_| PipelineConfig::default())?;
    let p = c.pipelines;
    let need = |p: Option<Arc<OffloadPipeline>>| p.context("a pipeline the tiers should have");
    Ok(Tiers {
        g1: local.device().clone(),
        g2: local.host().context("G2")?.clone(),
        g3: pools.disk.context("G3")?,
        g3_disk: local.disk().context("G3's file")?.clone(),
        offload_12: need(p.offload_device_to_host)?,
        offload_23: need(p.offload_host_to_disk)?,
        onboard_32: need(p.onboard_disk_to_host)?,
        onboard_21: need(p.onboard_host_to_device)?,
        _dir: dir,
    })
}

/// Waits for a transfer and insists it completed.
async fn completed(h: &TransferHandle, what: &str) -> Result<usize> {
    match h.wait().await {
        TransferStatus::Completed { blocks, .. } => Ok(blocks),
        other => bail!("{what}: expected completion, got {other:?}"),
    }
}

/// Onboards `sources` into freshly allocated blocks of the pipeline's
/// destination pool and returns them registered.
async fn onboard(p: &OffloadPipeline, sources: Vec<ImmutableBlock>) -> Result<Vec<ImmutableBlock>> {
    let dests = p.link().destination().allocate(sources.len())?;
    let h = p
        .onboard(sources, dests, 1)
        .map_err(|r| anyhow::anyhow!("onboard refused: {}", r.error))?;
    completed(&h, "onboard").await?;
    h.take_blocks().context("onboarded blocks missing")
}

struct Out<W: Write> {
    w: W,
}

impl<W: Write> Out<W> {
    fn line(&mut self, s: impl AsRef<str>) -> Result<()> {
        writeln!(self.w, "{}", s.as_ref())?;
        Ok(())
    }
    fn pools(&mut self, t: &Tiers) -> Result<()> {
        for p in [t.g1.pool(), t.g2.pool(), &t.g3] {
            let s = p.status();
            self.line(format!(
                "    {:<11} active {:>2}  inactive {:>2}  empty {:>2}  / {:>2}   evictions {}",
                p.tier().to_string(),
                s.active,
                s.inactive,
                s.empty,
                s.capacity,
                s.counters.evictions
            ))?;
        }
        Ok(())
    }
}

/// Prefill on G1: reuse what G1 already has, compute the rest block by block
/// through the lifecycle, write its KV bytes, register the full blocks.
fn compute_on_g1(
    t: &Tiers,
    seq: &TokenSequence,
    reuse: Vec<ImmutableBlock>,
) -> Result<Vec<ImmutableBlock>> {
    let bytes = t.g1.block_bytes();
    let done = reuse.len();
    let mut out = reuse;
    let todo = &seq.blocks()[done..];
    let fresh = t.g1.pool().allocate(todo.len())?;
    for (b, tb) in fresh.into_iter().zip(todo) {
        let mut p = b.init(seq.salt_hash(), tb.parent_sequence_hash(), tb.position());
        p.add_tokens(tb.tokens());
        let mut running = p.ready().map_err(|e| e.error)?.schedule_compute();
        t.g1.write(&mut running, &kv_bytes(tb.sequence_hash().0, bytes))?;
        match running.compute_done() {
            ComputeDone::Complete(c) => out.push(c.register()),
            ComputeDone::Partial(_) => {
                bail!("block {} was full but did not complete", tb.position())
            }
        }
    }
    Ok(out)
}

fn verify(t: &HostTier, blocks: &[ImmutableBlock]) -> Result<usize> {
    let mut buf = vec![0u8; t.block_bytes()];
    for b in blocks {
        t.read(b, &mut buf)?;
        ensure!(
            buf == kv_bytes(b.sequence_hash().0, buf.len()),
            "block {} on {} does not hold the bytes computed for it",
            b.id(),
            b.tier()
        );
    }
    Ok(blocks.len() * buf.len())
}

/// Runs the scenario, printing to `w`.
pub async fn run(args: &WalkthroughArgs, w: impl Write) -> Result<()> {
    let bs = usize::from(args.block_size);
    let t = build(bs)?;
    let mut o = Out { w };
    let salt = kvbm_core::tokens::salt_hash(b"demo-model");

    o.line(format!(
        "kvbm demo — block size {bs} tokens, {} KiB per block; G1 is host memory standing in for a GPU",
        t.g1.block_bytes() / 1024
    ))?;
    o.line("(the interactive console is not built yet; this prints what the block manager did)")?;
    o.pools(&t)?;

    let a_tokens = request_a(&t, &mut o, bs, salt).await?;
    request_c(&t, &mut o, bs, salt).await?;
    request_b(&t, &mut o, bs, salt, &a_tokens).await?;
    report_pipelines(&t, &mut o)?;
    o.line("demo finished: every copy verified")?;
    Ok(())
}

/// `len` consecutive token ids from `start`.
fn prompt(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

/// [1] Request A is computed on G1 and offloaded eagerly, G1 → G2 → G3;
/// offloading it again is skipped. Returns its prompt (B shares it).
async fn request_a<W: Write>(
    t: &Tiers,
    o: &mut Out<W>,
    bs: usize,
    salt: SaltHash,
) -> Result<Vec<u32>> {
    let a_tokens = prompt(1000, 2 * bs + bs / 2);
    let a = TokenSequence::from_tokens(&a_tokens, bs, salt)?;
    o.line(format!(
        "\n[1] request A: {} prompt tokens = {} full blocks + {} in the tail",
        a.total_tokens(),
        a.blocks().len(),
        a.tail().len()
    ))?;
    let hit = t.g1.pool().match_prefix(&a.sequence_hashes());
    o.line(format!("    G1 prefix match: {} blocks", hit.len()))?;
    let a_blocks = compute_on_g1(t, &a, hit)?;
    o.line(format!(
        "    computed and registered {} blocks on G1: ids {:?}",
        a_blocks.len(),
        a_blocks.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    // Eager offload, gated on the forward pass that wrote the blocks.
    let (forward_pass, pre) = precondition();
    let h = t
        .offload_12
        .offload(&a_blocks, Some(pre))
        .map_err(|r| anyhow::anyhow!("offload refused: {}", r.error))?;
    forward_pass.trigger();
    completed(&h, "offload G1 → G2").await?;
    let a_g2 = t.g2.pool().match_prefix(&a.sequence_hashes());
    let h = t
        .offload_23
        .offload(&a_g2, None)
        .map_err(|r| anyhow::anyhow!("offload refused: {}", r.error))?;
    completed(&h, "offload G2 → G3").await?;
    let a_g3 = t.g3.match_prefix(&a.sequence_hashes());
    o.line(format!(
        "    eager offload after the forward pass: G1 → G2 (ids {:?}) → G3 (ids {:?})",
        a_g2.iter().map(|b| b.id()).collect::<Vec<_>>(),
        a_g3.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    let again = t
        .offload_12
        .offload(&a_blocks, None)
        .map_err(|r| anyhow::anyhow!("offload refused: {}", r.error))?;
    o.line(format!(
        "    offloading A again: {:?} (presence policy)",
        again.wait().await
    ))?;
    drop((a_blocks, a_g2, a_g3));
    o.line("    request A finished: its blocks stay cached, inactive")?;
    o.pools(t)?;

    Ok(a_tokens)
}

/// [2] Request C fills G1 and G2, pushing A out of both; the offload of
/// its last blocks is cancelled while it waits for its forward pass.
async fn request_c<W: Write>(t: &Tiers, o: &mut Out<W>, bs: usize, salt: SaltHash) -> Result<()> {
    let c = TokenSequence::from_tokens(&prompt(50_000, 6 * bs), bs, salt)?;
    o.line(format!(
        "\n[2] request C: {} unrelated tokens ({} blocks) — fills G1 and G2",
        c.total_tokens(),
        c.blocks().len()
    ))?;
    let c_blocks = compute_on_g1(t, &c, Vec::new())?;
    let keep = t.g2.pool().capacity();
    let h = t
        .offload_12
        .offload(&c_blocks[..keep], None)
        .map_err(|r| anyhow::anyhow!("offload refused: {}", r.error))?;
    let moved = completed(&h, "offload C").await?;
    o.line(format!(
        "    computed {} blocks on G1 (evicting A's), offloaded the first {moved} to G2 (evicting A's there too)",
        c_blocks.len()
    ))?;
    // The rest waits on a forward pass that is cancelled: nothing moves.
    let (_pass, pre) = precondition();
    let h = t
        .offload_12
        .offload(&c_blocks[keep..], Some(pre))
        .map_err(|r| anyhow::anyhow!("offload refused: {}", r.error))?;
    o.line(format!(
        "    offload of C's last {} blocks cancelled while waiting for its forward pass: {:?}",
        c_blocks.len() - keep,
        h.cancel().await
    ))?;
    drop(c_blocks);
    o.pools(t)?;

    Ok(())
}

/// [3] Request B shares A's full blocks, found on G3 only: onboarded
/// G3 → G2 → G1 and checked byte for byte against A's forward pass.
async fn request_b<W: Write>(
    t: &Tiers,
    o: &mut Out<W>,
    bs: usize,
    salt: SaltHash,
    a_tokens: &[u32],
) -> Result<()> {
    let mut b_tokens = a_tokens[..2 * bs].to_vec();
    b_tokens.extend(prompt(9000, bs + bs / 3));
    let b = TokenSequence::from_tokens(&b_tokens, bs, salt)?;
    let hashes = b.sequence_hashes();
    o.line(format!(
        "\n[3] request B: {} tokens, the first {} shared with A",
        b.total_tokens(),
        2 * bs
    ))?;
    let on_g1 = t.g1.pool().match_prefix(&hashes);
    let on_g2 = t.g2.pool().match_prefix(&hashes);
    let on_g3 = t.g3.match_prefix(&hashes);
    o.line(format!(
        "    prefix match: G1 {} blocks, G2 {} blocks, G3 {} blocks ({} tokens)",
        on_g1.len(),
        on_g2.len(),
        on_g3.len(),
        on_g3.len() * bs
    ))?;
    ensure!(
        on_g1.is_empty() && on_g2.is_empty() && on_g3.len() == 2,
        "unexpected cache state"
    );
    let mut buf = vec![0u8; t.g1.block_bytes()];
    for blk in &on_g3 {
        t.g3_disk.read_block(blk.id(), &mut buf)?;
        ensure!(
            buf == kv_bytes(blk.sequence_hash().0, buf.len()),
            "G3 bytes differ"
        );
    }
    let up2 = onboard(&t.onboard_32, on_g3).await?;
    let up1 = onboard(&t.onboard_21, up2.clone()).await?;
    let checked = verify(&t.g2, &up2)? + verify(&t.g1, &up1)?;
    o.line(format!(
        "    onboarded G3 → G2 → G1 (G1 ids {:?}); {checked} bytes checked against A's forward pass",
        up1.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    let b_blocks = compute_on_g1(t, &b, up1)?;
    o.line(format!(
        "    computed the other {} full blocks; {} tokens of {} came from cache",
        b_blocks.len() - 2,
        2 * bs,
        b.total_tokens()
    ))?;
    drop((up2, b_blocks));
    o.pools(t)?;

    Ok(())
}

/// What each pipeline did, with its engine's refusals and failures.
fn report_pipelines<W: Write>(t: &Tiers, o: &mut Out<W>) -> Result<()> {
    o.line("\npipelines:")?;
    for (what, p) in [
        ("G1 → G2 offload", &t.offload_12),
        ("G2 → G3 offload", &t.offload_23),
        ("G3 → G2 onboard", &t.onboard_32),
        ("G2 → G1 onboard", &t.onboard_21),
    ] {
        let s = p.stats();
        let skipped: Vec<String> = s
            .skipped
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        let c = p.link().engine().counters();
        o.line(format!(
            "    {what}: {} completed, {} cancelled, skipped [{}], {} batches, {} blocks, {} bytes (engine: {} rejected, {} failed)",
            s.completed,
            s.cancelled,
            skipped.join(", "),
            s.batches,
            s.blocks_transferred,
            s.bytes_transferred,
            c.rejected,
            c.failed
        ))?;
    }
    Ok(())
}
