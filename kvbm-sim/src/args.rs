//! The simulator's command-line options, declared once: `kvbm-sim`,
//! `kvbm-recorder record` and `kvbm-console demo` flatten [`SimArgs`] into
//! their own commands, so an option means the same thing, with the same
//! default, everywhere (a command that needs another default, such as the
//! demo's real-time pacing, overrides it with clap's `mut_arg`, which its
//! `--help` shows).
//!
//! [`SimArgs::load`] turns the options into a [`SimConfig`] and a workload,
//! checking what clap cannot.

use crate::model::{ModelPreset, WorkerModel};
use crate::scenario;
use crate::sim::{OffloadMode, Pacing, SimConfig, TierEviction};
use crate::workload::{
    LengthDist, MOONCAKE_BLOCK_TOKENS, MooncakeOptions, RequestSpec, SkippedLine, SyntheticConfig,
    WorkloadError, generate, parse_mooncake_lenient,
};
use kvbm_events::breakpoint::{MAX_DEADLINE, MIN_DEADLINE};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A built-in scenario instead of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The CPU-offload walk-through: request A is computed and offloaded
    /// to the host, request B arrives later and hits A's prefix there.
    #[value(alias = "walkthrough")]
    CpuOffload,
}

/// The simulated engine's options.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// A Mooncake JSONL trace (timestamp ms, input_length, output_length,
    /// hash_ids of 512-token blocks). Without it, a synthetic workload.
    #[arg(long, conflicts_with = "scenario", help_heading = "Workload")]
    pub trace: Option<PathBuf>,
    /// Tokens each of the trace's hash ids stands for: 512 in the
    /// published traces; a trace that `kvbm-recorder export --format
    /// mooncake` wrote says its own in `TRACE.meta.json`.
    #[arg(long, default_value_t = MOONCAKE_BLOCK_TOKENS as u32,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576), help_heading = "Workload")]
    pub trace_block_tokens: u32,
    /// A built-in scenario instead of a workload (it sets its own block
    /// size and capacities).
    #[arg(long, value_enum, help_heading = "Workload")]
    pub scenario: Option<Scenario>,
    /// Use at most this many requests of the trace.
    #[arg(long, help_heading = "Workload")]
    pub max_requests: Option<usize>,
    /// Most tokens, prompts and outputs together, the requests used from
    /// the trace may ask for: every prompt is held in memory (4 bytes a
    /// token) and computed, and a few-KB trace can ask for a Gi tokens. A
    /// trace asking for more is refused, naming the line that crossed it.
    #[arg(long, default_value_t = DEFAULT_MAX_TRACE_TOKENS, help_heading = "Workload")]
    pub max_trace_tokens: u64,
    /// Multiply trace timestamps by this (2.0 = half the arrival rate).
    #[arg(long, default_value_t = 1.0, help_heading = "Workload")]
    pub time_scale: f64,
    /// Synthetic: number of requests.
    #[arg(long, default_value_t = 100, help_heading = "Workload")]
    pub requests: usize,
    /// Synthetic: arrivals per second (Poisson).
    #[arg(long, default_value_t = 10.0, help_heading = "Workload")]
    pub rate: f64,
    /// Synthetic: mean prompt length (log-normal).
    #[arg(long, default_value_t = 1024, help_heading = "Workload")]
    pub prompt_len: usize,
    /// Synthetic: mean output length (log-normal).
    #[arg(long, default_value_t = 64, help_heading = "Workload")]
    pub output_len: usize,
    /// Synthetic: spread of both lengths (σ of the log-normal).
    #[arg(long, default_value_t = 0.5, help_heading = "Workload")]
    pub length_sigma: f64,
    /// Synthetic: longest prompt or output.
    #[arg(long, default_value_t = 1 << 20, help_heading = "Workload")]
    pub max_len: usize,
    /// Synthetic: fraction of requests starting with a shared prefix.
    #[arg(long, default_value_t = 0.5, help_heading = "Workload")]
    pub shared_prefix_ratio: f64,
    /// Synthetic: how many distinct shared prefixes.
    #[arg(long, default_value_t = 4, help_heading = "Workload")]
    pub shared_prefixes: usize,
    /// Synthetic: length of each shared prefix.
    #[arg(long, default_value_t = 512, help_heading = "Workload")]
    pub shared_prefix_len: usize,
    /// Synthetic: random seed.
    #[arg(long, default_value_t = 1, help_heading = "Workload")]
    pub seed: u64,

    /// Tokens per block.
    #[arg(long, default_value_t = 16, help_heading = "Engine")]
    pub block_size: usize,
    /// G1 capacity in tokens.
    #[arg(long, default_value_t = 65_536, help_heading = "Engine")]
    pub device_capacity_tokens: usize,
    /// G2 capacity in tokens (0 disables the host tier).
    #[arg(long, default_value_t = 262_144, help_heading = "Engine")]
    pub host_capacity_tokens: usize,
    /// G3 capacity in tokens (0 disables the disk tier).
    #[arg(long, default_value_t = 0, help_heading = "Engine")]
    pub disk_capacity_tokens: usize,
    /// When a G1 block is stored to G2: `eager` (write-through, after the
    /// forward pass that computed it), `lazy` (when its request finishes)
    /// or `after-hits:N` (at its N-th hit in G1's prefix cache, N 1–15).
    #[arg(long, default_value = "eager", help_heading = "Engine")]
    pub offload: OffloadMode,
    /// Cache policy: `lru`, `lfu`, `s3fifo` or `arc` for every tier, each
    /// also with TinyLFU admission in front on G2 and G3 (`tinylfu+lru`),
    /// or per tier, `G2=tinylfu+s3fifo,G3=lfu` (tiers not named keep LRU).
    #[arg(long, default_value = "lru", help_heading = "Engine")]
    pub eviction: TierEviction,
    /// G1 serves no prefix hits: every hit comes from G2 or G3. With it,
    /// G2 is the one cache `kvbm-recorder capacity --policies` models (G1
    /// in front is otherwise a small recency window of its own).
    #[arg(long, help_heading = "Engine")]
    pub no_device_prefix_cache: bool,
    /// Token budget per iteration.
    #[arg(long, default_value_t = 8192, help_heading = "Engine")]
    pub max_batch_tokens: usize,
    /// The model the engine stands for: its KV bytes per token (what every
    /// byte figure counts) and its forward-pass timings.
    #[arg(long, value_enum, default_value_t = ModelPreset::Llama3_8b, help_heading = "Model")]
    pub model: ModelPreset,
    /// KV bytes per token, instead of the model's.
    #[arg(long, help_heading = "Model")]
    pub kv_bytes_per_token: Option<u64>,
    /// Prefill cost per prompt token, µs, instead of the model's.
    #[arg(long, help_heading = "Model")]
    pub prefill_us_per_token: Option<f64>,
    /// Fixed decode cost per iteration, ms, instead of the model's.
    #[arg(long, help_heading = "Model")]
    pub decode_ms_per_step: Option<f64>,
    /// Device ↔ host (PCIe) bandwidth, GB/s: how long modelled G1 ↔ G2
    /// transfers take.
    #[arg(long, default_value_t = 20.0, help_heading = "Model")]
    pub pcie_gbps: f64,
    /// Disk bandwidth, GB/s: how long modelled G3 transfers take.
    #[arg(long, default_value_t = 2.0, help_heading = "Model")]
    pub disk_gbps: f64,
    /// Bytes per token the simulated storages really hold and copy (kept
    /// small so runs stay fast; byte figures count the model's bytes).
    #[arg(
        long,
        alias = "bytes-per-token",
        default_value_t = 4,
        help_heading = "Model"
    )]
    pub real_bytes_per_token: usize,
    /// Pace the run in real time × this speed instead of as fast as
    /// possible.
    #[arg(long, alias = "speed", help_heading = "Engine")]
    pub real_time: Option<f64>,
}

