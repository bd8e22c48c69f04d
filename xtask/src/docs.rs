//! Checks that keep the README true: run by `cargo xtask test` (these are xtask's own
//! tests, in the workspace's test step).

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

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
            if name != "tt-testkit" && name != "tt-workspace-hack" {
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

    /// ARCHITECTURE.md's sections: (heading, text), `##` and `###` alike.
    fn architecture() -> Vec<(String, String)> {
        let text = std::fs::read_to_string(crate::root().join("ARCHITECTURE.md")).unwrap();
        let mut sections: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(head) = line.strip_prefix("### ").or(line.strip_prefix("## ")) {
                sections.push((head.trim_matches('`').to_owned(), String::new()));
            } else if let Some((_, body)) = sections.last_mut() {
                body.push_str(line);
                body.push('\n');
            }
        }
        sections
    }

    /// The code spans of `text`.
    fn spans(text: &str) -> Vec<&str> {
        text.split('`').skip(1).step_by(2).collect()
    }

    /// Every package of the workspace and its directory: the crates under `crates/`,
    /// the facade at the root, xtask.
    fn packages() -> Vec<(String, PathBuf)> {
        let root = crate::root();
        let mut out = vec![
            ("torchtools".to_owned(), root.clone()),
            ("xtask".to_owned(), root.join("xtask")),
        ];
        for entry in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
            if entry.path().join("Cargo.toml").exists() {
                let name = entry.file_name().to_string_lossy().into_owned();
                out.push((name, entry.path()));
            }
        }
        out
    }

    /// Every package has its section under "## Crates", saying what it is for and the
    /// invariants it keeps: ARCHITECTURE.md is per crate, not per file.
    #[test]
    fn every_package_has_its_architecture_section() {
        let sections = architecture();
        for (name, _) in packages() {
            let Some((_, body)) = sections.iter().find(|(h, _)| *h == name) else {
                panic!("ARCHITECTURE.md has no section `### `{name}``");
            };
            for part in ["**For**:", "**Invariants**:"] {
                assert!(body.contains(part), "ARCHITECTURE.md's {name}: no {part}");
            }
        }
    }

    /// Every file ARCHITECTURE.md names (a code span ending in a source file's
    /// extension) exists: in a crate's section, under its `src/`, its directory or the
    /// root; elsewhere, anywhere in the workspace.
    #[test]
    fn every_file_the_architecture_names_exists() {
        let root = crate::root();
        let packages = packages();
        let mut all = Vec::new();
        walk(&root, &mut all);
        let mut missing = Vec::new();
        for (head, body) in architecture() {
            let dir = packages.iter().find(|(n, _)| *n == head).map(|(_, d)| d);
            for span in spans(&body) {
                let is_file = [".rs", ".py", ".pyi", ".sh", ".h", ".cpp"]
                    .iter()
                    .any(|e| span.ends_with(e));
                if !is_file || span.contains(' ') {
                    continue;
                }
                let found = match dir {
                    Some(d) => [d.join("src").join(span), d.join(span), root.join(span)]
                        .iter()
                        .any(|p| p.exists()),
                    None => all.iter().any(|p| p.ends_with(span)),
                };
                if !found {
                    missing.push(format!("{head}: {span}"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "ARCHITECTURE.md names files that do not exist: {missing:#?}"
        );
    }

    /// Every file of the workspace outside `target/` and hidden folders.
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }

    /// The names a check can have: Rust tests (`#[test] fn`, and the trials of
    /// harness-free test files, `("name", function)`), Python tests (`def test_`), and
    /// the checks of xtask (its functions).
    fn known_checks() -> BTreeSet<String> {
        let (mut files, xtask) = (Vec::new(), crate::root().join("xtask"));
        walk(&crate::root(), &mut files);
        let mut names = BTreeSet::new();
        for file in files {
            let ext = file
                .extension()
                .and_then(|e| e.to_str())
                .unwrap_or_default();
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            let in_xtask = file.starts_with(&xtask);
            match ext {
                "rs" => {
                    let words: Vec<&str> = text.split_whitespace().collect();
                    for (i, w) in words.iter().enumerate() {
                        if *w != "fn" {
                            continue;
                        }
                        let name: String = words
                            .get(i + 1)
                            .unwrap_or(&"")
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        let attrs = words[i.saturating_sub(8)..i].join(" ");
                        // `#[test]`, or an async runtime's (`#[tokio::test]`).
                        if in_xtask || attrs.contains("#[test]") || attrs.contains("::test]") {
                            names.insert(name);
                        }
                    }
                    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
                    for piece in flat.replace("( \"", "(\"").split("(\"").skip(1) {
                        if let Some((name, rest)) = piece.split_once('"') {
                            if rest.trim_start().starts_with(',') && name.matches('_').count() >= 3
                            {
                                names.insert(name.to_owned());
                            }
                        }
                    }
                }
                "py" => {
                    for line in text.lines() {
                        if let Some(rest) = line.trim_start().strip_prefix("def test_") {
                            let name = rest.split('(').next().unwrap_or_default();
                            names.insert(format!("test_{name}"));
                        }
                    }
                }
                _ => {}
            }
        }
        names
    }

    /// The invariants' bullets: those of each crate's "**Invariants**:" list and of
    /// "## Workspace invariants", with their section.
    fn invariants() -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (head, body) in architecture() {
            let list = if head == "Workspace invariants" {
                Some(body.as_str())
            } else {
                body.split_once("**Invariants**:").map(|(_, l)| l)
            };
            let Some(list) = list else { continue };
            let list = list.split("\n**").next().unwrap_or_default();
            for bullet in list.split("\n- ").skip(1) {
                out.push((head.clone(), bullet.to_owned()));
            }
        }
        out
    }

    /// Each invariant names the test (or xtask check) that holds it, and every test
    /// name it gives (a code span of four words or more joined by `_`) is a real one:
    /// a renamed or removed test fails here, not silently in the document.
    #[test]
    fn every_invariant_names_a_test_that_exists() {
        let known = known_checks();
        let bullets = invariants();
        assert!(
            bullets.len() >= 40,
            "only {} invariants read",
            bullets.len()
        );
        let mut problems = Vec::new();
        for (head, bullet) in bullets {
            let names: Vec<&str> = spans(&bullet)
                .into_iter()
                .filter(|s| {
                    s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                })
                .collect();
            if !names.iter().any(|n| known.contains(*n)) {
                problems.push(format!("{head}: names no test: {}", bullet.trim()));
            }
            for n in names.iter().filter(|n| n.matches('_').count() >= 3) {
                if !known.contains(*n) {
                    problems.push(format!("{head}: no test or check is called `{n}`"));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "ARCHITECTURE.md's invariants: {problems:#?}"
        );
    }

    /// Integration test files that are a test binary of their own beside their crate's
    /// one (`tests/it/main.rs` or a single file), each with its reason: the one list.
    /// GPU tests (`tests/gpu.rs`) and harness-less targets are apart by their nature.
    const TESTS_APART: [(&str, &str); 6] = [
        (
            "crates/tt-ckpt/tests/load_memory.rs",
            "measures its own process's memory",
        ),
        (
            "crates/tt-tracker/tests/track.rs",
            "its trackers measure the test process and its descendants",
        ),
        (
            "crates/tt-train/tests/heap.rs",
            "sets its process's allocator",
        ),
        (
            "crates/tt-lock/tests/trust.rs",
            "changes the process's umask and copies its binary for other users to run",
        ),
        (
            "crates/tt-reserve/tests/backend.rs",
            "owns its process's TORCHTOOLS_LOCK_DIR (so does reserve.rs)",
        ),
        (
            "crates/tt-sys/tests/c10d.rs",
            "needs the c10d feature, which cpu.rs's default build lacks",
        ),
    ];

    /// Each package links at most one ordinary integration test binary beyond the
    /// listed ones: every binary links the crate's whole dependency tree again, and CI
    /// runs on two cores.
    #[test]
    fn each_crate_has_one_integration_test_binary_beyond_the_listed_ones() {
        let root = crate::root();
        let mut problems = Vec::new();
        for (name, dir) in packages() {
            let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
            let mut binaries = Vec::new();
            if dir.join("tests/it/main.rs").exists() {
                binaries.push("tests/it/main.rs".to_owned());
            }
            for entry in std::fs::read_dir(dir.join("tests")).into_iter().flatten() {
                let file = entry.unwrap().file_name().to_string_lossy().into_owned();
                let rel = format!("tests/{file}");
                let path = dir.join(&rel);
                let listed = TESTS_APART
                    .iter()
                    .any(|(apart, _)| root.join(apart) == path);
                let harnessless = manifest.split("[[test]]").any(|t| {
                    t.contains(&format!("path = \"{rel}\"")) && t.contains("harness = false")
                });
                if file.ends_with(".rs") && file != "gpu.rs" && !listed && !harnessless {
                    binaries.push(rel);
                }
            }
            if binaries.len() > 1 {
                problems.push(format!("{name}: {binaries:?}"));
            }
        }
        assert!(
            problems.is_empty(),
            "test binaries to merge into tests/it/ (one module per file), or to list in \
             TESTS_APART with the reason they need a process of their own: {problems:#?}"
        );
    }

    /// The functions of `text` (a Rust file, its `#[cfg(test)]` module cut off) longer
    /// than `limit` lines, from their `fn` line to their closing brace, as `name (N)`.
    /// Braces are counted as written (the format strings of this code base pair them).
    fn long_functions(text: &str, limit: usize) -> Vec<String> {
        let lines: Vec<&str> = text
            .lines()
            .take_while(|l| !l.starts_with("#[cfg(test)]"))
            .collect();
        let mut long = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            let Some(at) = line.find("fn ") else { continue };
            let before = line[..at].trim();
            let is_item = before.is_empty()
                || before.split_whitespace().all(|w| {
                    w.starts_with("pub")
                        || ["const", "async", "unsafe", "extern", "\"C\""].contains(&w)
                });
            if !is_item || line.trim_start().starts_with("//") {
                continue;
            }
            let name: String = line[at + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let (mut depth, mut opened) = (0i64, false);
            for (j, l) in lines[i..].iter().enumerate() {
                if !opened && l.trim_end().ends_with(';') && !l.contains('{') {
                    break; // a declaration without a body
                }
                depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
                opened |= l.contains('{');
                if opened && depth <= 0 {
                    if j + 1 > limit {
                        long.push(format!("{name} ({} lines)", j + 1));
                    }
                    break;
                }
            }
        }
        long
    }

    /// An error's text that is no error value is its `reason`, in every crate: a field
    /// named `message` in a library's source is the other word for it.
    #[test]
    fn error_text_fields_are_named_reason() {
        let root = crate::root();
        let mut files = Vec::new();
        walk(&root.join("crates"), &mut files);
        let mut found = Vec::new();
        for file in files {
            let rel = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .display()
                .to_string();
            if !rel.ends_with(".rs") || !rel.contains("/src/") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                let field = line.trim_start();
                if line.starts_with("        ")
                    && (field.starts_with("message: String,")
                        || field.starts_with("message: &'static str,"))
                {
                    found.push(format!("{rel}:{}", n + 1));
                }
            }
        }
        assert!(
            found.is_empty(),
            "error fields named message, not reason: {found:#?}"
        );
    }

    /// No function outside tests is 100 lines or longer: a long one is cut where a
    /// reader would (the issue that set the rule found 192-line ones).
    #[test]
    fn no_function_outside_tests_reaches_100_lines() {
        assert_eq!(
            long_functions("fn a() {\n    x;\n}\n\nfn b() {\n    y;\n    z;\n}\n", 3),
            ["b (4 lines)"]
        );
        let root = crate::root();
        let mut files = Vec::new();
        walk(&root, &mut files);
        let mut long = Vec::new();
        for file in files {
            let rel = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .to_string_lossy()
                .into_owned();
            let is_test =
                rel.contains("/tests/") || rel.starts_with("tests/") || rel.contains("/benches/");
            if !rel.ends_with(".rs") || is_test || rel.contains("/fuzz/") {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            long.extend(
                long_functions(&text, 99)
                    .into_iter()
                    .map(|f| format!("{rel}: {f}")),
            );
        }
        assert!(long.is_empty(), "functions of 100 lines or more: {long:#?}");
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

    /// The modules a crate root declares, at every depth: each module's path (`a::b`;
    /// the root is ``), and its code without comments, attributes and test modules.
    /// A root's modules sit beside it (`src/lib.rs`, `src/main.rs`, `src/bin/x.rs`,
    /// `examples/x.rs`); a module `a.rs` or `a/mod.rs` keeps its own in `a/`; a
    /// `#[path = "f.rs"]` module is that file, beside the file declaring it; an inline
    /// `mod a { .. }` is a module of its own. A declared module whose file cannot be
    /// read is an error (the check would read nothing of it).
    fn modules_of(root: &Path) -> std::collections::BTreeMap<String, String> {
        let mut out = std::collections::BTreeMap::new();
        let beside = root.parent().unwrap_or(Path::new("."));
        let raw = std::fs::read_to_string(root)
            .unwrap_or_else(|e| panic!("the crate root {}: {e}", root.display()));
        module_text(&raw, beside, beside, "", &mut out);
        out
    }

    /// Reads one module's text (`raw`, as written), its files' directory `dir` (where
    /// `#[path]` files are) and its children's `children`, into `out` under `path`.
    fn module_text(
        raw: &str,
        dir: &Path,
        children: &Path,
        path: &str,
        out: &mut std::collections::BTreeMap<String, String>,
    ) {
        // Tests may use anything; a doc link is not a dependency.
        let raw = without_test_modules(&without_comment_lines(raw));
        let files = path_attributes(&raw);
        let mut text = code(&raw);
        let child_of = |name: &str| match path {
            "" => name.to_owned(),
            _ => format!("{path}::{name}"),
        };
        // Inline modules, cut out of this one's text.
        while let Some((start, open, name)) = inline_module(&text) {
            let end = block_end(&text, open);
            let body = text[open + 1..end.saturating_sub(1)].to_owned();
            let nested = children.join(&name);
            module_text(&body, &nested, &nested, &child_of(&name), out);
            text.replace_range(start..end, " ");
        }
        for line in text.lines().map(str::trim) {
            let line = ["pub(crate) ", "pub(super) ", "pub "]
                .iter()
                .fold(line, |l, p| l.trim_start_matches(p));
            let Some(name) = line.strip_prefix("mod ").and_then(|m| m.strip_suffix(';')) else {
                continue;
            };
            if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let (file, own) = match files.get(name) {
                Some(f) => {
                    let file = dir.join(f);
                    let own = match file.file_name().is_some_and(|n| n == "mod.rs") {
                        true => file.parent().unwrap_or(dir).to_owned(),
                        false => file.with_extension(""),
                    };
                    (file, own)
                }
                None => {
                    let flat = children.join(format!("{name}.rs"));
                    let nested = children.join(name).join("mod.rs");
                    (
                        if flat.is_file() { flat } else { nested },
                        children.join(name),
                    )
                }
            };
            let child_raw = std::fs::read_to_string(&file).unwrap_or_else(|e| {
                panic!(
                    "module {} is declared but its file {} cannot be read: {e}",
                    child_of(name),
                    file.display()
                )
            });
            let file_dir = file.parent().unwrap_or(dir).to_owned();
            module_text(&child_raw, &file_dir, &own, &child_of(name), out);
        }
        out.insert(path.to_owned(), text);
    }

    /// `text` without its whole-line comments (doc comments included).
    fn without_comment_lines(text: &str) -> String {
        text.lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `text` without its `#[cfg(test)] mod NAME { .. }` modules, wherever they are.
    fn without_test_modules(text: &str) -> String {
        let mut text = text.to_owned();
        let mut from = 0;
        while let Some(found) = text[from..].find("#[cfg(test)]") {
            let at = from + found;
            let rest = text[at + "#[cfg(test)]".len()..].trim_start();
            let rest = ["pub(crate) ", "pub "]
                .iter()
                .fold(rest, |r, p| r.trim_start_matches(p));
            let is_module = rest.strip_prefix("mod ").is_some_and(|r| {
                let name_end = r
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(r.len());
                r[name_end..].trim_start().starts_with('{')
            });
            let declared = rest.strip_prefix("mod ").is_some_and(|r| {
                r.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    .trim_start()
                    .starts_with(';')
            });
            if declared {
                // `#[cfg(test)] mod tests;`: its declaration goes, so its file is not read.
                let end = text[at..].find(';').map_or(text.len(), |e| at + e + 1);
                text.replace_range(at..end, " ");
                continue;
            }
            match is_module.then(|| text[at..].find('{')).flatten() {
                Some(open) => {
                    let end = block_end(&text, at + open);
                    text.replace_range(at..end, " ");
                }
                None => from = at + 1,
            }
        }
        text
    }

    /// The files `#[path = "f.rs"] mod NAME;` name: NAME to `f.rs`.
    fn path_attributes(text: &str) -> std::collections::BTreeMap<String, String> {
        let mut files = std::collections::BTreeMap::new();
        for (at, _) in text.match_indices("#[path") {
            let rest = &text[at..];
            let Some(close) = rest.find(']') else {
                continue;
            };
            let Some(file) = rest[..close].split('"').nth(1) else {
                continue;
            };
            // The next `mod NAME` after the attribute (others may come between).
            let Some(m) = rest[close..].find("mod ") else {
                continue;
            };
            let name: String = rest[close + m + 4..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            files.insert(name, file.to_owned());
        }
        files
    }

    /// The first inline module of `text`: where its line starts, its `{` and its name.
    fn inline_module(text: &str) -> Option<(usize, usize, String)> {
        let mut at = 0;
        for line in text.split_inclusive('\n') {
            let trimmed = line.trim_start();
            let item = ["pub(crate) ", "pub(super) ", "pub "]
                .iter()
                .fold(trimmed, |l, p| l.trim_start_matches(p));
            if let Some(rest) = item.strip_prefix("mod ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && rest[name.len()..].trim_start().starts_with('{') {
                    let open = at + line.find('{')?;
                    return Some((at, open, name));
                }
            }
            at += line.len();
        }
        None
    }

    /// Just past the `}` that closes the `{` at `open` (braces in strings and in
    /// character literals do not count); the end of `text` when none does.
    fn block_end(text: &str, open: usize) -> usize {
        let b = text.as_bytes();
        let mut depth = 0usize;
        let mut i = open;
        while i < b.len() {
            match b[i] {
                b'"' => {
                    i += 1;
                    while i < b.len() && b[i] != b'"' {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                }
                b'\'' if i + 2 < b.len() && b[i + 2] == b'\'' => i += 2,
                b'\'' if i + 1 < b.len() && b[i + 1] == b'\\' => {
                    i += 2;
                    while i < b.len() && b[i] != b'\'' {
                        i += 1;
                    }
                }
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        b.len()
    }

    /// The items each module re-exports (`pub use m::Item;`, groups and aliases too):
    /// `(module, item)` to the module the item comes from.
    fn reexports(
        modules: &std::collections::BTreeMap<String, String>,
    ) -> std::collections::BTreeMap<(String, String), String> {
        let mut item_of = std::collections::BTreeMap::new();
        for (module, text) in modules {
            for head in ["pub use ", "pub(crate) use "] {
                for (at, _) in text.match_indices(head) {
                    for path in use_tree(&text[at + head.len()..]) {
                        let path = path.trim_start_matches("self::");
                        let (base, rest) = match path.strip_prefix("crate::") {
                            Some(rest) => (String::new(), rest),
                            None => (module.clone(), path),
                        };
                        let Some(item) = rest.rsplit("::").next() else {
                            continue;
                        };
                        let from = resolve(modules, &base, rest, &Default::default());
                        if from != *module {
                            item_of.insert((module.clone(), item.to_owned()), from);
                        }
                    }
                }
            }
        }
        item_of
    }

    /// The module a path names, read from `base`: through its child modules as far as
    /// they go, then through an item one of them re-exports.
    fn resolve(
        modules: &std::collections::BTreeMap<String, String>,
        base: &str,
        path: &str,
        item_of: &std::collections::BTreeMap<(String, String), String>,
    ) -> String {
        let mut at = base.to_owned();
        for segment in path.split("::") {
            let name: String = segment
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let child = if at.is_empty() {
                name.clone()
            } else {
                format!("{at}::{name}")
            };
            if modules.contains_key(&child) {
                at = child;
            } else {
                if let Some(from) = item_of.get(&(at.clone(), name)) {
                    at = from.clone();
                }
                break;
            }
        }
        at
    }

    /// Which modules each module of a crate root names, through `crate::`, `super::`
    /// (as often as written) or an item a module re-exports. A module naming its own
    /// ancestor or descendant is not counted (that is what holds it, or what it holds),
    /// nor is a crate's `error` module, every module's error type.
    fn module_graph(root: &Path) -> std::collections::BTreeMap<String, BTreeSet<String>> {
        let modules = modules_of(root);
        let item_of = reexports(&modules);
        let related = |a: &str, b: &str| {
            a.is_empty()
                || b.is_empty()
                || a == b
                || a.starts_with(&format!("{b}::"))
                || b.starts_with(&format!("{a}::"))
        };
        let mut graph = std::collections::BTreeMap::new();
        for (module, text) in &modules {
            let mut uses = BTreeSet::new();
            for (at, _) in text.match_indices("crate::") {
                if at > 0 && text[..at].ends_with("::") {
                    continue; // `$crate::` or a path's middle
                }
                for path in use_tree(&text[at + "crate::".len()..]) {
                    uses.insert(resolve(&modules, "", &path, &item_of));
                }
            }
            for (at, _) in text.match_indices("super::") {
                if at > 0 && text[..at].ends_with("::") {
                    continue; // counted from the first `super::`
                }
                let mut rest = &text[at..];
                let mut base = module.as_str();
                while let Some(after) = rest.strip_prefix("super::") {
                    base = base.rsplit_once("::").map_or("", |(parent, _)| parent);
                    rest = after;
                }
                for path in use_tree(rest) {
                    uses.insert(resolve(&modules, base, &path, &item_of));
                }
            }
            uses.retain(|m| !related(module, m) && m != "error");
            graph.insert(module.clone(), uses);
        }
        graph.remove("");
        graph
    }

    /// The circles among one crate root's modules (see `module_graph`), each as
    /// `a -> b -> a`.
    fn circles_in(root: &Path) -> Vec<String> {
        let graph = module_graph(root);
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

    /// Every crate root of a package: its library, its binary, each `src/bin/` binary
    /// and each example.
    fn crate_roots(package: &Path) -> Vec<std::path::PathBuf> {
        let mut roots: Vec<_> = ["src/lib.rs", "src/main.rs"]
            .iter()
            .map(|r| package.join(r))
            .filter(|r| r.is_file())
            .collect();
        for dir in ["src/bin", "examples"] {
            let Ok(entries) = std::fs::read_dir(package.join(dir)) else {
                continue;
            };
            let mut files: Vec<_> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "rs"))
                .collect();
            files.sort();
            roots.extend(files);
        }
        roots
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
            let circles = circles_in(&dir.path().join("lib.rs"));
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
                circles_in(&dir.path().join("lib.rs")),
                Vec::<String>::new(),
                "{a:?} / {b:?}"
            );
        }
    }

    /// The check reads a binary's root as a library's, and modules at every depth: a
    /// circle between a nested module and a top one is seen, through the nested
    /// module's parent's re-export too; a module naming its parent (`super::`) or its
    /// child is not a circle.
    #[test]
    fn the_module_check_reads_binaries_and_nested_modules() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("main.rs", "mod commands;\nmod store;\nfn main() {}\n");
        write(
            "commands/mod.rs",
            "pub(crate) mod jobs;\npub(crate) use jobs::Args;\nfn f() -> jobs::Args { todo!() }\n",
        );
        write(
            "commands/jobs.rs",
            "use super::Args;\nuse crate::store::Store;\n",
        );
        write("store.rs", "pub struct Store;\n");
        let main = dir.path().join("main.rs");
        assert_eq!(circles_in(&main), Vec::<String>::new());
        for back in [
            "use crate::commands::jobs::Args;",
            "use crate::commands::Args;",
            "use super::commands::jobs;",
        ] {
            write("store.rs", &format!("{back}\npub struct Store;\n"));
            let circles = circles_in(&main);
            assert!(
                circles.contains(&"commands::jobs -> store -> commands::jobs".to_owned()),
                "{back}: {circles:?}"
            );
        }
    }

    /// The check reads inline modules as modules of their own, `#[path]` modules from
    /// their file, and code after a test module; a declared module without its file
    /// is an error, not an empty module.
    #[test]
    fn the_module_check_reads_inline_and_path_modules_and_code_after_tests() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        let lib = dir.path().join("lib.rs");
        // An inline module and a top one naming each other.
        write(
            "lib.rs",
            "mod top;\nmod inner {\n    use crate::top::T;\n    pub struct I;\n}\n",
        );
        write(
            "top.rs",
            "pub struct T;\nfn f() -> crate::inner::I { todo!() }\n",
        );
        assert!(
            circles_in(&lib).contains(&"inner -> top -> inner".to_owned()),
            "{:?}",
            circles_in(&lib)
        );
        // A `#[path]` module, and code after a test module.
        write(
            "lib.rs",
            "mod top;\n#[path = \"elsewhere/named.rs\"]\nmod other;\n",
        );
        write("elsewhere/named.rs", "use crate::top::T;\npub struct O;\n");
        write(
            "top.rs",
            "pub struct T;\n#[cfg(test)]\nmod tests {\n    fn f() { let _ = \"}\"; }\n}\nfn g() -> crate::other::O { todo!() }\n",
        );
        assert!(
            circles_in(&lib).contains(&"other -> top -> other".to_owned()),
            "{:?}",
            circles_in(&lib)
        );
        // A module whose file is gone.
        write("lib.rs", "mod top;\nmod gone;\n");
        let missing = std::panic::catch_unwind(|| circles_in(&lib));
        let message = missing
            .err()
            .and_then(|e| e.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(
            message.contains("module gone is declared but its file"),
            "{message}"
        );
    }

    /// A module that names another which names it back (directly or around a circle)
    /// means a helper sits in the wrong file: move it to a leaf.
    #[test]
    fn no_crate_has_modules_that_import_each_other_in_circles() {
        let root = crate::root();
        let mut packages = vec![root.clone(), root.join("xtask")];
        packages.extend(
            std::fs::read_dir(root.join("crates"))
                .unwrap()
                .flatten()
                .map(|e| e.path()),
        );
        let mut circles = Vec::new();
        let mut roots = 0;
        for package in packages {
            for file in crate_roots(&package) {
                roots += 1;
                let rel = file
                    .strip_prefix(&root)
                    .unwrap_or(&file)
                    .display()
                    .to_string();
                circles.extend(circles_in(&file).into_iter().map(|c| format!("{rel}: {c}")));
            }
        }
        // Every library and binary, the CLI's included, and the examples.
        assert!(roots >= 25, "only {roots} crate roots found");
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
