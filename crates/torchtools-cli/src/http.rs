//! The read-only HTTP server of `serve` and `metrics --listen`: hyper's HTTP/1 on
//! tokio, each connection on its own task (a slow client never blocks another), at
//! most [`MAX_CONNECTIONS`] at once, a request's head bounded to [`MAX_HEAD`] bytes and
//! read within [`HEAD_TIMEOUT`], `GET`/`HEAD` only, without a body, and a target of at
//! most [`MAX_URL`] bytes; every answer is never cached and never framed.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::exit::Exit;

/// Connections served at once; more wait to be accepted.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// The most bytes of a request's head (request line and headers) read.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send a request's head (a slow one is dropped).
pub(crate) const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request target taken.
pub(crate) const MAX_URL: usize = 2048;

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
        Exit(
            2,
            format!("--listen {addr}: cannot listen there: {e} (another port, or another address)"),
        )
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
/// own. `who` names the server in refusals.
pub(crate) fn run<R, F>(listener: std::net::TcpListener, who: &'static str, route: R) -> Result<()>
where
    R: Fn(Get) -> F + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the server's threads")?;
    runtime.block_on(accept(listener, who, Arc::new(route)))
}

/// Accepts connections until stopped: each served on its own task.
async fn accept<R, F>(
    listener: std::net::TcpListener,
    who: &'static str,
    route: Arc<R>,
) -> Result<()>
where
    R: Fn(Get) -> F + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = Arc::clone(&slots)
            .acquire_owned()
            .await
            .context("the connection limit closed")?;
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors or a connection reset before it was accepted: say
                // it, breathe, go on.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let route = Arc::clone(&route);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let route = Arc::clone(&route);
                async move {
                    let answer = match checked(&request) {
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
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!("a client's connection ended: {e}");
            }
            drop(slot);
        });
    }
}

/// The checks every request passes before any work: `GET` (or `HEAD`), no body, a
/// target of at most [`MAX_URL`] bytes. The refusal's status and reason otherwise.
fn checked(request: &hyper::Request<hyper::body::Incoming>) -> Result<Get, (u16, &'static str)> {
    use hyper::body::Body;
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
