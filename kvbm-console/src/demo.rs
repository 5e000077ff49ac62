//! `kvbm-console demo`: the block manager on a small built-in scenario.
//!
//! Until the interactive console exists, the demo runs seed 002's story with
//! real pools, real bytes and real transfer engines, and prints what
//! happened: request A is computed on G1 and offloaded eagerly to G2 and G3;
//! request C pushes A out of G1 and G2; request B shares A's prefix, misses
//! on G1 and G2, hits on G3, and its prefix is onboarded G3 → G2 → G1 and
//! checked byte for byte against what A's forward pass wrote.
//!
//! Host memory stands in for G1 (no GPU needed); G3 is a file in a temporary
//! directory that is removed on exit.

use anyhow::{Context, Result, bail, ensure};
use kvbm_core::block::ComputeDone;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::link::{HostTier, TierLink};
use kvbm_core::storage::{DiskStorage, HostStorage};
use kvbm_core::transfer::{DiskDirection, DiskEngine, MemcpyEngine, TransferEngine};
use kvbm_core::{BlockPool, ImmutableBlock, PoolConfig, SaltHash, Tier, TokenSequence};
use std::io::Write;
use std::sync::Arc;

/// Demo settings (from the command line).
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Tokens per block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub block_size: u16,
}

struct Tiers {
    g1: HostTier,
    g2: HostTier,
    g3: BlockPool,
    g3_disk: Arc<DiskStorage>,
    offload_12: TierLink,
    offload_23: TierLink,
    onboard_32: TierLink,
    onboard_21: TierLink,
    _dir: tempfile::TempDir,
}

fn layout(blocks: usize, page: usize) -> Result<Layout> {
    // A small model: 2 layers, K and V, 8 heads × 16 dims, fp16.
    Ok(Layout::new(
        LayoutConfig {
            num_blocks: blocks,
            num_layers: 2,
            outer_dim: 2,
            page_size: page,
            inner_dim: 128,
            dtype_bytes: 2,
        },
        LayoutKind::FullyContiguous,
    )?)
}

fn build(block_size: usize) -> Result<Tiers> {
    let (c1, c2, c3) = (6, 4, 16);
    let pool = |tier, capacity| {
        BlockPool::new(PoolConfig {
            tier,
            capacity,
            block_size,
        })
    };
    let (p1, p2, p3) = (
        pool(Tier::Device, c1)?,
        pool(Tier::Host, c2)?,
        pool(Tier::Disk, c3)?,
    );
    let dir = tempfile::tempdir().context("creating a temporary directory for G3")?;
    let s1 = Arc::new(HostStorage::new(layout(c1, block_size)?)?);
    let s2 = Arc::new(HostStorage::new(layout(c2, block_size)?)?);
    let s3 = Arc::new(DiskStorage::create(
        dir.path().join("g3.kvbm"),
        layout(c3, block_size)?,
    )?);
    let e12: Arc<dyn TransferEngine> = Arc::new(MemcpyEngine::new(
        s1.clone(),
        Tier::Device,
        s2.clone(),
        Tier::Host,
    )?);
    let e21: Arc<dyn TransferEngine> = Arc::new(MemcpyEngine::new(
        s2.clone(),
        Tier::Host,
        s1.clone(),
        Tier::Device,
    )?);
    let e23: Arc<dyn TransferEngine> = Arc::new(DiskEngine::new(
        s2.clone(),
        s3.clone(),
        DiskDirection::HostToDisk,
        Tier::Host,
    )?);
    let e32: Arc<dyn TransferEngine> = Arc::new(DiskEngine::new(
        s2.clone(),
        s3.clone(),
        DiskDirection::DiskToHost,
        Tier::Host,
    )?);
    // SAFETY: each storage was created above for exactly one pool and is
    // reached only through these links and bindings.
    unsafe {
        Ok(Tiers {
            g1: HostTier::bind(p1.clone(), s1)?,
            g2: HostTier::bind(p2.clone(), s2)?,
            g3: p3.clone(),
            g3_disk: s3,
            offload_12: TierLink::new(e12, p1.clone(), p2.clone())?,
            offload_23: TierLink::new(e23, p2.clone(), p3.clone())?,
            onboard_32: TierLink::new(e32, p3, p2.clone())?,
            onboard_21: TierLink::new(e21, p2, p1)?,
            _dir: dir,
        })
    }
}

