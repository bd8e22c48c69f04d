//! The read-only HTTP server of `serve` and `metrics --listen`: hyper's HTTP/1 on
//! tokio, each connection on its own task (a slow client never blocks another), at
//! most [`MAX_CONNECTIONS`] at once and [`MAX_PER_CLIENT`] of one client (an address,
//! and past a few from one local address, a local user known by the socket's owner),
//! each for at most
//! [`MAX_LIFETIME`] (a client that never reads its answers lets go of its slot); a
//! request's head bounded to [`MAX_HEAD`] bytes and read within [`HEAD_TIMEOUT`],
//! `GET`/`HEAD` only, without a body, a target of at most [`MAX_URL`] bytes, and a
//! `Host` that is one of this server's own names ([`Names`]: a page elsewhere that
//! rebinds its name to this address gets nothing); every answer is never cached and
//! never framed.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::exit::Exit;

/// How long the server waits before accepting again after a failed accept.
const ACCEPT_RETRY_AFTER: Duration = Duration::from_millis(50);

/// Connections served at once; more wait to be accepted.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// The most bytes of a request's head (request line and headers) read.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send a request's head (a slow one is dropped).
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request target taken.
pub(crate) const MAX_URL: usize = 2048;
/// Connections of one client at once; more are closed as they come.
pub(crate) const MAX_PER_CLIENT: usize = 32;
/// Connections from one address counted as that address's before each further one is
/// told apart by its socket's owner (reading the kernel's socket table costs
/// milliseconds on a busy machine: only a crowded address pays it).
const BY_ADDRESS_FIRST: usize = 8;
/// The longest a connection is kept, whatever its client does (a browser opens a new
/// one for its next request).
pub(crate) const MAX_LIFETIME: Duration = Duration::from_secs(30);

/// The names a request may give as its `Host`: this server's own. Loopback names, this
/// machine's name, the address it listens on, the names given with `--host`, and any
/// address written as numbers (a page can only rebind a name, never an address).
#[derive(Debug, Clone)]
pub(crate) struct Names(Vec<String>);

impl Names {
    /// The names of a server bound to `bound`, with `given` (`--host`).
    pub(crate) fn of(bound: SocketAddr, given: &[String]) -> Names {
        let mut names = vec!["localhost".to_owned(), tt_device::host_name()];
        if !bound.ip().is_unspecified() {
            names.push(bound.ip().to_string());
        }
        names.extend(given.iter().cloned());
        Names(
            names
                .into_iter()
                .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
                .collect(),
        )
    }

    /// Whether a request whose `Host` header is `host` is for this server.
    pub(crate) fn allow(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        // `[::1]:9836`, `name:9836`, `name`.
        let name = match host.strip_prefix('[') {
            Some(rest) => rest.split_once(']').map_or("", |(addr, _)| addr),
            None => host
                .rsplit_once(':')
                .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
                .map_or(host.as_str(), |(name, _)| name),
        };
        let name = name.trim_end_matches('.');
        !name.is_empty()
            && (name.parse::<IpAddr>().is_ok()
                || name.ends_with(".localhost")
                || self.0.iter().any(|n| n == name))
    }
}

/// Who a connection is from, for [`MAX_PER_CLIENT`]: its address, and past
/// [`BY_ADDRESS_FIRST`] connections from one local address, the uid that owns the
/// client's socket (read from the kernel's socket table): one local user cannot fill
/// the address that every local user shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Client {
    Uid(u32),
    Addr(IpAddr),
}

impl Client {
    fn of(ours: SocketAddr, peer: SocketAddr) -> Client {
        socket_owner(ours, peer).map_or(Client::Addr(peer.ip()), Client::Uid)
    }
}

/// The uid owning the socket at `peer` connected to `ours`, where that socket is on
/// this machine (in this network namespace): its line in `/proc/net/tcp` or `tcp6`.
fn socket_owner(ours: SocketAddr, peer: SocketAddr) -> Option<u32> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let (local, remote, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
                let same = |text: &str, addr: SocketAddr| {
                    proc_net_addr(text).is_some_and(|a| same_endpoint(a, addr))
                };
                (same(local, peer) && same(remote, ours))
                    .then(|| uid.parse().ok())
                    .flatten()
            })
        })
}

