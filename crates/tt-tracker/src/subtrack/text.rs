//! gpu_tracker's text and JSON layouts of sub-tracking results: its `_dict_to_str`
//! (title-cased keys, tab indents) around tables laid out as pandas prints a DataFrame
//! with its display options (`float_format` rounding to 8 decimals).

use std::collections::HashSet;

use serde::Serialize;

use super::{Comparison, OrderedMap, Scalar, Stats, SubTrackingResults};

/// `json.dumps(value, indent=1)` with a final newline (NaN written as `null`).
pub(super) fn pretty_json(value: &impl Serialize) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        serde_json::ser::PrettyFormatter::with_indent(b" "),
    );
    // Serialising plain data into a Vec cannot fail.
    if value.serialize(&mut ser).is_err() {
        return String::new();
    }
    let mut s = String::from_utf8_lossy(&out).into_owned();
    s.push('\n');
    s
}

/// gpu_tracker's display format: rounded to 8 decimals, then Python's `repr`.
fn display(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    crate::units::python_repr(format!("{x:.8}").parse().unwrap_or(x))
}

/// Python's `str.title()`.
fn title(s: &str) -> String {
    let mut prev_cased = false;
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        if cased && prev_cased {
            out.extend(c.to_lowercase());
        } else if cased {
            out.extend(c.to_uppercase());
        } else {
            out.push(c);
        }
        prev_cased = cased;
    }
    out
}

enum Column {
    /// A float column: headers get pandas' leading space.
    Float(Vec<f64>),
    /// Mixed values (an object column).
    Object(Vec<Scalar>),
}

/// A table as pandas prints it.
struct Frame {
    index: Vec<String>,
    columns: Vec<(String, Column)>,
}

fn width(s: &str) -> usize {
    s.chars().count()
}

impl Frame {
    fn lines(&self) -> Vec<String> {
        let index_w = self.index.iter().map(|s| width(s)).max().unwrap_or(0);
        let mut header = " ".repeat(index_w);
        let mut rows: Vec<String> = self
            .index
            .iter()
            .map(|i| format!("{i}{}", " ".repeat(index_w - width(i))))
            .collect();
        for (label, column) in &self.columns {
            let (label, cells): (String, Vec<String>) = match column {
                Column::Float(xs) => (
                    format!(" {label}"),
                    xs.iter().map(|x| display(*x)).collect(),
                ),
                Column::Object(vs) => (
                    label.clone(),
                    vs.iter()
                        .map(|v| match v {
                            Scalar::Real(x) => display(*x),
                            Scalar::Int(i) => format!(" {i}"),
                            Scalar::Text(s) => format!(" {s}"),
                        })
                        .collect(),
                ),
            };
            let w = cells
                .iter()
                .map(|c| width(c))
                .chain([width(&label)])
                .max()
                .unwrap_or(0);
            header += &format!(" {label:>w$}");
            for (row, cell) in rows.iter_mut().zip(&cells) {
                *row += &format!(" {cell:>w$}");
            }
        }
        std::iter::once(header).chain(rows).collect()
    }

    /// A statistics table: one row per measure.
    fn stats(stats: &OrderedMap<Stats>) -> Frame {
        let col = |f: fn(&Stats) -> f64| Column::Float(stats.0.iter().map(|(_, s)| f(s)).collect());
        Frame {
            index: stats.keys().map(str::to_owned).collect(),
            columns: vec![
                ("min".into(), col(|s| s.min)),
                ("max".into(), col(|s| s.max)),
                ("mean".into(), col(|s| s.mean)),
                ("std".into(), col(|s| s.std)),
            ],
        }
    }

    /// A Series printed as gpu_tracker prints one: a one-row table without a row name.
    fn row(values: impl IntoIterator<Item = (String, Column)>) -> Frame {
        Frame {
            index: vec![String::new()],
            columns: values.into_iter().collect(),
        }
    }

    fn float_row(values: &OrderedMap<f64>) -> Frame {
        Frame::row(
            values
                .iter()
                .map(|(k, v)| (k.to_owned(), Column::Float(vec![*v]))),
        )
    }
}

enum Node {
    Scalar(String),
    Frame(Frame),
    Dict(Vec<(String, Node)>),
    List(Vec<Vec<(String, Node)>>),
}

/// gpu_tracker's `_dict_to_str`.
fn dict_to_str(out: &mut String, dict: &[(String, Node)], indent: usize, keep: &HashSet<String>) {
    let tabs = "\t".repeat(indent);
    let keys: Vec<String> = dict
        .iter()
        .map(|(k, _)| {
            let k = if keep.contains(k) {
                k.clone()
            } else {
                title(&k.replace('_', " "))
            };
            format!("{tabs}{k}")
        })
        .collect();
    let max = keys.iter().map(|k| width(k)).max().unwrap_or(0);
    for (key, (_, node)) in keys.iter().zip(dict) {
        match node {
            Node::Scalar(v) => {
                out.push_str(&format!("{key}:{} {v}\n", " ".repeat(max - width(key))));
            }
            Node::Dict(d) => {
                out.push_str(&format!("{key}:\n"));
                dict_to_str(out, d, indent + 1, keep);
            }
            Node::Frame(f) => {
                out.push_str(&format!("{key}:\n"));
                for line in f.lines() {
                    out.push_str(&format!("{tabs}\t{line}\n"));
                }
            }
            Node::List(items) => {
                out.push_str(&format!("{key}:\n"));
                for item in items {
                    dict_to_str(out, item, indent + 1, keep);
                    out.push('\n');
                }
            }
        }
    }
}

