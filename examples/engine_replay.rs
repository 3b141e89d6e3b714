//! Replays a training run's gradients through the Rust engine, so that a
//! binding's results can be compared with the engine's bit for bit (the
//! Python package must give exactly what the Rust engine gives).
//!
//! ```text
//! mpirun -np 3 target/release/examples/engine_replay DIR
//! ```
//!
//! `DIR/table.json` holds `{"options": {...}, "layers": [{"name", "shape",
//! "strategy"}, ...]}` (options as `Config::from_options_json` takes them,
//! strategies as `GradSync::register_spec` does); `DIR/in.rank{r}.npy` is
//! rank `r`'s gradients, float32 of shape `[steps, total elements]` (the
//! layers concatenated in registration order). Each step's update
//! directions are written to `DIR/rust.rank{r}.npy` in the same layout.

use gradsync::sync::GradSync;
use mpi::traits::*;
use ndarray::Array2;

fn main() {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Serialized).expect("MPI initializes once");
    let world = universe.world();
    let rank = world.rank();
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: engine_replay DIR"));
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let table: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("table.json"))?)?;
        let cfg = gradsync::sync::Config::from_options_json(&table["options"].to_string())?;
        let mut sync = GradSync::new(&world, cfg)?;
        let mut sizes = Vec::new();
        for l in table["layers"]
            .as_array()
            .ok_or("layers must be an array")?
        {
            let shape: Vec<usize> = serde_json::from_value(l["shape"].clone())?;
            let name = l["name"].as_str().ok_or("layer name")?;
            let spec = l["strategy"].as_str().ok_or("layer strategy")?;
            sync.register_spec(name, &shape, spec)?;
            sizes.push(shape.iter().product::<usize>());
        }
        let input: Array2<f32> = ndarray_npy::read_npy(dir.join(format!("in.rank{rank}.npy")))?;
        let mut out = input.clone();
        for mut row in out.rows_mut() {
            let flat = row.as_slice_mut().ok_or("row is contiguous")?;
            let mut rest = flat;
            let mut grads: Vec<&mut [f32]> = Vec::new();
            for &n in &sizes {
                let (a, b) = rest.split_at_mut(n);
                grads.push(a);
                rest = b;
            }
            sync.sync(&mut grads)?;
        }
        ndarray_npy::write_npy(dir.join(format!("rust.rank{rank}.npy")), &out)?;
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("engine_replay: rank {rank}: {e}");
        world.abort(1);
    }
    println!("rank {rank}: replayed");
}