/// Whether two endpoints are one, an IPv4 address and its IPv6-mapped form alike.
fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    let plain = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    a.port() == b.port() && plain(a.ip()) == plain(b.ip())
}

/// An address as `/proc/net/tcp{,6}` writes it: the address's bytes in words of four,
/// each printed as the machine's integer (`0100007F:1F90` is 127.0.0.1:8080 here).
fn proc_net_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..addr.len()).step_by(8) {
        let word = u32::from_str_radix(addr.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Each client's connections open now.
#[derive(Default)]
struct Open(Mutex<HashMap<Client, usize>>);

impl Open {
    /// Counts one more of `client`'s, unless it has [`MAX_PER_CLIENT`] already.
    /// How many of `client`'s connections are open.
    fn count(&self, client: Client) -> usize {
        let open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        open.get(&client).copied().unwrap_or(0)
    }

    fn enter(self: &Arc<Self>, client: Client) -> Option<Entered> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(client).or_insert(0);
        if *n >= MAX_PER_CLIENT {
            return None;
        }
        *n += 1;
        Some(Entered(Arc::clone(self), client))
    }
}

/// One connection counted in [`Open`] until dropped.
struct Entered(Arc<Open>, Client);

impl Drop for Entered {
    fn drop(&mut self) {
        let mut open = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}

/// An answer.
pub(crate) type Response = hyper::Response<http_body_util::Full<hyper::body::Bytes>>;

/// A request that passed the checks: what the routes read of it.
pub(crate) struct Get {
    /// The path, without the query.
    pub(crate) path: String,
    /// The `Accept` header, if any.
    pub(crate) accept: Option<String>,
}

/// Binds `addr` for `option` (`--listen`): an error saying what to change when taken.
pub(crate) fn bind(addr: SocketAddr) -> Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr).map_err(|e| {
        Exit::usage(format!(
            "--listen {addr}: cannot listen there: {e} (another port, or another address)"
        ))
    })?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// An answer with `status`, content type `kind` and `body`, with the headers every
/// answer carries (never cached, never framed, no script but the page's own).
pub(crate) fn response(status: u16, kind: &str, body: impl Into<hyper::body::Bytes>) -> Response {
    let mut response = hyper::Response::new(http_body_util::Full::new(body.into()));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    let mut set = |name: &'static str, value: &str| {
        if let Ok(value) = hyper::header::HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    };
    set("content-type", kind);
    // Never cached: each load is the machine as it is; nothing framed elsewhere.
    set("cache-control", "no-store");
    set("x-content-type-options", "nosniff");
    set("x-frame-options", "DENY");
    set(
        "content-security-policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
         connect-src 'self'; img-src 'self' data:",
    );
    response
}

/// A plain-text refusal or error from `who` (`torchtools serve`).
pub(crate) fn text(status: u16, who: &str, why: &str) -> Response {
    response(
        status,
        "text/plain; charset=utf-8",
        format!("{who}: {why}\n"),
    )
}

/// Serves `route` on `listener` until the process is stopped, on two threads of its
/// own, answering requests for `names` only. `who` names the server in refusals.
pub(crate) fn run<R, F>(
    listener: std::net::TcpListener,
    who: &'static str,
    names: Names,
    route: R,
) -> Result<()>
where
    R: Fn(Get) -> F + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the server's threads")?;
    runtime.block_on(accept(listener, who, Arc::new(names), Arc::new(route)))
}

