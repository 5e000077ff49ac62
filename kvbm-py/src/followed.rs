//! vLLM's requests as the scheduler side follows them between steps, and
//! each step's scheduler output read in place into a [`StepInput`].
//!
//! `build_connector_meta` runs every step on vLLM's critical path, and most
//! of its requests only decoded a token. Reading vLLM's own per-step lists
//! here (the running requests' ids, added blocks and computed tokens) and
//! each request's token list, which vLLM appends to in place, leaves the
//! connector class no loop over its requests: no tuple, dict entry or
//! list slice a request a step in Python, and no conversion of them into
//! Rust values. The Python objects are only read, with the GIL held.
//!
//! A request whose inputs cannot be read (a token that is not a token id,
//! a block table that is not a list of ids) is left out of the step with
//! the reason, in [`StepInput::refused`]; the others go on.

use crate::scheduler::{Scheduled, StepInput};
use kvbm_events::RequestId;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use std::collections::HashMap;

/// What is kept of one request between steps.
struct Request {
    /// Its id (the map's key: the same allocation).
    id: RequestId,
    /// vLLM's list of the request's tokens (prompt, then each sampled
    /// token appended as it is made), or a sequence standing for it.
    tokens: Py<PyAny>,
    /// How many of `tokens` kvbm has been given.
    sent: usize,
    /// The prompt's length.
    prompt_len: usize,
    /// The request's block table as last given (vLLM's ids, group 0).
    blocks: Vec<u32>,
}

/// The requests the connector follows, by vLLM's request id (the
/// scheduler side's own `Arc` of it, which `Scheduled` shares).
#[derive(Default)]
pub(crate) struct Followed {
    requests: HashMap<RequestId, Request, foldhash::fast::RandomState>,
}

/// One step's scheduler output, as vLLM's objects (see
/// [`Followed::step`]).
pub(crate) struct StepArgs<'a, 'py> {
    /// `(req_id, num_computed_tokens, block_ids)` of each request scheduled
    /// for the first time (`block_ids` a tuple of lists, one per group).
    pub new: &'a Bound<'py, PyList>,
    /// `scheduled_cached_reqs.req_ids`.
    pub ids: &'a Bound<'py, PyList>,
    /// `scheduled_cached_reqs.new_block_ids`: per request `None` or a tuple
    /// of lists of ids added (or, resumed, the whole table).
    pub added: &'a Bound<'py, PyList>,
    /// `scheduled_cached_reqs.num_computed_tokens`.
    pub computed: &'a Bound<'py, PyList>,
    /// `num_scheduled_tokens`: request id to tokens this step.
    pub num_scheduled: &'a Bound<'py, PyDict>,
    /// `scheduled_cached_reqs.resumed_req_ids` (any container), or `None`.
    pub resumed: Option<&'a Bound<'py, PyAny>>,
    /// `kv_connector_block_state`, or `None`: its `get_block_ids(id)`
    /// gives a request's whole table, when vLLM offers one.
    pub block_state: Option<&'a Bound<'py, PyAny>>,
}

impl Followed {
    /// Follows `id` from its first lookup: `tokens` is vLLM's token list
    /// (`prompt_sent` of them given to kvbm with the lookup).
    pub fn follow(
        &mut self,
        id: RequestId,
        tokens: Py<PyAny>,
        prompt_sent: usize,
        prompt_len: usize,
    ) {
        self.requests.entry(id.clone()).or_insert_with(|| Request {
            id,
            tokens,
            sent: prompt_sent,
            prompt_len,
            blocks: Vec::new(),
        });
    }

    pub fn contains(&self, id: &str) -> bool {
        self.requests.contains_key(id)
    }

    /// vLLM allocated `blocks` to `id` (its whole table).
    pub fn allocated(&mut self, id: &str, blocks: &[u32]) {
        if let Some(r) = self.requests.get_mut(id) {
            r.blocks.clear();
            r.blocks.extend_from_slice(blocks);
        }
    }

