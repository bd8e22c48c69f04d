//! Whose a record is: the owner of its file (`st_uid`), never what the record says of
//! itself. Every record in a lock directory (holder, share, queue ticket, usage log) is
//! written by its own process into a file of its own; a reader believes a record only
//! when the user it names is the file's owner. (A leaf: every reader uses it.)

use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::path::PathBuf;
use std::sync::Mutex;

use serde::Serialize;

/// A record that a reader did not believe: the user it names is not its file's owner
/// (another user wrote it, claiming to be someone else), or, in [`Ignored::reason`], a
/// value in it that nobody's record may hold (a queue number past any real queue's, a
/// budget past the GPU's memory, a start in the future). Views list these ("1 record
/// ignored: ..."), so that a forgery is seen, not silently dropped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Ignored {
    /// The record's file.
    pub path: PathBuf,
    /// The uid that owns the file: who really wrote it.
    pub owner_uid: u32,
    /// That uid's user name here, when the password database has one.
    pub owner: Option<String>,
    /// The user the record claims.
    pub claims: String,
    /// Why a record that names its file's owner is still not believed; `None` for a
    /// record that claims another user.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Ignored {
    /// A record of `claims` in `path` (owned by `owner_uid`) not believed for `reason`.
    pub(crate) fn because(
        path: &std::path::Path,
        owner_uid: u32,
        claims: &str,
        reason: String,
    ) -> Ignored {
        Ignored {
            path: path.to_owned(),
            owner_uid,
            owner: known_name(owner_uid),
            claims: claims.to_owned(),
            reason: Some(reason),
        }
    }
}

/// One line; the file's name and what it claims are another user's text, so control
/// characters are made visible ([`tt_device::printable`]).
impl fmt::Display for Ignored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = format!("{}: written by uid {}", self.path.display(), self.owner_uid);
        if let Some(name) = &self.owner {
            line.push_str(&format!(" ({name})"));
        }
        match &self.reason {
            Some(reason) => line.push_str(&format!(": {reason}")),
            None => line.push_str(&format!(", claims {}", self.claims)),
        }
        f.write_str(&tt_device::printable(&line))
    }
}

/// Uid to user name, cached: readers check every record they read, and the password
/// database may be a file read whole at each lookup.
static NAMES: Mutex<Option<HashMap<u32, Option<String>>>> = Mutex::new(None);

/// The user name of `uid` as records spell it: the password database's name, or
/// `uid N` where it has none. [`crate::Holder::current`] writes the same.
pub fn name_of_uid(uid: u32) -> String {
    known_name(uid).unwrap_or_else(|| format!("uid {uid}"))
}

fn known_name(uid: u32) -> Option<String> {
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names
        .get_or_insert_with(HashMap::new)
        .entry(uid)
        .or_insert_with(|| user_name_of(uid))
        .clone()
}

/// The user name of `uid` from the password database (`getpwuid_r`), as holder records
/// and `torchtools top` show users; `None` when the database has no entry.
pub fn user_name_of(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: an all-zero passwd is a valid value for getpwuid_r to overwrite.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; buf outlives the use of pwd's strings.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: getpwuid_r succeeded, so pw_name is a NUL-terminated string inside buf.
    Some(
        unsafe { CStr::from_ptr(pwd.pw_name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Whether a record claiming the user `claims`, in a file owned by `owner_uid`, is
/// believed: `Err` says why not. The one rule every reader of a lock directory's
/// records applies (the command's job records too).
pub fn check(
    path: &std::path::Path,
    owner_uid: u32,
    claims: &str,
) -> std::result::Result<(), Ignored> {
    if claims == name_of_uid(owner_uid) {
        return Ok(());
    }
    Err(Ignored {
        path: path.to_owned(),
        owner_uid,
        owner: known_name(owner_uid),
        claims: claims.to_owned(),
        reason: None,
    })
}

/// This process's effective uid: whose the files it creates are, and whose records it
/// may write.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Why a file that steers what others' programs do (the machine's policy, a user's
/// hook config) is not read: see [`trusted_text`].
#[derive(Debug)]
pub enum Untrusted {
    /// Not a regular file (a FIFO, a directory, a device).
    NotRegular,
    /// Owned by this uid, none of those trusted.
    Owner(u32),
    /// Writable by its group or others: its permission bits.
    Writable(u32),
    /// Larger than the bound given.
    TooLarge(u64),
    /// It cannot be opened or read.
    Io(std::io::Error),
}

/// The text of `path` when one of `owners` owns it and no other user can write it,
/// read with a bound of `max` bytes (opened without blocking, so a FIFO planted under
/// the name never hangs the reader); `None` when there is no such file.
pub fn trusted_text(
    path: &std::path::Path,
    owners: &[u32],
    max: u64,
) -> std::result::Result<Option<String>, Untrusted> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Untrusted::Io(e)),
    };
    let meta = file.metadata().map_err(Untrusted::Io)?;
    if !meta.is_file() {
        return Err(Untrusted::NotRegular);
    }
    if !owners.contains(&meta.uid()) {
        return Err(Untrusted::Owner(meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(Untrusted::Writable(meta.mode() & 0o7777));
    }
    let mut text = String::new();
    file.take(max + 1)
        .read_to_string(&mut text)
        .map_err(Untrusted::Io)?;
    if text.len() as u64 > max {
        return Err(Untrusted::TooLarge(max));
    }
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_record_is_believed_only_when_it_names_its_files_owner() {
        let path = Path::new("/tmp/torchtools-locks/held/x.json");
        assert_eq!(check(path, 0, "root"), Ok(()));
        let forged = check(path, 65_534, "root").unwrap_err();
        assert_eq!(forged.owner_uid, 65_534);
        assert_eq!(forged.claims, "root");
        let text = forged.to_string();
        assert!(
            text.starts_with("/tmp/torchtools-locks/held/x.json: written by uid 65534")
                && text.ends_with(", claims root"),
            "{text}"
        );
        // A uid without a name is spelled `uid N`, as Holder::current writes it.
        assert_eq!(check(path, 4_000_000_123, "uid 4000000123"), Ok(()));
        assert!(check(path, 4_000_000_123, "root").is_err());
    }
}
