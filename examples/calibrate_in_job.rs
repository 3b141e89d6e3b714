//! Calibrating from inside a training job (`tests/calibrate_lib.rs`): every
//! rank calls [`gradsync::calibrate::calibrate`] on the job's communicator, as a
//! training script would before choosing its strategies, with no `gradsync`
//! command and nothing of the CLI. Runnable by hand:
//!
//! ```text
//! mpirun -np 3 target/release/examples/calibrate_in_job
//! mpirun -np 3 target/release/examples/calibrate_in_job bad-reps 1
//! ```
//!
//! Scenarios (the second argument is the odd rank):
//! * `ok` (the default): small options (64 KiB layers, 3 rounds, 0.5 s).
//! * `bad-reps`: that rank passes `reps = 1` (invalid there only).
//! * `other-densities`: that rank passes different (valid) densities.
//!
//! Each rank's line, `RANK <r> OK <hash> <ranks>` (a hash of the profile's
//! JSON) or `RANK <r> ERR <collective> <error>`, is gathered to rank 0,
//! which prints them all, then `PROFILE <json>`. Exits 0 when it could print them
//! (the test compares the lines across ranks).

use gradsync::calibrate::{calibrate, CalibrateOptions};
use gradsync::comm::{MpiComm, Transport};
use gradsync::dense::{allgatherv_with, AllgathervAlgo, Gathered};
use std::hash::{Hash, Hasher};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).map_or("ok", String::as_str);
    let odd: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0);
    let universe = mpi::initialize().expect("MPI initializes once");
    let comm = MpiComm::duplicate_of(&universe.world()).expect("communicator");
    let rank = comm.rank();
    let mut opts = CalibrateOptions {
        max_bytes: 64 << 10,
        reps: 3,
        min_seconds: 0.5,
        note: "calibrate_in_job".into(),
        ..CalibrateOptions::default()
    };
    if rank == odd {
        match scenario {
            "bad-reps" => opts.reps = 1,
            "other-densities" => opts.densities = vec![0.05],
            _ => {}
        }
    }
    let (line, profile) = match calibrate(&comm, &opts) {
        Ok(profile) => {
            profile.validate().expect("a calibrated profile validates");
            let json = serde_json::to_string(&profile).expect("JSON");
            let mut h = std::collections::hash_map::DefaultHasher::new();
            json.hash(&mut h);
            let line = format!("RANK {rank} OK {:016x} {}", h.finish(), profile.meta.ranks);
            (line, Some(json))
        }
        Err(e) => {
            // One line; a collective error reached every rank alike.
            let msg = e.to_string().replace('\n', " ");
            (format!("RANK {rank} ERR {} {msg}", e.is_collective()), None)
        }
    };
    // Rank 0 prints every rank's line: lines printed by several ranks at
    // once can interleave in mpirun's output (rank 0's 5 KB profile line
    // was split by rank 1's once).
    let mut all = Gathered::default();
    allgatherv_with(&comm, line.as_bytes(), AllgathervAlgo::Mpi, &mut all)
        .expect("gathering the ranks' lines");
    if rank == 0 {
        let mut out = String::new();
        for r in 0..all.len() {
            out.push_str(&String::from_utf8_lossy(all.message(r)));
            out.push('\n');
        }
        if let Some(json) = profile {
            out.push_str(&format!("PROFILE {json}\n"));
        }
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(out.as_bytes()).expect("stdout");
        stdout.flush().expect("stdout");
    }
}
