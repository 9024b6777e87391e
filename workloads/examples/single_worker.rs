//! One worker's SGD with momentum on a built-in workload, no cluster: the held-out score every
//! `every` steps. How `docs/workloads.md` picked the new models' learning rates.
//!
//! `cargo run --release -p syncopate-workloads --example single_worker -- WORKLOAD LR STEPS BATCH EVERY`
//! (for instance `fashion-cnn 0.01 2000 32 500`, or `fortunes-lm 0.05 400 16 100`).

use syncopate_workloads::{by_name, Evaluator, WorkloadOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, lr, steps, batch, every] = args.as_slice() else {
        eprintln!("usage: single_worker WORKLOAD LR STEPS BATCH EVERY");
        std::process::exit(2);
    };
    let number = |s: &str| -> f64 { s.parse().unwrap_or_else(|_| panic!("`{s}` is not a number")) };
    let (lr, steps, batch, every) =
        (number(lr) as f32, number(steps) as u64, number(batch) as u32, number(every) as u64);
    let opts = WorkloadOptions::default();
    let mut w = by_name(name, &opts).expect("the workload and its data (scripts/setup.sh installs it)");
    let scorer = Evaluator::for_workload(name, &opts).expect("its held-out data").expect("a held-out set");
    let mut params = w.init_params(1);
    let (mut grad, mut velocity) = (vec![0.0; params.len()], vec![0.0f32; params.len()]);
    let began = std::time::Instant::now();
    for step in 1..=steps {
        w.gradient(0, step, batch, &params, &mut grad);
        for ((p, v), g) in params.iter_mut().zip(&mut velocity).zip(&grad) {
            *v = 0.9 * *v + g;
            *p -= lr * *v;
        }
        if step % every.max(1) == 0 {
            let s = scorer.evaluate(&params);
            println!(
                "{name} lr {lr} step {step}: held-out loss {:.3}, accuracy {:.1}% ({:.0} s)",
                s.loss,
                s.accuracy * 100.0,
                began.elapsed().as_secs_f64()
            );
        }
    }
}
