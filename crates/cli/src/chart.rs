//! PNG charts for reports (`hybridcache analyze --report-dir`, `hybridcache bench`).
//!
//! A thin layer over plotters with one look for every chart the product draws: white background,
//! title, axis labels (callers put the unit in the label, e.g. "time (s)"), a legend when there is
//! more than one series, and compact tick labels (1.5k, 2M). The font is embedded (DejaVu Sans,
//! rendered by plotters' ab_glyph backend), so drawing needs no system font libraries and looks
//! the same on every machine.
//!
//! Inputs that cannot be drawn as given are handled rather than rejected: an empty chart gets an
//! axis frame and a "no data" note, a single point or a flat series gets a padded range, and on a
//! log axis the points that are not positive are left out (a log axis cannot show them).

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// DejaVu Sans (Debian's fonts-dejavu-core; free license, see the DejaVu fonts' LICENSE).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
/// The family name the embedded font is registered under; every text style below uses it.
const FAMILY: &str = "hybridcache-sans";

/// Pixel size of every chart: wide enough for a time axis, small enough to embed in Markdown.
const SIZE: (u32, u32) = (1024, 600);

/// One line of a line chart.
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart: one or more series over shared axes.
#[derive(Debug, Clone, Copy)]
pub struct LineChart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: &'a [Series],
    pub log_x: bool,
    pub log_y: bool,
}

/// Registers the embedded font once per process. plotters keeps fonts in a global table, and
/// registering from several threads at once (tests run in parallel) is safe through the OnceLock.
fn font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded chart font could not be loaded"))
    }
}

/// Colours for the series, chosen to stay distinguishable in print and for the common forms of
/// colour blindness (Okabe-Ito palette).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Compact tick label: 1.5k, 20M, 0.25; integers without a decimal point.
pub fn format_tick(v: f64) -> String {
    if !v.is_finite() {
        return String::new();
    }
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e12 {
        (v / 1e12, "T")
    } else if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = if scaled == scaled.round() || scaled.abs() >= 100.0 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 10.0 {
        format!("{scaled:.1}")
    } else if scaled.abs() >= 0.01 || scaled == 0.0 {
        format!("{scaled:.2}")
    } else {
        format!("{scaled:.1e}")
    };
    // "1.50" reads better as "1.5"; only trim a fractional part, never an integer's zeros.
    let s = if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s}{suffix}")
}

/// The data range of one axis, padded so a single value or a flat line still gets a visible
/// range, and (for a log axis) kept strictly positive.
fn axis_range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let mut lo = f64::INFINITY;
    let mut hi = f64::NEG_INFINITY;
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() || !hi.is_finite() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        if hi / lo < 1.5 {
            // A log axis over less than a factor of 1.5 would show no decade ticks at all.
            return (lo / 2.0, hi * 2.0);
        }
        return (lo, hi);
    }
    // Anchor linear axes at zero when all data are on one side of it: rates, shares and depths
    // read wrong when the axis starts at an arbitrary value.
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi < 0.0 {
        hi = 0.0;
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = if hi == 0.0 { 1.0 } else { hi.abs() * 0.5 };
        return (lo - if lo < 0.0 { pad } else { 0.0 }, hi + pad);
    }
    // A little headroom so the top line does not sit on the frame.
    (lo, hi + (hi - lo) * 0.05)
}

/// Writes a line chart as a PNG at `path`.
pub fn line_chart(path: &Path, chart: &LineChart) -> Result<()> {
    font()?;
    // Points a log axis cannot show are dropped here, once, so ranges and drawing agree.
    let usable = |&(x, y): &(f64, f64)| {
        x.is_finite() && y.is_finite() && (!chart.log_x || x > 0.0) && (!chart.log_y || y > 0.0)
    };
    let series: Vec<(String, Vec<(f64, f64)>)> = chart
        .series
        .iter()
        .map(|s| {
            (
                s.label.clone(),
                s.points.iter().copied().filter(usable).collect(),
            )
        })
        .collect();
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.1.iter().map(|p| p.1));
    let (x0, x1) = axis_range(xs, chart.log_x);
    let (y0, y1) = axis_range(ys, chart.log_y);
    let data = Lines {
        chart,
        series: &series,
    };
    // The coordinate types differ between linear and log axes, so each combination is its own
    // monomorphisation of the same drawing code.
    match (chart.log_x, chart.log_y) {
        (false, false) => data.draw(path, x0..x1, y0..y1),
        (true, false) => data.draw(path, (x0..x1).log_scale(), y0..y1),
        (false, true) => data.draw(path, x0..x1, (y0..y1).log_scale()),
        (true, true) => data.draw(path, (x0..x1).log_scale(), (y0..y1).log_scale()),
    }
    .with_context(|| format!("cannot write chart {}", path.display()))
}

