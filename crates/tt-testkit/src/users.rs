//! Users for tests about a machine of many users: two ordinary, non-root users who
//! use the GPUs (`tt-test-a`, `tt-test-b`), and `nobody` as the vandal. Root reads and
//! writes every file, so a root reader proves nothing about modes and owners: the users
//! who read and decide in such a test are these two.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A user a test runs children as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestUser {
    /// The user's uid.
    pub uid: u32,
    /// Its primary group.
    pub gid: u32,
}

/// The two ordinary users' names.
pub const USER_NAMES: [&str; 2] = ["tt-test-a", "tt-test-b"];

/// The vandal: `nobody` (uid and gid 65534).
pub const VANDAL: TestUser = TestUser {
    uid: 65_534,
    gid: 65_534,
};

/// Serializes the creation of the users among this binary's tests (`useradd` itself
/// locks the password database against other processes).
static CREATING: Mutex<()> = Mutex::new(());

/// The two ordinary test users, created (system users, no home, no login shell) when
/// they do not exist yet. Needs root: `Err` says why not otherwise, or what `useradd`
/// said.
pub fn two_users() -> Result<[TestUser; 2], String> {
    let _turn = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = [VANDAL; 2];
    for (i, name) in USER_NAMES.iter().enumerate() {
        out[i] = match lookup(name) {
            Some(user) => user,
            None => {
                let made = Command::new("useradd")
                    .args(["--system", "--no-create-home", "--user-group"])
                    .args(["--shell", "/usr/sbin/nologin", name])
                    .output()
                    .map_err(|e| format!("cannot run useradd: {e}"))?;
                match lookup(name) {
                    Some(user) => user,
                    None => {
                        return Err(format!(
                            "useradd {name} failed: {}",
                            String::from_utf8_lossy(&made.stderr).trim()
                        ))
                    }
                }
            }
        };
    }
    Ok(out)
}

/// A user's uid and gid as `id` prints them.
fn lookup(name: &str) -> Option<TestUser> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, name]).output().ok()?;
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    Some(TestUser {
        uid: id("-u")?,
        gid: id("-g")?,
    })
}

/// The two ordinary test users when they exist already (for a child process, which
/// must not create them): `None` otherwise.
pub fn two_users_known() -> Option<[TestUser; 2]> {
    Some([lookup(USER_NAMES[0])?, lookup(USER_NAMES[1])?])
}

/// A copy of the running test binary that every user may run: the test users and
/// `nobody` may not reach `target/`, so children run as them start from this copy, in a
/// 0755 directory of its own. Removed when dropped.
pub struct RunnableCopy {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl RunnableCopy {
    /// Copies this test binary as `name`. Panics (a test's set-up) when it cannot.
    pub fn new(name: &str) -> RunnableCopy {
        let dir = tempfile::tempdir().expect("a temporary directory for the test binary's copy");
        let exe = std::env::current_exe().expect("the test binary's own path");
        let path = dir.path().join(name);
        let runnable = |p: &Path| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
                .unwrap_or_else(|e| panic!("making {} 0755: {e}", p.display()));
        };
        runnable(dir.path());
        std::fs::copy(&exe, &path).expect("copying the test binary");
        runnable(&path);
        RunnableCopy { _dir: dir, path }
    }

    /// The copy's path, to give to `Command::new`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `start` (a `Command`'s `spawn` or `output`), tried again while the kernel refuses to
/// run a file still open for writing (ETXTBSY), for up to ten seconds: a binary just
/// copied stays open in any child another test forked meanwhile, until that child's own
/// exec closes it.
pub fn retry_while_busy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let begun = Instant::now();
    loop {
        match start() {
            Err(e)
                if e.kind() == std::io::ErrorKind::ExecutableFileBusy
                    && begun.elapsed() < Duration::from_secs(10) =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binary_still_open_for_writing_is_run_once_it_is_closed() {
        let copy = RunnableCopy::new("true-copy");
        std::fs::copy("/bin/true", copy.path()).unwrap();
        let writer = std::fs::OpenOptions::new()
            .write(true)
            .open(copy.path())
            .unwrap();
        let busy = Command::new(copy.path()).status();
        assert_eq!(
            busy.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::ExecutableFileBusy)
        );
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(writer);
        });
        let ran = retry_while_busy(|| Command::new(copy.path()).status()).unwrap();
        assert!(ran.success());
        closer.join().unwrap();
    }
}
