//! The network interface that reaches the rendezvous host, for Gloo and NCCL.
//!
//! Gloo binds to the address the host's name resolves to; on many machines that is
//! `127.0.0.1` (`/etc/hosts`), and every rank then offers a loopback address to peers on
//! other hosts ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). Naming the
//! interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`) fixes it; this finds it.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::{Error, Result};

/// The variables that name the interface, Gloo's then NCCL's.
pub const SOCKET_IFNAME_VARS: [&str; 2] = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"];

/// An interface chosen for the ranks, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketInterface {
    /// The interface's name (`eth0`).
    pub name: String,
    /// Its address on the route to the master.
    pub local: IpAddr,
    /// The variables to set (those the user did not set), with the name.
    pub set: Vec<(&'static str, String)>,
}

impl std::fmt::Display for SocketInterface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vars: Vec<String> = self.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        write!(
            f,
            "{} (the interface whose route reaches the master, address {}; this host's name \
             resolves to a loopback address, which peers on other hosts cannot reach)",
            vars.join(" "),
            self.local
        )
    }
}

/// The interface to name for ranks that meet at `master_addr`, when one must be named:
/// `GLOO_SOCKET_IFNAME` unset, `master_addr` not a loopback address, and this host's
/// name resolving to one. `None` when nothing needs setting (a user's own setting
/// always wins); an error naming `master_addr` when no interface reaches it.
pub fn socket_interface_for(master_addr: &str) -> Result<Option<SocketInterface>> {
    let user_set = |v: &str| std::env::var_os(v).is_some_and(|s| !s.is_empty());
    if user_set(SOCKET_IFNAME_VARS[0]) {
        return Ok(None);
    }
    let master = resolve(master_addr).ok_or_else(|| Error::Launch {
        reason: format!(
            "MASTER_ADDR {master_addr:?} does not resolve to an address: give the first \
             node's address or a name this host resolves"
        ),
    })?;
    if master.is_loopback() || !hostname_is_loopback() {
        return Ok(None);
    }
    let (name, local) = route_to(master).ok_or_else(|| Error::Launch {
        reason: format!(
            "no network interface of this host reaches MASTER_ADDR {master_addr} ({master}): \
             check the address and this host's routes (`ip route get {master}`), or name the \
             interface with GLOO_SOCKET_IFNAME"
        ),
    })?;
    let set = SOCKET_IFNAME_VARS
        .iter()
        .filter(|v| !user_set(v))
        .map(|v| (*v, name.clone()))
        .collect();
    Ok(Some(SocketInterface { name, local, set }))
}

fn resolve(host: &str) -> Option<IpAddr> {
    (host, 0).to_socket_addrs().ok()?.map(|a| a.ip()).next()
}

/// This host's name (`gethostname`).
pub(crate) fn host_name() -> Option<String> {
    tt_device::host_name_if_known()
}

/// Whether this host's name resolves to a loopback address (or does not resolve).
fn hostname_is_loopback() -> bool {
    let Some(name) = host_name() else {
        return true;
    };
    match (name.as_str(), 0).to_socket_addrs() {
        Ok(mut addrs) => addrs.next().is_none_or(|a| a.ip().is_loopback()),
        Err(_) => true,
    }
}

/// The local interface (name, address) the kernel routes `to` through: a UDP socket
/// connected there (no packet is sent) tells the source address, and the interface
/// holding it is the one.
fn route_to(to: IpAddr) -> Option<(String, IpAddr)> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(SocketAddr::new(to, 9)).ok()?;
    let local = socket.local_addr().ok()?.ip();
    interface_with(local).map(|name| (name, local))
}

/// The name of the interface that holds `addr` (`getifaddrs`).
fn interface_with(addr: IpAddr) -> Option<String> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|entry| {
        let sa = entry.address?;
        let ip = match (sa.as_sockaddr_in(), sa.as_sockaddr_in6()) {
            (Some(v4), _) => IpAddr::V4(v4.ip()),
            (_, Some(v6)) => IpAddr::V6(v6.ip()),
            _ => return None,
        };
        (ip == addr).then_some(entry.interface_name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_route_is_the_loopback_interface() {
        let (name, local) = route_to("127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(local, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(name, "lo");
        // A loopback master needs no interface named.
        assert_eq!(socket_interface_for("127.0.0.1").unwrap(), None);
        assert!(socket_interface_for("no-such-host.invalid").is_err());
    }
}