/// Accepts connections until stopped: each served on its own task.
async fn accept<R, F>(
    listener: std::net::TcpListener,
    who: &'static str,
    names: Arc<Names>,
    route: Arc<R>,
) -> Result<()>
where
    R: Fn(Get) -> F + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let ours = listener.local_addr()?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let open = Arc::new(Open::default());
    loop {
        let slot = Arc::clone(&slots)
            .acquire_owned()
            .await
            .context("the connection limit closed")?;
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors or a connection reset before it was accepted: say
                // it, breathe, go on.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(ACCEPT_RETRY_AFTER).await;
                continue;
            }
        };
        // Closed at once past the client's share of the slots.
        // Only a process of this machine connects from a loopback address or from the
        // address it listens on.
        let local = peer.ip().is_loopback() || peer.ip() == ours.ip();
        let crowded = open.count(Client::Addr(peer.ip())) >= BY_ADDRESS_FIRST;
        let client = if local && crowded {
            Client::of(ours, peer)
        } else {
            Client::Addr(peer.ip())
        };
        let Some(entered) = open.enter(client) else {
            drop(stream);
            continue;
        };
        let route = Arc::clone(&route);
        let names = Arc::clone(&names);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let route = Arc::clone(&route);
                let names = Arc::clone(&names);
                async move {
                    let answer = match checked(&request, &names) {
                        Ok(get) => route(get).await,
                        Err((status, why)) => text(status, who, why),
                    };
                    Ok::<_, std::convert::Infallible>(answer)
                }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .max_buf_size(MAX_HEAD)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            match tokio::time::timeout(MAX_LIFETIME, served).await {
                Ok(Err(e)) => tracing::debug!("a client's connection ended: {e}"),
                Err(_) => tracing::debug!("a client's connection reached its lifetime"),
                Ok(Ok(())) => {}
            }
            drop(entered);
            drop(slot);
        });
    }
}

/// The checks every request passes before any work: for one of `names`, `GET` (or
/// `HEAD`), no body, a target of at most [`MAX_URL`] bytes. The refusal's status and
/// reason otherwise.
fn checked(
    request: &hyper::Request<hyper::body::Incoming>,
    names: &Names,
) -> Result<Get, (u16, &'static str)> {
    use hyper::body::Body;
    let host = request
        .headers()
        .get(hyper::header::HOST)
        .and_then(|v| v.to_str().ok());
    if !host.is_some_and(|h| names.allow(h)) {
        return Err((
            421,
            "not a name of this server: use its address, localhost, or a name given \
             with --host",
        ));
    }
    if !matches!(*request.method(), hyper::Method::GET | hyper::Method::HEAD) {
        return Err((405, "read-only: GET only"));
    }
    if request.body().size_hint().lower() > 0 || request.body().size_hint().upper().is_none() {
        return Err((413, "a GET has no body"));
    }
    if request.uri().to_string().len() > MAX_URL {
        return Err((414, "the address is too long"));
    }
    Ok(Get {
        path: request.uri().path().to_owned(),
        accept: request
            .headers()
            .get("accept")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_servers_names_and_addresses_are_answered() {
        let bound: SocketAddr = "0.0.0.0:9836".parse().unwrap_or_else(|e| panic!("{e}"));
        let names = Names::of(bound, &["gpu1.lab.example".to_owned()]);
        for ok in [
            "127.0.0.1:9836",
            "localhost:9836",
            "LOCALHOST",
            "[::1]:9836",
            "10.1.2.3",
            "gpu1.lab.example.:9836",
            &tt_device::host_name(),
        ] {
            assert!(names.allow(ok), "{ok}");
        }
        for refused in [
            "attacker.example",
            "attacker.example:9836",
            "",
            ":9836",
            "[::1",
        ] {
            assert!(!names.allow(refused), "{refused}");
        }
    }

    #[test]
    fn the_kernels_socket_table_addresses_are_read() {
        let v4 = proc_net_addr("0100007F:1F90");
        assert_eq!(v4, "127.0.0.1:8080".parse().ok());
        let v6 = proc_net_addr("00000000000000000000000001000000:0050");
        assert_eq!(v6, "[::1]:80".parse().ok());
        assert_eq!(proc_net_addr("zz:1"), None);
        // This test's own connection is found, owned by this process's user.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let ours = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let client = std::net::TcpStream::connect(ours).unwrap_or_else(|e| panic!("{e}"));
        let (_, peer) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(peer, client.local_addr().unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(Client::of(ours, peer), Client::Uid(tt_lock::euid()));
    }
}