/// An option value clap accepts but the simulator cannot use.
#[derive(Debug, thiserror::Error)]
pub enum SimArgsError {
    /// A value out of range.
    #[error("--{option}: {reason}")]
    Bad {
        /// The option, without dashes.
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The trace could not be opened.
    #[error("opening trace {path}: {source}")]
    OpenTrace {
        /// The trace.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The trace has no line but blank ones: nothing to run.
    #[error("no usable request in trace {path}: it is empty or blank")]
    EmptyTrace {
        /// The trace.
        path: PathBuf,
    },
    /// The trace asks for more tokens than `--max-trace-tokens`.
    #[error(
        "trace {path}: by line {line} it asks for more than --max-trace-tokens {max} tokens \
         (prompts and outputs together); use fewer requests (--max-requests) or raise \
         --max-trace-tokens"
    )]
    TraceTooBig {
        /// The trace.
        path: PathBuf,
        /// The line whose request crossed the cap.
        line: usize,
        /// The cap.
        max: u64,
    },
    /// A request needs more device blocks than the device has: it could
    /// never finish (preempted and recomputed for ever).
    #[error(
        "request {request} needs {needs} device blocks ({prompt} prompt and {output} output \
         tokens) but the device holds {blocks} (--device-capacity-tokens / --block-size): it \
         could never finish; give the device more tokens"
    )]
    NeverFits {
        /// The request's id (`mc-LINE` for a trace's line).
        request: String,
        /// Blocks it needs at its longest.
        needs: usize,
        /// Its prompt tokens.
        prompt: usize,
        /// Its output tokens.
        output: usize,
        /// The device's blocks.
        blocks: usize,
    },
    /// Every line of the trace was skipped: nothing to run.
    #[error(
        "no usable request in trace {path}: all {skipped} of its lines were skipped (line {first_line}: {first})"
    )]
    NothingInTrace {
        /// The trace.
        path: PathBuf,
        /// Lines skipped.
        skipped: usize,
        /// The first one's number.
        first_line: usize,
        /// Why it was skipped.
        first: String,
    },
    /// The trace or the synthetic workload could not be built.
    #[error("{what}: {source}")]
    Workload {
        /// The trace's path, or "synthetic workload".
        what: String,
        /// Why.
        #[source]
        source: WorkloadError,
    },
}

