//! Pictures of a simulated step: Chrome-trace JSON (a lane per device and
//! stream), the timeline as SVG in the style of DeepSeek's DualPipe figure
//! (F, B, BI, BW, overlapped F&B, comm, idle), and one self-contained HTML
//! report (timeline, memory over time per device, summary table; no network
//! fetches: everything is inline).

use super::{Simulation, SpanKind};
use std::fmt::Write as _;

/// Lanes drawn at most; a larger plan shows its first devices and says so.
pub const MAX_LANES: usize = 64;

fn color(k: SpanKind) -> &'static str {
    match k {
        SpanKind::F => "#f6b26b",
        SpanKind::B => "#93c47d",
        SpanKind::BI => "#b6d7a8",
        SpanKind::BW => "#6fa8dc",
        SpanKind::R => "#e06666",
        SpanKind::Update => "#b7b7b7",
        SpanKind::Comm => "#ffe599",
    }
}

fn kind_name(k: SpanKind) -> &'static str {
    match k {
        SpanKind::F => "F",
        SpanKind::B => "B",
        SpanKind::BI => "BI",
        SpanKind::BW => "BW",
        SpanKind::R => "R",
        SpanKind::Update => "update",
        SpanKind::Comm => "comm",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Seconds in a readable unit.
pub fn human_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} KB", b / 1e3)
    }
}

/// Chrome-trace JSON: a process per device, a thread per stream, one
/// complete event per op (microseconds).
pub fn chrome_trace(sim: &Simulation) -> String {
    let mut events = Vec::with_capacity(sim.spans.len() + 2 * sim.devices.len());
    for (d, _) in sim.devices.iter().enumerate() {
        events.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": d, "args": {"name": format!("device {d}")}}));
        for (si, s) in sim.streams.iter().enumerate() {
            events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": d, "tid": si, "args": {"name": s}}));
        }
    }
    for s in &sim.spans {
        events.push(serde_json::json!({
            "ph": "X",
            "name": s.label.to_string(),
            "cat": kind_name(s.kind),
            "pid": s.device,
            "tid": s.stream,
            "ts": s.start * 1e6,
            "dur": (s.end - s.start) * 1e6,
        }));
    }
    serde_json::to_string(&serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}))
        .expect("json")
}

/// The legend, as SVG elements at (x, y).
fn legend(out: &mut String, x: f64, y: f64) {
    let items = [
        (Some(SpanKind::F), "F"),
        (Some(SpanKind::B), "B"),
        (Some(SpanKind::BI), "BI"),
        (Some(SpanKind::BW), "BW (W)"),
        (Some(SpanKind::R), "R (recompute)"),
        (None, "overlapped F&B"),
        (Some(SpanKind::Update), "update"),
        (Some(SpanKind::Comm), "comm"),
    ];
    let mut cx = x;
    for (k, name) in items {
        let fill = match k {
            Some(k) => color(k).to_string(),
            None => "url(#fb)".to_string(),
        };
        let _ = write!(
            out,
            r##"<rect x="{cx}" y="{y}" width="14" height="14" fill="{fill}" stroke="#444" stroke-width="0.5"/><text x="{}" y="{}" font-size="12">{}</text>"##,
            cx + 18.0,
            y + 11.0,
            esc(name)
        );
        cx += 30.0 + 7.5 * name.len() as f64;
    }
    let _ = write!(
        out,
        r##"<rect x="{cx}" y="{y}" width="14" height="14" fill="#ffffff" stroke="#444" stroke-width="0.5"/><text x="{}" y="{}" font-size="12">idle</text>"##,
        cx + 18.0,
        y + 11.0
    );
}

/// The timeline: a lane per device (computation), a thin band beneath it
/// (communication); `title` above.
pub fn timeline_svg(sim: &Simulation, title: &str) -> String {
    timeline_svg_on(sim, title, sim.step_time)
}

