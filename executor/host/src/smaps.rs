//! Reading a process's `/proc/PID/smaps`: what each of its mappings holds (the benchmarks'
//! memory figures, by part of a VMM).

/// Calls `f(path, field, kib)` for every `Field: N kB` line of a process's smaps, with the
/// path (or `[name]`, or "" for anonymous memory) of the mapping the line belongs to.
pub fn for_each_field(smaps: &str, mut f: impl FnMut(&str, &str, u64)) {
    let mut path = "";
    for l in smaps.lines() {
        let mut words = l.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode [path]"; a path may hold
            // spaces, so it is the rest of the line after the fifth field.
            let mut rest = l;
            for _ in 0..5 {
                rest = rest.trim_start();
                rest = rest.find(char::is_whitespace).map_or("", |i| &rest[i..]);
            }
            path = rest.trim();
        } else if let Some(kib) = words.next().and_then(|v| v.parse().ok()) {
            f(path, first, kib);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_come_with_their_mapping_s_whole_path() {
        let smaps = "\
55d0-55e0 r-xp 00000000 08:01 12 /usr/bin/tine
Private_Clean:        8 kB
7f00-7f10 rw-p 00000000 00:00 0 
Private_Dirty:       64 kB
7f60-7f70 rw-p 00000000 00:01 8 /data dir/snapshots/w/memory.img
Private_Dirty: 500 kB
7f80-7f90 rw-s 00000000 00:01 9 /memfd:tine-hot-image (deleted)
Rss:        4 kB
VmFlags: rd wr sh mr mw me ms sd
7fa0-7fb0 rw-p 00000000 00:00 0                          [heap]
Pss:        100 kB
";
        let mut seen = Vec::new();
        for_each_field(smaps, |path, field, kib| {
            seen.push((path.to_string(), field.to_string(), kib))
        });
        let seen: Vec<(&str, &str, u64)> = seen
            .iter()
            .map(|(p, f, k)| (p.as_str(), f.as_str(), *k))
            .collect();
        assert_eq!(
            seen,
            [
                ("/usr/bin/tine", "Private_Clean:", 8),
                ("", "Private_Dirty:", 64),
                ("/data dir/snapshots/w/memory.img", "Private_Dirty:", 500),
                ("/memfd:tine-hot-image (deleted)", "Rss:", 4),
                ("[heap]", "Pss:", 100),
            ]
        );
    }
}
