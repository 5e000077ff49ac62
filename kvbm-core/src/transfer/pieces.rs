//! A batch of block copies flattened into one list of byte pieces, with
//! pieces that continue each other on both sides merged.
//!
//! A copy engine that pays per call (a CUDA copy is a driver call and a
//! DMA descriptor each) wants as few, as large pieces as it can get, and
//! wants them all at once so that a single batched call can carry them
//! (`cuMemcpyBatchAsync`). vLLM's per-layer tensors make a block
//! `num_layers` pieces, or `2 * num_layers` in their outer-first form;
//! consecutive blocks on both sides (a request's blocks usually are) merge
//! into one piece per layer (or page).
//!
//! The list is computed from the layouts alone, so it is checked here on
//! the CPU against a plain block-by-block copy; the engines only map each
//! piece's ranges to addresses.

use super::BlockPair;
use crate::layout::{Layout, LayoutError, MemRange, for_each_copy_piece};
use std::collections::HashMap;

/// One contiguous copy: `src.len == dst.len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Where the bytes come from.
    pub src: MemRange,
    /// Where they go.
    pub dst: MemRange,
}

/// The pieces of copying each pair's source block of `src` into its
/// destination block of `dst`, in pair order, merged where a piece starts
/// where the previous one ended on both sides.
///
/// Errors when a block is out of range or the shapes differ; the list is
/// then not started.
pub fn copy_pieces(
    src: &Layout,
    dst: &Layout,
    pairs: &[BlockPair],
) -> Result<Vec<Piece>, LayoutError> {
    let mut out: Vec<Piece> = Vec::new();
    // Where each piece so far ends, on both sides: a block's pieces for
    // different layers (and K and V) interleave, so the piece a new one
    // continues is seldom the last one pushed.
    let mut ends: HashMap<(usize, usize, usize, usize), usize> = HashMap::new();
    for p in pairs {
        for_each_copy_piece::<LayoutError>(src, p.src, dst, p.dst, |s, d| {
            let key = (s.region, s.offset, d.region, d.offset);
            if let Some(i) = ends.remove(&key) {
                let q = &mut out[i];
                q.src.len += s.len;
                q.dst.len += d.len;
                ends.insert(end_of(q), i);
            } else {
                let q = Piece { src: s, dst: d };
                ends.insert(end_of(&q), out.len());
                out.push(q);
            }
            Ok(())
        })?;
    }
    Ok(out)
}

fn end_of(p: &Piece) -> (usize, usize, usize, usize) {
    (
        p.src.region,
        p.src.offset + p.src.len,
        p.dst.region,
        p.dst.offset + p.dst.len,
    )
}

