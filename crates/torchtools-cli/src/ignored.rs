//! What the views (`locks`, `queue`, `top`, `jobs`, `usage`) say of the records in the
//! lock directory that they did not believe: each names another user than the owner
//! of its file, so another user wrote it. They are shown, never silently dropped.

use tt_lock::Ignored;

/// The lines a view prints under its listing, none when every record was believed:
/// `1 record ignored: PATH: written by uid 65534 (nobody), claims root`.
pub(crate) fn lines(ignored: &[Ignored]) -> Vec<String> {
    match ignored {
        [] => Vec::new(),
        [one] => vec![format!("1 record ignored: {one}")],
        many => std::iter::once(format!("{} records ignored:", many.len()))
            .chain(many.iter().map(|i| format!("  {i}")))
            .collect(),
    }
}

/// Prints [`lines`].
pub(crate) fn say(ignored: &[Ignored]) {
    for line in lines(ignored) {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_ignored_record_is_one_line_naming_writer_and_claim() {
        let forged = Ignored {
            path: "/tmp/torchtools-locks/held-gpu-0.1-2-3-0.json".into(),
            owner_uid: 65_534,
            owner: Some("nobody".into()),
            claims: "root".into(),
            reason: None,
        };
        assert!(lines(&[]).is_empty());
        assert_eq!(
            lines(std::slice::from_ref(&forged)),
            [
                "1 record ignored: /tmp/torchtools-locks/held-gpu-0.1-2-3-0.json: written by \
              uid 65534 (nobody), claims root"
            ]
        );
        let two = lines(&[forged.clone(), forged]);
        assert_eq!(two.len(), 3);
        assert_eq!(two[0], "2 records ignored:");
    }
}
