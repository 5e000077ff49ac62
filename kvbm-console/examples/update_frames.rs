//! Rewrites the golden frames of `tests/views.rs` (`tests/frames/*.txt`)
//! from the current code, and says which changed:
//!
//! ```sh
//! cargo run -p kvbm-console --example update_frames
//! ```
//!
//! This is the only way the goldens are written: the test compares and
//! never writes. Review the diff before committing it; the test's content
//! assertions, which do not come from these files, still have to pass.

#[path = "../tests/support/mod.rs"]
mod support;

fn main() -> std::io::Result<()> {
    let mut app = support::replay_app("cpu-offload-walkthrough");
    let walkthrough = support::walkthrough_frames(&mut app)
        .into_iter()
        .map(|(name, lines)| (name.to_string(), lines));
    let mut changed = 0;
    for (name, lines) in walkthrough.chain(support::preemption_frames()) {
        let path = support::golden_path(&name);
        let text = support::golden_text(&lines);
        let old = std::fs::read_to_string(&path).ok();
        if old.as_deref() == Some(text.as_str()) {
            println!("unchanged {}", path.display());
            continue;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, &text)?;
        changed += 1;
        println!(
            "{} {}",
            if old.is_some() { "rewrote" } else { "wrote" },
            path.display()
        );
    }
    println!("{changed} golden frame(s) written");
    Ok(())
}