struct Lines<'a> {
    chart: &'a LineChart<'a>,
    series: &'a [(String, Vec<(f64, f64)>)],
}

impl Lines<'_> {
    fn draw<X, Y>(&self, path: &Path, x: X, y: Y) -> Result<()>
    where
        X: AsRangedCoord<Value = f64>,
        Y: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut ctx = ChartBuilder::on(&root)
            .caption(self.chart.title, (FAMILY, 26))
            .margin(16)
            .x_label_area_size(52)
            .y_label_area_size(80)
            .build_cartesian_2d(x, y)
            .map_err(plot_err)?;
        ctx.configure_mesh()
            .x_desc(self.chart.x_label)
            .y_desc(self.chart.y_label)
            .axis_desc_style((FAMILY, 18))
            .label_style((FAMILY, 15))
            .x_label_formatter(&|v| format_tick(*v))
            .y_label_formatter(&|v| format_tick(*v))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(plot_err)?;
        let mut any = false;
        for (i, (label, points)) in self.series.iter().enumerate() {
            if points.is_empty() {
                continue;
            }
            any = true;
            let c = color(i);
            let style = c.stroke_width(2);
            let drawn = ctx
                .draw_series(LineSeries::new(points.iter().copied(), style))
                .map_err(plot_err)?;
            if !label.is_empty() {
                drawn
                    .label(label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
            }
            // A line needs two points; mark a lone point so it is visible at all.
            if points.len() == 1 {
                ctx.draw_series(points.iter().map(|&p| Circle::new(p, 4, c.filled())))
                    .map_err(plot_err)?;
            }
        }
        let labelled = self
            .series
            .iter()
            .filter(|(l, p)| !l.is_empty() && !p.is_empty())
            .count();
        if labelled > 1 || (labelled == 1 && self.series.len() == 1) {
            ctx.configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .label_font((FAMILY, 15))
                .draw()
                .map_err(plot_err)?;
        }
        if !any {
            no_data(&root)?;
        }
        root.present().map_err(plot_err)?;
        Ok(())
    }
}

/// Writes a bar chart (one bar per labelled value, in the given order) as a PNG at `path`.
pub fn bar_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    bars: &[(String, f64)],
) -> Result<()> {
    font()?;
    draw_bars(path, title, x_label, y_label, bars)
        .with_context(|| format!("cannot write chart {}", path.display()))
}

fn draw_bars(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    bars: &[(String, f64)],
) -> Result<()> {
    let values: Vec<f64> = bars
        .iter()
        .map(|b| if b.1.is_finite() { b.1 } else { 0.0 })
        .collect();
    let (y0, y1) = axis_range(values.iter().copied(), false);
    // Leave room above the tallest bar for its value label.
    let y1 = y1 + (y1 - y0) * 0.08;
    let n = bars.len().max(1);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    // At least five slots wide, so one or two bars do not fill the whole chart.
    let pad = (5.0 - n as f64).max(0.0) / 2.0;
    let x: RangedCoordf64 = (-0.5 - pad..n as f64 - 0.5 + pad).into();
    let mut ctx = ChartBuilder::on(&root)
        .caption(title, (FAMILY, 26))
        .margin(16)
        .x_label_area_size(64)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y0..y1)
        .map_err(plot_err)?;
    let label_at = |v: &f64| -> String {
        // Ticks are requested at whole indexes below; anything else stays blank.
        let i = v.round();
        if (v - i).abs() > 1e-6 || i < 0.0 {
            return String::new();
        }
        bars.get(i as usize)
            .map(|b| b.0.clone())
            .unwrap_or_default()
    };
    // Many bars would make the category labels overlap: label every k-th one.
    let step = bars.len().div_ceil(24).max(1);
    let ticks = (bars.len().div_ceil(step)).max(1);
    ctx.configure_mesh()
        .disable_x_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .axis_desc_style((FAMILY, 18))
        .label_style((FAMILY, if bars.len() > 12 { 12 } else { 15 }))
        .x_labels(ticks)
        .x_label_formatter(&label_at)
        .y_label_formatter(&|v| format_tick(*v))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(plot_err)?;
    let c = color(0);
    ctx.draw_series(values.iter().enumerate().map(|(i, &v)| {
        let x = i as f64;
        Rectangle::new([(x - 0.38, 0.0), (x + 0.38, v)], c.filled())
    }))
    .map_err(plot_err)?;
    // Value labels on top of the bars, unless there are too many to read.
    if bars.len() <= 24 {
        let style = TextStyle::from((FAMILY, 13).into_font()).color(&BLACK).pos(
            plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Bottom,
            ),
        );
        ctx.draw_series(
            values
                .iter()
                .enumerate()
                .map(|(i, &v)| Text::new(format_tick(v), (i as f64, v.max(0.0)), style.clone())),
        )
        .map_err(plot_err)?;
    }
    if bars.is_empty() {
        no_data(&root)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Writes "no data" in the middle of an empty chart, so an empty PNG is not mistaken for a bug.
fn no_data<DB: DrawingBackend>(root: &DrawingArea<DB, plotters::coord::Shift>) -> Result<()> {
    let (w, h) = root.dim_in_pixel();
    let style = TextStyle::from((FAMILY, 24).into_font())
        .color(&RGBColor(120, 120, 120))
        .pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Center,
        ));
    root.draw_text("no data", &style, (w as i32 / 2, h as i32 / 2))
        .map_err(plot_err)
}

