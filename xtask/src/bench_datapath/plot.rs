//! PNG line plots against N (log x axis) with plotters' bitmap backend. Text is drawn with
//! DejaVu Sans (Debian package fonts-dejavu-core).

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context as _, Result, anyhow};
use plotters::prelude::*;

pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = std::fs::read(FONT)
            .map_err(|e| format!("cannot read {FONT} ({e}); install fonts-dejavu-core"))?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{FONT} is not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// One curve.
pub struct Series {
    pub name: String,
    pub color: RGBColor,
    pub points: Vec<(f64, f64)>,
}

/// One per path, in `Path::ALL`'s order.
pub const COLORS: [RGBColor; 8] = [
    RGBColor(90, 90, 90),
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
];

/// Draws `series` against N (log scale) into `path`; `log_y` for a log-scale y axis.
pub fn line_plot(
    path: &Path,
    title: &str,
    y_desc: &str,
    series: &[Series],
    log_y: bool,
) -> Result<()> {
    register_font()?;
    let pts = || series.iter().flat_map(|s| s.points.iter().copied());
    let finite: Vec<(f64, f64)> = pts()
        .filter(|(x, y)| x.is_finite() && y.is_finite() && *x > 0.0 && (!log_y || *y > 0.0))
        .collect();
    if finite.is_empty() {
        return Err(anyhow!("{title}: nothing to plot"));
    }
    let xmin = finite.iter().map(|p| p.0).fold(f64::INFINITY, f64::min) / 1.6;
    let xmax = finite.iter().map(|p| p.0).fold(0.0, f64::max) * 1.6;
    let ymax = finite.iter().map(|p| p.1).fold(0.0, f64::max);
    let ymin_pos = finite.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let draw = |root: DrawingArea<BitMapBackend, _>| -> Result<()> {
        root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
        let mut b = ChartBuilder::on(&root);
        b.caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80);
        macro_rules! body {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .x_desc("services (N)")
                    .y_desc(y_desc)
                    .x_label_formatter(&|x| format!("{x:.0}"))
                    .y_label_formatter(&|y| {
                        if *y >= 1.0 || *y == 0.0 {
                            format!("{y:.0}")
                        } else {
                            format!("{y:.2}")
                        }
                    })
                    .label_style(("sans-serif", 14))
                    .draw()
                    .map_err(|e| anyhow!("{e:?}"))?;
                for s in series {
                    let c = s.color;
                    let pts: Vec<(f64, f64)> = s
                        .points
                        .iter()
                        .copied()
                        .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_y || *y > 0.0))
                        .collect();
                    chart
                        .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                        .map_err(|e| anyhow!("{e:?}"))?
                        .label(s.name.as_str())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                        });
                    chart
                        .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                        .map_err(|e| anyhow!("{e:?}"))?;
                }
                chart
                    .configure_series_labels()
                    .label_font(("sans-serif", 14))
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .position(if log_y {
                        SeriesLabelPosition::UpperLeft
                    } else {
                        SeriesLabelPosition::LowerLeft
                    })
                    .draw()
                    .map_err(|e| anyhow!("{e:?}"))?;
            }};
        }
        if log_y {
            body!(
                b.build_cartesian_2d(
                    (xmin..xmax).log_scale(),
                    (ymin_pos / 2.0..ymax * 2.0).log_scale()
                )
                .map_err(|e| anyhow!("{e:?}"))?
            );
        } else {
            body!(
                b.build_cartesian_2d((xmin..xmax).log_scale(), 0.0..ymax * 1.15)
                    .map_err(|e| anyhow!("{e:?}"))?
            );
        }
        root.present().map_err(|e| anyhow!("{e:?}"))?;
        Ok(())
    };
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    draw(root).with_context(|| format!("drawing {}", path.display()))
}
