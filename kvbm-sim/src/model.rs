//! The models the simulator can stand for: how many KV bytes a token
//! takes and roughly how long the forward pass takes.
//!
//! KV bytes per token = 2 (K and V) × layers × KV heads × head dim × dtype
//! bytes, from each model's published configuration. The timings are rough
//! figures for one modern datacenter GPU (the 70B one for a
//! tensor-parallel group); they shape the run, they are not a benchmark.

use serde::Serialize;

/// A model preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelPreset {
    /// Llama-3.2-1B-like: 16 layers, 8 KV heads of 64, bf16: 32 KiB/token.
    #[value(name = "llama-3.2-1b")]
    Llama32_1b,
    /// Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16: 128 KiB/token.
    #[value(name = "llama-3-8b")]
    Llama3_8b,
    /// Llama-3-70B-like: 80 layers, 8 KV heads of 128, bf16: 320 KiB/token.
    #[value(name = "llama-3-70b")]
    Llama3_70b,
}

/// What a preset stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// The preset's name, as `--model` takes it.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Prefill cost per prompt token, ns.
    pub prefill_ns_per_token: u64,
    /// Fixed cost of an iteration that decodes, ns.
    pub decode_ns_per_step: u64,
    /// Extra decode cost per sequence, ns.
    pub decode_ns_per_seq: u64,
}

impl ModelSpec {
    /// KV bytes one token takes: K and V for every layer and KV head.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

impl ModelPreset {
    /// The preset's figures.
    pub fn spec(self) -> ModelSpec {
        match self {
            ModelPreset::Llama32_1b => ModelSpec {
                name: "llama-3.2-1b",
                layers: 16,
                kv_heads: 8,
                head_dim: 64,
                dtype_bytes: 2,
                prefill_ns_per_token: 6_000,
                decode_ns_per_step: 6_000_000,
                decode_ns_per_seq: 20_000,
            },
            ModelPreset::Llama3_8b => ModelSpec {
                name: "llama-3-8b",
                layers: 32,
                kv_heads: 8,
                head_dim: 128,
                dtype_bytes: 2,
                prefill_ns_per_token: 30_000,
                decode_ns_per_step: 15_000_000,
                decode_ns_per_seq: 50_000,
            },
            ModelPreset::Llama3_70b => ModelSpec {
                name: "llama-3-70b",
                layers: 80,
                kv_heads: 8,
                head_dim: 128,
                dtype_bytes: 2,
                prefill_ns_per_token: 90_000,
                decode_ns_per_step: 35_000_000,
                decode_ns_per_seq: 120_000,
            },
        }
    }

    /// The worker model of this preset, with the default link bandwidths.
    pub fn worker(self) -> WorkerModel {
        let s = self.spec();
        WorkerModel {
            prefill_ns_per_token: s.prefill_ns_per_token,
            decode_ns_per_step: s.decode_ns_per_step,
            decode_ns_per_seq: s.decode_ns_per_seq,
            model_kv_bytes_per_token: s.kv_bytes_per_token(),
            ..WorkerModel::default()
        }
    }
}

/// How long things take in the simulated engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WorkerModel {
    /// Prefill cost per prompt token, ns.
    pub prefill_ns_per_token: u64,
    /// Fixed cost of an iteration that decodes, ns.
    pub decode_ns_per_step: u64,
    /// Extra decode cost per sequence, ns.
    pub decode_ns_per_seq: u64,
    /// KV bytes per token of the modelled model (for transfer times only;
    /// the bytes really moved are `real_bytes_per_token`).
    pub model_kv_bytes_per_token: u64,
    /// Host → device and device → host bandwidth, bytes/s.
    pub pcie_bytes_per_s: f64,
    /// Disk ↔ host bandwidth, bytes/s.
    pub disk_bytes_per_s: f64,
}

impl Default for WorkerModel {
    fn default() -> Self {
        // Roughly an 8B model on one modern GPU.
        WorkerModel {
            prefill_ns_per_token: 30_000,
            decode_ns_per_step: 15_000_000,
            decode_ns_per_seq: 50_000,
            model_kv_bytes_per_token: 128 * 1024,
            pcie_bytes_per_s: 20e9,
            disk_bytes_per_s: 2e9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn kv_bytes_follow_the_published_shapes() {
        assert_eq!(
            ModelPreset::Llama32_1b.spec().kv_bytes_per_token(),
            32 << 10
        );
        assert_eq!(
            ModelPreset::Llama3_8b.spec().kv_bytes_per_token(),
            128 << 10
        );
        assert_eq!(
            ModelPreset::Llama3_70b.spec().kv_bytes_per_token(),
            320 << 10
        );
    }

    #[test]
    fn the_default_worker_model_is_the_8b_preset() {
        assert_eq!(ModelPreset::Llama3_8b.worker(), WorkerModel::default());
    }

    #[test]
    fn names_match_what_the_command_line_takes() {
        for p in ModelPreset::value_variants() {
            let v = p.to_possible_value().unwrap();
            assert_eq!(v.get_name(), p.spec().name);
        }
    }
}
