//! The crate's one error type.
//!
//! Every fallible call in gradsync returns [`Result`]. Collectives are written so
//! that an error detected by one rank is either detected by every rank (size
//! validation) or surfaces as a transport error instead of a hang or garbage.

/// Errors returned by gradsync.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Ranks passed buffers of different lengths to the same collective.
    /// Returned on *every* rank when validation is on.
    #[error("size mismatch across ranks: this rank passed {local} elements, ranks passed between {min} (rank {min_rank}) and {max} (rank {max_rank})")]
    SizeMismatch {
        /// Length passed on this rank.
        local: u64,
        /// Smallest length passed by any rank.
        min: u64,
        /// Largest length passed by any rank.
        max: u64,
        /// The lowest rank that passed `min`.
        min_rank: usize,
        /// The lowest rank that passed `max`.
        max_rank: usize,
    },
    /// A point-to-point message did not have the length the algorithm expected.
    #[error("message from rank {peer} (tag {tag}) has {got} elements, expected {expected}")]
    MessageSize {
        /// Sending rank.
        peer: usize,
        /// Message tag.
        tag: i32,
        /// Elements the receiver expected.
        expected: usize,
        /// Elements that arrived (or a lower bound when MPI truncated).
        got: usize,
    },
    /// An MPI call returned an error code (gradsync sets `MPI_ERRORS_RETURN` on
    /// its own duplicated communicator, so MPI errors come back as values).
    #[error("MPI error in {call}: {message} (code {code})")]
    Mpi {
        /// The MPI function that failed.
        call: &'static str,
        /// MPI's error code.
        code: i32,
        /// MPI's error string.
        message: String,
    },
    /// A transport-level failure that is not an MPI error code (in-process
    /// transport timeouts, peers that went away).
    #[error("transport error: {0}")]
    Transport(String),
    /// A caller passed something that cannot work (rank out of range, too many
    /// elements for one MPI call, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The transport cannot do what was asked (e.g. MPI-native collectives on
    /// the in-process transport).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An encoded message is corrupt, truncated, or does not fit the buffer
    /// it is decoded into. Decoders return this instead of panicking.
    #[error("decode error: {0}")]
    Decode(String),
    /// A peer's fused message, or one layer's unit in it, is corrupt or
    /// truncated. Names the sending rank and the layer.
    #[error("bad message from rank {rank}, layer {layer:?}: {reason}")]
    PeerMessage {
        /// Rank whose message is bad.
        rank: usize,
        /// Layer name (`"<fused header>"` for the message framing).
        layer: String,
        /// What is wrong.
        reason: String,
    },
    /// Ranks passed different arguments to a collective that must get the
    /// same ones (a dtype, an algorithm, an operation). Returned on every
    /// rank.
    #[error("arguments differ across ranks: {0}")]
    ArgumentMismatch(String),
    /// Ranks are in different engine calls (one restores a snapshot while
    /// another steps, one registers a layer after the first step, ...):
    /// their first agreement met, nothing else was exchanged, no state
    /// changed (a step's counter does not advance). Returned on every
    /// rank, naming rank 0's call and the lowest rank whose call differs.
    #[error("the call differs across ranks: {0}")]
    CallMismatch(String),
    /// Ranks disagree on the synchronization engine's layer table (names,
    /// shapes, strategies, options). Returned on every rank.
    #[error("layer table differs across ranks: {0}")]
    TableMismatch(String),
    /// A gradient held NaN or Inf (`rank`: the lowest such rank), or
    /// every rank's was finite and their sum overflowed f32 (`rank` is
    /// `None`), and the engine's policy is to fail. Returned on every rank.
    #[error("{}", match .rank {
        Some(r) => format!("non-finite gradient in layer {layer:?} from rank {r}"),
        None => format!("non-finite result in layer {layer:?}: every rank's gradient was finite, their sum overflowed f32"),
    })]
    NonFinite {
        /// The rank whose gradient was bad, when known.
        rank: Option<usize>,
        /// Layer name.
        layer: String,
    },
    /// One or more ranks failed in a collective phase (a step, a set-up
    /// phase agreed by [`crate::comm::agree::agree`]); returned alike on every
    /// rank, failing or not, naming the lowest failing rank and its error.
    #[error("rank {rank} failed{}{}: {message}", match .step { Some(s) => format!(" in step {s}"), None => String::new() }, if *.others > 0 { format!(" (and {} other rank{})", .others, if *.others == 1 { "" } else { "s" }) } else { String::new() })]
    RankFailed {
        /// The lowest failing rank.
        rank: usize,
        /// How many other ranks failed too.
        others: usize,
        /// Every failing rank, ascending (`rank` first): whether this rank
        /// is among them tells a binding to raise its own argument error
        /// here when every rank passed the same bad argument.
        failed: Vec<usize>,
        /// The engine's step, when the failure happened inside one.
        step: Option<u64>,
        /// The failing rank's error.
        message: String,
    },
    /// The GPU cannot be used or failed: no CUDA driver library, no
    /// device, a driver error in an allocation or a copy ([`crate::gpu`]).
    #[error("GPU: {0}")]
    Device(String),
    /// A snapshot file is unreadable, from another version, or from another
    /// layer table or rank.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// An input or output file of the CLI could not be read, parsed or
    /// written: names the file ([`Error::file`]).
    #[error("{}: {reason}", .path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong (the I/O or parse error).
        reason: String,
    },
    /// I/O error (CLI and reports).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// JSON (de)serialization error.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    /// [`Error::File`]: `reason` (an I/O or parse error) about `path`.
    pub fn file(path: impl AsRef<std::path::Path>, reason: impl std::fmt::Display) -> Self {
        Error::File {
            path: path.as_ref().to_path_buf(),
            reason: reason.to_string(),
        }
    }

    /// Whether every rank of the communicator returns this error at the same
    /// point when one does (the failure model, [`crate::comm::agree`]): agreed
    /// failures, table and size mismatches found by a collective check,
    /// corrupt data every rank received alike, NaN/Inf found in a collective
    /// result or reported through the fused message. Anything else may be
    /// local to one rank; the CLI then aborts the job instead of finalizing.
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Error::RankFailed { .. }
                | Error::TableMismatch(_)
                | Error::ArgumentMismatch(_)
                | Error::CallMismatch(_)
                | Error::SizeMismatch { .. }
                | Error::PeerMessage { .. }
                | Error::NonFinite { .. }
        )
    }
}

