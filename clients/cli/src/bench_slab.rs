//! The host kernel's slab, by cache, per child: `/proc/slabinfo` read before a fan-out's
//! workers start and after its children idled, the growth of each cache's active objects
//! divided by N. Host-wide (the executor's share of each spawn counts too) and readable by
//! root only; it names what the child's cgroup's `slab` figure is made of (e.g. KVM's debugfs
//! files, which `tine doctor` can tell how to be rid of). SLUB counts every object of a slab a
//! CPU holds as active, so a few children's objects can come from slabs already counted: small
//! N read low (one child read 16 KiB in the lab where ten read 246 KiB each).

use std::collections::BTreeMap;

/// Where the kernel lists its slab caches (mode 0400: root only).
const SLABINFO: &str = "/proc/slabinfo";
/// The caches a table shows, largest first; the rest are summed in one row.
const SHOWN: usize = 12;

/// KiB per child by cache, largest first (see [`Slab::growth_per_child`]).
pub type Growth = Vec<(String, f64)>;
/// One N's growth (None where slabinfo could not be read).
pub struct Row {
    pub n: usize,
    /// Workers already waiting when the window opened: what their start made (their VMs among
    /// it) is not in the growth.
    pub waiting_before: usize,
    pub growth: Option<Growth>,
}

/// Bytes in active objects, per cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slab(BTreeMap<String, u64>);

impl Slab {
    /// None where slabinfo cannot be read (not root, or no slab statistics in this kernel).
    pub fn read() -> Option<Slab> {
        std::fs::read_to_string(SLABINFO)
            .ok()
            .and_then(|s| Slab::parse(&s))
    }

    /// `slabinfo - version: 2.1` text: a line per cache, `name active_objs num_objs objsize
    /// ...`. None when the text is not that.
    pub fn parse(text: &str) -> Option<Slab> {
        let mut lines = text.lines();
        if !lines.next()?.starts_with("slabinfo - version: 2.") {
            return None;
        }
        let mut caches = BTreeMap::new();
        for l in lines.filter(|l| !l.starts_with('#')) {
            let mut w = l.split_whitespace();
            let (Some(name), Some(active), Some(_), Some(size)) =
                (w.next(), w.next(), w.next(), w.next())
            else {
                continue;
            };
            let (Ok(active), Ok(size)) = (active.parse::<u64>(), size.parse::<u64>()) else {
                return None;
            };
            *caches.entry(name.to_string()).or_default() += active * size;
        }
        Some(Slab(caches))
    }

    /// KiB per child of each cache that grew since `before`, over `n` children, largest first.
    pub fn growth_per_child(&self, before: &Slab, n: usize) -> Growth {
        let mut grown: Growth = self
            .0
            .iter()
            .filter_map(|(name, &now)| {
                let was = before.0.get(name).copied().unwrap_or(0);
                (now > was).then(|| (name.clone(), (now - was) as f64 / 1024.0 / n.max(1) as f64))
            })
            .collect();
        grown.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        grown
    }
}

/// The table (the [`SHOWN`] largest caches of each N, the rest summed) and its JSON (every
/// cache that grew, per N).
pub fn print_table(rows: &[Row]) -> String {
    if rows.is_empty() {
        return "[]".into();
    }
    println!("\nhost kernel slab by cache (KiB per child: growth of each cache's active objects from before the workers of each N started to after its children idled, over N; host-wide, so the executor's own share of each spawn counts too; workers already waiting before are not in it; SLUB counts the objects of slabs a CPU holds as active, so small N read low: take N >= 10):");
    if rows.iter().all(|r| r.growth.is_none()) {
        println!("  {SLABINFO} is not readable here (root only)");
        return "[]".into();
    }
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        for (name, _) in r.growth.iter().flatten().take(SHOWN) {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
    }
    print!("{:<28}", "cache");
    for r in rows {
        print!(" {:>10}", format!("N={}", r.n));
    }
    println!();
    print!("{:<28}", "(workers waiting before)");
    for r in rows {
        print!(" {:>10}", r.waiting_before);
    }
    println!();
    let kib = |r: &Option<Growth>, name: &str| {
        r.as_ref()
            .map(|r| r.iter().find(|(c, _)| c == name).map_or(0.0, |(_, k)| *k))
    };
    let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    for name in &names {
        print!("{name:<28}");
        for r in rows {
            print!(" {:>10}", cell(kib(&r.growth, name)));
        }
        println!();
    }
    for (label, sum_of) in [("other caches", false), ("all caches", true)] {
        print!("{label:<28}");
        for r in rows {
            // From 0.0: an empty f64 sum is -0.0.
            let v = r.growth.as_ref().map(|r| {
                r.iter()
                    .filter(|(c, _)| sum_of || !names.contains(&c.as_str()))
                    .fold(0.0, |sum, (_, k)| sum + k)
            });
            print!(" {:>10}", cell(v));
        }
        println!();
    }
    let json: Vec<String> = rows
        .iter()
        .map(|r| {
            let caches = match &r.growth {
                None => "null".to_string(),
                Some(r) => format!(
                    "{{{}}}",
                    r.iter()
                        .map(|(c, k)| format!("{c:?}:{k:.2}"))
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            };
            format!(
                "{{\"n\":{},\"workers_waiting_before\":{},\"kib_per_child\":{caches}}}",
                r.n, r.waiting_before
            )
        })
        .collect();
    format!("[{}]", json.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "slabinfo - version: 2.1
# name            <active_objs> <num_objs> <objsize> <objperslab> <pagesperslab> : tunables <limit> <batchcount> <sharedfactor> : slabdata <active_slabs> <num_slabs> <sharedavail>
inode_cache          100    120    632   25    4 : tunables    0    0    0 : slabdata      4      4      0
task_struct           10     12   6528    4    8 : tunables    0    0    0 : slabdata      3      3      0
dentry              1000   1050    192   21    1 : tunables    0    0    0 : slabdata     50     50      0
";

    #[test]
    fn the_growth_of_each_cache_is_shared_among_the_children_largest_first() {
        let before = Slab::parse(BEFORE).unwrap();
        let after = Slab::parse(
            &BEFORE
                .replace("inode_cache          100", "inode_cache          240")
                .replace("task_struct           10", "task_struct           18")
                .replace("dentry              1000", "dentry               900"),
        )
        .unwrap();
        let grown = after.growth_per_child(&before, 2);
        // inode_cache: 140 x 632 B / 2; task_struct: 8 x 6528 B / 2; dentry shrank.
        assert_eq!(
            grown,
            [
                ("inode_cache".to_string(), 140.0 * 632.0 / 1024.0 / 2.0),
                ("task_struct".to_string(), 8.0 * 6528.0 / 1024.0 / 2.0),
            ]
        );
        let json = print_table(&[
            Row {
                n: 2,
                waiting_before: 0,
                growth: Some(grown),
            },
            Row {
                n: 10,
                waiting_before: 1,
                growth: None,
            },
        ]);
        assert_eq!(
            json,
            "[{\"n\":2,\"workers_waiting_before\":0,\"kib_per_child\":{\"inode_cache\":43.20,\
             \"task_struct\":25.50}},{\"n\":10,\"workers_waiting_before\":1,\"kib_per_child\":null}]"
        );
    }

    #[test]
    fn text_that_is_not_slabinfo_is_refused() {
        assert_eq!(Slab::parse(""), None);
        assert_eq!(Slab::parse("MemTotal: 1 kB\n"), None);
        let bad = BEFORE.replace("632", "six");
        assert_eq!(Slab::parse(&bad), None);
    }
}
