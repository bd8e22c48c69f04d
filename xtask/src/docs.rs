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
