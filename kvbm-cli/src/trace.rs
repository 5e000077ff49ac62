//! The capacity curve of a Mooncake trace: the simulator's reader
//! (`kvbm_sim::workload`) feeding the recorder library's
//! [`TraceCurve`], for `kvbm-recorder capacity --trace`.

use crate::policies::PolicyCurves;
use kvbm_recorder::analysis::capacity::{CapacityReport, Sampling, TraceCurve};
use kvbm_sim::workload::{MooncakeOptions, MooncakeReader, WorkloadError};
use std::io::BufRead;

/// The curve of the Mooncake trace in `reader`, in file order. Malformed
/// lines are skipped and counted, each reported to `skipped` with its line
/// number; a reader that cannot go on is an error.
pub fn capacity_of_trace(
    reader: impl BufRead,
    sampling: Sampling,
    capacities: &[u64],
    skipped: impl FnMut(usize, &str),
) -> Result<CapacityReport, WorkloadError> {
    capacity_and_policies_of_trace(reader, sampling, capacities, None, skipped)
}

/// [`capacity_of_trace`], also feeding each request to `policies`
/// (to be prepared for the trace's blocks, [`MooncakeOptions`]'
/// `block_tokens`).
pub fn capacity_and_policies_of_trace(
    reader: impl BufRead,
    sampling: Sampling,
    capacities: &[u64],
    mut policies: Option<&mut PolicyCurves>,
    mut skipped: impl FnMut(usize, &str),
) -> Result<CapacityReport, WorkloadError> {
    let opts = MooncakeOptions::default();
    let bs = opts.block_tokens as u32;
    let mut curve = TraceCurve::new(sampling, opts.block_tokens);
    let mut r = MooncakeReader::new(reader, opts)?;
    while let Some(item) = r.next_line() {
        match item {
            Ok(l) => {
                curve.request(l.timestamp_ms, l.input_length, &l.hash_ids);
                if let Some(p) = policies.as_deref_mut() {
                    p.request(l.input_length as u64, bs, curve.last_keys());
                }
            }
            Err(WorkloadError::Line { line, error }) => {
                curve.skipped_line();
                skipped(line, &error.to_string());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(curve.report(capacities))
}
