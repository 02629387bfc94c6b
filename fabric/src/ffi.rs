//! The only `unsafe` of the crate: the shim's functions (shim/dkf.c) behind owned handles.
//!
//! Safety argument, once for the module: every handle is a non-null pointer the shim returned
//! and that only its owner ([`Listener`] or [`Conn`]) holds; the owner frees it exactly once, in
//! `Drop`; every call takes `&mut self`, so calls on one handle never overlap (the shim is not
//! thread-safe per handle); buffer indexes are checked against the connection's `nbufs` before a
//! call, and buffer slices borrow the handle, so none outlives it. A posted buffer is not handed
//! out as a slice until its completion came back ([`crate::stream`] keeps that rule: it takes a
//! receive buffer's slice only after its completion and before posting it again, and a send
//! buffer's only while no send of it is in flight). A handle's wait descriptors are registered
//! with the reactor by the handle itself and deregistered in its `Drop` before libfabric closes
//! them.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::task::{Context, Poll};

use tokio::io::unix::AsyncFd;

use crate::FabricError;

#[repr(C)]
struct DkfListener {
    _private: [u8; 0],
}
#[repr(C)]
struct DkfConn {
    _private: [u8; 0],
}
/// libfabric's `struct fi_info` (a connection request), never read here.
#[repr(C)]
struct FiInfo {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn dkf_load() -> c_int;
    fn dkf_load_error() -> *const c_char;
    fn dkf_strerror(code: c_int) -> *const c_char;
    fn dkf_listen(
        prov: *const c_char,
        node: *const c_char,
        service: *const c_char,
        bufsize: usize,
        nbufs: usize,
        out: *mut *mut DkfListener,
    ) -> c_int;
    fn dkf_listener_fd(l: *mut DkfListener) -> c_int;
    fn dkf_listener_port(l: *mut DkfListener) -> c_int;
    fn dkf_listener_provider(l: *mut DkfListener) -> *const c_char;
    fn dkf_listener_next(l: *mut DkfListener, req: *mut *mut FiInfo) -> c_int;
    fn dkf_listener_accept_req(l: *mut DkfListener, req: *mut FiInfo, out: *mut *mut DkfConn) -> c_int;
    fn dkf_listener_reject_req(l: *mut DkfListener, req: *mut FiInfo);
    fn dkf_listener_close(l: *mut DkfListener);
    fn dkf_connect(
        prov: *const c_char,
        node: *const c_char,
        service: *const c_char,
        bufsize: usize,
        nbufs: usize,
        out: *mut *mut DkfConn,
    ) -> c_int;
    fn dkf_conn_eq_fd(c: *mut DkfConn) -> c_int;
    fn dkf_conn_cq_fd(c: *mut DkfConn) -> c_int;
    fn dkf_conn_poll_cm(c: *mut DkfConn) -> c_int;
    fn dkf_conn_trywait(c: *mut DkfConn) -> c_int;
    fn dkf_conn_buf(c: *mut DkfConn, i: usize) -> *mut u8;
    fn dkf_conn_post_recv(c: *mut DkfConn, i: usize) -> c_int;
    fn dkf_conn_send(c: *mut DkfConn, i: usize, len: usize) -> c_int;
    fn dkf_conn_poll_cq(c: *mut DkfConn, out: *mut Completion, max: usize) -> c_int;
    fn dkf_conn_shutdown(c: *mut DkfConn);
    fn dkf_conn_close(c: *mut DkfConn);
}

pub use crate::reports::{CmEvent, Completion, EAGAIN};

/// libfabric's name for an error code.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a static, NUL-terminated string for any code.
    unsafe { CStr::from_ptr(dkf_strerror(code)) }.to_string_lossy().into_owned()
}

