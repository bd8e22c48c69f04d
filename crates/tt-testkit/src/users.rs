//! Users for tests about a machine of many users: two ordinary, non-root users who
//! use the GPUs (`tt-test-a`, `tt-test-b`), and `nobody` as the vandal. Root reads and
//! writes every file, so a root reader proves nothing about modes and owners: the users
//! who read and decide in such a test are these two.

use std::process::Command;
use std::sync::Mutex;

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
