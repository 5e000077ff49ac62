//! vLLM's KV tensors as kvbm's G1: which of vLLM's arrangements they are,
//! on which device, and where each of the layout's regions starts.
//!
//! vLLM hands its connector one tensor per attention layer. kvbm copies in
//! and out of three arrangements of them:
//!
//! * **block first**, `[num_blocks, ...]` per layer (vLLM's CPU backend, and
//!   FlashInfer's `[num_blocks, 2, ...]`): a block of a layer is one range
//!   ([`LayoutKind::LayerSeparate`]);
//! * **K/V first**, `[2, num_blocks, block_size, heads, head_dim]` per layer
//!   (vLLM's FlashAttention and most CUDA backends): a block of a layer is
//!   a K page and a V page far apart
//!   ([`LayoutKind::LayerSeparateOuterFirst`]);
//! * **cross-layer**, one `[num_blocks, num_layers, ...]` tensor seen as a
//!   view per layer (vLLM's cross-layer KV blocks): a block is one range of
//!   every layer together ([`LayoutKind::FullyContiguous`]).
//!
//! Anything else is refused with what was found, before any byte moves.

use crate::tiers::{Geometry, GeometryError};
use kvbm_core::layout::{Layout, LayoutKind};

/// One of vLLM's per-layer KV tensors, as the Python side reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct KvTensor {
    /// The layer's name.
    pub name: String,
    /// Address of its first byte.
    pub data_ptr: u64,
    /// Its size in bytes.
    pub nbytes: u64,
    /// Its first dimension (vLLM's blocks, or 2 for K/V-first tensors).
    pub num_blocks: usize,
    /// Bytes between consecutive entries of its first dimension.
    pub block_stride_bytes: usize,
    /// Whether its bytes are contiguous.
    pub contiguous: bool,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// Its shape (older callers sent none).
    #[serde(default)]
    pub shape: Vec<usize>,
}

/// Where vLLM's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(usize),
}

impl Device {
    fn parse(s: &str) -> Option<Device> {
        match s {
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(0)),
            _ => s.strip_prefix("cuda:")?.parse().ok().map(Device::Cuda),
        }
    }
}

/// vLLM's tensors read as a kvbm layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G1Shape {
    /// The layout of G1 (its block count is the tensors').
    pub layout: Layout,
    /// The address of each of the layout's regions.
    pub regions: Vec<u64>,
    /// Where they are.
    pub device: Device,
}

impl G1Shape {
    /// Each layer's page in this many parts (2 for K/V first): the host
    /// and disk tiers' layouts must split the same way to match shapes.
    pub fn outer(&self) -> usize {
        self.layout.config().outer_dim
    }
}

