//! Where a reader's files come from: a log directory, or the same files held
//! in memory (a log fetched over the network, embedded in a test, or fed by
//! a fuzzer). Both go through exactly the same reading code.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, Cursor, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{LogError, io_err};

/// A log directory or its files in memory.
#[derive(Clone, Debug)]
pub(crate) enum Store {
    Dir(PathBuf),
    Memory(BTreeMap<String, Arc<[u8]>>),
}

/// An open file of a [`Store`].
#[derive(Debug)]
pub(crate) enum StoreFile {
    Disk(BufReader<File>),
    Memory(Cursor<Arc<[u8]>>),
}

impl Read for StoreFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Disk(r) => r.read(buf),
            Self::Memory(r) => r.read(buf),
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Self::Disk(r) => r.read_exact(buf),
            Self::Memory(r) => r.read_exact(buf),
        }
    }
}

impl Seek for StoreFile {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        match self {
            Self::Disk(r) => r.seek(pos),
            Self::Memory(r) => r.seek(pos),
        }
    }
}

impl Store {
    /// The names of every file.
    pub(crate) fn names(&self) -> Result<Vec<String>, LogError> {
        match self {
            Self::Dir(dir) => {
                let mut out = Vec::new();
                for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
                    let entry = entry.map_err(io_err(dir))?;
                    if let Ok(name) = entry.file_name().into_string() {
                        out.push(name);
                    }
                }
                Ok(out)
            }
            Self::Memory(files) => Ok(files.keys().cloned().collect()),
        }
    }

    /// Opens `name` with a read buffer of at most `buffer` bytes (never more
    /// than the file holds), returning it and its length.
    pub(crate) fn open(&self, name: &str, buffer: usize) -> io::Result<(StoreFile, u64)> {
        match self {
            Self::Dir(dir) => {
                let file = File::open(dir.join(name))?;
                let len = file.metadata()?.len();
                let r = BufReader::with_capacity(super::buffer_for(buffer, len), file);
                Ok((StoreFile::Disk(r), len))
            }
            Self::Memory(files) => {
                let bytes = files
                    .get(name)
                    .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
                Ok((
                    StoreFile::Memory(Cursor::new(Arc::clone(bytes))),
                    bytes.len() as u64,
                ))
            }
        }
    }

    /// The whole of a small file, refusing one larger than `max` bytes
    /// before reading it.
    pub(crate) fn read_small(&self, name: &str, max: u64) -> io::Result<Vec<u8>> {
        let (file, len) = self.open(name, 8 << 10)?;
        if len > max {
            return Err(io::Error::other(format!(
                "{len} bytes is more than the {max} expected"
            )));
        }
        let mut b = Vec::with_capacity(len as usize);
        file.take(max).read_to_end(&mut b)?;
        Ok(b)
    }

    /// A path naming `name` in error messages.
    pub(crate) fn path(&self, name: &str) -> PathBuf {
        match self {
            Self::Dir(dir) => dir.join(name),
            Self::Memory(_) => PathBuf::from(name),
        }
    }

    /// The directory, for a store on disk.
    pub(crate) fn dir(&self) -> Option<&Path> {
        match self {
            Self::Dir(dir) => Some(dir),
            Self::Memory(_) => None,
        }
    }
}
