//! Turning a hung test into a failure that says where it hung.
//!
//! A test that waits on a child process, a pipe or a thread can hang for ever when
//! something goes wrong, and a hang is the worst failure: CI runs until its own limit
//! and prints nothing about the cause. [`within`] bounds a test body; past the bound
//! the test fails with [`report`]: every thread of this process and every process
//! below it, with its state, where the kernel has it waiting, and its kernel stack
//! where this user may read it.

use std::fmt::Write as _;
use std::sync::mpsc;
use std::time::Duration;

/// Runs `body` on its own thread and returns what it returns (a panic in it fails the
/// test as usual). If it has not finished after `limit`, the test fails with a
/// [`report`] of this process and its descendants; the body's thread is left behind.
pub fn within<R: Send + 'static>(
    limit: Duration,
    what: &str,
    body: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name(format!("within: {what}"))
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
            let _ = tx.send(result);
        })
        .unwrap();
    match rx.recv_timeout(limit) {
        Ok(Ok(value)) => {
            let _ = worker.join();
            value
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!(
            "{what} did not finish within {limit:?}: it hangs. Where everything waits:\n{}{}",
            report(std::process::id()),
            user_stacks(std::process::id())
        ),
    }
}

/// Every thread of process `root` and every process below it: pid, state, the kernel
/// function it waits in (`wchan`), its command line, and its kernel stack where
/// readable (root only). For hang reports; never fails.
pub fn report(root: u32) -> String {
    let mut out = String::new();
    let mut todo = vec![(root, 0usize)];
    while let Some((pid, depth)) = todo.pop() {
        let indent = "  ".repeat(depth);
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        let _ = writeln!(out, "{indent}process {pid}: {}", cmd.trim_end());
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        for tid in tasks {
            let dir = format!("/proc/{pid}/task/{tid}");
            let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).unwrap_or_default();
            let state = read("stat")
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next().map(str::to_owned))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{indent}  thread {tid} {:?} state {state} waits in {:?}",
                read("comm").trim(),
                read("wchan").trim()
            );
            for frame in read("stack").lines() {
                let _ = writeln!(out, "{indent}    {frame}");
            }
        }
        todo.extend(children(pid).into_iter().map(|c| (c, depth + 1)));
    }
    out
}

/// The child processes of `pid`, from every thread's `children` list (a child forked
/// by any thread is listed under that thread only). Empty once `pid` is gone.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// This process's threads' user-space stacks, from gdb where it is installed (written
/// to a file: gdb stops this process while it writes, so a pipe could fill and wait
/// for ever). Empty when gdb is missing or fails.
fn user_stacks(pid: u32) -> String {
    let file = std::env::temp_dir().join(format!("tt-testkit-hang-{pid}.txt"));
    let ran = std::process::Command::new("timeout")
        .args(["120", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt"])
        .stdin(std::process::Stdio::null())
        .stdout(
            std::fs::File::create(&file).map_or_else(|_| std::process::Stdio::null(), Into::into),
        )
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    let _ = std::fs::remove_file(&file);
    if ran && text.contains("Thread") {
        format!("gdb's view of this process:\n{text}")
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_that_finishes_gives_its_value_and_a_panic_stays_a_panic() {
        assert_eq!(within(Duration::from_secs(60), "sum", || 2 + 2), 4);
        let panic = std::panic::catch_unwind(|| {
            within(Duration::from_secs(60), "boom", || panic!("inside"));
        })
        .unwrap_err();
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"inside"));
    }

    #[test]
    fn a_hang_fails_with_where_this_process_and_its_children_wait() {
        let mut sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let panic = std::panic::catch_unwind(|| {
            within(Duration::from_millis(200), "a wait for ever", || {
                std::thread::sleep(Duration::from_secs(3600))
            });
        })
        .unwrap_err();
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("a wait for ever did not finish"),
            "{message}"
        );
        assert!(
            message.contains(&format!("process {}", std::process::id())),
            "{message}"
        );
        assert!(message.contains("\"within: a wait"), "{message}");
        assert!(
            message.contains(&format!("process {}: sleep 60", sleeper.id())),
            "{message}"
        );
        if std::process::Command::new("gdb")
            .arg("--version")
            .output()
            .is_ok()
        {
            // Where the body's thread sleeps, in user space.
            assert!(message.contains("gdb's view"), "{message}");
            assert!(message.contains("sleep"), "{message}");
        }
    }
}
