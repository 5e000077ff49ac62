//! Block layouts: where the bytes of a KV block live inside a tier's memory.
//!
//! A KV block holds, for every transformer layer, `outer_dim` pages (2 for K
//! and V, 1 for MLA's joint latent), each page being `page_size` tokens of
//! `inner_dim` elements of `dtype_bytes` bytes. We call one such page a
//! *chunk*: it is the smallest unit that is contiguous in every layout.
//!
//! Two arrangements are supported:
//!
//! * [`LayoutKind::FullyContiguous`]: one memory region; block `b` occupies
//!   `[b * block_bytes, (b + 1) * block_bytes)`, ordered `[layer][outer][chunk]`.
//!   A block is a single contiguous range, which is what disk and host tiers
//!   want (one large copy per block).
//! * [`LayoutKind::LayerSeparate`]: one region per layer (what inference
//!   engines usually allocate, one KV tensor per layer). Region `l` holds layer
//!   `l` of every block; block `b` sits at `b * layer_block_bytes`, ordered
//!   `[outer][chunk]`. A block is `num_layers` ranges.
//! * [`LayoutKind::LayerSeparateOuterFirst`]: one region per layer, ordered
//!   `[outer][block][chunk]`: all blocks' K pages, then all their V pages.
//!   This is vLLM's per-layer tensor on its CUDA attention backends,
//!   `[2, num_blocks, block_size, heads, head_dim]`. A block is
//!   `num_layers * outer_dim` ranges, one page each.
//!
//! All size arithmetic is checked once, in [`Layout::new`]; afterwards every
//! offset of a valid (block, layer, outer) triple is below the total size,
//! which is known to fit in `isize`, so the per-access arithmetic cannot
//! overflow and is done unchecked after the indices are bounds-checked.

use kvbm_events::tier::BlockId;
use std::fmt;

/// Alignment of every region allocation. Regions are allocated page aligned
/// so they can be registered with the CUDA driver (pinned) and used with
/// direct I/O; [`Layout::new`] checks that the rounded-up size still fits.
pub const REGION_ALIGN: usize = 4096;

/// The dimensions of a layout. Every field must be non-zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutConfig {
    /// Number of blocks in the tier (its capacity).
    pub num_blocks: usize,
    /// Number of transformer layers.
    pub num_layers: usize,
    /// 2 for separate K and V, 1 for MLA.
    pub outer_dim: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Elements per token in one (layer, outer) page: heads * head_dim.
    pub inner_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

/// How blocks are arranged in memory; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// One region; each block is one contiguous range.
    FullyContiguous,
    /// One region per layer; each block is one range per layer.
    LayerSeparate,
    /// One region per layer, outer dimension first; each block is one
    /// range per (layer, outer) page.
    LayerSeparateOuterFirst,
}

impl LayoutKind {
    /// Every kind, for tests and tools that cover them all.
    pub const ALL: [LayoutKind; 3] = [
        LayoutKind::FullyContiguous,
        LayoutKind::LayerSeparate,
        LayoutKind::LayerSeparateOuterFirst,
    ];
}

/// Why a layout could not be built or an index could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A dimension of the [`LayoutConfig`] was zero.
    #[error("layout dimension `{field}` must be non-zero")]
    ZeroDimension {
        /// The name of the offending [`LayoutConfig`] field.
        field: &'static str,
    },
    /// A size computation overflowed (or the total does not fit in `isize`,
    /// the limit for any single allocation).
    #[error("layout size overflow computing {what}")]
    Overflow {
        /// Which quantity overflowed.
        what: &'static str,
    },
    /// A block index at or beyond `num_blocks`.
    #[error("block {block} out of range (layout has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// The requested block.
        block: BlockId,
        /// The layout's block count.
        num_blocks: usize,
    },
    /// A layer index at or beyond `num_layers`.
    #[error("layer {layer} out of range (layout has {num_layers} layers)")]
    LayerOutOfRange {
        /// The requested layer.
        layer: usize,
        /// The layout's layer count.
        num_layers: usize,
    },
    /// An outer index at or beyond `outer_dim`.
    #[error("outer index {outer} out of range (outer_dim is {outer_dim})")]
    OuterOutOfRange {
        /// The requested outer index.
        outer: usize,
        /// The layout's outer dimension.
        outer_dim: usize,
    },
    /// A copy between two layouts whose blocks have different shapes
    /// (see [`Layout::same_shape`]).
    #[error("layouts have different block shapes")]
    ShapeMismatch,
    /// A [`MemRange`] that does not lie inside the layout's regions.
    #[error(
        "range {range} does not fit in the layout ({num_regions} regions of {region_bytes} bytes)"
    )]
    RangeOutOfBounds {
        /// The offending range.
        range: MemRange,
        /// The layout's region count.
        num_regions: usize,
        /// The layout's region size.
        region_bytes: usize,
    },
}

