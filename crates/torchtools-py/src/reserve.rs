//! `reserve_gpu_for_training`: tt-reserve's lock, queue and fence, held by a Python
//! object. The same queue, `locks`, `top` and `usage` as the `torchtools` command's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use tt_device::Bytes;
use tt_lock::{GpuSpec, Holder};
use tt_reserve::ReserveOptions;

use crate::errors::{reserve_error, BadRequestError};

/// How often a wait for GPUs looks at Python's signals (Ctrl-C).
const SIGNAL_EVERY: Duration = Duration::from_millis(100);

/// GPUs reserved for this process: their locks, held, and their fences, raised, until
/// [`Reservation::release`] (or the object is collected, or the process ends).
#[pyclass(module = "torchtools._native")]
pub(crate) struct Reservation {
    inner: Mutex<Option<tt_reserve::Reservation>>,
    gpus: Vec<String>,
    visible: String,
    ordinal: Option<usize>,
    fenced: u64,
}

#[pymethods]
impl Reservation {
    /// Waits in the queue (as `blocking` and `timeout` say) and takes the GPUs:
    /// `gpus` as users name them (`"0"`, a UUID or a prefix, `"cuda:1"`, `"auto"`),
    /// `count` of them for `auto`; a fence leaves `training_reserved_bytes +
    /// safety_margin_bytes` free on each (`fence=False`: the lock alone); `share`
    /// shares one GPU by memory budget (`training_reserved_bytes`). `command` is what
    /// `torchtools locks` shows for this process. Ctrl-C while waiting raises
    /// KeyboardInterrupt; nothing stays held.
    #[new]
    #[pyo3(signature = (gpus, count, training_reserved_bytes, safety_margin_bytes, blocking, timeout, fence, share, command))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn new(
        py: Python<'_>,
        gpus: Vec<String>,
        count: Option<usize>,
        training_reserved_bytes: u64,
        safety_margin_bytes: u64,
        blocking: bool,
        timeout: Option<f64>,
        fence: bool,
        share: bool,
        command: Vec<String>,
    ) -> PyResult<Reservation> {
        let gpus = gpus
            .iter()
            .map(|g| g.parse::<GpuSpec>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| BadRequestError::new_err(e.to_string()))?;
        let timeout = match timeout {
            None => None,
            Some(t) => Some(Duration::try_from_secs_f64(t).map_err(|_| {
                BadRequestError::new_err(format!(
                    "timeout={t}: give seconds, 0 or more (or None to wait as long as it takes)"
                ))
            })?),
        };
        let mut holder = Holder::current().running(command);
        if training_reserved_bytes > 0 {
            holder = holder.reserving(Bytes(training_reserved_bytes));
        }
        let options = ReserveOptions {
            gpus,
            count,
            training_reserved_bytes: Bytes(training_reserved_bytes),
            safety_margin_bytes: Bytes(safety_margin_bytes),
            blocking,
            timeout,
            fence,
            holder: Some(holder),
            share,
        };
        let reservation = wait_for(py, options)?;
        let gpus = reservation
            .gpus()
            .iter()
            .map(|g| g.key.cuda_visible_entry())
            .collect();
        Ok(Reservation {
            gpus,
            visible: reservation.cuda_visible_devices(),
            ordinal: reservation.ordinal(),
            fenced: reservation.fenced().0,
            inner: Mutex::new(Some(reservation)),
        })
    }

    /// The GPUs reserved, as `CUDA_VISIBLE_DEVICES` names them (empty on a machine
    /// without GPUs).
    #[getter]
    fn gpus(&self) -> Vec<String> {
        self.gpus.clone()
    }

    /// The value for `CUDA_VISIBLE_DEVICES` of a process started to use them.
    #[getter]
    fn cuda_visible_devices(&self) -> String {
        self.visible.clone()
    }

    /// The first reserved GPU's CUDA ordinal in this process (`cuda:N`), when CUDA
    /// shows it.
    #[getter]
    fn ordinal(&self) -> Option<usize> {
        self.ordinal
    }

    /// Bytes held by the fences when they were raised.
    #[getter]
    fn fenced_bytes(&self) -> u64 {
        self.fenced
    }

    /// Whether it is still held.
    #[getter]
    fn held(&self) -> bool {
        self.inner.lock().map(|r| r.is_some()).unwrap_or(false)
    }

    /// Records how the job ended (the usage records show it), for `release`.
    fn set_exit_status(&self, status: i32) {
        if let Ok(mut r) = self.inner.lock() {
            if let Some(r) = r.as_mut() {
                r.set_exit_status(status);
            }
        }
    }

    /// Lowers the fences and releases the locks (again: nothing).
    fn release(&self) {
        if let Ok(mut r) = self.inner.lock() {
            drop(r.take());
        }
    }
}

/// Takes the reservation on a thread of its own, looking at Python's signals while it
/// waits: a KeyboardInterrupt gives up, and what the thread takes afterwards is
/// released at once.
fn wait_for(py: Python<'_>, options: ReserveOptions) -> PyResult<tt_reserve::Reservation> {
    let (tx, rx) = mpsc::channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    let gave_up = Arc::clone(&cancelled);
    std::thread::spawn(move || {
        let taken = tt_reserve::reserve_with(options, |w| eprintln!("torchtools: {w}"));
        if !gave_up.load(Ordering::SeqCst) {
            // A receiver gone meanwhile drops it: released.
            let _ = tx.send(taken);
        }
    });
    let mut rx = rx;
    loop {
        // The receiver goes to the wait and comes back (it cannot be shared).
        let (answer, back) = py.detach(move || (rx.recv_timeout(SIGNAL_EVERY), rx));
        rx = back;
        match answer {
            Ok(taken) => return taken.map_err(reserve_error),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(interrupt) = py.check_signals() {
                    cancelled.store(true, Ordering::SeqCst);
                    return Err(interrupt);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(crate::errors::error(
                    "the reservation's thread ended without an answer",
                ))
            }
        }
    }
}