/// plotters' errors borrow the backend's error type; flatten them to text.
fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("{e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PNG_SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];

    fn check_png(path: &Path) {
        let bytes = std::fs::read(path).expect("chart written");
        assert_eq!(&bytes[..8], &PNG_SIGNATURE, "PNG signature");
        // IHDR carries width and height big-endian at offsets 16 and 20.
        let w = u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        let h = u32::from_be_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
        assert_eq!((w, h), SIZE);
        // Compressed, a chart with text and lines is a few KiB to a few hundred KiB; a blank
        // canvas compresses to far less than 4 KiB.
        assert!(
            bytes.len() > 4_000 && bytes.len() < 2_000_000,
            "{} bytes",
            bytes.len()
        );
    }

    #[test]
    fn line_chart_writes_png() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = Series {
            label: "reads".into(),
            points: (0..100).map(|i| (i as f64, (i * i) as f64)).collect(),
        };
        let b = Series {
            label: "writes".into(),
            points: (0..100).map(|i| (i as f64, 50.0 * i as f64)).collect(),
        };
        let series = [a, b];
        let path = dir.path().join("line.png");
        line_chart(
            &path,
            &LineChart {
                title: "IOPS over time",
                x_label: "time (s)",
                y_label: "IOPS",
                series: &series,
                log_x: false,
                log_y: false,
            },
        )
        .expect("chart");
        check_png(&path);
    }

    #[test]
    fn log_axes_and_degenerate_inputs_do_not_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cases: Vec<Vec<Series>> = vec![
            vec![],
            vec![Series::default()],
            vec![Series {
                label: "one".into(),
                points: vec![(4096.0, 0.5)],
            }],
            vec![Series {
                label: "with zero and negatives".into(),
                points: vec![(0.0, 0.0), (-1.0, 3.0), (10.0, 0.2), (1e6, 0.9)],
            }],
            vec![Series {
                label: "flat".into(),
                points: vec![(1.0, 7.0), (2.0, 7.0), (3.0, 7.0)],
            }],
        ];
        for (i, series) in cases.iter().enumerate() {
            for (lx, ly) in [(false, false), (true, false), (false, true), (true, true)] {
                let path = dir.path().join(format!("c{i}-{lx}-{ly}.png"));
                line_chart(
                    &path,
                    &LineChart {
                        title: "miss-ratio curve",
                        x_label: "cache size (bytes)",
                        y_label: "hit ratio",
                        series,
                        log_x: lx,
                        log_y: ly,
                    },
                )
                .expect("chart");
                check_png(&path);
            }
        }
    }

    #[test]
    fn bar_chart_writes_png() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bars: Vec<(String, f64)> = [("4 KiB", 812.0), ("8 KiB", 40.0), ("64 KiB", 3100.0)]
            .iter()
            .map(|(l, v)| (l.to_string(), *v))
            .collect();
        let path = dir.path().join("bars.png");
        bar_chart(&path, "block sizes", "request size", "requests", &bars).expect("chart");
        check_png(&path);
        let empty = dir.path().join("empty.png");
        bar_chart(&empty, "block sizes", "request size", "requests", &[]).expect("chart");
        check_png(&empty);
        let many: Vec<(String, f64)> = (0..60).map(|i| (format!("{i}"), i as f64)).collect();
        let path = dir.path().join("many.png");
        bar_chart(&path, "many", "x", "y", &many).expect("chart");
        check_png(&path);
    }

    #[test]
    fn ticks_are_compact() {
        assert_eq!(format_tick(0.0), "0");
        assert_eq!(format_tick(1500.0), "1500");
        assert_eq!(format_tick(15000.0), "15k");
        assert_eq!(format_tick(2_500_000.0), "2.5M");
        assert_eq!(format_tick(0.25), "0.25");
        assert_eq!(format_tick(1.5), "1.5");
        assert_eq!(format_tick(100.0), "100");
    }
}
