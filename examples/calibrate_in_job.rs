//! Calibrating from inside a training job (`tests/calibrate_lib.rs`): every
//! rank calls [`gradsync::cost::calibrate`] on the job's communicator, as a
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
//! Each rank prints `RANK <r> OK <hash> <ranks>` (a hash of the profile's
//! JSON) and rank 0 then `PROFILE <json>`, or each rank prints
//! `RANK <r> ERR <collective> <error>`. Exits 0 when it could print them
//! (the test compares the lines across ranks).

use gradsync::comm::{MpiComm, Transport};
use gradsync::cost::{calibrate, CalibrateOptions};
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
    match calibrate(&comm, &opts) {
        Ok(profile) => {
            profile.validate().expect("a calibrated profile validates");
            let json = serde_json::to_string(&profile).expect("JSON");
            let mut h = std::collections::hash_map::DefaultHasher::new();
            json.hash(&mut h);
            println!("RANK {rank} OK {:016x} {}", h.finish(), profile.meta.ranks);
            if rank == 0 {
                println!("PROFILE {json}");
            }
        }
        Err(e) => {
            // One line; a collective error reached every rank alike.
            let msg = e.to_string().replace('\n', " ");
            println!("RANK {rank} ERR {} {msg}", e.is_collective());
        }
    }
}
