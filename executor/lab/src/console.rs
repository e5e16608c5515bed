//! Splits L1's serial console into the command's output and the init's marker lines.
//!
//! Markers look like `TINE-LAB-<nonce> <event> [arg]`. The random nonce makes collisions with
//! the command's own output practically impossible, so a marker is recognised anywhere in a
//! line (the command's last line may lack a newline).

/// What the console said.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Bytes written by the command (CRLF turned into LF).
    Output(Vec<u8>),
    /// L1's /init started; guest uptime in seconds.
    Init(Option<f64>),
    /// Modules are loaded, filesystems mounted; the command starts now.
    Started,
    /// /init could not set up the lab (e.g. an insmod or mount failed).
    SetupFailed(String),
    /// The command finished with this status.
    Exit(i32),
}

pub struct ConsoleFilter {
    token: Vec<u8>,
    pending: Vec<u8>,
    held_cr: bool,
    started: bool,
    finished: bool,
    /// The console before the command started and after it ended (kernel and init messages).
    boot_log: Vec<u8>,
}

const BOOT_LOG_LIMIT: usize = 256 * 1024;

impl ConsoleFilter {
    pub fn new(nonce: &str) -> ConsoleFilter {
        ConsoleFilter {
            token: format!("TINE-LAB-{nonce} ").into_bytes(),
            pending: Vec::new(),
            held_cr: false,
            started: false,
            finished: false,
            boot_log: Vec::new(),
        }
    }

    /// Console text that was not command output, for error reports.
    pub fn boot_log(&self) -> String {
        String::from_utf8_lossy(&self.boot_log).into_owned()
    }

    /// Feeds raw console bytes and returns the events they complete.
    pub fn feed(&mut self, data: &[u8]) -> Vec<Event> {
        self.normalize_into_pending(data);
        let mut events = Vec::new();
        loop {
            match find(&self.pending, &self.token) {
                Some(at) => {
                    let Some(nl) = self.pending[at..].iter().position(|&b| b == b'\n') else {
                        // Marker line incomplete: pass on what precedes it, wait for the rest.
                        let text: Vec<u8> = self.pending.drain(..at).collect();
                        self.text(text, &mut events);
                        break;
                    };
                    let text: Vec<u8> = self.pending.drain(..at).collect();
                    self.text(text, &mut events);
                    let line: Vec<u8> = self.pending.drain(..nl + 1).collect();
                    let body = String::from_utf8_lossy(&line[self.token.len()..]);
                    if let Some(event) = self.marker(body.trim()) {
                        events.push(event);
                    }
                }
                None => {
                    // Hold back a tail that might be the start of a marker split across reads.
                    let keep = longest_suffix_prefix(&self.pending, &self.token);
                    let text: Vec<u8> = self.pending.drain(..self.pending.len() - keep).collect();
                    self.text(text, &mut events);
                    break;
                }
            }
        }
        events
    }

    /// Whatever is still held back once the console closed.
    pub fn flush(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        let mut text = std::mem::take(&mut self.pending);
        if std::mem::take(&mut self.held_cr) {
            text.push(b'\r');
        }
        self.text(text, &mut events);
        events
    }

    fn normalize_into_pending(&mut self, data: &[u8]) {
        for &b in data {
            if std::mem::take(&mut self.held_cr) && b != b'\n' {
                self.pending.push(b'\r');
            }
            if b == b'\r' {
                self.held_cr = true;
            } else {
                self.pending.push(b);
            }
        }
    }

    fn text(&mut self, text: Vec<u8>, events: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        if self.started && !self.finished {
            events.push(Event::Output(text));
        } else {
            self.boot_log.extend_from_slice(&text);
            if self.boot_log.len() > BOOT_LOG_LIMIT {
                let cut = self.boot_log.len() - BOOT_LOG_LIMIT;
                self.boot_log.drain(..cut);
            }
        }
    }

    fn marker(&mut self, body: &str) -> Option<Event> {
        let (word, arg) = body.split_once(' ').unwrap_or((body, ""));
        match word {
            "init" => Some(Event::Init(arg.split_whitespace().next()?.parse().ok())),
            "start" => {
                self.started = true;
                Some(Event::Started)
            }
            "exit" => {
                self.finished = true;
                arg.trim().parse().ok().map(Event::Exit)
            }
            "setup-failed" => {
                self.finished = true;
                Some(Event::SetupFailed(arg.to_string()))
            }
            _ => None,
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn longest_suffix_prefix(hay: &[u8], needle: &[u8]) -> usize {
    (1..needle.len().min(hay.len() + 1))
        .rev()
        .find(|&n| hay[hay.len() - n..] == needle[..n])
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> (Vec<Event>, ConsoleFilter) {
        let mut f = ConsoleFilter::new("ab12");
        let mut events: Vec<Event> = chunks.iter().flat_map(|c| f.feed(c)).collect();
        events.extend(f.flush());
        (events, f)
    }

    fn output(events: &[Event]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Output(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn separates_boot_noise_output_and_markers() {
        let console = b"SeaBIOS\r\n[ 0.1] kernel\r\nTINE-LAB-ab12 init 1.52\r\nTINE-LAB-ab12 start\r\nhello\r\nworld\r\nTINE-LAB-ab12 exit 7\r\n[ 3.0] reboot: Power down\r\n";
        let (events, f) = run(&[console]);
        assert_eq!(events.first(), Some(&Event::Init(Some(1.52))));
        assert!(events.contains(&Event::Started));
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, Event::Exit(7)))
                .count(),
            1
        );
        assert_eq!(output(&events), "hello\nworld\n");
        assert!(f.boot_log().contains("SeaBIOS\n"));
        assert!(f.boot_log().contains("Power down"));
    }

    #[test]
    fn handles_markers_split_across_reads_and_mid_line() {
        let console: &[u8] = b"TINE-LAB-ab12 start\r\nno newline at endTINE-LAB-ab12 exit 3\r\n";
        // Every possible split point, including inside the token and the CRLF.
        for cut in 0..console.len() {
            let (events, _) = run(&[&console[..cut], &console[cut..]]);
            assert_eq!(output(&events), "no newline at end", "cut at {cut}");
            assert!(events.contains(&Event::Exit(3)), "cut at {cut}");
        }
    }

    #[test]
    fn foreign_nonces_and_lone_cr_are_plain_output() {
        let (events, _) = run(&[
            b"TINE-LAB-ab12 start\n",
            b"TINE-LAB-zz99 exit 1\nprogress\r50%\n",
            b"TINE-LAB-ab12 setup-failed mount 9p host\n",
        ]);
        assert_eq!(output(&events), "TINE-LAB-zz99 exit 1\nprogress\r50%\n");
        assert_eq!(
            events.last(),
            Some(&Event::SetupFailed("mount 9p host".into()))
        );
    }
}