/// What [`SimArgs::load`] gives: the engine's configuration and its
/// workload, and the trace lines it skipped (for the caller to report).
#[derive(Debug)]
pub struct Loaded {
    /// The engine.
    pub config: SimConfig,
    /// The requests, in arrival order.
    pub workload: Vec<RequestSpec>,
    /// Trace lines skipped as unreadable.
    pub skipped: Vec<SkippedLine>,
}

/// Default for `--max-trace-tokens`: 256 Mi tokens, 1 GiB of prompt
/// tokens held (the simulator builds every prompt before it runs). The
/// sample trace in `data/mooncake` asks for 61.8 M (61,194,628 prompt and
/// 595,432 output tokens), a quarter of it, so traces a few times its size
/// run unasked; a few KB of lines each asking for the per-line cap of 1 Mi
/// tokens do not.
pub const DEFAULT_MAX_TRACE_TOKENS: u64 = 256 << 20;

/// The most `--kv-bytes-per-token` takes: 1 GiB. The largest real models
/// hold a few MiB of KV per token (Llama-3.1-405B, with grouped-query
/// attention, 504 KiB in bf16; GPT-3 175B, with full multi-head attention,
/// 4.5 MiB in fp16), so this is over 200 times any of them, and keeps a
/// block's bytes and the byte totals far from a u64's limit.
pub const MAX_KV_BYTES_PER_TOKEN: u64 = 1 << 30;

fn bad(option: &'static str, reason: impl Into<String>) -> SimArgsError {
    SimArgsError::Bad {
        option,
        reason: reason.into(),
    }
}