/// [`timeline_svg`] on a time axis `axis` seconds wide (≥ the step time),
/// so timelines drawn one under another share their scale.
pub fn timeline_svg_on(sim: &Simulation, title: &str, axis: f64) -> String {
    let axis = axis.max(sim.step_time);
    let lanes = sim.devices.len().min(MAX_LANES);
    let (left, top, width, lane_h, comm_h, gap) = (80.0, 50.0, 1100.0, 22.0, 6.0, 6.0);
    let row = lane_h + comm_h + gap;
    let height = top + row * lanes as f64 + 40.0;
    let scale = if axis > 0.0 { width / axis } else { 0.0 };
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" class="timeline">"#,
        left + width + 20.0
    );
    out.push_str(r##"<defs><pattern id="fb" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="3" height="6" fill="#f6b26b"/><rect x="3" width="3" height="6" fill="#93c47d"/></pattern></defs>"##);
    let _ = write!(
        out,
        r#"<text x="{left}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    legend(&mut out, left, 26.0);
    // Spans per device, compute first.
    let mut by_dev: Vec<Vec<&super::Span>> = vec![Vec::new(); lanes];
    for s in &sim.spans {
        if (s.device as usize) < lanes && s.end > s.start {
            by_dev[s.device as usize].push(s);
        }
    }
    let geo = Lanes {
        left,
        top,
        width,
        lane_h,
        comm_h,
        row,
        scale,
    };
    for (d, spans) in by_dev.iter().enumerate() {
        lane_svg(&mut out, sim, d, spans, &geo);
    }
    let y = top + row * lanes as f64 + 16.0;
    let mut note = format!(
        "step {} · bubble {:.1}%",
        human_time(sim.step_time),
        sim.bubble * 100.0
    );
    if sim.devices.len() > lanes {
        let _ = write!(
            note,
            " · first {lanes} of {} devices shown",
            sim.devices.len()
        );
    }
    let _ = write!(
        out,
        r#"<text x="{left}" y="{y}" font-size="12">{}</text></svg>"#,
        esc(&note)
    );
    out
}

/// Where the timeline's lanes are drawn: the plot's left edge, top and
/// width, a lane's compute and communication heights, a row's height (lane,
/// communication strip and gap), and pixels per second.
struct Lanes {
    left: f64,
    top: f64,
    width: f64,
    lane_h: f64,
    comm_h: f64,
    row: f64,
    scale: f64,
}

/// Device `d`'s lane: its compute spans (overlapped F&B hatched, the
/// microbatch written where it fits), its communication strip below.
fn lane_svg(out: &mut String, sim: &Simulation, d: usize, spans: &[&super::Span], g: &Lanes) {
    let (left, width, lane_h, comm_h, scale) = (g.left, g.width, g.lane_h, g.comm_h, g.scale);
    let y = g.top + g.row * d as f64;
    let _ = write!(
        out,
        r##"<g class="lane" data-device="{d}"><text x="{}" y="{}" font-size="12" text-anchor="end">device {d}</text><rect x="{left}" y="{y}" width="{width}" height="{lane_h}" fill="#ffffff" stroke="#999" stroke-width="0.5"/>"##,
        left - 6.0,
        y + 15.0
    );
    let mut compute: Vec<&super::Span> = spans
        .iter()
        .copied()
        .filter(|s| s.kind.is_compute())
        .collect();
    compute.sort_by(|a, b| a.start.total_cmp(&b.start));
    let overlapped = overlapped_fb(&compute);
    for (s, &overlapped) in compute.iter().zip(&overlapped) {
        let x = left + s.start * scale;
        let w = ((s.end - s.start) * scale).max(0.5);
        let fill = if overlapped {
            "url(#fb)".to_string()
        } else {
            color(s.kind).to_string()
        };
        let _ = write!(
            out,
            r##"<rect x="{x:.2}" y="{y}" width="{w:.2}" height="{lane_h}" fill="{fill}" stroke="#333" stroke-width="0.3"><title>{}</title></rect>"##,
            esc(&format!(
                "{} {}–{}",
                s.label,
                human_time(s.start),
                human_time(s.end)
            ))
        );
        if w > 16.0 {
            let mb = s
                .label
                .microbatch
                .map(|m| m.to_string())
                .unwrap_or_default();
            let _ = write!(
                out,
                r#"<text x="{:.2}" y="{}" font-size="10" text-anchor="middle">{}</text>"#,
                x + w / 2.0,
                y + 15.0,
                mb
            );
        }
    }
    for s in spans.iter().filter(|s| !s.kind.is_compute()) {
        let x = left + s.start * scale;
        let w = ((s.end - s.start) * scale).max(0.5);
        let _ = write!(
            out,
            r##"<rect x="{x:.2}" y="{}" width="{w:.2}" height="{comm_h}" fill="{}"><title>{}</title></rect>"##,
            y + lane_h,
            color(SpanKind::Comm),
            esc(&format!(
                "{} [{}] {}–{}",
                s.label,
                sim.streams[s.stream as usize],
                human_time(s.start),
                human_time(s.end)
            ))
        );
    }
    out.push_str("</g>");
}

/// Overlapped F&B: which compute spans (sorted by start) run a forward and
/// a backward at once. Span j overlaps span i (j > i) exactly while j
/// starts before i ends, so the scan stops at the first that does not.
fn overlapped_fb(compute: &[&super::Span]) -> Vec<bool> {
    let mut overlapped = vec![false; compute.len()];
    for i in 0..compute.len() {
        for j in i + 1..compute.len() {
            if compute[j].start >= compute[i].end {
                break;
            }
            if matches!(
                (compute[i].kind, compute[j].kind),
                (SpanKind::F, SpanKind::B | SpanKind::BI)
                    | (SpanKind::B | SpanKind::BI, SpanKind::F)
            ) {
                overlapped[i] = true;
                overlapped[j] = true;
            }
        }
    }
    overlapped
}

/// Bytes in use over time, one line per device (up to 8), model states included.
fn memory_svg(sim: &Simulation, capacity: Option<f64>, axis: f64) -> String {
    let axis = axis.max(sim.step_time);
    let (left, top, width, height) = (80.0, 20.0, 1100.0, 220.0);
    let shown = sim.devices.len().min(8);
    let max = sim.devices[..shown]
        .iter()
        .map(|d| d.peak_bytes as f64)
        .fold(1.0, f64::max)
        .max(
            capacity.unwrap_or(0.0).min(
                4.0 * sim
                    .devices
                    .iter()
                    .map(|d| d.peak_bytes as f64)
                    .fold(1.0, f64::max),
            ),
        );
    let sx = if axis > 0.0 { width / axis } else { 0.0 };
    let sy = height / max;
    let palette = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    ];
    let mut out = String::new();
    let _ = write!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" class="memory"><rect x="{left}" y="{top}" width="{width}" height="{height}" fill="#fafafa" stroke="#999"/>"##,
        left + width + 160.0,
        top + height + 30.0
    );
    if let Some(c) = capacity {
        if c <= max {
            let y = top + height - c * sy;
            let _ = write!(
                out,
                r##"<line x1="{left}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#c00" stroke-dasharray="4 3"/><text x="{}" y="{:.1}" font-size="11" fill="#c00">device memory</text>"##,
                left + width,
                left + width + 6.0,
                y + 4.0
            );
        }
    }
    for (d, dev) in sim.devices[..shown].iter().enumerate() {
        let mut pts = String::new();
        let mut prev = dev.memory.first().map_or(0.0, |m| m.1 as f64);
        for &(t, b) in &dev.memory {
            let x = left + t * sx;
            let _ = write!(pts, "{x:.1},{:.1} ", top + height - prev * sy);
            let _ = write!(pts, "{x:.1},{:.1} ", top + height - b as f64 * sy);
            prev = b as f64;
        }
        let _ = write!(pts, "{:.1},{:.1}", left + width, top + height - prev * sy);
        let c = palette[d % palette.len()];
        let _ = write!(
            out,
            r#"<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"/><text x="{}" y="{}" font-size="11" fill="{c}">device {d}: peak {}</text>"#,
            left + width + 6.0,
            top + 14.0 + 14.0 * d as f64 + if capacity.is_some() { 14.0 } else { 0.0 },
            human_bytes(dev.peak_bytes)
        );
    }
    let _ = write!(
        out,
        r#"<text x="{left}" y="{}" font-size="11">0</text><text x="{}" y="{}" font-size="11" text-anchor="end">{}</text><text x="4" y="{}" font-size="11">{}</text></svg>"#,
        top + height + 14.0,
        left + width,
        top + height + 14.0,
        human_time(axis),
        top + 10.0,
        human_bytes(max as u64)
    );
    out
}

