//! A tmpfs mounted for one test (shared by the storage and node test suites): root mounts it;
//! without root the test is skipped, except under `CI`, where it must run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted for one test, unmounted when dropped.
pub struct Tmpfs {
    dir: PathBuf,
    _parent: Option<tempfile::TempDir>,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` bytes on a new temporary directory; None (after saying why)
    /// when this machine cannot.
    pub fn mount(size: u64) -> Option<Tmpfs> {
        let parent = tempfile::tempdir().expect("tempdir");
        let mut fs = Tmpfs::mount_at(&parent.path().join("mnt"), size)?;
        fs._parent = Some(parent);
        Some(fs)
    }

    /// Mounts a tmpfs of `size` bytes on `dir` (created if missing).
    pub fn mount_at(dir: &Path, size: u64) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).expect("mkdir");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(std::env::var("CI").is_err(), "CI must be able to mount a tmpfs (run as root)");
            eprintln!("skipping: cannot mount a tmpfs here (needs root)");
            return None;
        }
        Some(Tmpfs { dir: dir.to_path_buf(), _parent: None })
    }

    /// Grows (or shrinks) the file system.
    pub fn resize(&self, size: u64) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "remount {}", self.dir.display());
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
