use std::path::PathBuf;

/// Errors of tt-ckpt. I/O errors name the operation and the path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The launcher's variables that say which rank writes are wrong (a typo in
    /// `RANK`, one of `RANK` / `WORLD_SIZE` without the other, ...): nothing is opened,
    /// rather than every rank writing or none.
    #[error("which rank writes the checkpoints in {}: {cause}", dir.display())]
    Environment {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong, naming the variable.
        cause: tt_dist::Error,
    },
    /// A filesystem operation failed.
    #[error("{op} {}: {cause}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error (in the message, so not also the `source()`).
        cause: std::io::Error,
    },
    /// The checkpoint's bytes or header are not what was written.
    #[error("{} is not a valid checkpoint: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The safetensors layer refused the tensors (bad shape/size, duplicate name...).
    #[error("cannot write the tensors: {reason}")]
    Tensors {
        /// What was refused, and why.
        reason: String,
    },
    /// A tensor of the file cannot be read as asked (a dtype tch has no kind for, a
    /// copy to a device that failed).
    #[error("cannot read the tensors: {reason}")]
    Unreadable {
        /// Which tensor, and what failed.
        reason: String,
    },
    /// A safetensors file does not fit a VarStore (`TensorFile::load_var_store`); the
    /// VarStore was left unchanged.
    #[error("cannot load {} into the VarStore: {}", path.display(), state_dict_text(missing, unexpected, mismatched, *strict))]
    StateDict {
        /// The file.
        path: PathBuf,
        /// Variables with no tensor of their name.
        missing: Vec<String>,
        /// Tensors with no variable of their name.
        unexpected: Vec<String>,
        /// Names whose shape or dtype does not fit, each with what differs.
        mismatched: Vec<String>,
        /// Whether missing and unexpected names were errors.
        strict: bool,
    },
    /// A value could not be turned into JSON or back.
    #[error("value {key:?}: {cause}")]
    Value {
        /// The value's key.
        key: String,
        /// serde's error (in the message, so not also the `source()`).
        cause: serde_json::Error,
    },
    /// A key or tensor name that is not there.
    #[error("the checkpoint has no {what} named {name:?}")]
    Missing {
        /// "tensor" or "value".
        what: &'static str,
        /// The name asked for.
        name: String,
    },
    /// No valid checkpoint in the directory.
    #[error("no valid checkpoint in {}{}", dir.display(), skipped_text(skipped))]
    NoCheckpoint {
        /// The directory.
        dir: PathBuf,
        /// The files tried and why each was skipped.
        skipped: Vec<(PathBuf, String)>,
    },
    /// A save below steps already in the directory (another run's, or this run's
    /// before a roll-back); nothing was written.
    #[error(
        "{} already holds checkpoints of later steps than {step} ({}): they belong to an \
         earlier run, or to a later point of this one, and saving here would mix two runs. \
         To continue that run, resume from it (load_latest); to start over in this directory, \
         open it with .supersede_newer(), which moves them into {}/superseded/ (nothing is \
         deleted); or save into another directory",
        dir.display(),
        steps_text(newer),
        dir.display()
    )]
    NewerCheckpoints {
        /// The directory.
        dir: PathBuf,
        /// The step being saved.
        step: u64,
        /// The later steps found, lowest first.
        newer: Vec<u64>,
    },
    /// The previous background save failed; this call did nothing else.
    #[error("the previous background save failed (nothing else was done; save again): {0}")]
    PreviousSaveFailed(Box<Error>),
    /// A background save thread could not run to its end.
    #[error("background save: {reason}")]
    SaveThread {
        /// What the thread was doing.
        reason: String,
    },
    /// A tensor name the format cannot hold.
    #[error("tensor name {name:?} is reserved or empty: use another name")]
    BadName {
        /// The name.
        name: String,
    },
}

fn state_dict_text(
    missing: &[String],
    unexpected: &[String],
    mismatched: &[String],
    strict: bool,
) -> String {
    let quoted = |names: &[String]| {
        names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut parts = Vec::new();
    if !mismatched.is_empty() {
        parts.push(format!("does not fit: {}", mismatched.join("; ")));
    }
    if strict && !missing.is_empty() {
        parts.push(format!("missing in the file: {}", quoted(missing)));
    }
    if strict && !unexpected.is_empty() {
        parts.push(format!("unexpected in the file: {}", quoted(unexpected)));
    }
    let mut text = parts.join("; ");
    if strict && !(missing.is_empty() && unexpected.is_empty()) {
        text.push_str(
            " (the names must match the VarStore's paths, e.g. \"l1.weight\"; \
             LoadOptions::non_strict() loads what matches and reports the rest)",
        );
    }
    text
}

fn steps_text(steps: &[u64]) -> String {
    let list: Vec<String> = steps.iter().map(|s| format!("step {s}")).collect();
    list.join(", ")
}

fn skipped_text(skipped: &[(PathBuf, String)]) -> String {
    if skipped.is_empty() {
        return String::new();
    }
    let list: Vec<String> = skipped
        .iter()
        .map(|(p, why)| format!("{}: {why}", p.display()))
        .collect();
    format!(" (skipped: {})", list.join("; "))
}

/// `Result` with tt-ckpt's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |cause| Error::Io { op, path, cause }
}

#[cfg(test)]
mod state_dict_tests {
    use super::*;

    fn message(mismatched: &[&str], strict: bool) -> String {
        Error::StateDict {
            path: PathBuf::from("ckpt-3.safetensors"),
            missing: vec!["l2.bias".into()],
            unexpected: vec!["head.w".into()],
            mismatched: mismatched.iter().map(|s| (*s).to_owned()).collect(),
            strict,
        }
        .to_string()
    }

    #[test]
    fn a_state_dict_that_does_not_fit_says_what_and_how_to_load_anyway() {
        let strict = message(&["l1.weight: shape [4, 2] in the file, [4, 3] here"], true);
        assert_eq!(
            strict,
            "cannot load ckpt-3.safetensors into the VarStore: does not fit: l1.weight: \
             shape [4, 2] in the file, [4, 3] here; missing in the file: \"l2.bias\"; \
             unexpected in the file: \"head.w\" (the names must match the VarStore's \
             paths, e.g. \"l1.weight\"; LoadOptions::non_strict() loads what matches and \
             reports the rest)"
        );
        // Non-strict: only what does not fit, and no advice about names.
        assert_eq!(
            message(&["l1.weight: dtype"], false),
            "cannot load ckpt-3.safetensors into the VarStore: does not fit: l1.weight: dtype"
        );
        assert!(!message(&[], true).contains("does not fit"));
        // The advice about names comes with any name error, and only with one.
        let hint = "the names must match the VarStore's paths";
        let only_missing = state_dict_text(&["l2.bias".into()], &[], &[], true);
        assert!(only_missing.contains(hint), "{only_missing}");
        let only_unexpected = state_dict_text(&[], &["head.w".into()], &[], true);
        assert!(only_unexpected.contains(hint), "{only_unexpected}");
        let only_shape = state_dict_text(&[], &[], &["l1.weight: dtype".into()], true);
        assert!(!only_shape.contains(hint), "{only_shape}");
    }
}