/// Bytes the pieces copy.
pub fn total_bytes(pieces: &[Piece]) -> u64 {
    pieces.iter().map(|p| p.src.len as u64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};
    use proptest::prelude::*;

    fn layout(kind: LayoutKind, blocks: usize, layers: usize, outer: usize) -> Layout {
        let config = LayoutConfig {
            num_blocks: blocks,
            num_layers: layers,
            outer_dim: outer,
            page_size: 2,
            inner_dim: 3,
            dtype_bytes: 1,
        };
        Layout::new(config, kind).unwrap()
    }

    /// Regions as byte vectors, each byte its own (region, offset) mark.
    fn regions(l: &Layout, seed: u8) -> Vec<Vec<u8>> {
        (0..l.num_regions())
            .map(|r| {
                (0..l.region_bytes())
                    .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8) ^ seed)
                    .collect()
            })
            .collect()
    }

    fn apply(pieces: &[Piece], src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
        for p in pieces {
            assert_eq!(p.src.len, p.dst.len);
            let from = &src[p.src.region][p.src.offset..p.src.offset + p.src.len];
            dst[p.dst.region][p.dst.offset..p.dst.offset + p.dst.len].copy_from_slice(from);
        }
    }

    /// The reference: page by page through `Layout::chunk`.
    fn by_pages(s: &Layout, d: &Layout, pairs: &[BlockPair], src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
        for p in pairs {
            for layer in 0..s.config().num_layers {
                for outer in 0..s.config().outer_dim {
                    let a = s.chunk(p.src, layer, outer).unwrap();
                    let b = d.chunk(p.dst, layer, outer).unwrap();
                    let from = &src[a.region][a.offset..a.offset + a.len];
                    dst[b.region][b.offset..b.offset + b.len].copy_from_slice(from);
                }
            }
        }
    }

    #[test]
    fn consecutive_blocks_merge_per_layer() {
        // vLLM's outer-first tensors to the host tier's contiguous blocks:
        // blocks 3..7 into 10..14 follow each other page by page on the
        // device side, but not on the host side, where a block's other
        // layers lie between them: a piece per page.
        let g1 = layout(LayoutKind::LayerSeparateOuterFirst, 16, 4, 2);
        let g2 = layout(LayoutKind::FullyContiguous, 16, 4, 2);
        let pairs: Vec<_> = (0..4).map(|i| BlockPair::new(3 + i, 10 + i)).collect();
        assert_eq!(copy_pieces(&g1, &g2, &pairs).unwrap().len(), 4 * 4 * 2);
        // Same kinds: consecutive blocks are one piece per region.
        let a = layout(LayoutKind::LayerSeparateOuterFirst, 16, 4, 2);
        let b = layout(LayoutKind::LayerSeparateOuterFirst, 20, 4, 2);
        assert_eq!(copy_pieces(&a, &b, &pairs).unwrap().len(), 4 * 2);
        let a = layout(LayoutKind::LayerSeparate, 16, 4, 2);
        assert_eq!(copy_pieces(&a, &a, &pairs).unwrap().len(), 4);
        let f = layout(LayoutKind::FullyContiguous, 16, 4, 2);
        assert_eq!(copy_pieces(&f, &f, &pairs).unwrap().len(), 1);
        // Out of order: nothing merges, and the bytes are the same count.
        let back: Vec<_> = pairs.iter().rev().copied().collect();
        let pieces = copy_pieces(&f, &f, &back).unwrap();
        assert_eq!(pieces.len(), 4);
        assert_eq!(total_bytes(&pieces), 4 * f.block_bytes() as u64);
    }

    #[test]
    fn a_bad_block_is_an_error() {
        let f = layout(LayoutKind::FullyContiguous, 4, 2, 2);
        assert!(copy_pieces(&f, &f, &[BlockPair::new(0, 1), BlockPair::new(4, 2)]).is_err());
        let other = layout(LayoutKind::FullyContiguous, 4, 3, 2);
        assert!(copy_pieces(&f, &other, &[BlockPair::new(0, 1)]).is_err());
    }

    proptest! {
        #[test]
        fn pieces_copy_what_pages_copy(
            sk in prop::sample::select(LayoutKind::ALL.to_vec()),
            dk in prop::sample::select(LayoutKind::ALL.to_vec()),
            layers in 1usize..4, outer in 1usize..3,
            pairs in prop::collection::vec((0u32..12, 0u32..12), 0..10),
        ) {
            let s = layout(sk, 12, layers, outer);
            let d = layout(dk, 12, layers, outer);
            // Distinct destinations, as the engines require.
            let mut seen = std::collections::HashSet::new();
            let pairs: Vec<_> = pairs.into_iter().filter(|(_, d)| seen.insert(*d))
                .map(|(a, b)| BlockPair::new(a, b)).collect();
            let src = regions(&s, 1);
            let mut want = regions(&d, 2);
            let mut got = want.clone();
            by_pages(&s, &d, &pairs, &src, &mut want);
            let pieces = copy_pieces(&s, &d, &pairs).unwrap();
            apply(&pieces, &src, &mut got);
            prop_assert_eq!(got, want);
            prop_assert_eq!(total_bytes(&pieces), (pairs.len() * s.block_bytes()) as u64);
            for p in &pieces {
                s.check_range(&p.src).unwrap();
                d.check_range(&p.dst).unwrap();
            }
        }
    }
}