/// The longest span of seconds an option takes: a century, past any run
/// or wait anyone means, well inside what a deadline (`Instant` plus it)
/// can hold on every platform.
pub const MAX_SECONDS: f64 = 100.0 * 365.0 * 86_400.0;

/// A clap value parser for a breakpoint's pause deadline in seconds
/// (`--bp-deadline-s`): [`seconds`], within what a pause may last
/// ([`MIN_DEADLINE`] to [`MAX_DEADLINE`], 1 ms to a day).
pub fn deadline_seconds(s: &str) -> Result<Duration, String> {
    let (min, max) = (MIN_DEADLINE.as_secs_f64(), MAX_DEADLINE.as_secs_f64());
    let out_of_range = || format!("{s} is not a number of seconds from {min} to {max} (a day)");
    let v = seconds(s).map_err(|_| out_of_range())?;
    if (min..=max).contains(&v) {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(out_of_range())
    }
}

/// A clap value parser for an option that is a span of seconds (`--…-s`):
/// a number from 0 to [`MAX_SECONDS`]. Every binary's seconds go through
/// it, so that `-1`, `nan` or `1e300` is refused by name instead of
/// panicking where it becomes a `Duration` or a deadline.
pub fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if (0.0..=MAX_SECONDS).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{s} is not a number of seconds from 0 to {MAX_SECONDS:.0} (a century)"
        ))
    }
}

fn positive(option: &'static str, v: f64) -> Result<(), SimArgsError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(option, format!("{v} is not a positive number")))
    }
}

fn non_negative(option: &'static str, v: f64) -> Result<(), SimArgsError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(bad(option, format!("{v} is not a non-negative number")))
    }
}

fn at_most(option: &'static str, v: f64, max: f64) -> Result<(), SimArgsError> {
    if v <= max {
        Ok(())
    } else {
        Err(bad(option, format!("{v} is more than {max}")))
    }
}

impl SimArgs {
    /// Checks the options and builds the engine's configuration and
    /// workload.
    pub fn load(&self) -> Result<Loaded, SimArgsError> {
        self.check()?;
        let mut config = SimConfig {
            block_size: self.block_size,
            device_capacity_tokens: self.device_capacity_tokens,
            host_capacity_tokens: self.host_capacity_tokens,
            disk_capacity_tokens: self.disk_capacity_tokens,
            max_batch_tokens: self.max_batch_tokens,
            offload_mode: self.offload,
            eviction: self.eviction,
            device_prefix_cache: !self.no_device_prefix_cache,
            real_bytes_per_token: self.real_bytes_per_token,
            worker: self.worker(),
            model: self.model_name(),
            pacing: match self.real_time {
                Some(speed) => Pacing::RealTime { speed },
                None => Pacing::Virtual,
            },
            ..SimConfig::default()
        };
        let (workload, skipped) = match (&self.scenario, &self.trace) {
            (Some(Scenario::CpuOffload), _) => {
                scenario::cpu_offload_engine(&mut config);
                (scenario::cpu_offload_workload(), Vec::new())
            }
            (None, Some(path)) => self.read_trace(path)?,
            (None, None) => (self.synthetic_workload()?, Vec::new()),
        };
        // The engine preempts to make room, but a request longer than the
        // whole device would preempt itself and start again for ever.
        let blocks = config.device_capacity_tokens / config.block_size;
        if let Some(r) = workload
            .iter()
            .find(|r| (r.prompt.len() + r.output_len).div_ceil(config.block_size) > blocks)
        {
            return Err(SimArgsError::NeverFits {
                request: r.id.clone(),
                needs: (r.prompt.len() + r.output_len).div_ceil(config.block_size),
                prompt: r.prompt.len(),
                output: r.output_len,
                blocks,
            });
        }
        Ok(Loaded {
            config,
            workload,
            skipped,
        })
    }

