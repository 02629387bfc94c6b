//! The stand-in for `ffi` in a build without libfabric: nothing can be opened
//! ([`FabricError::NotBuilt`]), so no handle exists and its methods cannot be reached.

use crate::FabricError;
pub use crate::reports::{CmEvent, Completion, EAGAIN};

/// No names without libfabric.
pub fn strerror(code: i32) -> String {
    format!("error {code}")
}

/// No handle of either kind can be made.
enum Never {}

pub struct Listener(Never);

impl Listener {
    pub fn listen(_: &str, _: &str, _: &str, _: usize, _: usize) -> Result<Self, FabricError> {
        Err(FabricError::NotBuilt)
    }
    pub fn poll_ready(&self, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        match self.0 {}
    }
    pub fn port(&mut self) -> Result<u16, FabricError> {
        match self.0 {}
    }
    pub fn provider(&mut self) -> String {
        match self.0 {}
    }
    pub fn accept_with<G>(&mut self, _: &mut impl FnMut() -> Option<G>) -> Result<Option<(Conn, G)>, FabricError> {
        match self.0 {}
    }
}

pub struct Conn(Never);

impl Conn {
    pub fn connect(_: &str, _: &str, _: &str, _: usize, _: usize) -> Result<Self, FabricError> {
        Err(FabricError::NotBuilt)
    }
    pub fn poll_ready(&self, _: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        match self.0 {}
    }
    pub fn poll_cm(&mut self) -> Result<CmEvent, FabricError> {
        match self.0 {}
    }
    pub fn may_wait(&mut self) -> Result<bool, FabricError> {
        match self.0 {}
    }
    pub fn poll_cq(&mut self, _: &mut [Completion; 16]) -> Result<usize, FabricError> {
        match self.0 {}
    }
    pub fn recv_buf(&mut self, _: usize, _: usize, _: usize) -> &[u8] {
        match self.0 {}
    }
    pub fn send_buf(&mut self, _: usize, _: usize, _: usize) -> &mut [u8] {
        match self.0 {}
    }
    pub fn post_recv(&mut self, _: usize, _: usize) -> Result<(), FabricError> {
        match self.0 {}
    }
    pub fn send(&mut self, _: usize, _: usize, _: usize, _: usize) -> Result<(), FabricError> {
        match self.0 {}
    }
    pub fn shutdown(&mut self) {
        match self.0 {}
    }
}
