//! Process checks shared by test suites that do not use the whole behaviour support
//! (`#[path = "common/procs.rs"] mod procs;`).

/// Whether process `pid` exists and is not a zombie (its state, read from `/proc`).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}