    pub fn forget(&mut self, id: &str) {
        self.requests.remove(id);
    }

    /// The step's input: each followed request vLLM scheduled, with the
    /// tokens it has that kvbm was not given and, where it changed, its
    /// block table. Requests kvbm does not follow are skipped. Errs only
    /// when the lists themselves are not what vLLM passes (a request's
    /// own unreadable input leaves that request out, in `refused`).
    pub fn step(&mut self, a: &StepArgs<'_, '_>) -> PyResult<StepInput> {
        let n = a.ids.len();
        if a.added.len() != n || a.computed.len() != n {
            return Err(PyTypeError::new_err(format!(
                "kvbm: the scheduled requests' lists differ in length: {n} ids, {} block lists, \
                 {} computed counts",
                a.added.len(),
                a.computed.len()
            )));
        }
        let mut input = StepInput::default();
        input.scheduled.reserve(n + a.new.len());
        for item in a.new.iter() {
            let (id, computed, blocks): (Bound<'_, PyString>, usize, Bound<'_, PyAny>) =
                item.extract().map_err(|e| {
                    PyTypeError::new_err(format!(
                        "kvbm: a new request is not (id, computed tokens, block ids): {e}"
                    ))
                })?;
            let table = first_group(&blocks).map(|b| Table::New(b.unwrap_or_default()));
            push(&mut input, self.read(a, &id, computed, table));
        }
        // Usually empty: then no request is looked up in it.
        let resumed = match a.resumed {
            Some(r) if !r.is_none() && r.len()? > 0 => Some(r),
            _ => None,
        };
        for i in 0..n {
            let id = a.ids.get_item(i)?;
            let id = id.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!("kvbm: scheduled request {i}'s id is not a string"))
            })?;
            let computed: usize = a.computed.get_item(i)?.extract().map_err(|e| {
                PyTypeError::new_err(format!(
                    "kvbm: scheduled request {i}'s computed tokens: {e}"
                ))
            })?;
            let added = a.added.get_item(i)?;
            let table = match resumed {
                // Resumed after preemption: what vLLM passes is the whole
                // table.
                Some(r) if r.contains(id)? => {
                    first_group(&added).map(|b| Table::Whole(b.unwrap_or_default()))
                }
                // Most decode steps add no block: nothing is rebuilt.
                _ if added.is_none() => Ok(Table::Unchanged),
                _ => first_group(&added).map(|more| match more {
                    Some(more) if !more.is_empty() => Table::Append(more),
                    _ => Table::Unchanged,
                }),
            };
            push(&mut input, self.read(a, id, computed, table));
        }
        Ok(input)
    }

    /// One request of the step. `Err(None)`: not followed.
    fn read(
        &mut self,
        a: &StepArgs<'_, '_>,
        id: &Bound<'_, PyString>,
        computed: usize,
        table: PyResult<Table>,
    ) -> Result<Scheduled, Option<String>> {
        let key = id.to_str().map_err(|e| Some(named(id, e)))?;
        let Some(r) = self.requests.get_mut(key) else {
            return Err(None); // a request kvbm never saw (added before the connector)
        };
        let fail = |e: PyErr| Some(named(id, e));
        let table = table.map_err(fail)?;
        let scheduled: usize = match a.num_scheduled.get_item(id).map_err(fail)? {
            Some(v) => v.extract().map_err(fail)?,
            None => 0,
        };
        let py = id.py();
        let (new_tokens, now) = read_from(r.tokens.bind(py), r.sent).map_err(fail)?;
        let block_ids = match table {
            Table::Unchanged => None,
            changed => {
                // vLLM's block state, when it offers one, has the whole
                // table (resolved on each call: asked only here).
                let state = match a.block_state.filter(|s| !s.is_none()) {
                    Some(s) => s
                        .call_method1(intern!(py, "get_block_ids"), (id,))
                        .and_then(|t| first_group(&t))
                        .map_err(fail)?,
                    None => None,
                };
                Some(changed.resolve(state, &r.blocks))
            }
        };
        r.sent = now;
        if let Some(t) = &block_ids {
            r.blocks.clone_from(t);
        }
        Ok(Scheduled {
            request: r.id.clone(),
            new_tokens,
            prompt_len: r.prompt_len,
            computed_before: computed,
            scheduled,
            block_ids,
        })
    }
}