/// What the simulated forward pass writes into a block: derived from the
/// block's sequence hash, so any later copy can be checked.
fn kv_bytes(seq_hash: u64, n: usize) -> Vec<u8> {
    let mut x = seq_hash | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
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
pub async fn run(args: &DemoArgs, w: impl Write) -> Result<()> {
    let bs = usize::from(args.block_size);
    let t = build(bs)?;
    let mut o = Out { w };
    let salt = SaltHash::from_salt(b"demo-model");
    let prompt = |start: u32, len: usize| -> Vec<u32> { (start..start + len as u32).collect() };

    o.line(format!(
        "kvbm demo — block size {bs} tokens, {} KiB per block; G1 is host memory standing in for a GPU",
        t.g1.block_bytes() / 1024
    ))?;
    o.line("(the interactive console is not built yet; this prints what the block manager did)")?;
    o.pools(&t)?;

    // Request A.
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
    let a_blocks = compute_on_g1(&t, &a, hit)?;
    o.line(format!(
        "    computed and registered {} blocks on G1: ids {:?}",
        a_blocks.len(),
        a_blocks.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    let a_g2 = t.offload_12.copy_and_register(a_blocks.clone()).await?;
    let a_g3 = t.offload_23.copy_and_register(a_g2.clone()).await?;
    o.line(format!(
        "    eager offload G1 → G2 (ids {:?}) → G3 (ids {:?})",
        a_g2.iter().map(|b| b.id()).collect::<Vec<_>>(),
        a_g3.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    drop((a_blocks, a_g2, a_g3));
    o.line("    request A finished: its blocks stay cached, inactive")?;
    o.pools(&t)?;

    // Request C pushes A out of G1 and G2.
    let c = TokenSequence::from_tokens(&prompt(50_000, 6 * bs), bs, salt)?;
    o.line(format!(
        "\n[2] request C: {} unrelated tokens ({} blocks) — fills G1 and G2",
        c.total_tokens(),
        c.blocks().len()
    ))?;
    let c_blocks = compute_on_g1(&t, &c, Vec::new())?;
    let c_g2 = t
        .offload_12
        .copy_and_register(c_blocks[..t.g2.pool().capacity()].to_vec())
        .await?;
    o.line(format!(
        "    computed {} blocks on G1 (evicting A's), offloaded the first {} to G2 (evicting A's there too)",
        c_blocks.len(),
        c_g2.len()
    ))?;
    drop((c_blocks, c_g2));
    o.pools(&t)?;

    // Request B shares A's full blocks.
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
    let up2 = t.onboard_32.copy_and_register(on_g3).await?;
    let up1 = t.onboard_21.copy_and_register(up2.clone()).await?;
    let checked = verify(&t.g2, &up2)? + verify(&t.g1, &up1)?;
    o.line(format!(
        "    onboarded G3 → G2 → G1 (G1 ids {:?}); {checked} bytes checked against A's forward pass",
        up1.iter().map(|b| b.id()).collect::<Vec<_>>()
    ))?;
    let b_blocks = compute_on_g1(&t, &b, up1)?;
    o.line(format!(
        "    computed the other {} full blocks; {} tokens of {} came from cache",
        b_blocks.len() - 2,
        2 * bs,
        b.total_tokens()
    ))?;
    drop((up2, b_blocks));
    o.pools(&t)?;

    o.line("\ntransfer engines:")?;
    for (what, l) in [
        ("G1 → G2 memcpy", &t.offload_12),
        ("G2 → G3 disk  ", &t.offload_23),
        ("G3 → G2 disk  ", &t.onboard_32),
        ("G2 → G1 memcpy", &t.onboard_21),
    ] {
        let c = l.engine().counters();
        o.line(format!(
            "    {what}: {} batches, {} blocks, {} bytes, {} rejected, {} failed",
            c.batches, c.blocks, c.bytes, c.rejected, c.failed
        ))?;
    }
    o.line("demo finished: every copy verified")?;
    Ok(())
}