/// Loads libfabric (once per process): [`FabricError::Unavailable`] if it is not installed.
fn load() -> Result<(), FabricError> {
    // SAFETY: dkf_load is idempotent and thread-safe (pthread_once); dkf_load_error returns a
    // static NUL-terminated buffer, written once before dkf_load first returns.
    if unsafe { dkf_load() } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    Err(FabricError::Unavailable(unsafe { CStr::from_ptr(dkf_load_error()) }.to_string_lossy().into_owned()))
}

fn check(what: &'static str, r: c_int) -> Result<c_int, FabricError> {
    if r < 0 { Err(FabricError::Call { what, code: -r, message: strerror(-r) }) } else { Ok(r) }
}

fn cstr(s: &str) -> Result<CString, FabricError> {
    CString::new(s).map_err(|_| FabricError::Address(format!("{s:?} holds a NUL byte")))
}

/// A descriptor libfabric owns, watched by the reactor (never closed here).
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Registers `fds` (distinct ones once) with the current runtime's reactor.
fn watch(fds: &[c_int]) -> std::io::Result<Vec<AsyncFd<Fd>>> {
    let mut out: Vec<AsyncFd<Fd>> = Vec::with_capacity(fds.len());
    for &fd in fds {
        if out.iter().any(|w| w.get_ref().0 == fd) {
            continue;
        }
        // SAFETY: the descriptor is open (libfabric returned it for an open object) and stays
        // open while registered: the handle that owns both drops its registrations first.
        let w = unsafe { AsyncFd::register(Fd(fd)) }.map_err(|e| e.into_parts().1)?;
        out.push(w);
    }
    Ok(out)
}

