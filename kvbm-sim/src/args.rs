//! The simulator's command-line options, declared once: `kvbm-sim`,
//! `kvbm-recorder record` and `kvbm-console demo` flatten [`SimArgs`] into
//! their own commands, so an option means the same thing, with the same
//! default, everywhere (a command that needs another default, such as the
//! demo's real-time pacing, overrides it with clap's `mut_arg`, which its
//! `--help` shows).
//!
//! [`SimArgs::load`] turns the options into a [`SimConfig`] and a workload,
//! checking what clap cannot.

use crate::model::ModelPreset;
use crate::scenario;
use crate::sim::{OffloadMode, Pacing, SimConfig};
use crate::workload::{
    LengthDist, MooncakeOptions, RequestSpec, SkippedLine, SyntheticConfig, WorkloadError,
    generate, parse_mooncake_lenient,
};
use std::io::BufReader;
use std::path::PathBuf;

/// A built-in scenario instead of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The CPU-offload walk-through: request A is computed and offloaded
    /// to the host, request B arrives later and hits A's prefix there.
    #[value(alias = "walkthrough")]
    CpuOffload,
}

/// Eager or lazy offload, on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Offload {
    /// Store each block after the forward pass that computed it.
    Eager,
    /// Store a request's blocks when it finishes.
    Lazy,
}

/// The simulated engine's options.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// A Mooncake JSONL trace (timestamp ms, input_length, output_length,
    /// hash_ids of 512-token blocks). Without it, a synthetic workload.
    #[arg(long, conflicts_with = "scenario", help_heading = "Workload")]
    pub trace: Option<PathBuf>,
    /// A built-in scenario instead of a workload (it sets its own block
    /// size and capacities).
    #[arg(long, value_enum, help_heading = "Workload")]
    pub scenario: Option<Scenario>,
    /// Use at most this many requests of the trace.
    #[arg(long, help_heading = "Workload")]
    pub max_requests: Option<usize>,
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
    /// Offload mode.
    #[arg(long, value_enum, default_value_t = Offload::Eager, help_heading = "Engine")]
    pub offload: Offload,
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
        if self.kv_bytes_per_token == Some(0) {
            return Err(bad("kv-bytes-per-token", "must be at least 1"));
        }
        if self.real_bytes_per_token == 0 {
            return Err(bad("real-bytes-per-token", "must be at least 1"));
        }
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
        let model = match self.kv_bytes_per_token {
            None => self.model.spec().name.to_string(),
            Some(v) => format!("{} with {v} KV bytes/token", self.model.spec().name),
        };
        if let Some(s) = self.real_time {
            positive("real-time", s)?;
        }
        if !(0.0..=1.0).contains(&self.shared_prefix_ratio) {
            return Err(bad("shared-prefix-ratio", "must be in [0, 1]"));
        }
        let mut config = SimConfig {
            block_size: self.block_size,
            device_capacity_tokens: self.device_capacity_tokens,
            host_capacity_tokens: self.host_capacity_tokens,
            disk_capacity_tokens: self.disk_capacity_tokens,
            max_batch_tokens: self.max_batch_tokens,
            offload_mode: match self.offload {
                Offload::Eager => OffloadMode::Eager,
                Offload::Lazy => OffloadMode::Lazy,
            },
            real_bytes_per_token: self.real_bytes_per_token,
            worker,
            model,
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
            (None, Some(path)) => {
                let f = std::fs::File::open(path).map_err(|source| SimArgsError::OpenTrace {
                    path: path.clone(),
                    source,
                })?;
                let opts = MooncakeOptions {
                    max_requests: self.max_requests,
                    time_scale: self.time_scale,
                    ..MooncakeOptions::default()
                };
                let report =
                    parse_mooncake_lenient(BufReader::new(f), &opts).map_err(|source| {
                        SimArgsError::Workload {
                            what: format!("reading trace {}", path.display()),
                            source,
                        }
                    })?;
                if let (true, Some(first)) = (report.requests.is_empty(), report.skipped.first()) {
                    return Err(SimArgsError::NothingInTrace {
                        path: path.clone(),
                        skipped: report.skipped.len(),
                        first_line: first.line,
                        first: first.error.to_string(),
                    });
                }
                (report.requests, report.skipped)
            }
            (None, None) => {
                let length = |mean: usize| LengthDist::LogNormal {
                    mean: mean as f64,
                    sigma: self.length_sigma,
                };
                let workload = generate(&SyntheticConfig {
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
                })?;
                (workload, Vec::new())
            }
        };
        Ok(Loaded {
            config,
            workload,
            skipped,
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
