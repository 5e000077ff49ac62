//! The terminal and the event loop.
//!
//! [`Term`] puts the terminal in raw mode on the alternate screen with
//! mouse capture, and restores it when dropped, on panic (a hook restores
//! it before the panic message prints) and on Ctrl-C (a key in raw mode, and
//! SIGINT too). [`run`] is a `tokio::select!` over terminal input, the event
//! source and a render tick.

use crate::app::App;
use anyhow::Result;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::event::{
    self, DisableMouseCapture, EnableMouseCapture, Event as TermEvent,
};
use ratatui::crossterm::execute;
use ratatui::crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use std::io::{Stdout, stdout};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

fn restore() {
    let _ = disable_raw_mode();
    let _ = execute!(
        stdout(),
        DisableMouseCapture,
        LeaveAlternateScreen,
        ratatui::crossterm::cursor::Show
    );
}

/// The terminal in console mode; restored on drop.
pub struct Term {
    /// The ratatui terminal.
    pub terminal: Terminal<CrosstermBackend<Stdout>>,
}

impl Term {
    /// Enters raw mode, the alternate screen and mouse capture, and
    /// installs the panic hook that leaves them.
    pub fn enter() -> Result<Self> {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
        // Without a terminal (output piped, run from a script or CI) the
        // OS's words alone ("No such device or address") say nothing.
        enable_raw_mode().map_err(|e| {
            anyhow::anyhow!(
                "the console needs a terminal to draw on ({e}); run it in one (in CI: under \
                 tmux or script); `kvbm-console walkthrough` prints text"
            )
        })?;
        execute!(stdout(), EnterAlternateScreen, EnableMouseCapture)?;
        let terminal = Terminal::new(CrosstermBackend::new(stdout()))?;
        Ok(Term { terminal })
    }
}

impl Drop for Term {
    fn drop(&mut self) {
        restore();
    }
}

/// How often the screen is redrawn.
pub const RENDER_EVERY: Duration = Duration::from_millis(100);

/// How often the source is read.
pub const PULL_EVERY: Duration = Duration::from_millis(25);

/// Terminal input read on a thread: crossterm's reader blocks, and a
/// bounded channel carries what it read (the reader waits when the loop is
/// behind, so no key is lost and nothing grows).
fn spawn_input(stop: Arc<AtomicBool>) -> mpsc::Receiver<TermEvent> {
    let (tx, rx) = mpsc::channel(256);
    std::thread::Builder::new()
        .name("kvbm-console-input".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match event::poll(Duration::from_millis(50)) {
                    Ok(true) => match event::read() {
                        Ok(ev) => {
                            if tx.blocking_send(ev).is_err() {
                                break;
                            }
                        }
                        Err(_) => break,
                    },
                    Ok(false) => {}
                    Err(_) => break,
                }
            }
        })
        .ok();
    rx
}

/// What the loop drives: the single-engine [`App`], or the fleet console.
pub trait Screen {
    /// One key.
    fn key(&mut self, ev: ratatui::crossterm::event::KeyEvent);
    /// The mouse.
    fn mouse(&mut self, ev: ratatui::crossterm::event::MouseEvent);
    /// The terminal's new size.
    fn resize(&mut self, width: u16, height: u16);
    /// New events from the source.
    fn pull(&mut self, now: Instant) -> usize;
    /// The periodic step before drawing.
    fn tick(&mut self);
    /// Draws (changes nothing).
    fn render(&self, f: &mut ratatui::Frame);
    /// Whether it wants to exit.
    fn quitting(&self) -> bool;
    /// Asks it to exit (Ctrl-C).
    fn quit(&mut self);
}

impl Screen for App {
    fn key(&mut self, ev: ratatui::crossterm::event::KeyEvent) {
        App::key(self, ev)
    }
    fn mouse(&mut self, ev: ratatui::crossterm::event::MouseEvent) {
        App::mouse(self, ev)
    }
    fn resize(&mut self, width: u16, height: u16) {
        App::resize(self, width, height)
    }
    fn pull(&mut self, now: Instant) -> usize {
        App::pull(self, now)
    }
    fn tick(&mut self) {
        App::tick(self)
    }
    fn render(&self, f: &mut ratatui::Frame) {
        App::render(self, f)
    }
    fn quitting(&self) -> bool {
        self.quit
    }
    fn quit(&mut self) {
        self.quit = true;
    }
}

/// Runs the console until the user quits. `on_tick` runs after each pull
/// (the caller's chance to notice, say, that its engine finished).
pub async fn run<S: Screen>(
    app: &mut S,
    term: &mut Term,
    mut on_tick: impl FnMut(&mut S),
) -> Result<()> {
    // Applied here to whatever the screen drew, so the fleet console and
    // an engine drilled into from it honour it as the single console does.
    let no_color = no_color_requested();
    let stop = Arc::new(AtomicBool::new(false));
    let mut input = spawn_input(stop.clone());
    let size = term.terminal.size()?;
    app.resize(size.width, size.height);
    let mut render = tokio::time::interval(RENDER_EVERY);
    render.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut pull = tokio::time::interval(PULL_EVERY);
    pull.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let result = loop {
        let mut redraw = false;
        tokio::select! {
            ev = input.recv() => match ev {
                Some(TermEvent::Key(k)) => { app.key(k); redraw = true; }
                Some(TermEvent::Mouse(m)) => { app.mouse(m); redraw = true; }
                Some(TermEvent::Resize(w, h)) => { app.resize(w, h); redraw = true; }
                Some(_) => {}
                None => break Ok(()),
            },
            _ = pull.tick() => {
                app.pull(Instant::now());
                on_tick(app);
            }
            _ = render.tick() => {
                app.tick();
                redraw = true;
            }
            _ = &mut ctrl_c => { app.quit(); }
        }
        if app.quitting() {
            break Ok(());
        }
        let draw = |f: &mut ratatui::Frame| {
            app.render(f);
            if no_color {
                crate::ui::strip_colors(f.buffer_mut());
            }
        };
        if redraw && let Err(e) = term.terminal.draw(draw) {
            break Err(e.into());
        }
    };
    stop.store(true, Ordering::Relaxed);
    result
}

/// True when the `NO_COLOR` environment variable is set to anything but
/// the empty string (<https://no-color.org>).
pub fn no_color_requested() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}