pub(super) fn results(r: &SubTrackingResults) -> String {
    let static_data = Frame::row(
        r.static_data
            .iter()
            .map(|(k, v)| (k.to_owned(), Column::Object(vec![v.clone()]))),
    );
    let blocks = r
        .code_block_results
        .iter()
        .map(|b| {
            let (t, total) = (&b.compute_time.stats, b.compute_time.total);
            let times = [
                ("min", t.min),
                ("max", t.max),
                ("mean", t.mean),
                ("std", t.std),
                ("total", total),
            ];
            vec![
                ("name".to_owned(), Node::Scalar(b.name.clone())),
                (
                    "num_timepoints".to_owned(),
                    Node::Scalar(b.num_timepoints.to_string()),
                ),
                (
                    "num_calls".to_owned(),
                    Node::Scalar(b.num_calls.to_string()),
                ),
                (
                    "num_non_empty_calls".to_owned(),
                    Node::Scalar(b.num_non_empty_calls.to_string()),
                ),
                (
                    "compute_time".to_owned(),
                    Node::Frame(Frame::row(
                        times.map(|(k, v)| (k.to_owned(), Column::Float(vec![v]))),
                    )),
                ),
                (
                    "resource_usage".to_owned(),
                    Node::Frame(Frame::stats(&b.resource_usage)),
                ),
            ]
        })
        .collect();
    let dict = vec![
        ("overall".to_owned(), Node::Frame(Frame::stats(&r.overall))),
        ("static_data".to_owned(), Node::Frame(static_data)),
        ("code_block_results".to_owned(), Node::List(blocks)),
    ];
    let mut out = String::new();
    dict_to_str(&mut out, &dict, 0, &HashSet::new());
    out
}

pub(super) fn comparison(c: &Comparison) -> String {
    let rows = |m: &OrderedMap<OrderedMap<f64>>| {
        m.iter()
            .map(|(k, v)| (k.to_owned(), Node::Frame(Frame::float_row(v))))
            .collect::<Vec<_>>()
    };
    let dict = vec![
        (
            "overall_resource_usage".to_owned(),
            Node::Dict(rows(&c.overall_resource_usage)),
        ),
        (
            "code_block_resource_usage".to_owned(),
            Node::Dict(
                c.code_block_resource_usage
                    .iter()
                    .map(|(k, v)| (k.to_owned(), Node::Dict(rows(v))))
                    .collect(),
            ),
        ),
        (
            "code_block_compute_time".to_owned(),
            Node::Dict(rows(&c.code_block_compute_time)),
        ),
    ];
    let keep = c
        .code_block_compute_time
        .keys()
        .map(str::to_owned)
        .collect();
    let mut out = String::new();
    dict_to_str(&mut out, &dict, 0, &keep);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_prints_them() {
        for (x, s) in [
            (0.1, "0.1"),
            (2.0, "2.0"),
            (-2.5, "-2.5"),
            (123456789.125, "123456789.125"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (-3.25e20, "-3.25e+20"),
            (1e-7, "1e-07"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(crate::units::python_repr(x), s, "{x}");
        }
        assert_eq!(display(0.300467967987), "0.30046797");
        assert_eq!(display(25.276510208), "25.27651021");
        assert_eq!(display(0.000000001), "0.0");
        assert_eq!(display(f64::NAN), "NaN");
    }

    #[test]
    fn titles_as_python_titles() {
        assert_eq!(title("num non empty calls"), "Num Non Empty Calls");
        assert_eq!(title("s.py:5 x1y"), "S.Py:5 X1Y");
    }

    #[test]
    fn tables_as_pandas_prints_them() {
        // Printed by pandas 3.1 with gpu_tracker's display options.
        let f = Frame {
            index: vec!["a".into(), "b".into()],
            columns: vec![
                ("min".into(), Column::Float(vec![0.3, -1.0])),
                ("std".into(), Column::Float(vec![0.0, 22.0])),
            ],
        };
        assert_eq!(f.lines(), ["   min  std", "a  0.3  0.0", "b -1.0 22.0"]);
        let f = Frame::row([
            (
                "x".into(),
                Column::Object(vec![Scalar::Text("gigabytes".into())]),
            ),
            ("y".into(), Column::Object(vec![Scalar::Real(25.2)])),
            ("z".into(), Column::Object(vec![Scalar::Int(2)])),
        ]);
        assert_eq!(f.lines(), ["          x    y  z", "  gigabytes 25.2  2"]);
    }
}