/// How a request's block table changed this step.
enum Table {
    /// No block added (most decode steps).
    Unchanged,
    /// First scheduled, with vLLM's table for it.
    New(Vec<u32>),
    /// Resumed after preemption: the whole table.
    Whole(Vec<u32>),
    /// Blocks added to the end.
    Append(Vec<u32>),
}

impl Table {
    /// The table now: vLLM's block state's (`state`) where it has one,
    /// else what the change makes of the last one known (`last`).
    fn resolve(self, state: Option<Vec<u32>>, last: &[u32]) -> Vec<u32> {
        match self {
            Table::Unchanged => last.to_vec(),
            Table::New(given) => {
                // The table `update_state_after_alloc` gave, where vLLM's
                // block state has none; an empty one gives way to the new
                // request's own.
                let t = state.unwrap_or_else(|| last.to_vec());
                if t.is_empty() { given } else { t }
            }
            Table::Whole(whole) => state.unwrap_or(whole),
            Table::Append(more) => state.unwrap_or_else(|| {
                let mut t = Vec::with_capacity(last.len() + more.len());
                t.extend_from_slice(last);
                t.extend_from_slice(&more);
                t
            }),
        }
    }
}

fn push(input: &mut StepInput, read: Result<Scheduled, Option<String>>) {
    match read {
        Ok(s) => input.scheduled.push(s),
        Err(Some(why)) => input.refused.push(why),
        Err(None) => {}
    }
}

fn named(id: &Bound<'_, PyString>, e: PyErr) -> String {
    // The message alone: which exception Python made of it says nothing
    // here.
    let why = e.value(id.py()).to_string();
    format!("request {}: {why}", clip(&id.to_string_lossy()))
}

/// A request id as said in a message: at most 100 characters.
fn clip(id: &str) -> String {
    match id.char_indices().nth(100) {
        Some((at, _)) => format!("{}…", &id[..at]),
        None => id.to_string(),
    }
}

/// The tokens of `tokens` from `from` on, and how many have been read now
/// (never fewer than `from`: vLLM's list only grows, and were it to
/// shrink, tokens kvbm already has would not be given again).
fn read_from(tokens: &Bound<'_, PyAny>, from: usize) -> PyResult<(Vec<u32>, usize)> {
    // vLLM's list itself: its length and items without a method call.
    if let Ok(list) = tokens.cast::<PyList>() {
        let n = list.len();
        let mut out = Vec::with_capacity(n.saturating_sub(from));
        for i in from..n {
            out.push(token(&list.get_item(i)?, i)?);
        }
        return Ok((out, n.max(from)));
    }
    let n = tokens.len()?;
    let mut out = Vec::with_capacity(n.saturating_sub(from));
    for i in from..n {
        out.push(token(&tokens.get_item(i)?, i)?);
    }
    Ok((out, n.max(from)))
}

fn token(v: &Bound<'_, PyAny>, at: usize) -> PyResult<u32> {
    v.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "token {at} is {}, not a token id (0 to 4294967295)",
            clip(
                &v.repr()
                    .map(|r| r.to_string_lossy().into_owned())
                    .unwrap_or_default()
            )
        ))
    })
}

/// Group 0 of vLLM's per-group block lists (`None` passed through).
fn first_group(groups: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    if groups.is_none() {
        return Ok(None);
    }
    if groups.len()? == 0 {
        return Ok(Some(Vec::new()));
    }
    groups
        .get_item(0)?
        .extract::<Vec<u32>>()
        .map(Some)
        .map_err(|e| {
            let why = e.value(groups.py()).to_string();
            PyTypeError::new_err(format!("block ids are not lists of ids ({why})"))
        })
}
