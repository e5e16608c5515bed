//! Guest console sinks.

use std::io::Write;

use anyhow::{Context, Result};

/// Console writer that pushes every write straight out, so a reader sees output as it happens.
struct Unbuffered<W: Write>(W);

impl<W: Write> Write for Unbuffered<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        if buf.contains(&b'\n') {
            self.0.flush()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// The console to a file, or to stdout when no path is given.
pub fn open_console(path: Option<&std::path::Path>) -> Result<Box<dyn Write + Send>> {
    Ok(match path {
        Some(p) => Box::new(Unbuffered(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(Unbuffered(std::io::stdout())),
    })
}