    /// Checks the options one at a time, so that an error names the first
    /// bad one.
    fn check(&self) -> Result<(), SimArgsError> {
        if self.block_size == 0 {
            return Err(bad("block-size", "must be at least 1"));
        }
        positive("time-scale", self.time_scale)?;
        positive("rate", self.rate)?;
        non_negative("length-sigma", self.length_sigma)?;
        // At most a minute a token or a step: past that the modelled
        // clock (nanoseconds in a u64) would overflow within a run.
        if let Some(v) = self.prefill_us_per_token {
            non_negative("prefill-us-per-token", v)?;
            at_most("prefill-us-per-token", v, 60e6)?;
        }
        if let Some(v) = self.decode_ms_per_step {
            non_negative("decode-ms-per-step", v)?;
            at_most("decode-ms-per-step", v, 60e3)?;
        }
        positive("pcie-gbps", self.pcie_gbps)?;
        positive("disk-gbps", self.disk_gbps)?;
        if let Some(v) = self.kv_bytes_per_token
            && !(1..=MAX_KV_BYTES_PER_TOKEN).contains(&v)
        {
            return Err(bad(
                "kv-bytes-per-token",
                format!(
                    "{v} is not from 1 to {MAX_KV_BYTES_PER_TOKEN} (1 GiB, over 200 times \
                     any real model's)"
                ),
            ));
        }
        if self.max_requests == Some(0) {
            return Err(bad("max-requests", "must be at least 1"));
        }
        if self.max_trace_tokens == 0 {
            return Err(bad("max-trace-tokens", "must be at least 1"));
        }
        if self.real_bytes_per_token == 0 {
            return Err(bad("real-bytes-per-token", "must be at least 1"));
        }
        if let Some(s) = self.real_time {
            positive("real-time", s)?;
        }
        if !(0.0..=1.0).contains(&self.shared_prefix_ratio) {
            return Err(bad("shared-prefix-ratio", "must be in [0, 1]"));
        }
        // Checked here too, so the error names the option typed rather
        // than the engine's setting.
        if self.device_capacity_tokens < self.block_size {
            return Err(bad(
                "device-capacity-tokens",
                format!(
                    "{} tokens hold no {}-token block (--block-size)",
                    self.device_capacity_tokens, self.block_size
                ),
            ));
        }
        if self.max_batch_tokens == 0 {
            return Err(bad("max-batch-tokens", "must be at least 1"));
        }
        Ok(())
    }

    /// The model's worker, with the timings and sizes given overriding its
    /// own.
    fn worker(&self) -> WorkerModel {
        let mut worker = self.model.worker();
        if let Some(v) = self.prefill_us_per_token {
            worker.prefill_ns_per_token = (v * 1e3) as u64;
        }
        if let Some(v) = self.decode_ms_per_step {
            worker.decode_ns_per_step = (v * 1e6) as u64;
        }
        if let Some(v) = self.kv_bytes_per_token {
            worker.model_kv_bytes_per_token = v;
        }
        worker.pcie_bytes_per_s = self.pcie_gbps * 1e9;
        worker.disk_bytes_per_s = self.disk_gbps * 1e9;
        worker
    }

    /// The model's name, and its KV bytes per token when given.
    fn model_name(&self) -> String {
        match self.kv_bytes_per_token {
            None => self.model.spec().name.to_string(),
            Some(v) => format!("{} with {v} KV bytes/token", self.model.spec().name),
        }
    }

