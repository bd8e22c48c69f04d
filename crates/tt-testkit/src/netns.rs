//! Two "hosts" on one machine for multi-node tests: network namespaces joined by a
//! veth pair, host 0 at 10.231.0.1 and host 1 at 10.231.0.2 (interfaces
//! `tt<tag>av` and `tt<tag>bv`), torn down on drop. Needs root, as mounts do.

use std::process::Command;

/// The two namespaces.
pub struct TwoHosts {
    names: [String; 2],
}

impl TwoHosts {
    /// Makes them (`tag`: a few letters unique to the test). `None`, after a printed
    /// "SKIPPED" line, where that needs root and `TORCHTOOLS_TEST_NO_MOUNT` says why it
    /// cannot run; a failure otherwise.
    pub fn new(tag: &str) -> Option<TwoHosts> {
        let names = [format!("tt{tag}a"), format!("tt{tag}b")];
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        for n in &names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        let (a, b) = (names[0].as_str(), names[1].as_str());
        let (va, vb) = (format!("{a}v"), format!("{b}v"));
        let ok = ip(&["netns", "add", a])
            && ip(&["netns", "add", b])
            && ip(&[
                "link", "add", &va, "netns", a, "type", "veth", "peer", &vb, "netns", b,
            ])
            && ip(&["-n", a, "addr", "add", "10.231.0.1/24", "dev", &va])
            && ip(&["-n", b, "addr", "add", "10.231.0.2/24", "dev", &vb])
            && ip(&["-n", a, "link", "set", &va, "up"])
            && ip(&["-n", b, "link", "set", &vb, "up"])
            && ip(&["-n", a, "link", "set", "lo", "up"])
            && ip(&["-n", b, "link", "set", "lo", "up"]);
        let hosts = TwoHosts { names };
        if ok {
            return Some(hosts);
        }
        crate::skip_knowingly(
            "two network namespaces (ip netns needs root)",
            &format!(
                "cannot make two network namespaces (`ip netns add` needs root): run as root, \
                 or set {}=<why> to skip this test knowingly",
                crate::NO_MOUNT_ENV
            ),
        );
        None
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> &'static str {
        ["10.231.0.1", "10.231.0.2"][i]
    }

    /// Host `i`'s namespace's name (`ip netns`).
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// Host `i`'s interface toward the other.
    pub fn interface(&self, i: usize) -> String {
        format!("{}v", self.names[i])
    }

    /// `program` on host `i` (`ip netns exec`), with no interface variable set.
    pub fn exec(&self, i: usize, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i], program])
            .env_remove("GLOO_SOCKET_IFNAME")
            .env_remove("NCCL_SOCKET_IFNAME");
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}