/// "yes", "no" or "-" (no capacity known): whether `peak` bytes fit.
fn fits(peak: u64, capacity: Option<f64>) -> String {
    match capacity {
        Some(c) if peak as f64 > c => "no".into(),
        Some(_) => "yes".into(),
        None => "-".into(),
    }
}

/// The summary table rows: device, busy, idle, exposed comm, peak memory, fits.
pub fn summary_rows(sim: &Simulation, capacity: Option<f64>) -> Vec<[String; 6]> {
    sim.devices
        .iter()
        .enumerate()
        .map(|(d, s)| {
            let exposed: f64 = s.exposed_comm.values().sum();
            let detail: Vec<String> = s
                .exposed_comm
                .iter()
                .filter(|(_, v)| **v > 0.0)
                .map(|(k, v)| format!("{k} {}", human_time(*v)))
                .collect();
            [
                d.to_string(),
                human_time(s.busy),
                format!(
                    "{} ({:.1}%)",
                    human_time(s.idle),
                    100.0 * s.idle / sim.step_time.max(f64::MIN_POSITIVE)
                ),
                if detail.is_empty() {
                    human_time(exposed)
                } else {
                    format!("{} ({})", human_time(exposed), detail.join(", "))
                },
                human_bytes(s.peak_bytes),
                // A device with nothing to do is not a fit: the plan
                // leaves it idle (the compiler refuses such plans).
                if s.busy > 0.0 {
                    fits(s.peak_bytes, capacity)
                } else {
                    "idle".into()
                },
            ]
        })
        .collect()
}