/// Why vLLM's tensors cannot be G1.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// One tensor (or `(all)`) is not what kvbm can copy.
    #[error("kvbm: vLLM's KV cache tensor {name}: {reason}")]
    Tensor {
        /// The layer.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The geometry does not make a layout.
    #[error(transparent)]
    Geometry(#[from] GeometryError),
}

fn bad(name: &str, reason: impl Into<String>) -> TensorError {
    TensorError::Tensor {
        name: name.to_string(),
        reason: reason.into(),
    }
}

/// Reads `tensors` (one per layer, in vLLM's order) against `geometry`;
/// see the module docs.
pub fn g1_shape(geometry: &Geometry, tensors: &[KvTensor]) -> Result<G1Shape, TensorError> {
    geometry.check()?;
    let layers = geometry.num_layers;
    if tensors.len() != layers {
        return Err(bad(
            "(all)",
            format!("{} tensors for {layers} layers", tensors.len()),
        ));
    }
    let mut device = None;
    for t in tensors {
        let d = Device::parse(&t.device).ok_or_else(|| {
            bad(
                &t.name,
                format!("on {}; kvbm copies CPU and CUDA tensors", t.device),
            )
        })?;
        match device {
            None => device = Some(d),
            Some(first) if first != d => {
                return Err(bad(
                    &t.name,
                    format!("on {}, the first layer on {first:?}", t.device),
                ));
            }
            Some(_) => {}
        }
        if t.data_ptr == 0 {
            return Err(bad(&t.name, "its data_ptr is null (0)"));
        }
    }
    let device = device.unwrap_or(Device::Cpu);
    if let Some(shape) = cross_layer(geometry, tensors)? {
        return Ok(G1Shape { device, ..shape });
    }
    let mut kind = None;
    for t in tensors {
        let k = per_layer(geometry, t)?;
        match kind {
            None => kind = Some(k),
            Some(first) if first != k => {
                return Err(bad(
                    &t.name,
                    format!("arranged as {k:?}, the first layer as {first:?}"),
                ));
            }
            Some(_) => {}
        }
    }
    let (kind, outer, blocks) = kind.unwrap_or((LayoutKind::LayerSeparate, 1, 0));
    Ok(G1Shape {
        layout: geometry.layout_split(blocks, kind, outer)?,
        regions: tensors.iter().map(|t| t.data_ptr).collect(),
        device,
    })
}

/// One layer's own tensor: block first or K/V first, with its block count.
fn per_layer(g: &Geometry, t: &KvTensor) -> Result<(LayoutKind, usize, usize), TensorError> {
    if !t.contiguous {
        return Err(bad(&t.name, "not contiguous"));
    }
    let page = g.page_bytes;
    // Block first: what vLLM's CPU backend allocates.
    if t.block_stride_bytes == page {
        if t.num_blocks < g.num_gpu_blocks {
            return Err(bad(
                &t.name,
                format!(
                    "{} blocks, vLLM configured {}",
                    t.num_blocks, g.num_gpu_blocks
                ),
            ));
        }
        // Cannot overflow: Geometry::check.
        let need = (g.num_gpu_blocks * page) as u64;
        if t.nbytes < need {
            return Err(bad(
                &t.name,
                format!("{} bytes at {:#x}, need {need}", t.nbytes, t.data_ptr),
            ));
        }
        return Ok((LayoutKind::LayerSeparate, 1, g.num_gpu_blocks));
    }
    // K/V first: [2, num_blocks, ...], each half all blocks' K (then V).
    if let [2, blocks, ..] = t.shape[..] {
        let half = blocks.checked_mul(page / 2);
        let fits = page.is_multiple_of(2)
            && blocks >= g.num_gpu_blocks
            && half == Some(t.block_stride_bytes)
            && half.and_then(|h| h.checked_mul(2)).map(|n| n as u64) == Some(t.nbytes);
        if fits {
            return Ok((LayoutKind::LayerSeparateOuterFirst, 2, blocks));
        }
    }
    Err(bad(
        &t.name,
        format!(
            "shape {:?}, {} bytes between entries of its first dimension: neither \
             [num_blocks, ...] with {page} bytes a block nor [2, num_blocks, ...] with at \
             least {} blocks (the cache config's {page} bytes a block of a layer)",
            t.shape, t.block_stride_bytes, g.num_gpu_blocks
        ),
    ))
}

/// Per-layer views of one `[num_blocks, num_layers, ...]` tensor, when
/// that is what `tensors` are: each layer's view starts one page after the
/// previous one's, and its blocks are `num_layers` pages apart.
fn cross_layer(g: &Geometry, tensors: &[KvTensor]) -> Result<Option<G1Shape>, TensorError> {
    let (layers, page) = (g.num_layers, g.page_bytes);
    let Some(stride) = layers.checked_mul(page) else {
        return Ok(None);
    };
    let first = &tensors[0];
    let views = layers > 1
        && tensors.iter().enumerate().all(|(l, t)| {
            t.block_stride_bytes == stride
                && (l as u64)
                    .checked_mul(page as u64)
                    .and_then(|o| first.data_ptr.checked_add(o))
                    == Some(t.data_ptr)
        });
    if !views {
        return Ok(None);
    }
    let blocks = tensors.iter().map(|t| t.num_blocks).min().unwrap_or(0);
    if blocks < g.num_gpu_blocks {
        return Err(bad(
            &first.name,
            format!(
                "{blocks} blocks in the cross-layer tensor, vLLM configured {}",
                g.num_gpu_blocks
            ),
        ));
    }
    Ok(Some(G1Shape {
        layout: g.layout_split(g.num_gpu_blocks, LayoutKind::FullyContiguous, 1)?,
        regions: vec![first.data_ptr],
        device: Device::Cpu,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry {
            num_gpu_blocks: 8,
            block_size: 4,
            num_layers: 3,
            page_bytes: 256,
        }
    }

    fn tensor(l: usize, ptr: u64, shape: Vec<usize>, stride: usize, nbytes: u64) -> KvTensor {
        KvTensor {
            name: format!("layers.{l}"),
            data_ptr: ptr,
            nbytes,
            num_blocks: shape[0],
            block_stride_bytes: stride,
            contiguous: true,
            device: "cuda:1".into(),
            shape,
        }
    }

    #[test]
    fn block_first_tensors_are_layer_separate() {
        let ts: Vec<_> = (0..3)
            .map(|l| tensor(l, 0x1000 * (l as u64 + 1), vec![8, 2, 4, 16], 256, 2048))
            .collect();
        let s = g1_shape(&geometry(), &ts).unwrap();
        assert_eq!(s.layout.kind(), LayoutKind::LayerSeparate);
        assert_eq!(s.regions, [0x1000, 0x2000, 0x3000]);
        assert_eq!(s.device, Device::Cuda(1));
        assert_eq!(s.outer(), 1);
    }

    #[test]
    fn kv_first_tensors_are_outer_first_with_their_own_block_count() {
        // [2, 10, 4, 2, 16]: K of all ten blocks, then V.
        let ts: Vec<_> = (0..3)
            .map(|l| {
                tensor(
                    l,
                    0x10000 * (l as u64 + 1),
                    vec![2, 10, 4, 2, 16],
                    1280,
                    2560,
                )
            })
            .collect();
        let s = g1_shape(&geometry(), &ts).unwrap();
        assert_eq!(s.layout.kind(), LayoutKind::LayerSeparateOuterFirst);
        assert_eq!(s.layout.num_blocks(), 10);
        assert_eq!(s.outer(), 2);
        assert_eq!(s.layout.region_bytes(), 2560);
        // V of block 1 of layer 2 is half a tensor in.
        let v = s.layout.chunk(1, 2, 1).unwrap();
        assert_eq!((v.region, v.offset, v.len), (2, 1280 + 128, 128));
    }

    #[test]
    fn cross_layer_views_are_one_contiguous_region() {
        // [8, 3, 256 bytes]: layer l's view starts l pages in, blocks are
        // three pages apart.
        let ts: Vec<_> = (0..3)
            .map(|l| {
                let mut t = tensor(l, 0x8000 + 256 * l as u64, vec![8, 2, 4, 16], 768, 2048);
                t.contiguous = false;
                t
            })
            .collect();
        let s = g1_shape(&geometry(), &ts).unwrap();
        assert_eq!(s.layout.kind(), LayoutKind::FullyContiguous);
        assert_eq!(s.regions, [0x8000]);
        assert_eq!(s.layout.region_bytes(), 8 * 768);
        assert_eq!(s.device, Device::Cuda(1));
    }

    #[test]
    fn what_does_not_fit_is_named() {
        let g = geometry();
        let ok = |l| tensor(l, 0x1000 * (l as u64 + 1), vec![8, 2, 4, 16], 256, 2048);
        let err = |ts: Vec<KvTensor>| g1_shape(&g, &ts).unwrap_err().to_string();
        assert!(err(vec![ok(0), ok(1)]).contains("2 tensors for 3 layers"));
        let mut ts = vec![ok(0), ok(1), ok(2)];
        ts[1].device = "mps".into();
        assert!(err(ts).contains("layers.1: on mps"));
        let mut ts = vec![ok(0), ok(1), ok(2)];
        ts[2].device = "cuda:0".into();
        assert!(err(ts).contains("the first layer on Cuda(1)"));
        let mut ts = vec![ok(0), ok(1), ok(2)];
        ts[0].data_ptr = 0;
        assert!(err(ts).contains("null"));
        let mut ts = vec![ok(0), ok(1), ok(2)];
        ts[2].contiguous = false;
        assert!(err(ts).contains("layers.2: not contiguous"));
        let mut ts = vec![ok(0), ok(1), ok(2)];
        ts[0].num_blocks = 4;
        assert!(err(ts).contains("4 blocks, vLLM configured 8"));
        // K/V first with too few blocks, and a stride that fits nothing.
        let kv = |l| tensor(l, 0x10000 * (l as u64 + 1), vec![2, 6, 4, 2, 16], 768, 1536);
        assert!(err(vec![kv(0), kv(1), kv(2)]).contains("neither"));
        // Layers arranged differently.
        let kv = |l| {
            tensor(
                l,
                0x10000 * (l as u64 + 1),
                vec![2, 8, 4, 2, 16],
                1024,
                2048,
            )
        };
        assert!(err(vec![ok(0), kv(1), ok(2)]).contains("the first layer as"));
    }
}