    /// Reads a Mooncake trace leniently: unreadable lines are skipped (and
    /// returned), but a trace with nothing readable is an error.
    fn read_trace(
        &self,
        path: &Path,
    ) -> Result<(Vec<RequestSpec>, Vec<SkippedLine>), SimArgsError> {
        let f = std::fs::File::open(path).map_err(|source| SimArgsError::OpenTrace {
            path: path.to_path_buf(),
            source,
        })?;
        let opts = MooncakeOptions {
            block_tokens: self.trace_block_tokens as usize,
            max_requests: self.max_requests,
            time_scale: self.time_scale,
            max_total_tokens: Some(self.max_trace_tokens),
            ..MooncakeOptions::default()
        };
        let report = parse_mooncake_lenient(BufReader::new(f), &opts).map_err(|e| match e {
            WorkloadError::TooManyTokens { line, max } => SimArgsError::TraceTooBig {
                path: path.to_path_buf(),
                line,
                max,
            },
            source => SimArgsError::Workload {
                what: format!("reading trace {}", path.display()),
                source,
            },
        })?;
        if report.requests.is_empty() {
            return Err(match report.skipped.first() {
                Some(first) => SimArgsError::NothingInTrace {
                    path: path.to_path_buf(),
                    skipped: report.skipped.len(),
                    first_line: first.line,
                    first: first.error.to_string(),
                },
                None => SimArgsError::EmptyTrace {
                    path: path.to_path_buf(),
                },
            });
        }
        Ok((report.requests, report.skipped))
    }

