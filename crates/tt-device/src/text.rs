//! Text from other users (commands, host names, job ids in records; other processes'
//! command lines) made safe to print: a terminal obeys control characters, so a
//! command line holding `ESC ]` or `ESC [2J` could retitle or clear the terminal of
//! whoever views it, or forge lines of a view.

use std::borrow::Cow;

/// `text` with every control character (C0, DEL, C1: newlines and tabs included)
/// written as a visible escape (`\x1b`, `\n`, `\u{9b}`); other text unchanged, and not
/// copied when there is nothing to escape.
///
/// ```
/// assert_eq!(tt_device::printable("train.py --lr 3"), "train.py --lr 3");
/// assert_eq!(tt_device::printable("x\x1b[2Jy\n"), "x\\x1b[2Jy\\n");
/// ```
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x80 && c.is_control() => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_character_is_visible_and_nothing_else_changes() {
        assert!(matches!(printable("héllo wörld ✓"), Cow::Borrowed(_)));
        let all: String = (0u32..0xa0).filter_map(char::from_u32).collect();
        let shown = printable(&all);
        assert!(!shown.chars().any(char::is_control), "{shown}");
        assert!(shown.contains("\\x1b") && shown.contains("\\x7f") && shown.contains("\\u{9b}"));
        assert!(shown.contains(" !\"#") && shown.contains("XYZ"));
    }
}
