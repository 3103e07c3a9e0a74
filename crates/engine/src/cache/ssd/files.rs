//! The SSD tier's side of the filesystem: below the cache root it follows no symbolic link at any
//! level, opens nothing but regular files (and never blocks opening one), and deletes only regular
//! files. The folder may hold anything another program, user or mistake left there: a FIFO named
//! `x.entry` must not hang startup, and a symlinked namespace folder must not lead a cleanup
//! outside the cache.
//!
//! Every path is checked with `lstat` from the root down before it is used, and entry files are
//! opened with `O_NOFOLLOW | O_NONBLOCK` and checked again with `fstat` on the open file.

use std::fs::{self, File, FileType, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use super::format::AtPath;
use super::SsdError;

/// What a file type is, for a message saying why it is left alone.
fn describe(kind: FileType) -> &'static str {
    if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_dir() {
        "a folder"
    } else if kind.is_file() {
        "a regular file"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

fn not_a(wanted: &'static str, path: &Path, kind: FileType) -> SsdError {
    SsdError::Unsafe { path: path.to_path_buf(), found: describe(kind), wanted }
}

/// The type of `path` itself (a link is not followed); `None` when nothing is there.
fn lstat(path: &Path) -> Result<Option<FileType>, SsdError> {
    match fs::symlink_metadata(path) {
        Ok(meta) => Ok(Some(meta.file_type())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).at(path),
    }
}

/// Checks that every folder from `path`'s parent up to `root` (included) is a real folder, not a
/// link to one. `path` must lie below `root`.
fn folders_are_real(root: &Path, path: &Path) -> Result<(), SsdError> {
    let mut folder = path.parent();
    while let Some(dir) = folder {
        match lstat(dir)? {
            Some(kind) if kind.is_dir() => {}
            Some(kind) => return Err(not_a("a folder", dir, kind)),
            None => return Err(io::Error::from(io::ErrorKind::NotFound)).at(dir),
        }
        if dir == root {
            return Ok(());
        }
        folder = dir.parent();
    }
    Err(SsdError::Unsafe { path: path.to_path_buf(), found: "outside the cache folder", wanted: "below it" })
}

/// Makes sure `dir` (the root, or a folder below `root`) is a real folder, creating it when
/// missing; a link or anything else in its place is refused.
pub(super) fn ensure_dir(root: &Path, dir: &Path) -> Result<(), SsdError> {
    if dir != root {
        folders_are_real(root, dir)?;
    }
    match lstat(dir)? {
        Some(kind) if kind.is_dir() => Ok(()),
        Some(kind) => Err(not_a("a folder", dir, kind)),
        None => match fs::create_dir(dir) {
            // Another writer made it meanwhile: check what it is.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => ensure_dir(root, dir),
            created => created.at(dir),
        },
    }
}

/// Whether `dir` below `root` is a real folder to look into; the error says what it is instead.
pub(super) fn is_real_dir(root: &Path, dir: &Path) -> Result<(), SsdError> {
    folders_are_real(root, dir)?;
    match lstat(dir)? {
        Some(kind) if kind.is_dir() => Ok(()),
        Some(kind) => Err(not_a("a folder", dir, kind)),
        None => Err(io::Error::from(io::ErrorKind::NotFound)).at(dir),
    }
}

/// Opens the entry file at `path` below `root` for reading, only if it is a regular file reached
/// through real folders. Neither a link nor a FIFO, socket or device is ever opened blocking or
/// read: each is refused as [`SsdError::Unsafe`].
pub(super) fn open_entry(root: &Path, path: &Path) -> Result<File, SsdError> {
    folders_are_real(root, path)?;
    match lstat(path)? {
        Some(kind) if kind.is_file() => {}
        Some(kind) => return Err(not_a("a regular file", path, kind)),
        None => return Err(io::Error::from(io::ErrorKind::NotFound)).at(path),
    }
    // The checks above can race a swap of the file; these flags and the `fstat` below cannot.
    let file = match OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path) {
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(SsdError::Unsafe { path: path.to_path_buf(), found: "a symbolic link", wanted: "a regular file" })
        }
        opened => opened.at(path)?,
    };
    let kind = file.metadata().at(path)?.file_type();
    if !kind.is_file() {
        return Err(not_a("a regular file", path, kind));
    }
    Ok(file)
}

/// Deletes the regular file at `path` below `root`. Already gone is fine; anything that is not a
/// regular file reached through real folders is left where it is, as [`SsdError::Unsafe`].
pub(super) fn remove(root: &Path, path: &Path) -> Result<(), SsdError> {
    folders_are_real(root, path)?;
    match lstat(path)? {
        Some(kind) if kind.is_file() => {}
        Some(kind) => return Err(not_a("a regular file", path, kind)),
        None => return Ok(()),
    }
    match fs::remove_file(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        removed => removed.at(path),
    }
}