    /// The synthetic workload the options describe.
    fn synthetic_workload(&self) -> Result<Vec<RequestSpec>, SimArgsError> {
        let length = |mean: usize| LengthDist::LogNormal {
            mean: mean as f64,
            sigma: self.length_sigma,
        };
        generate(&SyntheticConfig {
            seed: self.seed,
            num_requests: self.requests,
            arrival_rate_per_s: self.rate,
            prompt_len: length(self.prompt_len),
            output_len: length(self.output_len),
            shared_prefix_ratio: self.shared_prefix_ratio,
            num_shared_prefixes: self.shared_prefixes,
            shared_prefix_len: self.shared_prefix_len,
            max_len: self.max_len,
            ..SyntheticConfig::default()
        })
        .map_err(|source| SimArgsError::Workload {
            what: "synthetic workload".into(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn parse(args: &[&str]) -> SimArgs {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap()
            .sim
    }

    #[test]
    fn defaults_build_a_synthetic_run() {
        let l = parse(&["--requests", "7"]).load().unwrap();
        assert_eq!(l.workload.len(), 7);
        assert_eq!(l.config.device_capacity_tokens, 65_536);
        assert_eq!(l.config.host_capacity_tokens, 262_144);
        assert_eq!(l.config.pacing, Pacing::Virtual);
    }

    #[test]
    fn the_model_preset_sets_kv_bytes_and_timings_and_flags_override_them() {
        let l = parse(&["--model", "llama-3-70b"]).load().unwrap();
        assert_eq!(l.config.worker.model_kv_bytes_per_token, 320 << 10);
        assert_eq!(l.config.worker.decode_ns_per_step, 35_000_000);
        assert_eq!(l.config.model, "llama-3-70b");
        let l = parse(&[
            "--model",
            "llama-3-70b",
            "--kv-bytes-per-token",
            "1000",
            "--decode-ms-per-step",
            "2",
            "--disk-gbps",
            "0.5",
        ])
        .load()
        .unwrap();
        assert_eq!(l.config.worker.model_kv_bytes_per_token, 1000);
        assert_eq!(l.config.worker.decode_ns_per_step, 2_000_000);
        assert_eq!(l.config.worker.disk_bytes_per_s, 0.5e9);
        assert_eq!(l.config.model, "llama-3-70b with 1000 KV bytes/token");
        // The old spelling of the real bytes still parses.
        let l = parse(&["--bytes-per-token", "8"]).load().unwrap();
        assert_eq!(l.config.real_bytes_per_token, 8);
    }

    #[test]
    fn a_request_longer_than_the_device_is_refused_naming_it() {
        // Three requests of exactly `prompt` prompt and 8 output tokens on a
        // 64-token device (4 blocks of 16).
        let load = |prompt: &str| {
            parse(&[
                "--requests",
                "3",
                "--prompt-len",
                prompt,
                "--length-sigma",
                "0",
                "--shared-prefix-ratio",
                "0",
                "--output-len",
                "8",
                "--device-capacity-tokens",
                "64",
            ])
            .load()
        };
        // 64 + 8 tokens need 5 blocks. Before this was checked the run
        // never ended.
        let e = load("64").unwrap_err();
        assert!(
            matches!(
                e,
                SimArgsError::NeverFits {
                    needs: 5,
                    blocks: 4,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("could never finish"), "{e}");
        // Within the device: it fits.
        assert!(load("48").is_ok());
    }

    #[test]
    fn the_scenario_sets_its_own_engine() {
        let l = parse(&["--scenario", "walkthrough"]).load().unwrap();
        assert_eq!(l.workload.len(), 2);
        assert!(!l.config.device_prefix_cache);
        assert_eq!(l.config.block_size, 16);
    }

    #[test]
    fn values_clap_accepts_but_the_engine_cannot_use_are_named() {
        for (args, option) in [
            (&["--block-size", "0"][..], "block-size"),
            (&["--rate", "0"], "rate"),
            (&["--time-scale=-1"], "time-scale"),
            (&["--real-time", "nan"], "real-time"),
            (&["--shared-prefix-ratio", "1.5"], "shared-prefix-ratio"),
            (&["--pcie-gbps", "0"], "pcie-gbps"),
            (&["--kv-bytes-per-token", "0"], "kv-bytes-per-token"),
            (&["--real-bytes-per-token", "0"], "real-bytes-per-token"),
            // Past a minute a token or a step, the modelled clock would
            // overflow (this panicked in the engine before).
            (&["--prefill-us-per-token", "1e300"], "prefill-us-per-token"),
            (&["--decode-ms-per-step", "1e300"], "decode-ms-per-step"),
            // Past any real model: its products with block sizes and block
            // counts overflowed (a panic in the engine, or totals wrapped).
            (
                &["--kv-bytes-per-token", "18446744073709551615"],
                "kv-bytes-per-token",
            ),
            (
                &["--kv-bytes-per-token", "1073741825"],
                "kv-bytes-per-token",
            ),
            (&["--max-requests", "0"], "max-requests"),
            (&["--max-trace-tokens", "0"], "max-trace-tokens"),
            (
                &["--device-capacity-tokens", "15"],
                "device-capacity-tokens",
            ),
            (&["--max-batch-tokens", "0"], "max-batch-tokens"),
        ] {
            let err = parse(args).load().unwrap_err().to_string();
            assert!(err.starts_with(&format!("--{option}:")), "{err}");
        }
        let err = parse(&["--trace", "/nonexistent/trace.jsonl"])
            .load()
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
        // A trace of which no line is a request is nothing to run; one
        // with a good line runs it, the bad ones reported.
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.jsonl");
        std::fs::write(&t, "{\"timestamp\": \"x\"}\nnot json\n").unwrap();
        let err = parse(&["--trace", t.to_str().unwrap()])
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no usable request") && err.contains("all 2"),
            "{err}"
        );
        assert!(err.contains("line 1"), "{err}");
        std::fs::write(
            &t,
            "not json\n{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [1, 2]}\n",
        )
        .unwrap();
        let l = parse(&["--trace", t.to_str().unwrap()]).load().unwrap();
        assert_eq!((l.workload.len(), l.skipped.len()), (1, 1));
    }

    #[test]
    fn the_largest_kv_bytes_per_token_is_taken() {
        let max = MAX_KV_BYTES_PER_TOKEN.to_string();
        let l = parse(&["--kv-bytes-per-token", &max]).load().unwrap();
        assert_eq!(l.config.worker.model_kv_bytes_per_token, 1 << 30);
    }

    #[test]
    fn the_sample_trace_fits_the_default_token_cap() {
        use crate::workload::MooncakeReader;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/mooncake/synthetic_trace.jsonl"
        );
        let f = std::fs::File::open(path).unwrap();
        let opts = MooncakeOptions {
            max_total_tokens: Some(DEFAULT_MAX_TRACE_TOKENS),
            ..MooncakeOptions::default()
        };
        // Lines only: the cap is checked before any prompt is built.
        let mut r = MooncakeReader::new(BufReader::new(f), opts).unwrap();
        let mut lines = 0;
        while let Some(l) = r.next_line() {
            l.unwrap();
            lines += 1;
        }
        assert_eq!(lines, 3993);
    }

    #[test]
    fn an_empty_or_blank_trace_is_nothing_to_run() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.jsonl");
        for text in ["", "\n", "  \n\t\n\r\n"] {
            std::fs::write(&t, text).unwrap();
            let err = parse(&["--trace", t.to_str().unwrap()]).load().unwrap_err();
            assert!(matches!(err, SimArgsError::EmptyTrace { .. }), "{err}");
            let err = err.to_string();
            assert!(
                err.contains("no usable request") && err.contains("t.jsonl"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_trace_asking_for_too_many_tokens_is_refused_at_the_line_that_crossed() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.jsonl");
        // 1 Mi + 1 tokens a line: the 256th crosses the default 256 Mi.
        // (Outputs count as prompts do, and cost this test no memory.)
        let text: String = (0..300)
            .map(|i| {
                format!(
                    "{{\"timestamp\": {i}, \"input_length\": 1, \"output_length\": 1048576, \"hash_ids\": []}}\n"
                )
            })
            .collect();
        std::fs::write(&t, text).unwrap();
        let err = parse(&["--trace", t.to_str().unwrap()]).load().unwrap_err();
        assert!(
            matches!(
                err,
                SimArgsError::TraceTooBig {
                    line: 256,
                    max: DEFAULT_MAX_TRACE_TOKENS,
                    ..
                }
            ),
            "{err}"
        );
        let err = err.to_string();
        assert!(
            err.contains("line 256") && err.contains("--max-trace-tokens 268435456"),
            "{err}"
        );
        // The flag moves the bound; fewer requests keep under it.
        let err = parse(&[
            "--trace",
            t.to_str().unwrap(),
            "--max-trace-tokens",
            "3000000",
        ])
        .load()
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 3"), "{err}");
        // (A device that holds a request's million output tokens.)
        let l = parse(&[
            "--trace",
            t.to_str().unwrap(),
            "--max-requests",
            "2",
            "--device-capacity-tokens",
            "2097152",
        ])
        .load()
        .unwrap();
        assert_eq!(l.workload.len(), 2);
    }

    #[test]
    fn a_pause_deadline_is_from_a_millisecond_to_a_day() {
        assert_eq!(deadline_seconds("60"), Ok(Duration::from_secs(60)));
        assert_eq!(deadline_seconds("0.001"), Ok(Duration::from_millis(1)));
        assert_eq!(deadline_seconds("86400"), Ok(Duration::from_secs(86_400)));
        for bad in ["0", "0.0009", "86400.5", "1e300", "-1", "nan", "soon"] {
            let err = deadline_seconds(bad).unwrap_err();
            assert!(err.contains("from 0.001 to 86400"), "{bad}: {err}");
        }
    }

    #[test]
    fn seconds_are_a_number_from_zero_to_a_century() {
        for ok in ["0", "1", "2.5", " 10 ", "3153600000"] {
            assert!(seconds(ok).is_ok(), "{ok}");
        }
        for bad in [
            "-1",
            "nan",
            "inf",
            "-inf",
            "1e300",
            "3153600001",
            "",
            "5s",
            "ten",
        ] {
            let err = seconds(bad).unwrap_err();
            assert!(err.contains("seconds"), "{bad}: {err}");
        }
    }

    proptest::proptest! {
        /// Whatever the text, no panic; what is accepted makes a deadline
        /// from now, as every binary does with it.
        #[test]
        fn any_text_is_seconds_or_an_error_never_a_panic(s in ".{0,24}", v in proptest::num::f64::ANY) {
            for text in [s, v.to_string(), format!("{v:e}")] {
                if let Ok(secs) = seconds(&text) {
                    let d = std::time::Duration::try_from_secs_f64(secs).unwrap();
                    proptest::prop_assert!(std::time::Instant::now().checked_add(d).is_some());
                }
            }
        }
    }
}
