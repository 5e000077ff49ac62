//! What travels between vLLM's scheduler process and its worker process,
//! once per step: the scheduler side's [`StepPlan`] (inside vLLM's
//! connector metadata) and the worker side's [`StepReport`] (inside its
//! worker metadata). Both are JSON bytes, so vLLM's pickling carries them
//! as plain data; both sides check what they read.

use serde::{Deserialize, Serialize};

/// An error as a report carries it (clipped, as every message in an
/// event is).
pub(crate) fn describe(e: &impl std::fmt::Display) -> String {
    kvbm_events::text::clip(&e.to_string(), kvbm_events::text::MAX_MESSAGE_CHARS)
}

/// Which copy a batch is; fixes which side is vLLM's G1 block id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Route {
    /// G1 → G2: `src` is a vLLM block id, `dst` a host block.
    DeviceToHost,
    /// G2 → G1: `src` a host block, `dst` a vLLM block id.
    HostToDevice,
    /// G1 → G3: `src` a vLLM block id, `dst` a disk block.
    DeviceToDisk,
    /// G3 → G1: `src` a disk block, `dst` a vLLM block id.
    DiskToDevice,
}

impl Route {
    /// True when blocks come into G1.
    pub fn is_load(self) -> bool {
        matches!(self, Route::HostToDevice | Route::DiskToDevice)
    }
}

/// One block to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pair {
    /// Source block.
    pub src: u32,
    /// Destination block.
    pub dst: u32,
    /// The block's sequence hash (for checks and test dumps).
    pub hash: u64,
}

/// A batch of copies that succeed or fail together.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Which copy.
    pub route: Route,
    /// The scheduler side's id, echoed in the report.
    pub id: u64,
    /// The blocks.
    pub pairs: Vec<Pair>,
}

/// What the worker does in one step, before that step's forward pass:
/// stores first (blocks an earlier forward pass computed, which the
/// engine may reuse from this step on), then loads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepPlan {
    /// vLLM's step number, as the scheduler side counts it.
    pub step: u64,
    /// Copies out of G1.
    pub stores: Vec<Batch>,
    /// Copies into G1.
    pub loads: Vec<Batch>,
    /// G1 blocks that were promised a load this step but whose copy could
    /// not be shipped in time: the worker reports them as load errors, and
    /// vLLM computes them instead.
    pub failed_loads: Vec<u32>,
    /// Requests whose stores have all finished: the worker reports them as
    /// finished sending, and vLLM frees their blocks.
    pub finished_sending: Vec<String>,
}

/// How one batch went on the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// Which copy.
    pub route: Route,
    /// The batch's id.
    pub id: u64,
    /// Bytes moved (0 when it failed).
    pub bytes: u64,
    /// Time the copy took, ns.
    pub elapsed_ns: u64,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// What the worker reports back after a step.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReport {
    /// The plan's step.
    pub step: u64,
    /// Every batch of that plan.
    pub done: Vec<Done>,
}

/// Why bytes from the other side were not a plan or a report.
#[derive(Debug, thiserror::Error)]
#[error("kvbm: a {what} from the other process does not parse: {source}")]
pub struct MetaError {
    what: &'static str,
    #[source]
    source: serde_json::Error,
}

impl StepPlan {
    /// Whether it copies anything (most steps' plans do not).
    pub fn copies(&self) -> bool {
        !self.stores.is_empty() || !self.loads.is_empty()
    }

    /// Whether it gives the worker nothing to do (most steps): no copies,
    /// no failed loads, no finished requests.
    pub fn is_idle(&self) -> bool {
        !self.copies() && self.failed_loads.is_empty() && self.finished_sending.is_empty()
    }

    /// JSON bytes; none at all for an idle plan, so that vLLM carries
    /// nothing and the worker's Python skips the call into kvbm that step
    /// (between forward passes each such call costs the worker's critical
    /// path about 10 µs on a 2-core VM, its caches cold).
    pub fn to_bytes(&self) -> Vec<u8> {
        if self.is_idle() {
            return Vec::new();
        }
        // Plain data of known types: serialising cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses what [`to_bytes`](Self::to_bytes) wrote (no bytes: an idle
    /// plan, its step unsaid).
    pub fn from_bytes(b: &[u8]) -> Result<Self, MetaError> {
        if b.is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_slice(b).map_err(|source| MetaError {
            what: "step plan",
            source,
        })
    }
}

impl StepReport {
    /// JSON bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(b: &[u8]) -> Result<Self, MetaError> {
        serde_json::from_slice(b).map_err(|source| MetaError {
            what: "step report",
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_and_reports_round_trip_and_garbage_is_an_error() {
        let plan = StepPlan {
            step: 7,
            stores: vec![Batch {
                route: Route::DeviceToHost,
                id: 3,
                pairs: vec![Pair {
                    src: 1,
                    dst: 2,
                    hash: u64::MAX,
                }],
            }],
            failed_loads: vec![9],
            finished_sending: vec!["r-1".into()],
            ..StepPlan::default()
        };
        assert_eq!(StepPlan::from_bytes(&plan.to_bytes()).unwrap(), plan);
        let rep = StepReport {
            step: 7,
            done: vec![Done {
                route: Route::DiskToDevice,
                id: 3,
                bytes: 0,
                elapsed_ns: 1,
                error: Some("short read".into()),
            }],
        };
        assert_eq!(StepReport::from_bytes(&rep.to_bytes()).unwrap(), rep);
        assert!(StepPlan::from_bytes(b"\xff{").is_err());
        // An idle plan travels as nothing, and nothing is an idle plan.
        let idle = StepPlan {
            step: 8,
            ..StepPlan::default()
        };
        assert!(idle.is_idle() && idle.to_bytes().is_empty());
        assert!(StepPlan::from_bytes(b"").unwrap().is_idle());
        assert!(!plan.is_idle());
        assert!(StepReport::from_bytes(b"[]").is_err());
    }
}
