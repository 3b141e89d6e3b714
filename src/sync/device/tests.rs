use super::*;
use crate::comm::LocalComm;
use crate::gpu::HostMemory;
use crate::sync::{Config, Strategy};

/// Dense, RGC and quantized RGC layers and an empty one, with momentum.
fn engine(c: LocalComm) -> GradSync<LocalComm> {
    let mut e = GradSync::with_transport(
        c,
        Config {
            momentum: 0.9,
            ..Config::default()
        },
    )
    .expect("engine");
    e.register_with("dense", &[300], Strategy::Dense)
        .expect("register");
    e.register_with("rgc", &[5000], Strategy::rgc(0.01))
        .expect("register");
    e.register_with(
        "quant",
        &[3000],
        Strategy::Sparse {
            codec: "rgc-quant".parse().expect("codec"),
            density: Some(0.02),
        },
    )
    .expect("register");
    e.register_with("empty", &[0], Strategy::Dense)
        .expect("register");
    e
}

/// Integer-valued gradients, different on every rank and step.
fn grads(rank: usize, step: u64) -> Vec<Vec<f32>> {
    [300usize, 5000, 3000, 0]
        .iter()
        .enumerate()
        .map(|(l, &n)| {
            (0..n)
                .map(|i| (((i * 7 + l * 13 + rank * 31 + step as usize * 5) % 23) as f32) - 11.0)
                .collect()
        })
        .collect()
}

const STEPS: u64 = 4;

/// The host engine's outputs over STEPS steps; with `failed_first`, after
/// a step 0 that rank 1 failed ([`GradSync::fail_step`]).
fn host_run(p: usize, failed_first: bool) -> Vec<Vec<Vec<Vec<u32>>>> {
    LocalComm::run(p, |c| {
        let r = c.rank();
        let mut e = engine(c);
        if failed_first {
            if r == 1 {
                e.fail_step(Error::Device("x".into()));
            } else {
                let mut g = grads(r, 0);
                let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
                e.sync(&mut v).expect_err("rank 1 failed");
            }
        }
        (0..STEPS)
            .map(|t| {
                let mut g = grads(r, t);
                let mut v: Vec<&mut [f32]> = g.iter_mut().map(|x| &mut x[..]).collect();
                assert!(e.sync(&mut v).expect("host step").device.is_none());
                g.iter()
                    .map(|x| x.iter().map(|f| f.to_bits()).collect())
                    .collect()
            })
            .collect()
    })
}

/// The staged device step equals the host engine's step bit for bit, step
/// after step (residuals and momentum carried), at p = 1, 2, 3.
#[test]
fn device_step_equals_host_step() {
    for p in [1, 2, 3] {
        let want = host_run(p, false);
        let got = LocalComm::run(p, |c| {
            let r = c.rank();
            let mut e = engine(c);
            (0..STEPS)
                .map(|t| {
                    let mut dev: Vec<HostMemory> =
                        grads(r, t).into_iter().map(HostMemory::new).collect();
                    let st = e.sync_device(&mut dev).expect("device step").clone();
                    assert!(dev.iter().all(|d| d.hazards() == 0));
                    let ds = st.device.expect("device stats");
                    assert_eq!((ds.route.as_str(), ds.bytes), ("staged", 4 * 8300));
                    assert!(ds.to_host_s >= 0.0 && ds.to_device_s >= 0.0);
                    dev.iter()
                        .map(|d| d.data().iter().map(|f| f.to_bits()).collect())
                        .collect::<Vec<Vec<u32>>>()
                })
                .collect::<Vec<_>>()
        });
        assert_eq!(got, want, "p = {p}");
    }
}

/// A copy to the host failing on rank 1 fails the step on every rank
/// (RankFailed naming rank 1, the device buffers untouched), and the next
/// steps equal the host engine's after the same failed step.
#[test]
fn failed_copy_in_fails_the_step_everywhere() {
    let p = 3;
    let want = host_run(p, true);
    let got = LocalComm::run(p, |c| {
        let r = c.rank();
        let mut e = engine(c);
        let before = grads(r, 0);
        let mut dev: Vec<HostMemory> = before.clone().into_iter().map(HostMemory::new).collect();
        if r == 1 {
            let d = std::mem::take(&mut dev[1]);
            dev[1] = HostMemory::new(d.into_data()).fail_copy(0);
        }
        let err = e.sync_device(&mut dev).expect_err("a failed copy");
        assert!(
            matches!(&err, Error::RankFailed { rank: 1, message, .. } if message.contains("injected")),
            "rank {r}: {err}"
        );
        for (d, b) in dev.iter().zip(&before) {
            assert_eq!(
                d.data(),
                &b[..],
                "rank {r}: a failed step changed a device buffer"
            );
        }
        // The next steps are the host run's steps 0.. (nothing was applied).
        (0..STEPS)
            .map(|t| {
                let mut dev: Vec<HostMemory> =
                    grads(r, t).into_iter().map(HostMemory::new).collect();
                e.sync_device(&mut dev).expect("device step");
                dev.iter()
                    .map(|d| d.data().iter().map(|f| f.to_bits()).collect())
                    .collect::<Vec<Vec<u32>>>()
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(got, want);
}

/// A wrong number of device layers, or a wrong length, on one rank is an
/// error on every rank in that step.
#[test]
fn mismatched_layers_fail_on_every_rank() {
    let got = LocalComm::run(2, |c| {
        let r = c.rank();
        let mut e = engine(c);
        let mut g = grads(r, 0);
        if r == 0 {
            g[0].pop();
        }
        let mut dev: Vec<HostMemory> = g.into_iter().map(HostMemory::new).collect();
        e.sync_device(&mut dev)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for (r, res) in got.iter().enumerate() {
        let msg = res.as_ref().expect_err("mismatch");
        assert!(msg.contains("rank 0"), "rank {r}: {msg}");
    }
}
