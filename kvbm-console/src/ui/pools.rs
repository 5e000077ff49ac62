//! The pools view: per tier, a gauge of active / inactive / free blocks,
//! hit rate, evictions per second, and sparklines of the last minutes.

use super::panel;
use crate::app::App;
use crate::fmt;
use kvbm_events::tier::Tier;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Sparkline};

/// Draws one stacked bar: active, inactive, free.
fn gauge(width: usize, capacity: u32, active: u32, inactive: u32) -> Line<'static> {
    if capacity == 0 || width == 0 {
        return Line::from(Span::styled(
            "no capacity",
            Style::new().fg(Color::DarkGray),
        ));
    }
    let cells = |n: u32| ((n as f64 / capacity as f64) * width as f64).round() as usize;
    let a = cells(active).min(width);
    let i = cells(inactive).min(width - a);
    Line::from(vec![
        Span::styled("█".repeat(a), Style::new().fg(Color::Green)),
        Span::styled("▓".repeat(i), Style::new().fg(Color::Yellow)),
        Span::styled("░".repeat(width - a - i), Style::new().fg(Color::DarkGray)),
    ])
}

/// Draws the view.
pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let st = app.model.state();
    let rows = Layout::vertical([Constraint::Ratio(1, 3); 3]).split(area);
    for (tier, r) in Tier::ALL.into_iter().zip(rows.iter()) {
        let p = st.pool(tier);
        let evps = app.model.evictions_per_s(tier);
        let title = format!(
            "{} {} — {} blocks",
            tier.short_name(),
            match tier {
                Tier::Device => "device",
                Tier::Host => "host",
                Tier::Disk => "disk",
            },
            fmt::count(u64::from(p.capacity))
        );
        let block = panel(title);
        let inner = block.inner(*r);
        f.render_widget(block, *r);
        if p.capacity == 0 && p.gauge_ns.is_none() {
            f.render_widget(
                Paragraph::new(Span::styled(
                    "  no gauge seen (tier disabled or not reported)",
                    Style::new().fg(Color::DarkGray),
                )),
                inner,
            );
            continue;
        }
        let [left, right] =
            Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                .areas(inner);
        let lines = vec![
            gauge(
                left.width.saturating_sub(1) as usize,
                p.capacity,
                p.active,
                p.inactive,
            ),
            Line::from(vec![
                Span::styled("█ active ", Style::new().fg(Color::Green)),
                Span::raw(format!("{}  ", p.active)),
                Span::styled("▓ inactive ", Style::new().fg(Color::Yellow)),
                Span::raw(format!("{}  ", p.inactive)),
                Span::styled("░ free ", Style::new().fg(Color::DarkGray)),
                Span::raw(p.empty.to_string()),
            ]),
            Line::from(format!(
                "hit rate {} ({} of {} blocks looked up, {} lookups)",
                fmt::pct(p.hit_blocks, p.looked_up_blocks),
                fmt::count(p.hit_blocks),
                fmt::count(p.looked_up_blocks),
                fmt::count(p.lookups)
            )),
            Line::from(format!(
                "evictions {}/s ({} total) · registered {} ({} duplicates)",
                evps,
                fmt::count(p.evictions),
                fmt::count(p.registrations),
                fmt::count(p.duplicate_registrations)
            )),
        ];
        f.render_widget(Paragraph::new(lines), left);
        let samples = app.model.samples();
        let width = right.width as usize;
        let take = samples.len().saturating_sub(width);
        let active: Vec<u64> = samples
            .iter()
            .skip(take)
            .map(|s| u64::from(s.active[tier.index()]))
            .collect();
        let evict: Vec<u64> = samples
            .iter()
            .skip(take)
            .map(|s| s.evictions[tier.index()])
            .collect();
        let [la, sa, lb, sb] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Fill(1),
            Constraint::Length(1),
            Constraint::Fill(1),
        ])
        .areas(right);
        let label =
            |text: String| Paragraph::new(Span::styled(text, Style::new().fg(Color::DarkGray)));
        f.render_widget(label(format!("active blocks, last {} s", active.len())), la);
        f.render_widget(
            label(format!("evictions per second, last {} s", evict.len())),
            lb,
        );
        let max_active = u64::from(p.capacity).max(1);
        f.render_widget(
            Sparkline::default()
                .data(&active)
                .max(max_active)
                .style(Style::new().fg(Color::Green)),
            sa,
        );
        f.render_widget(
            Sparkline::default()
                .data(&evict)
                .style(Style::new().fg(Color::Yellow)),
            sb,
        );
    }
}
