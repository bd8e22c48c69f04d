use crate::{Error, Result};

fn parse(var: &'static str, value: String) -> Result<u64> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| Error::InvalidEnv { var, value })
}

/// `(WORLD_SIZE, RANK)` from torchrun's variables; `(1, 0)` when neither is set.
pub(crate) fn world_and_rank(lookup: impl Fn(&str) -> Option<String>) -> Result<(u64, u64)> {
    let get = |n: &str| lookup(n).filter(|v| !v.trim().is_empty());
    match (get("WORLD_SIZE"), get("RANK")) {
        (None, None) => Ok((1, 0)),
        (Some(_), None) => Err(Error::PartialEnv {
            set: "WORLD_SIZE",
            missing: "RANK",
        }),
        (None, Some(_)) => Err(Error::PartialEnv {
            set: "RANK",
            missing: "WORLD_SIZE",
        }),
        (Some(w), Some(r)) => Ok((parse("WORLD_SIZE", w)?, parse("RANK", r)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::world_and_rank;

    fn with(vars: &[(&str, &str)]) -> String {
        let lookup = |n: &str| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        };
        match world_and_rank(lookup) {
            Ok(v) => format!("{v:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn torchrun_variables() {
        assert_eq!(with(&[]), "(1, 0)");
        assert_eq!(with(&[("WORLD_SIZE", "4"), ("RANK", "3")]), "(4, 3)");
        assert_eq!(with(&[("WORLD_SIZE", ""), ("RANK", "")]), "(1, 0)");
        insta::assert_snapshot!([
            with(&[("WORLD_SIZE", "4")]),
            with(&[("RANK", "1")]),
            with(&[("WORLD_SIZE", "four"), ("RANK", "0")]),
            with(&[("WORLD_SIZE", "2"), ("RANK", "-1")]),
        ]
        .join("\n"));
    }
}