/// Ready when any of `fds` became readable since it was last found idle (then cleared).
fn poll_any(fds: &[AsyncFd<Fd>], cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
    let mut ready = false;
    for fd in fds {
        match fd.poll_read_ready(cx) {
            Poll::Ready(Ok(mut g)) => {
                g.clear_ready();
                ready = true;
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
    }
    if ready { Poll::Ready(Ok(())) } else { Poll::Pending }
}

/// A listening passive endpoint, its wait descriptor registered with the reactor.
pub struct Listener {
    ptr: NonNull<DkfListener>,
    fds: Vec<AsyncFd<Fd>>,
}

// SAFETY: the handle is used by one owner at a time (`&mut self`); libfabric objects may be used
// from any thread when calls are serialised (FI_THREAD_DOMAIN).
unsafe impl Send for Listener {}

impl Listener {
    /// Listens on `node:service` with provider `prov`; connections get `nbufs` buffers of
    /// `bufsize` bytes each way. Needs a Tokio runtime (its reactor watches the listener).
    pub fn listen(prov: &str, node: &str, service: &str, bufsize: usize, nbufs: usize) -> Result<Self, FabricError> {
        load()?;
        let (p, n, s) = (cstr(prov)?, cstr(node)?, cstr(service)?);
        let mut out = std::ptr::null_mut();
        // SAFETY: valid C strings that outlive the call; `out` is written on success only.
        check("listen", unsafe { dkf_listen(p.as_ptr(), n.as_ptr(), s.as_ptr(), bufsize, nbufs, &mut out) })?;
        let ptr =
            NonNull::new(out).ok_or(FabricError::Call { what: "listen", code: 0, message: "no handle".into() })?;
        let mut l = Listener { ptr, fds: Vec::new() };
        // SAFETY: see the module documentation.
        let fd = check("listener wait descriptor", unsafe { dkf_listener_fd(l.ptr.as_ptr()) })?;
        l.fds = watch(&[fd])?;
        Ok(l)
    }

    /// The port it listens on.
    pub fn port(&mut self) -> Result<u16, FabricError> {
        // SAFETY: see the module documentation.
        check("listener address", unsafe { dkf_listener_port(self.ptr.as_ptr()) }).map(|p| p as u16)
    }

    /// The provider it uses (the one asked for, or libfabric's first choice).
    pub fn provider(&mut self) -> String {
        // SAFETY: see the module documentation; the name is a NUL-terminated string the
        // listener's info holds, copied before the borrow ends.
        let p = unsafe { dkf_listener_provider(self.ptr.as_ptr()) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: as above (not null).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Ready when a connection request may be waiting.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        poll_any(&self.fds, cx)
    }

    /// The next connection request, accepted when `admit` gives what the connection is to hold
    /// (a permit, a reservation), refused at once — the peer's connect fails — when it gives
    /// nothing; None: no request waiting. Needs a Tokio runtime.
    pub fn accept_with<G>(&mut self, admit: &mut impl FnMut() -> Option<G>) -> Result<Option<(Conn, G)>, FabricError> {
        loop {
            let mut req = std::ptr::null_mut();
            // SAFETY: see the module documentation; `req` is written on success only.
            match unsafe { dkf_listener_next(self.ptr.as_ptr(), &mut req) } {
                r if r == -EAGAIN => return Ok(None),
                r => check("connection requests", r)?,
            };
            if req.is_null() {
                continue;
            }
            let Some(held) = admit() else {
                // SAFETY: `req` came from dkf_listener_next and is consumed here, once.
                unsafe { dkf_listener_reject_req(self.ptr.as_ptr(), req) };
                continue;
            };
            let mut out = std::ptr::null_mut();
            // SAFETY: `req` came from dkf_listener_next and is consumed here, once; `out` is
            // written on success only.
            let r = unsafe { dkf_listener_accept_req(self.ptr.as_ptr(), req, &mut out) };
            if r < 0 {
                tracing::debug!(error = %strerror(-r), "accepting a fabric connection failed (refused)");
                continue;
            }
            if let Some(ptr) = NonNull::new(out) {
                return Conn::watched(ptr).map(|c| Some((c, held)));
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.fds.clear();
        // SAFETY: the handle is freed once, here, after its descriptor left the reactor.
        unsafe { dkf_listener_close(self.ptr.as_ptr()) }
    }
}

/// A connection's endpoint, queues and registered buffers (see shim/dkf.c), its wait
/// descriptors registered with the reactor.
pub struct Conn {
    ptr: NonNull<DkfConn>,
    fds: Vec<AsyncFd<Fd>>,
}

// SAFETY: as for `Listener`.
unsafe impl Send for Conn {}

impl Conn {
    /// Starts connecting to `node:service` with provider `prov`. Needs a Tokio runtime.
    pub fn connect(prov: &str, node: &str, service: &str, bufsize: usize, nbufs: usize) -> Result<Self, FabricError> {
        load()?;
        let (p, n, s) = (cstr(prov)?, cstr(node)?, cstr(service)?);
        let mut out = std::ptr::null_mut();
        // SAFETY: valid C strings that outlive the call; `out` is written on success only.
        check("connect", unsafe { dkf_connect(p.as_ptr(), n.as_ptr(), s.as_ptr(), bufsize, nbufs, &mut out) })?;
        let ptr =
            NonNull::new(out).ok_or(FabricError::Call { what: "connect", code: 0, message: "no handle".into() })?;
        Conn::watched(ptr)
    }

    /// Owns `ptr` and registers its queues' descriptors.
    fn watched(ptr: NonNull<DkfConn>) -> Result<Conn, FabricError> {
        let mut c = Conn { ptr, fds: Vec::new() };
        // SAFETY: see the module documentation.
        let eq = check("event queue descriptor", unsafe { dkf_conn_eq_fd(c.ptr.as_ptr()) })?;
        // SAFETY: see the module documentation.
        let cq = check("completion queue descriptor", unsafe { dkf_conn_cq_fd(c.ptr.as_ptr()) })?;
        c.fds = watch(&[cq, eq])?;
        Ok(c)
    }

    /// Ready when either queue may hold something new (ask [`Conn::may_wait`] first).
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        poll_any(&self.fds, cx)
    }

    /// The next connection event.
    pub fn poll_cm(&mut self) -> Result<CmEvent, FabricError> {
        // SAFETY: see the module documentation.
        match unsafe { dkf_conn_poll_cm(self.ptr.as_ptr()) } {
            1 => Ok(CmEvent::Connected),
            2 => Ok(CmEvent::Shutdown),
            r if r == -EAGAIN => Ok(CmEvent::Nothing),
            r => check("connection events", r).map(|_| CmEvent::Nothing),
        }
    }

    /// Whether the caller may wait on the descriptors now (false: poll the queues again).
    pub fn may_wait(&mut self) -> Result<bool, FabricError> {
        // SAFETY: see the module documentation.
        match unsafe { dkf_conn_trywait(self.ptr.as_ptr()) } {
            0 => Ok(true),
            r if r == -EAGAIN => Ok(false),
            r => check("trywait", r).map(|_| false),
        }
    }

    /// Completions into `out`: how many.
    pub fn poll_cq(&mut self, out: &mut [Completion; 16]) -> Result<usize, FabricError> {
        // SAFETY: `out` holds 16 entries, the most the shim writes.
        match unsafe { dkf_conn_poll_cq(self.ptr.as_ptr(), out.as_mut_ptr(), out.len()) } {
            r if r == -EAGAIN => Ok(0),
            r => check("completions", r).map(|n| n as usize),
        }
    }

    /// Receive buffer `i` (of `nbufs`, `bufsize` bytes), to read what its completion delivered.
    pub fn recv_buf(&mut self, i: usize, nbufs: usize, bufsize: usize) -> &[u8] {
        assert!(i < nbufs, "receive buffer {i} of {nbufs}");
        // SAFETY: buffer i lies inside the connection's registered region of 2 × nbufs ×
        // bufsize bytes, lives as long as the handle (borrowed here), and is not posted while
        // the slice lives (see the module documentation).
        unsafe { std::slice::from_raw_parts(dkf_conn_buf(self.ptr.as_ptr(), i), bufsize) }
    }

    /// Send buffer `i` (of `nbufs`, `bufsize` bytes), to fill before sending it.
    pub fn send_buf(&mut self, i: usize, nbufs: usize, bufsize: usize) -> &mut [u8] {
        assert!(i < nbufs, "send buffer {i} of {nbufs}");
        // SAFETY: as for `recv_buf`; send buffers follow the receive buffers in the region, and
        // one that is in flight is not handed out.
        unsafe { std::slice::from_raw_parts_mut(dkf_conn_buf(self.ptr.as_ptr(), nbufs + i), bufsize) }
    }

    /// Posts receive buffer `i` again.
    pub fn post_recv(&mut self, i: usize, nbufs: usize) -> Result<(), FabricError> {
        assert!(i < nbufs, "receive buffer {i} of {nbufs}");
        // SAFETY: see the module documentation.
        check("post receive", unsafe { dkf_conn_post_recv(self.ptr.as_ptr(), i) }).map(|_| ())
    }

    /// Sends the first `len` bytes of send buffer `i`.
    pub fn send(&mut self, i: usize, len: usize, nbufs: usize, bufsize: usize) -> Result<(), FabricError> {
        assert!(i < nbufs && len <= bufsize, "send buffer {i} of {nbufs}, {len} bytes");
        // SAFETY: see the module documentation.
        check("send", unsafe { dkf_conn_send(self.ptr.as_ptr(), i, len) }).map(|_| ())
    }

    /// Shuts the connection down (the peer sees it end).
    pub fn shutdown(&mut self) {
        // SAFETY: see the module documentation.
        unsafe { dkf_conn_shutdown(self.ptr.as_ptr()) }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.fds.clear();
        // SAFETY: the handle is freed once, here, after its descriptors left the reactor.
        unsafe { dkf_conn_close(self.ptr.as_ptr()) }
    }
}