/// A byte range inside one region of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemRange {
    /// Region index (always 0 for [`LayoutKind::FullyContiguous`], the layer
    /// for the layer-separate kinds).
    pub region: usize,
    /// Byte offset from the start of the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl fmt::Display for MemRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region {} [{}, +{})", self.region, self.offset, self.len)
    }
}

/// A validated layout: a [`LayoutConfig`], a [`LayoutKind`] and the derived
/// sizes, all known not to overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    config: LayoutConfig,
    kind: LayoutKind,
    chunk_bytes: usize,
    layer_block_bytes: usize,
    block_bytes: usize,
    num_regions: usize,
    region_bytes: usize,
    total_bytes: usize,
}

fn mul(a: usize, b: usize, what: &'static str) -> Result<usize, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

impl Layout {
    /// Validates `config` and derives the sizes of `kind`.
    ///
    /// Errors: [`LayoutError::ZeroDimension`] naming the first zero field,
    /// [`LayoutError::Overflow`] when a size does not fit (the total, rounded
    /// up to [`REGION_ALIGN`], must fit in `isize`; `num_blocks` must be
    /// addressable by a [`BlockId`]).
    pub fn new(config: LayoutConfig, kind: LayoutKind) -> Result<Layout, LayoutError> {
        let fields = [
            ("num_blocks", config.num_blocks),
            ("num_layers", config.num_layers),
            ("outer_dim", config.outer_dim),
            ("page_size", config.page_size),
            ("inner_dim", config.inner_dim),
            ("dtype_bytes", config.dtype_bytes),
        ];
        if let Some((field, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(LayoutError::ZeroDimension { field });
        }
        // Every block must be nameable by a BlockId (u32).
        let max_blocks = u64::from(BlockId::MAX) + 1;
        if !u64::try_from(config.num_blocks).is_ok_and(|n| n <= max_blocks) {
            return Err(LayoutError::Overflow {
                what: "num_blocks (block ids are u32)",
            });
        }
        let chunk_bytes = mul(
            mul(config.page_size, config.inner_dim, "chunk bytes")?,
            config.dtype_bytes,
            "chunk bytes",
        )?;
        let layer_block_bytes = mul(config.outer_dim, chunk_bytes, "layer block bytes")?;
        let block_bytes = mul(config.num_layers, layer_block_bytes, "block bytes")?;
        let (num_regions, region_bytes) = match kind {
            LayoutKind::FullyContiguous => {
                (1, mul(config.num_blocks, block_bytes, "region bytes")?)
            }
            LayoutKind::LayerSeparate | LayoutKind::LayerSeparateOuterFirst => (
                config.num_layers,
                mul(config.num_blocks, layer_block_bytes, "region bytes")?,
            ),
        };
        let total_bytes = mul(num_regions, region_bytes, "total bytes")?;
        // Allocation limit: a std::alloc::Layout must have size, rounded up
        // to its alignment, at most isize::MAX. Checking the total (not just
        // one region) also keeps every offset we ever compute within isize,
        // which is what pointer `add` requires.
        let rounded = total_bytes
            .checked_add(REGION_ALIGN - 1)
            .ok_or(LayoutError::Overflow {
                what: "total bytes (rounded to alignment)",
            })?;
        if rounded > isize::MAX as usize {
            return Err(LayoutError::Overflow {
                what: "total bytes (exceeds isize::MAX)",
            });
        }
        Ok(Layout {
            config,
            kind,
            chunk_bytes,
            layer_block_bytes,
            block_bytes,
            num_regions,
            region_bytes,
            total_bytes,
        })
    }

    /// The dimensions this layout was built from.
    pub fn config(&self) -> &LayoutConfig {
        &self.config
    }

    /// The arrangement.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    /// Number of memory regions: 1, or `num_layers` for the layer-separate
    /// kinds.
    pub fn num_regions(&self) -> usize {
        self.num_regions
    }

    /// Size of each region in bytes (all regions have the same size).
    pub fn region_bytes(&self) -> usize {
        self.region_bytes
    }

    /// Size of all regions together: `num_blocks * block_bytes`.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Bytes of one block across all layers.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes of one block in one layer: `outer_dim * chunk_bytes`.
    pub fn layer_block_bytes(&self) -> usize {
        self.layer_block_bytes
    }

    /// Bytes of one (layer, outer) page: `page_size * inner_dim * dtype_bytes`.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// True when `other` has the same per-block shape (layers, outer dim,
    /// page size, inner dim, dtype), so a block of one can be copied into a
    /// block of the other. Block count and kind may differ.
    pub fn same_shape(&self, other: &Layout) -> bool {
        let (a, b) = (&self.config, &other.config);
        a.num_layers == b.num_layers
            && a.outer_dim == b.outer_dim
            && a.page_size == b.page_size
            && a.inner_dim == b.inner_dim
            && a.dtype_bytes == b.dtype_bytes
    }

    /// Checks that `block` is a valid block index.
    pub fn check_block(&self, block: BlockId) -> Result<(), LayoutError> {
        // usize is at least 32 bits on every platform this crate supports.
        if (block as usize) < self.config.num_blocks {
            Ok(())
        } else {
            Err(LayoutError::BlockOutOfRange {
                block,
                num_blocks: self.config.num_blocks,
            })
        }
    }

    /// Checks that `range` lies inside one of this layout's regions.
    pub fn check_range(&self, range: &MemRange) -> Result<(), LayoutError> {
        let fits = range.region < self.num_regions
            && range
                .offset
                .checked_add(range.len)
                .is_some_and(|end| end <= self.region_bytes);
        if fits {
            Ok(())
        } else {
            Err(LayoutError::RangeOutOfBounds {
                range: *range,
                num_regions: self.num_regions,
                region_bytes: self.region_bytes,
            })
        }
    }

    /// The range of the (layer, outer) page of `block`.
    pub fn chunk(
        &self,
        block: BlockId,
        layer: usize,
        outer: usize,
    ) -> Result<MemRange, LayoutError> {
        self.check_block(block)?;
        if layer >= self.config.num_layers {
            return Err(LayoutError::LayerOutOfRange {
                layer,
                num_layers: self.config.num_layers,
            });
        }
        if outer >= self.config.outer_dim {
            return Err(LayoutError::OuterOutOfRange {
                outer,
                outer_dim: self.config.outer_dim,
            });
        }
        // Indices are in range, so every offset below is < total_bytes,
        // which Layout::new proved fits in isize: no overflow possible.
        let b = block as usize;
        Ok(match self.kind {
            LayoutKind::FullyContiguous => MemRange {
                region: 0,
                offset: b * self.block_bytes
                    + layer * self.layer_block_bytes
                    + outer * self.chunk_bytes,
                len: self.chunk_bytes,
            },
            LayoutKind::LayerSeparate => MemRange {
                region: layer,
                offset: b * self.layer_block_bytes + outer * self.chunk_bytes,
                len: self.chunk_bytes,
            },
            LayoutKind::LayerSeparateOuterFirst => MemRange {
                region: layer,
                offset: (outer * self.config.num_blocks + b) * self.chunk_bytes,
                len: self.chunk_bytes,
            },
        })
    }

    /// The byte ranges of `block`, coalesced: exactly one range of
    /// [`block_bytes`](Self::block_bytes) for
    /// [`LayoutKind::FullyContiguous`], one range of
    /// [`layer_block_bytes`](Self::layer_block_bytes) per layer (in layer
    /// order) for [`LayoutKind::LayerSeparate`], one page per (layer, outer)
    /// for [`LayoutKind::LayerSeparateOuterFirst`]. Concatenated, they hold
    /// the block in `[layer][outer][chunk]` order in every kind.
    pub fn block_ranges(&self, block: BlockId) -> Result<BlockRanges, LayoutError> {
        self.check_block(block)?;
        let b = block as usize;
        // In range: see `chunk` for why this cannot overflow.
        let (per_region, len, offset, stride) = match self.kind {
            LayoutKind::FullyContiguous => (1, self.block_bytes, b * self.block_bytes, 0),
            LayoutKind::LayerSeparate => (1, self.layer_block_bytes, b * self.layer_block_bytes, 0),
            LayoutKind::LayerSeparateOuterFirst => (
                self.config.outer_dim,
                self.chunk_bytes,
                b * self.chunk_bytes,
                self.config.num_blocks * self.chunk_bytes,
            ),
        };
        Ok(BlockRanges {
            next: 0,
            count: self.num_regions * per_region,
            per_region,
            offset,
            stride,
            len,
        })
    }
}

impl Layout {
    /// The range of layer `layer` of `block` (its `outer_dim` pages, in
    /// order), contiguous in every kind but
    /// [`LayoutKind::LayerSeparateOuterFirst`] (whose layer is
    /// `outer_dim` ranges: see [`Self::contiguous_layers`]). The caller has
    /// checked both indices (see `chunk` for why the arithmetic cannot
    /// overflow then).
    fn layer_range(&self, block: BlockId, layer: usize) -> MemRange {
        debug_assert!(self.contiguous_layers());
        debug_assert!((block as usize) < self.config.num_blocks);
        debug_assert!(layer < self.config.num_layers);
        let b = block as usize;
        match self.kind {
            LayoutKind::FullyContiguous => MemRange {
                region: 0,
                offset: b * self.block_bytes + layer * self.layer_block_bytes,
                len: self.layer_block_bytes,
            },
            LayoutKind::LayerSeparate => MemRange {
                region: layer,
                offset: b * self.layer_block_bytes,
                len: self.layer_block_bytes,
            },
            // One page per layer only when outer_dim is 1 (callers check
            // `contiguous_layers`); then the layer is that page.
            LayoutKind::LayerSeparateOuterFirst => MemRange {
                region: layer,
                offset: b * self.chunk_bytes,
                len: self.layer_block_bytes,
            },
        }
    }

    /// True when each layer of a block is one contiguous range.
    fn contiguous_layers(&self) -> bool {
        self.kind != LayoutKind::LayerSeparateOuterFirst || self.config.outer_dim == 1
    }
}

/// Iterator over a block's coalesced ranges; see [`Layout::block_ranges`].
#[derive(Debug, Clone)]
pub struct BlockRanges {
    next: usize,
    count: usize,
    /// Ranges in each region (consecutive `next` values share a region).
    per_region: usize,
    offset: usize,
    /// Distance between consecutive ranges of one region.
    stride: usize,
    len: usize,
}

impl Iterator for BlockRanges {
    type Item = MemRange;

    fn next(&mut self) -> Option<MemRange> {
        if self.next >= self.count {
            return None;
        }
        // The region index is the layer for the layer-separate kinds and
        // always 0 for FullyContiguous (count == 1). Below count, so within
        // the layout (see `block_ranges`).
        let r = MemRange {
            region: self.next / self.per_region,
            offset: self.offset + (self.next % self.per_region) * self.stride,
            len: self.len,
        };
        self.next += 1;
        Some(r)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.count - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for BlockRanges {}

/// Calls `f(src_range, dst_range)` for every piece of a copy of block
/// `src_block` of `src` into block `dst_block` of `dst`. The pieces have equal
/// lengths and together cover both blocks exactly.
///
/// When both layouts have the same kind the pieces are the coalesced block
/// ranges (one large copy per range); otherwise they are the block's layers
/// (all `outer_dim` pages of a layer together), the largest unit contiguous
/// in both: one copy per layer rather than one per page, half as many for
/// separate K and V. Where a layer is not contiguous on one side (vLLM's
/// outer-first tensors), the pieces are pages.
///
/// Errors when the shapes differ or a block is out of range; nothing is
/// passed to `f` in that case.
pub(crate) fn for_each_copy_piece<E: From<LayoutError>>(
    src: &Layout,
    src_block: BlockId,
    dst: &Layout,
    dst_block: BlockId,
    mut f: impl FnMut(MemRange, MemRange) -> Result<(), E>,
) -> Result<(), E> {
    src.check_block(src_block)?;
    dst.check_block(dst_block)?;
    if !src.same_shape(dst) {
        // Callers check shapes up front; this keeps the helper total.
        return Err(LayoutError::ShapeMismatch.into());
    }
    if src.kind == dst.kind {
        for (s, d) in src
            .block_ranges(src_block)?
            .zip(dst.block_ranges(dst_block)?)
        {
            f(s, d)?;
        }
    } else if src.contiguous_layers() && dst.contiguous_layers() {
        for layer in 0..src.config.num_layers {
            f(
                src.layer_range(src_block, layer),
                dst.layer_range(dst_block, layer),
            )?;
        }
    } else {
        for layer in 0..src.config.num_layers {
            for outer in 0..src.config.outer_dim {
                f(
                    src.chunk(src_block, layer, outer)?,
                    dst.chunk(dst_block, layer, outer)?,
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(num_blocks: usize, num_layers: usize) -> LayoutConfig {
        LayoutConfig {
            num_blocks,
            num_layers,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn sizes_fully_contiguous() {
        let l = Layout::new(cfg(10, 3), LayoutKind::FullyContiguous).unwrap();
        assert_eq!(l.chunk_bytes(), 64);
        assert_eq!(l.layer_block_bytes(), 128);
        assert_eq!(l.block_bytes(), 384);
        assert_eq!(l.num_regions(), 1);
        assert_eq!(l.region_bytes(), 3840);
        assert_eq!(l.total_bytes(), 3840);
        let r: Vec<_> = l.block_ranges(2).unwrap().collect();
        assert_eq!(
            r,
            vec![MemRange {
                region: 0,
                offset: 768,
                len: 384
            }]
        );
        assert_eq!(
            l.chunk(2, 1, 1).unwrap(),
            MemRange {
                region: 0,
                offset: 768 + 128 + 64,
                len: 64
            }
        );
    }

    #[test]
    fn sizes_layer_separate() {
        let l = Layout::new(cfg(10, 3), LayoutKind::LayerSeparate).unwrap();
        assert_eq!(l.block_bytes(), 384);
        assert_eq!(l.num_regions(), 3);
        assert_eq!(l.region_bytes(), 1280);
        assert_eq!(l.total_bytes(), 3840);
        let r: Vec<_> = l.block_ranges(2).unwrap().collect();
        assert_eq!(r.len(), 3);
        for (layer, range) in r.iter().enumerate() {
            assert_eq!(
                *range,
                MemRange {
                    region: layer,
                    offset: 256,
                    len: 128
                }
            );
        }
        assert_eq!(
            l.chunk(2, 1, 1).unwrap(),
            MemRange {
                region: 1,
                offset: 256 + 64,
                len: 64
            }
        );
    }

    #[test]
    fn sizes_layer_separate_outer_first() {
        // vLLM's [2, num_blocks, block_size, heads, head_dim] per layer.
        let l = Layout::new(cfg(10, 3), LayoutKind::LayerSeparateOuterFirst).unwrap();
        assert_eq!(l.block_bytes(), 384);
        assert_eq!(l.num_regions(), 3);
        assert_eq!(l.region_bytes(), 1280);
        let r: Vec<_> = l.block_ranges(2).unwrap().collect();
        let at = |region, offset| MemRange {
            region,
            offset,
            len: 64,
        };
        // K of block 2 at 2 pages in, V after all ten blocks' K pages.
        assert_eq!(
            r,
            vec![
                at(0, 128),
                at(0, 640 + 128),
                at(1, 128),
                at(1, 768),
                at(2, 128),
                at(2, 768)
            ]
        );
        assert_eq!(l.chunk(2, 1, 1).unwrap(), at(1, 768));
    }

    #[test]
    fn two_mib_bench_shape() {
        let l = Layout::new(
            LayoutConfig {
                num_blocks: 64,
                num_layers: 1,
                outer_dim: 2,
                page_size: 16,
                inner_dim: 32768,
                dtype_bytes: 2,
            },
            LayoutKind::FullyContiguous,
        )
        .unwrap();
        assert_eq!(l.block_bytes(), 2 << 20);
    }

    #[test]
    fn zero_dimensions_are_named() {
        let base = cfg(4, 2);
        type Setter = fn(&mut LayoutConfig);
        let cases: [(&str, Setter); 6] = [
            ("num_blocks", |c| c.num_blocks = 0),
            ("num_layers", |c| c.num_layers = 0),
            ("outer_dim", |c| c.outer_dim = 0),
            ("page_size", |c| c.page_size = 0),
            ("inner_dim", |c| c.inner_dim = 0),
            ("dtype_bytes", |c| c.dtype_bytes = 0),
        ];
        for (name, set) in cases {
            let mut c = base;
            set(&mut c);
            for kind in LayoutKind::ALL {
                assert_eq!(
                    Layout::new(c, kind),
                    Err(LayoutError::ZeroDimension { field: name })
                );
            }
        }
    }

    #[test]
    fn overflow_is_an_error() {
        let mut c = cfg(4, 2);
        c.inner_dim = usize::MAX / 2;
        assert!(matches!(
            Layout::new(c, LayoutKind::FullyContiguous),
            Err(LayoutError::Overflow { .. })
        ));
        // Fits in usize but not in isize.
        let c = LayoutConfig {
            num_blocks: 1,
            num_layers: 1,
            outer_dim: 1,
            page_size: 1,
            inner_dim: 1,
            dtype_bytes: isize::MAX as usize,
        };
        assert!(matches!(
            Layout::new(c, LayoutKind::LayerSeparate),
            Err(LayoutError::Overflow { .. })
        ));
        // More blocks than a u32 BlockId can name.
        let mut c = cfg(1, 1);
        c.num_blocks = (u32::MAX as usize) + 2;
        c.inner_dim = 1;
        c.page_size = 1;
        c.outer_dim = 1;
        c.dtype_bytes = 1;
        assert!(matches!(
            Layout::new(c, LayoutKind::FullyContiguous),
            Err(LayoutError::Overflow { .. })
        ));
    }

    #[test]
    fn out_of_range_indices() {
        let l = Layout::new(cfg(4, 2), LayoutKind::LayerSeparate).unwrap();
        assert_eq!(
            l.block_ranges(4).err(),
            Some(LayoutError::BlockOutOfRange {
                block: 4,
                num_blocks: 4
            })
        );
        assert!(matches!(
            l.chunk(0, 2, 0),
            Err(LayoutError::LayerOutOfRange { .. })
        ));
        assert!(matches!(
            l.chunk(0, 0, 2),
            Err(LayoutError::OuterOutOfRange { .. })
        ));
        assert!(
            l.check_range(&MemRange {
                region: 2,
                offset: 0,
                len: 1
            })
            .is_err()
        );
        assert!(
            l.check_range(&MemRange {
                region: 0,
                offset: usize::MAX,
                len: 2
            })
            .is_err()
        );
        assert!(
            l.check_range(&MemRange {
                region: 1,
                offset: 0,
                len: l.region_bytes()
            })
            .is_ok()
        );
    }

    #[test]
    fn same_shape_ignores_count_and_kind() {
        let a = Layout::new(cfg(4, 2), LayoutKind::LayerSeparate).unwrap();
        let b = Layout::new(cfg(9, 2), LayoutKind::FullyContiguous).unwrap();
        let c = Layout::new(cfg(4, 3), LayoutKind::LayerSeparate).unwrap();
        assert!(a.same_shape(&b));
        assert!(!a.same_shape(&c));
    }

    #[test]
    fn copy_pieces_cover_the_block_in_order() {
        let fc = Layout::new(cfg(5, 3), LayoutKind::FullyContiguous).unwrap();
        let ls = Layout::new(cfg(7, 3), LayoutKind::LayerSeparate).unwrap();
        let of = Layout::new(cfg(6, 3), LayoutKind::LayerSeparateOuterFirst).unwrap();
        // cfg has outer_dim 2: across kinds, one piece per layer (both
        // pages together), not one per page, unless one side is
        // outer-first, where a layer's pages lie apart.
        assert_eq!(fc.config().outer_dim, 2);
        for (a, b, pieces) in [
            (&fc, &fc, 1),
            (&ls, &ls, 3),
            (&fc, &ls, 3),
            (&ls, &fc, 3),
            (&of, &of, 6),
            (&of, &fc, 6),
            (&ls, &of, 6),
        ] {
            let mut total = 0;
            let mut n = 0;
            for_each_copy_piece::<LayoutError>(a, 1, b, 4, |s, d| {
                assert_eq!(s.len, d.len);
                a.check_range(&s)?;
                b.check_range(&d)?;
                // Each piece is whole pages of the block, in order, at the
                // same place in both layouts: its page k is the block's next
                // page (layer, outer) in each, as `chunk` places it.
                for k in 0..s.len / a.chunk_bytes() {
                    let page = total / a.chunk_bytes() + k;
                    let (layer, outer) = (page / 2, page % 2);
                    let (cs, cd) = (a.chunk(1, layer, outer)?, b.chunk(4, layer, outer)?);
                    let at = k * a.chunk_bytes();
                    assert_eq!((cs.region, cs.offset), (s.region, s.offset + at));
                    assert_eq!((cd.region, cd.offset), (d.region, d.offset + at));
                }
                total += s.len;
                n += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(total, a.block_bytes());
            assert_eq!(n, pieces, "{:?} -> {:?}", a.kind(), b.kind());
        }
    }

    fn arb_config() -> impl Strategy<Value = LayoutConfig> {
        (
            1usize..20,
            1usize..6,
            1usize..3,
            1usize..5,
            1usize..17,
            1usize..5,
        )
            .prop_map(
                |(num_blocks, num_layers, outer_dim, page_size, inner_dim, dtype_bytes)| {
                    LayoutConfig {
                        num_blocks,
                        num_layers,
                        outer_dim,
                        page_size,
                        inner_dim,
                        dtype_bytes,
                    }
                },
            )
    }

    fn arb_kind() -> impl Strategy<Value = LayoutKind> {
        prop::sample::select(LayoutKind::ALL.to_vec())
    }

    fn overlaps(a: &MemRange, b: &MemRange) -> bool {
        a.region == b.region && a.offset < b.offset + b.len && b.offset < a.offset + a.len
    }

    proptest! {
        #[test]
        fn distinct_blocks_never_overlap(config in arb_config(), kind in arb_kind(),
                                         a in 0u32..40, b in 0u32..40) {
            let l = Layout::new(config, kind).unwrap();
            let n = l.num_blocks() as u32;
            let (a, b) = (a % n, b % n);
            let ra: Vec<_> = l.block_ranges(a).unwrap().collect();
            let rb: Vec<_> = l.block_ranges(b).unwrap().collect();
            prop_assert_eq!(ra.iter().map(|r| r.len).sum::<usize>(), l.block_bytes());
            for r in ra.iter().chain(rb.iter()) {
                prop_assert!(r.region < l.num_regions());
                prop_assert!(r.offset + r.len <= l.region_bytes());
            }
            if a != b {
                for x in &ra {
                    for y in &rb {
                        prop_assert!(!overlaps(x, y), "{} overlaps {}", x, y);
                    }
                }
            }
            // Every chunk lies inside one of the block's coalesced ranges.
            for layer in 0..config.num_layers {
                for outer in 0..config.outer_dim {
                    let c = l.chunk(a, layer, outer).unwrap();
                    prop_assert!(ra.iter().any(|r| r.region == c.region
                        && r.offset <= c.offset && c.offset + c.len <= r.offset + r.len));
                }
            }
        }

        #[test]
        fn any_config_is_ok_or_typed_error(num_blocks in any::<usize>(), num_layers in any::<usize>(),
                                           outer_dim in 0usize..4, page_size in any::<usize>(),
                                           inner_dim in any::<usize>(), dtype_bytes in 0usize..9,
                                           kind in arb_kind(), block in any::<u32>()) {
            let config = LayoutConfig { num_blocks, num_layers, outer_dim, page_size, inner_dim, dtype_bytes };
            match Layout::new(config, kind) {
                Ok(l) => {
                    // Index resolution never panics either.
                    let _ = l.block_ranges(block).map(|r| r.count());
                    let _ = l.chunk(block, num_layers.saturating_sub(1), 0);
                    prop_assert!(l.total_bytes() <= isize::MAX as usize);
                }
                Err(LayoutError::ZeroDimension { .. }) => {
                    prop_assert!([num_blocks, num_layers, outer_dim, page_size, inner_dim, dtype_bytes].contains(&0));
                }
                Err(LayoutError::Overflow { .. }) => {}
                Err(e) => prop_assert!(false, "unexpected error {e}"),
            }
        }
    }
}
