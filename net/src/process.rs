//! What every dpukv server process does at start besides its telemetry (`telemetry`): a
//! shutdown token cancelled on SIGINT or SIGTERM; and for supervisors, children that do not
//! outlive them.

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_on_signals() -> tokio_util::sync::CancellationToken {
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        t.cancel();
    });
    token
}

/// Makes the process `cmd` starts die (SIGKILL) when this process dies, however it dies — a
/// supervisor killed with SIGKILL leaves no servers behind holding its ports and files. The
/// signal is tied to the thread that spawns the child: spawn from a thread that lives as long as
/// the process (the main thread, say).
pub fn die_with_parent(cmd: &mut tokio::process::Command) {
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it calls prctl(2) and getppid(2) (plain system calls,
    // no allocation, no locks) and builds an io::Error from a raw errno (no allocation).
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // The parent may have died before the call: then nobody will send the signal.
            if rustix::process::getppid() != Some(parent) {
                return Err(std::io::Error::from_raw_os_error(rustix::io::Errno::SRCH.raw_os_error()));
            }
            Ok(())
        });
    }
}