/// What `path` is when it exists and is not a regular file (after
/// symlinks): "a directory", "a FIFO", "a device", "a socket or other
/// special file"; `None` for a regular file or nothing there (opening it
/// then names the error). Every file gradsync reads or writes is regular:
/// opening a FIFO blocks this rank while its peers wait in a collective, a
/// device never ends (`/dev/zero`), and renaming over one replaces it.
pub(crate) fn special_file(path: &std::path::Path) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = std::fs::metadata(path).ok()?.file_type();
    Some(if t.is_file() {
        return None;
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "a socket or other special file"
    })
}

/// The file a write to `path` should replace: `path` itself, or, where
/// `path` is a symlink (dangling included), the file it points to (so the
/// link stays a link and its target is what changes).
pub(crate) fn write_target(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.to_path_buf();
    // A few hops: a chain of links; a loop ends the walk (the open fails).
    for _ in 0..16 {
        match std::fs::read_link(&p) {
            Ok(t) if t.is_absolute() => p = t,
            Ok(t) => p = p.parent().map_or(t.clone(), |d| d.join(&t)),
            Err(_) => break,
        }
    }
    p
}

/// A fresh temporary file beside `target`, created exclusively (a stale
/// file, link or FIFO of that name is never opened), with a name no other
/// process picks: `.NAME.PID.N.tmp`.
pub(crate) fn create_temp_beside(
    target: &std::path::Path,
) -> std::io::Result<(std::path::PathBuf, std::fs::File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map_or_else(|| "gradsync".into(), |n| n.to_string_lossy().into_owned());
    let dir = target
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    loop {
        let tmp = dir.join(format!(
            ".{name}.{}.{}.tmp",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Where [`write_replacing`] writes `path` (a symlink's target) and the
/// permission bits the new file gets (the replaced file's), or why it
/// must not: a special file (the rename would replace a device node, as
/// root) or a read-only file (`>` would refuse it too, as a user; a
/// write-protected profile or snapshot is one somebody meant to keep).
pub(crate) fn replace_target(
    path: &std::path::Path,
) -> Result<(std::path::PathBuf, Option<std::fs::Permissions>), String> {
    if let Some(kind) = special_file(path) {
        return Err(format!("not a regular file ({kind})"));
    }
    let target = write_target(path);
    let keep = std::fs::metadata(&target).ok().map(|m| m.permissions());
    if keep.as_ref().is_some_and(|perm| perm.readonly()) {
        return Err("the file is read-only (no write permission bit); not replaced".into());
    }
    Ok((target, keep))
}

/// Write `bytes` to `path` through a temporary file beside it (synced)
/// and a rename, so that a full disk or a crash leaves the old file whole
/// (and no temporary file behind on an error). A symlink keeps pointing
/// to the file, which is what is replaced. A target that exists and is
/// not a regular file is refused: the rename would replace it (a device
/// node, when run as root). A replaced file's permission bits are kept;
/// a read-only one is refused.
/// Errors are the I/O error's text (the caller names the file).
pub(crate) fn write_replacing(path: &std::path::Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let (target, keep) = replace_target(path)?;
    let (tmp, mut f) = create_temp_beside(&target).map_err(|e| e.to_string())?;
    let r = f
        .write_all(bytes)
        .and_then(|()| keep.map_or(Ok(()), |perm| f.set_permissions(perm)))
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, &target));
    r.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        e.to_string()
    })
}

/// The bytes of a small input file (a profile, a layers file), read to at
/// most `limit` bytes: a path to a device or a huge file by mistake
/// (`/dev/zero`) is an error naming it instead of a read that fills the
/// memory. `what` names the kind of file in the error.
pub(crate) fn read_small_file(path: &std::path::Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    if let Some(kind) = special_file(path) {
        return Err(Error::file(
            path,
            format!("cannot read {what}: not a regular file ({kind})"),
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .map_err(|e| Error::file(path, format!("cannot read {what}: {e}")))?;
    if bytes.len() as u64 > limit {
        return Err(Error::file(
            path,
            format!("cannot read {what}: larger than {limit} bytes (not a {what}?)"),
        ));
    }
    Ok(bytes)
}

/// `Result<T, gradsync::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Special files are named and refused, on reading and on writing; a
    /// write replaces a regular file whole and leaves no `.tmp` behind,
    /// also when it fails.
    #[test]
    fn special_files_are_refused_and_writes_replace_whole() {
        let dir = std::env::temp_dir().join(format!("gs_err_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(special_file(&dir), Some("a directory"));
        assert_eq!(
            special_file(std::path::Path::new("/dev/null")),
            Some("a device")
        );
        assert_eq!(special_file(&dir.join("none")), None);
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(special_file(&fifo), Some("a FIFO"));
            // Neither call may open it (that would block this test).
            let e = read_small_file(&fifo, 1024, "profile").unwrap_err();
            assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
            let e = write_replacing(&fifo, b"x").unwrap_err();
            assert!(e.contains("not a regular file (a FIFO)"), "{e}");
        }
        let e = write_replacing(std::path::Path::new("/dev/null"), b"x").unwrap_err();
        assert!(e.contains("a device"), "{e}");
        let f = dir.join("p.json");
        write_replacing(&f, b"old").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_replacing(&f, b"new").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640, "the replaced file keeps its mode");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o444)).unwrap();
        let e = write_replacing(&f, b"lost").unwrap_err();
        assert!(e.contains("read-only"), "{e}");
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        // Through a symlink: the link stays, its target gets the bytes.
        let link = dir.join("link.json");
        std::os::unix::fs::symlink("p.json", &link).unwrap();
        write_replacing(&link, b"via link").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&f).unwrap(), b"via link");
        // A stale FIFO where an old build put its temporary file is never
        // opened (it would block).
        let stale = dir.join("p.json.tmp");
        if std::process::Command::new("mkfifo")
            .arg(&stale)
            .status()
            .is_ok_and(|s| s.success())
        {
            write_replacing(&f, b"again").unwrap();
            assert_eq!(std::fs::read(&f).unwrap(), b"again");
            std::fs::remove_file(&stale).unwrap();
        }
        let missing = dir.join("no/such/dir/p.json");
        assert!(write_replacing(&missing, b"x").is_err());
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .filter(|n| n.to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
