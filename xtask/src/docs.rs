//! Checks that keep the README true: run by `cargo xtask test` (these are xtask's own
//! tests, in the workspace's test step).

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    /// Variables the code reads between its own processes, never set by users: the
    /// probe's report pipe and the name of the probe a re-executed binary runs.
    const INTERNAL: [&str; 2] = ["TORCHTOOLS_PROBE_FD", "TORCHTOOLS_PROBE_RUN"];

    /// Every `TORCHTOOLS_*` name in `text` (not part of a longer name such as cargo's
    /// `DEP_TORCHTOOLS_...`).
    fn names(text: &str, out: &mut BTreeSet<String>) {
        let bytes = text.as_bytes();
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let mut i = 0;
        while let Some(at) = text[i..].find("TORCHTOOLS_") {
            let start = i + at;
            let mut end = start + "TORCHTOOLS_".len();
            while end < bytes.len() && word(bytes[end]) {
                end += 1;
            }
            let name = &text[start..end];
            let lone = start == 0 || !word(bytes[start - 1]);
            if lone && name.len() > "TORCHTOOLS_".len() && !name.ends_with('_') {
                out.insert(name.to_owned());
            }
            i = end;
        }
    }

    fn scan(dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                scan(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "sh") {
                names(&std::fs::read_to_string(&path).unwrap_or_default(), out);
            }
        }
    }

    /// The variables of the README's "Environment variables" table.
    fn table() -> BTreeSet<String> {
        let readme = std::fs::read_to_string(crate::root().join("README.md")).unwrap();
        let start = readme
            .find("## Environment variables")
            .expect("the variables section");
        let section = &readme[start..];
        let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
        let mut out = BTreeSet::new();
        for row in section[..end].lines().filter(|l| l.starts_with("| `")) {
            let first = row.split(" | ").next().unwrap_or_default();
            names(first, &mut out);
        }
        out
    }

    #[test]
    fn every_variable_the_code_reads_is_in_the_readme_table_and_back() {
        let root = crate::root();
        let mut code = BTreeSet::new();
        for dir in ["src", "examples", "xtask/src"] {
            scan(&root.join(dir), &mut code);
        }
        for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
            scan(&entry.path().join("src"), &mut code);
        }
        for internal in INTERNAL {
            assert!(code.remove(internal), "{internal} is no longer in the code");
        }
        let table = table();
        let missing: Vec<_> = code.difference(&table).collect();
        assert!(
            missing.is_empty(),
            "read by the code but not in the README's variables table: {missing:?}"
        );
        let mut everywhere = code.clone();
        for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
            scan(&entry.path().join("tests"), &mut everywhere);
        }
        let unread: Vec<_> = table.difference(&everywhere).collect();
        assert!(
            unread.is_empty(),
            "in the README's variables table but read nowhere: {unread:?}"
        );
    }

    /// `(crate, README text)` of every crate under `crates/`.
    fn crate_readmes() -> Vec<(String, String)> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(crate::root().join("crates"))
            .unwrap()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(entry.path().join("README.md"))
                .unwrap_or_else(|e| panic!("crates/{name}/README.md: {e}"));
            out.push((name, text));
        }
        out.sort();
        out
    }

    /// The lines of each fenced block whose info string starts with `lang`, with the
    /// info string: `(info, lines)`.
    fn blocks<'a>(text: &'a str, lang: &str) -> Vec<(&'a str, Vec<&'a str>)> {
        let mut out = Vec::new();
        let mut current: Option<(&str, Vec<&str>)> = None;
        for line in text.lines() {
            let t = line.trim();
            let fence = t.starts_with("```");
            // A block ends at a fence with no info string (```` ```rust ```` inside a
            // block is one of its lines).
            let close = fence && t.chars().all(|c| c == '`');
            match (&mut current, fence) {
                (Some(_), _) if close => out.extend(current.take()),
                (Some((_, lines)), _) => lines.push(line),
                (None, true) => {
                    let info = line.trim_start().trim_start_matches('`');
                    // Every fence opens a block, so a block of another language is
                    // skipped whole, not mistaken for text between blocks.
                    current = Some((info, Vec::new()));
                }
                (None, false) => {}
            }
        }
        out.into_iter()
            .filter(|(info, _)| info.split(',').next() == Some(lang))
            .collect()
    }

    /// A crate's README is its documentation on docs.rs and the page GitHub and
    /// crates.io show: one text, whose Rust examples are doctests.
    #[test]
    fn every_library_crate_is_documented_by_its_readme() {
        for (name, readme) in crate_readmes() {
            let lib = crate::root().join("crates").join(&name).join("src/lib.rs");
            let Ok(source) = std::fs::read_to_string(&lib) else {
                continue; // the CLI: a binary
            };
            if name == "torchtools-py" {
                // A Python extension, not a library for Rust: its README speaks to
                // Python users, its examples are Python (its pytest suite runs them).
                continue;
            }
            assert!(
                source.starts_with("#![doc = include_str!(\"../README.md\")]"),
                "crates/{name}/src/lib.rs: its documentation is not its README"
            );
            assert!(
                !source.lines().any(|l| l.starts_with("//!")),
                "crates/{name}/src/lib.rs: a second front page beside the README"
            );
            if name != "tt-testkit" {
                assert!(
                    blocks(&readme, "rust")
                        .iter()
                        .any(|(info, _)| !info.contains("ignore") && !info.contains("no_run")),
                    "crates/{name}/README.md: no Rust example that runs as a doctest"
                );
            }
        }
    }

    /// Hidden doctest lines (`# ...`) show as they are on GitHub and crates.io, so the
    /// READMEs' examples are whole programs instead.
    #[test]
    fn readme_examples_have_no_hidden_lines() {
        for (name, readme) in crate_readmes() {
            for (info, lines) in blocks(&readme, "rust") {
                for line in lines {
                    let t = line.trim_start();
                    assert!(
                        !(t == "#" || t.starts_with("# ")),
                        "crates/{name}/README.md, a ```{info} block: hidden line {line:?}"
                    );
                }
            }
        }
    }

    /// Relative links break on crates.io and docs.rs, where a README is shown alone.
    #[test]
    fn crate_readmes_link_absolutely() {
        for (name, readme) in crate_readmes() {
            for (at, _) in readme.match_indices("](") {
                let target = &readme[at + 2..];
                assert!(
                    target.starts_with("http") || target.starts_with('#'),
                    "crates/{name}/README.md: a relative link ]({})",
                    target.split(')').next().unwrap_or_default()
                );
            }
        }
    }

    #[test]
    fn blocks_are_read_by_language() {
        let text = "a\n```rust\nx\n```\n```sh\n```rust\n```\n```rust,no_run\ny\n```\n";
        assert_eq!(
            blocks(text, "rust"),
            [("rust", vec!["x"]), ("rust,no_run", vec!["y"])]
        );
    }

    /// The benchmark table between the markers `cargo xtask bench` writes: its header
    /// line (machine and date) and its rows.
    fn bench_table(text: &str) -> Option<(String, Vec<String>)> {
        use crate::bench::{TABLE_BEGIN, TABLE_END};
        let begin = text.find(TABLE_BEGIN)? + TABLE_BEGIN.len();
        let end = text[begin..].find(TABLE_END)? + begin;
        let region = &text[begin..end];
        let header = region
            .lines()
            .find(|l| l.starts_with("`cargo xtask bench` on "))?
            .to_owned();
        let rows = region
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| what |"))
            .map(str::to_owned)
            .collect();
        Some((header, rows))
    }

    /// The READMEs' benchmark tables are one `cargo xtask bench` run's: the project's
    /// whole table, and in each measured crate's README its own rows, with the same
    /// machine and date.
    #[test]
    fn benchmark_tables_come_from_one_bench_run() {
        let root = std::fs::read_to_string(crate::root().join("README.md")).unwrap();
        let (header, rows) = bench_table(&root).expect("README.md: the benchmark table's markers");
        assert!(rows.len() > 10, "README.md: {} benchmark rows", rows.len());
        let readmes = crate_readmes();
        let measured = crate::bench::BENCHES.map(|(k, _, _)| k);
        // (The root package's rows are in README.md's table alone.)
        for krate in measured
            .iter()
            .chain(&["torchtools-cli"])
            .filter(|k| **k != "torchtools")
        {
            let (_, text) = readmes.iter().find(|(n, _)| n == krate).unwrap();
            assert!(
                bench_table(text).is_some(),
                "crates/{krate}/README.md: no benchmark table between the markers"
            );
        }
        for (name, text) in &readmes {
            let Some((own_header, own_rows)) = bench_table(text) else {
                continue;
            };
            assert_eq!(
                own_header, header,
                "crates/{name}/README.md: another run's table"
            );
            assert!(
                !own_rows.is_empty(),
                "crates/{name}/README.md: an empty table"
            );
            for row in own_rows {
                assert!(
                    rows.contains(&row),
                    "crates/{name}/README.md: a row that is not the run's: {row}"
                );
            }
        }
    }

    /// Every source file under `dir` (`.rs`, and the C++ under `csrc`), as a path from
    /// `dir`.
    fn sources(dir: &Path, base: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                sources(&path, base, out);
            } else if path
                .extension()
                .is_some_and(|e| e == "rs" || e == "cpp" || e == "h")
            {
                let rel = path.strip_prefix(base).unwrap_or(&path);
                out.push(rel.display().to_string());
            }
        }
    }

    /// ARCHITECTURE.md's code map names every source file: under its package's bullet,
    /// each file as a code span of its path from `src/` (or from the package for
    /// `csrc/`, `examples/` and `xtask/`).
    #[test]
    fn the_code_map_names_every_source_file() {
        let root = crate::root();
        let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        let start = text.find("## Code map").expect("a code map");
        let map = &text[start..];
        let map = &map[..map[3..].find("\n## ").map_or(map.len(), |e| e + 3)];
        // Bullets: the first code span names the package or directory.
        let mut bullets: Vec<(String, BTreeSet<String>)> = Vec::new();
        for line in map.lines() {
            if let Some(rest) = line.strip_prefix("- `") {
                let head = rest.split('`').next().unwrap_or_default().to_owned();
                bullets.push((head, BTreeSet::new()));
            }
            if let Some((_, spans)) = bullets.last_mut() {
                for (i, span) in line.split('`').enumerate() {
                    if i % 2 == 1 {
                        // `shim.{h,cpp}` names both.
                        if let Some((stem, rest)) = span.split_once(".{") {
                            for ext in rest.trim_end_matches('}').split(',') {
                                spans.insert(format!("{stem}.{ext}"));
                            }
                        }
                        spans.insert(span.to_owned());
                    }
                }
            }
        }
        let bullet = |head: &str| {
            bullets
                .iter()
                .find(|(h, _)| h == head)
                .map(|(_, s)| s)
                .unwrap_or_else(|| panic!("ARCHITECTURE.md's code map has no bullet for `{head}`"))
        };
        let mut missing = Vec::new();
        let mut check = |head: &str, dir: &Path, prefix: &str| {
            let spans = bullet(head);
            let mut files = Vec::new();
            sources(dir, dir, &mut files);
            for file in files {
                let named = format!("{prefix}{file}");
                if file != "lib.rs" && file != "error.rs" && !spans.contains(&named) {
                    missing.push(format!("{head}: {named}"));
                }
            }
        };
        for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let head = format!("crates/{name}");
            check(&head, &entry.path().join("src"), "");
            check(&head, &entry.path().join("csrc"), "csrc/");
        }
        check("torchtools", &root.join("src"), "src/");
        check("examples/", &root.join("examples"), "");
        check("xtask/", &root.join("xtask/src"), "");
        assert!(
            missing.is_empty(),
            "source files missing from ARCHITECTURE.md's code map: {missing:#?}"
        );
    }

    /// The paths a use tree names, its groups expanded: `a::{b, c::{d as e}}` gives
    /// `a::b` and `a::c::d` (an alias keeps its item's name), with the text after it.
    fn use_tree(text: &str) -> Vec<String> {
        fn tree(s: &str, prefix: &str, out: &mut Vec<String>) -> usize {
            let mut i = 0;
            let bytes = s.as_bytes();
            let mut path = String::from(prefix);
            while i < bytes.len() {
                let c = bytes[i] as char;
                // A group only right after `::` (or at the tree's start): `Alpha {`
                // is an expression, and any other character ends the path.
                let at_group = path.trim_end().ends_with("::") || path.trim().is_empty();
                if c == '{' && at_group {
                    i += 1;
                    loop {
                        i += tree(&s[i..], &path, out);
                        match s[i..].chars().next() {
                            Some(',') => i += 1,
                            Some('}') => {
                                i += 1;
                                break;
                            }
                            _ => return i,
                        }
                    }
                    return i;
                }
                if !(c.is_ascii_alphanumeric() || c == '_' || c == ':' || c.is_whitespace()) {
                    break;
                }
                // Spaces before a name (`{Beta, Gamma}`) are not part of it.
                if c.is_whitespace() && (path.len() == prefix.len() || path.ends_with("::")) {
                    i += 1;
                    continue;
                }
                path.push(c);
                i += 1;
            }
            let path: String = path.split_whitespace().collect::<Vec<_>>().join(" ");
            // `Gamma as G` names Gamma; a word after the path ends it.
            let path = path.split(" as ").next().unwrap_or_default();
            let path = path.split_whitespace().next().unwrap_or_default();
            if !path.is_empty() && !path.ends_with("::") {
                out.push(path.to_owned());
            }
            i
        }
        let mut out = Vec::new();
        tree(text, "", &mut out);
        out
    }

    /// `text` without comments and without `#[...]` attributes.
    fn code(text: &str) -> String {
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect();
        let mut text = lines.join("\n");
        while let Some(at) = text.find("#[") {
            let mut depth = 0;
            let mut end = text.len();
            for (i, c) in text[at + 1..].char_indices() {
                match c {
                    '[' => depth += 1,
                    ']' => {
                        depth -= 1;
                        if depth == 0 {
                            end = at + 1 + i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            text.replace_range(at..end, " ");
        }
        text
    }

    /// The modules of one crate that each module names, through `crate::module::`,
    /// `super::` (a module of the crate's root), or the items `lib.rs` re-exports from
    /// a module (`crate::{Item}`): re-exports behind attributes and in `pub use { .. }`
    /// blocks too.
    fn module_graph(src: &Path) -> std::collections::BTreeMap<String, BTreeSet<String>> {
        let lib = code(&std::fs::read_to_string(src.join("lib.rs")).unwrap_or_default());
        let mut modules = BTreeSet::new();
        for stmt in lib.split(';').map(str::trim) {
            let stmt = stmt
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub ");
            if let Some(m) = stmt.strip_prefix("mod ") {
                if m.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    modules.insert(m.to_owned());
                }
            }
        }
        let mut item_of = std::collections::BTreeMap::new();
        for stmt in lib.split(';').map(str::trim) {
            let Some(tree) = stmt
                .strip_prefix("pub use ")
                .or_else(|| stmt.strip_prefix("pub(crate) use "))
            else {
                continue;
            };
            for path in use_tree(tree) {
                let path = path
                    .trim_start_matches("self::")
                    .trim_start_matches("crate::");
                let mut parts = path.split("::");
                let (Some(module), Some(item)) = (parts.next(), parts.last()) else {
                    continue;
                };
                if modules.contains(module) {
                    item_of.insert(item.to_owned(), module.to_owned());
                }
            }
        }
        let mut graph = std::collections::BTreeMap::new();
        for module in &modules {
            let text = std::fs::read_to_string(src.join(format!("{module}.rs")))
                .or_else(|_| std::fs::read_to_string(src.join(module).join("mod.rs")))
                .unwrap_or_default();
            // Tests may use anything; a doc link is not a dependency.
            let text = text
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap_or_default();
            let text = code(text);
            let mut uses = BTreeSet::new();
            for root in ["crate::", "super::"] {
                for (at, _) in text.match_indices(root) {
                    // `super::` inside a module's own child module is that module.
                    if at > 0 && text[..at].ends_with("::") {
                        continue;
                    }
                    for path in use_tree(&text[at + root.len()..]) {
                        let name: String = path
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if modules.contains(&name) {
                            uses.insert(name);
                        } else if let Some(m) = item_of.get(&name) {
                            uses.insert(m.clone());
                        }
                    }
                }
            }
            uses.remove(module);
            uses.remove("error"); // every module's error type: a leaf
            graph.insert(module.clone(), uses);
        }
        graph
    }

    /// The circles of one crate's `src` (see `module_graph`), each as `a -> b -> a`.
    fn circles_in(src: &Path) -> Vec<String> {
        let graph = module_graph(src);
        let mut circles = Vec::new();
        for start in graph.keys() {
            // Depth-first from `start`: does a path lead back to it?
            let mut stack = vec![(start.clone(), vec![start.clone()])];
            let mut seen = BTreeSet::new();
            while let Some((at, path)) = stack.pop() {
                for next in graph.get(&at).into_iter().flatten() {
                    if next == start {
                        circles.push(format!("{} -> {start}", path.join(" -> ")));
                    } else if seen.insert(next.clone()) {
                        let mut longer = path.clone();
                        longer.push(next.clone());
                        stack.push((next.clone(), longer));
                    }
                }
            }
        }
        circles
    }

    /// The check sees a module named back however the naming is written: a re-export
    /// behind `#[cfg]`, one in a `pub use { .. }` block, `super::`, a nested group
    /// `crate::{a::{X}}`; and it sees no circle where a module names itself, a doc
    /// comment names another, or a test module does.
    #[test]
    fn the_module_check_sees_circles_however_they_are_written() {
        let tree = |lib: &str, files: &[(&str, &str)]| {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("lib.rs"), lib).unwrap();
            for (name, text) in files {
                std::fs::write(dir.path().join(format!("{name}.rs")), text).unwrap();
            }
            dir
        };
        let lib = "mod a;\n#[cfg(feature = \"x\")]\nmod b;\n#[cfg(feature = \"x\")]\n#[cfg_attr(docsrs, doc(cfg(feature = \"x\")))]\npub use a::Alpha;\npub use {\n    b::{Beta, Gamma as G},\n};\n";
        for (a, b) in [
            // A cfg'd re-export named from b, b's module named from a.
            ("use crate::b::Beta;", "fn f() -> crate::Alpha { todo!() }"),
            // An item of the block re-export, through an alias's item name.
            ("fn f() -> crate::Gamma { todo!() }", "use super::a;"),
            // A nested group.
            ("use crate::{b::{Beta}};", "use crate::{Alpha, a};"),
        ] {
            let dir = tree(lib, &[("a", a), ("b", b)]);
            let circles = circles_in(dir.path());
            assert!(
                circles.contains(&"a -> b -> a".to_owned()),
                "{a:?} / {b:?}: {circles:?}"
            );
        }
        for (a, b) in [
            ("use crate::b::Beta;", "/// [`crate::Alpha`]\nfn f() {}"),
            (
                "use crate::b::Beta;",
                "fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}",
            ),
            ("use crate::a::x;", "use crate::b;"),
        ] {
            let dir = tree(lib, &[("a", a), ("b", b)]);
            assert_eq!(
                circles_in(dir.path()),
                Vec::<String>::new(),
                "{a:?} / {b:?}"
            );
        }
    }

    /// A module that names another which names it back (directly or around a circle)
    /// means a helper sits in the wrong file: move it to a leaf.
    #[test]
    fn no_crate_has_modules_that_import_each_other_in_circles() {
        let mut circles = Vec::new();
        for entry in std::fs::read_dir(crate::root().join("crates"))
            .unwrap()
            .flatten()
        {
            for circle in circles_in(&entry.path().join("src")) {
                circles.push(format!("{}: {circle}", entry.file_name().to_string_lossy()));
            }
        }
        assert!(circles.is_empty(), "modules in circles: {circles:#?}");
    }

    #[test]
    fn names_are_whole_words() {
        let mut out = BTreeSet::new();
        names(
            "DEP_TORCHTOOLS_SYS_X `TORCHTOOLS_LOG` TORCHTOOLS_PROBE_STEPS=5 TORCHTOOLS_*",
            &mut out,
        );
        assert_eq!(
            out.into_iter().collect::<Vec<_>>(),
            ["TORCHTOOLS_LOG", "TORCHTOOLS_PROBE_STEPS"]
        );
    }
}
