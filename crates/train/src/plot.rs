//! Line charts as standalone SVG (loss and acceptance curves).

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Stroke colour (CSS).
    pub color: &'static str,
    /// Points `(x, y)`.
    pub points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A chart of `series` with axes from the data's range (y from 0 when all values are
/// positive), ticks and a legend.
#[must_use]
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let (w, h, l, r, t, b) = (720.0, 420.0, 70.0, 20.0, 40.0, 50.0);
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if y0 > 0.0 {
        y0 = 0.0;
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| h - b - (y - y0) / (y1 - y0) * (h - t - b);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>
<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>
"#,
        w / 2.0,
        esc(title),
        h - b,
        w - r,
        h - b,
        h - b,
        (l + w - r) / 2.0,
        h - 12.0,
        esc(x_label),
        (t + h - b) / 2.0,
        (t + h - b) / 2.0,
        esc(y_label),
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let (xv, yv) = (x0 + f * (x1 - x0), y0 + f * (y1 - y0));
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{:.1}" text-anchor="end">{}</text><line x1="{l}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>"##,
            px(xv),
            h - b + 16.0,
            tick(xv),
            l - 6.0,
            py(yv) + 4.0,
            tick(yv),
            py(yv),
            w - r,
            py(yv),
        );
    }
    for (i, se) in series.iter().enumerate() {
        let path: Vec<String> = se
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
            se.color,
            path.join(" ")
        );
        #[allow(clippy::cast_precision_loss, reason = "a few series")]
        let ly = t + 14.0 + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            w - r - 190.0,
            w - r - 170.0,
            se.color,
            w - r - 164.0,
            ly + 4.0,
            esc(&se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn tick(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_each_series_inside_the_frame() {
        let svg = line_chart(
            "loss <train>",
            "step",
            "loss",
            &[Series {
                name: "train".into(),
                color: "steelblue",
                points: vec![(0.0, 4.0), (10.0, 2.0), (20.0, f64::NAN)],
            }],
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("loss &lt;train&gt;"));
        assert!(svg.contains(r#"points="70.0,40.0 700.0,205.0""#), "{svg}");
    }
}