/// One timeline of a report (a candidate strategy, a measured or a
/// simulated step): a title and its figures.
pub struct Section<'a> {
    pub title: String,
    pub sim: &'a Simulation,
    /// Device memory of the cluster, bytes (for "fits").
    pub capacity: Option<f64>,
    /// Where the times come from, shown under the title
    /// (`simulated on h100-8x`, `measured: step 7 of 20`).
    pub source: String,
}

/// One section in a row: title, step time, bubble, the largest exposed
/// communication of a device, the largest peak memory of a device, fits.
pub fn compare_row(s: &Section) -> [String; 6] {
    let exposed = s
        .sim
        .devices
        .iter()
        .map(|d| d.exposed_comm.values().sum::<f64>())
        .fold(0.0, f64::max);
    let peak = s
        .sim
        .devices
        .iter()
        .map(|d| d.peak_bytes)
        .max()
        .unwrap_or(0);
    [
        s.title.clone(),
        human_time(s.sim.step_time),
        format!("{:.1}%", s.sim.bubble * 100.0),
        human_time(exposed),
        human_bytes(peak),
        fits(peak, s.capacity),
    ]
}

/// A self-contained HTML page: with several sections a comparison table
/// first, then for each section the timeline, the memory chart and the
/// summary table, every timeline on one time axis. Inline SVG and CSS only.
pub fn html(title: &str, sections: &[Section]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<!DOCTYPE html><html><head><meta charset="utf-8"><title>{}</title><style>body{{font-family:sans-serif;margin:20px;color:#222}}table{{border-collapse:collapse;margin:8px 0 24px}}td,th{{border:1px solid #bbb;padding:3px 8px;font-size:13px;text-align:right}}th{{background:#eee}}h2{{margin-top:28px}}</style></head><body><h1>{}</h1>"#,
        esc(title),
        esc(title)
    );
    let axis = sections.iter().map(|s| s.sim.step_time).fold(0.0, f64::max);
    if sections.len() > 1 {
        out.push_str("<h2>Comparison</h2><table class=\"compare\"><tr><th>candidate</th><th>step time</th><th>bubble</th><th>exposed comm (worst device)</th><th>peak memory (worst device)</th><th>fits</th></tr>");
        for s in sections {
            out.push_str("<tr>");
            for c in compare_row(s) {
                let _ = write!(out, "<td>{}</td>", esc(&c));
            }
            out.push_str("</tr>");
        }
        out.push_str("</table>");
    }
    for s in sections {
        let _ = write!(out, "<h2>{}</h2>", esc(&s.title));
        let _ = write!(
            out,
            "<p>{} · step time <b>{}</b> · bubble <b>{:.1}%</b> · {} ops</p>",
            esc(&s.source),
            human_time(s.sim.step_time),
            s.sim.bubble * 100.0,
            s.sim.ops
        );
        out.push_str(&timeline_svg_on(s.sim, &s.title, axis));
        out.push_str("<h3>Memory over time</h3>");
        out.push_str(&memory_svg(s.sim, s.capacity, axis));
        out.push_str("<h3>Summary</h3><table><tr><th>device</th><th>busy</th><th>idle</th><th>exposed comm</th><th>peak memory</th><th>fits</th></tr>");
        for r in summary_rows(s.sim, s.capacity) {
            out.push_str("<tr>");
            for c in r {
                let _ = write!(out, "<td>{}</td>", esc(&c));
            }
            out.push_str("</tr>");
        }
        out.push_str("</table>");
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::super::{DeviceSummary, Label, Simulation, Span, SpanKind};
    use super::timeline_svg;
    use crate::compile::plan::OpKind;

    fn span(kind: SpanKind, op: OpKind, stream: u16, start: f64, end: f64) -> Span {
        Span {
            device: 0,
            stream,
            kind,
            label: Label {
                op,
                microbatch: Some(0),
                segment: None,
                peer: None,
            },
            start,
            end,
        }
    }

    #[test]
    fn only_a_forward_and_a_backward_at_once_are_drawn_as_overlapped() {
        let sim = |spans: Vec<Span>| Simulation {
            step_time: 10.0,
            devices: vec![DeviceSummary::default()],
            spans,
            streams: vec!["compute".into(), "compute2".into()],
            bubble: 0.0,
            ops: 3,
        };
        // The legend draws the pattern once.
        let count = |s: &Simulation| timeline_svg(s, "t").matches("url(#fb)").count() - 1;
        let apart = sim(vec![
            span(SpanKind::F, OpKind::F, 0, 0.0, 2.0),
            span(SpanKind::B, OpKind::B, 0, 2.0, 4.0),
        ]);
        assert_eq!(count(&apart), 0);
        // A long B overlapping two later Fs (not adjacent in start order).
        let at_once = sim(vec![
            span(SpanKind::B, OpKind::B, 1, 0.0, 9.0),
            span(SpanKind::F, OpKind::F, 0, 1.0, 2.0),
            span(SpanKind::F, OpKind::F, 0, 5.0, 6.0),
        ]);
        assert_eq!(count(&at_once), 3);
        // Two forwards at once are not an F&B pair.
        let two_f = sim(vec![
            span(SpanKind::F, OpKind::F, 0, 0.0, 2.0),
            span(SpanKind::F, OpKind::F, 1, 1.0, 3.0),
        ]);
        assert_eq!(count(&two_f), 0);
    }
}
